"""The source's change capture: publication, logical slot (pgoutput), reading changes, advancing the slot.

Changes are streamed by replication.py (START_REPLICATION). The slot moves only to a position the target has durably
committed (guarantee 7): by the stream's confirm(), or by `advance_slot` when a task died between the
target's commit and its confirm.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..errors import RetryableError, TerminalError, UsageError
from ..position import format_lsn, parse_lsn
from . import locks
from .catalog import Table
from .connect import describe_conn


@dataclass(frozen=True)
class SlotInfo:
    confirmed_flush: int | None
    restart_lsn: int | None
    wal_status: str | None
    active_pid: int | None
    invalidated: str | None = None  # why the server invalidated it (17+: invalidation_reason; 16: conflicting)
    synced: bool = False  # 17+: synchronized from a primary (on a standby: not readable until promoted)
    in_recovery: bool = False  # the server holding it is a standby


def check_source(conn: psycopg.Connection) -> None:
    """The settings logical replication needs, each with its way out."""
    version = conn.info.server_version
    if version < 140000:
        raise UsageError(f"source runs PostgreSQL {version // 10000}; Sluicegate needs 14 or newer")
    level = conn.execute("SHOW wal_level").fetchone()[0]
    if level != "logical":
        raise UsageError(
            f"source has wal_level = {level}; logical replication needs wal_level = logical: "
            f"ALTER SYSTEM SET wal_level = logical, then restart the source server"
        )
    slots = int(conn.execute("SHOW max_replication_slots").fetchone()[0])
    if slots < 1:
        raise UsageError("source has max_replication_slots = 0: set it to at least 1 and restart the server")


def ensure_publication(conn: psycopg.Connection, name: str, tables: list[Table], *, add_only: bool = False) -> None:
    """The publication holds `tables`. `add_only`: an existing one only gains those it lacks, never loses one,
    so that writers who may race (a Delta sink's Init and add-tables, two add-tables) end with the union."""
    for attempt in range(3):
        exists = conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,)).fetchone()
        wanted = tables
        verb = "ALTER PUBLICATION {} SET TABLE {}" if exists else "CREATE PUBLICATION {} FOR TABLE {}"
        if exists and add_only:
            have = set(conn.execute(  # the relations added to it (not pg_publication_tables' partitions)
                """SELECT n.nspname, c.relname FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid
                   JOIN pg_class c ON c.oid = r.prrelid JOIN pg_namespace n ON n.oid = c.relnamespace
                   WHERE p.pubname = %s""", (name,)).fetchall())
            wanted = [t for t in tables if (t.schema, t.name) not in have]
            if not wanted:
                _publish_via_root(conn, name)
                return
            verb = "ALTER PUBLICATION {} ADD TABLE {}"
        # ONLY: an inheritance parent's children are tables of their own (moved or not), as its copy reads it.
        # A partitioned table's partitions are always included, and publish_via_partition_root sends their
        # changes under the root's name, the table the workflow moves (else the applier meets names it
        # does not know: events_2023).
        rels = sql.SQL(", ").join(sql.SQL("ONLY {}").format(t.ident) for t in wanted)
        try:
            with locks.guard(conn, f"{'altering' if exists else 'creating'} publication {name}",
                             [t.ident.as_string(conn) for t in wanted], "ShareUpdateExclusiveLock", side="source"):
                if exists:
                    conn.execute(sql.SQL(verb).format(sql.Identifier(name), rels))
                    _publish_via_root(conn, name)
                else:
                    conn.execute(sql.SQL(verb + " WITH (publish_via_partition_root = true)").format(
                        sql.Identifier(name), rels))
            return
        except psycopg.errors.DuplicateObject:  # a racing writer made it, or added one of ours: read again
            if not add_only or attempt == 2:
                raise


def _publish_via_root(conn: psycopg.Connection, name: str) -> None:
    """A publication made before partitioned tables moved (or by hand) sends partitions' own names."""
    if not conn.execute("SELECT pubviaroot FROM pg_publication WHERE pubname = %s", (name,)).fetchone()[0]:
        conn.execute(sql.SQL("ALTER PUBLICATION {} SET (publish_via_partition_root = true)").format(
            sql.Identifier(name)))


def ensure_slot(conn: psycopg.Connection, name: str) -> int:
    """Create the logical slot if missing; its confirmed position. `conn` must be in autocommit."""
    info = slot_info(conn, name)
    if info is None:
        # The slot's first snapshot waits for every transaction running now to end: a long one is named.
        with locks.guard(conn, f"creating replication slot {name}", side="source",
                         holders=locks.describe_transactions):
            return create_slot(conn, name)
    return info.confirmed_flush


FAILOVER_VERSION = 170000


def create_slot(conn: psycopg.Connection, name: str) -> int:
    """Create the logical slot `name` (pgoutput); its start position. Every Sluicegate slot is made here.

    On PostgreSQL 17+ it is a failover slot: a standby with sync_replication_slots keeps a copy of it, so that
    once that standby is promoted the stream goes on from the copy, with nothing re-copied (README: source
    failover). Older servers have no such slots: a failover there means a re-bootstrap."""
    failover = ", false, false, true" if conn.info.server_version >= FAILOVER_VERSION else ""  # temporary, two_phase
    query = f"SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput'{failover})"
    return parse_lsn(conn.execute(query, (name,)).fetchone()[0])


def wait_standbys(conn: psycopg.Connection, position: int, stop=None, timeout: float = 30.0) -> None:
    """Until the standbys that synchronized_standby_slots names (17+) have flushed `position`.

    That setting keeps the change stream from running ahead of the standby that failover would promote, but a
    copy reads rows with SQL: a transaction is visible on the primary before its standby has it. A copy cycle
    is recorded only once they have its snapshot's position, so that a promoted standby never lacks rows the
    target was given; until then a failover makes the engine redo the cycle (its rows above lastpk are cleared).
    """
    if conn.info.server_version < FAILOVER_VERSION:
        return
    names = [n.strip() for n in conn.execute("SHOW synchronized_standby_slots").fetchone()[0].split(",") if n.strip()]
    if not names:
        return
    deadline = time.monotonic() + timeout
    while True:
        behind = [r[0] for r in conn.execute(
            """SELECT n FROM unnest(%s::text[]) n LEFT JOIN pg_replication_slots s ON s.slot_name = n
               WHERE s.restart_lsn IS NULL OR s.restart_lsn < %s::pg_lsn""", (names, format_lsn(position)))]
        if not behind:
            return
        if time.monotonic() > deadline or (stop is not None and stop.is_set()):
            raise RetryableError(
                f"the standbys of synchronized_standby_slots ({', '.join(behind)}) have not received the source's "
                f"WAL up to the copy's snapshot {format_lsn(position)} within {timeout:g} s (is the standby down? "
                f"drop it from synchronized_standby_slots if it is gone for good); the copy cycle will be redone")
        time.sleep(0.02)


_SLOT_COLUMNS = "confirmed_flush_lsn::text, restart_lsn::text, wal_status, active_pid, pg_is_in_recovery()"
_SLOT_QUERIES = (  # (from server version, the columns that say whether the slot is usable)
    (170000, _SLOT_COLUMNS + ", invalidation_reason, synced"),
    (160000, _SLOT_COLUMNS + ", CASE WHEN conflicting THEN 'conflict with recovery' END, false"),
    (0, _SLOT_COLUMNS + ", NULL, false"),
)


def slot_info(conn: psycopg.Connection, name: str) -> SlotInfo | None:
    version = conn.info.server_version
    columns = next(c for since, c in _SLOT_QUERIES if version >= since)
    row = conn.execute(f"SELECT {columns} FROM pg_replication_slots WHERE slot_name = %s",
                       (name,)).fetchone()
    if row is None:
        return None
    return SlotInfo(parse_lsn(row[0]) if row[0] else None, parse_lsn(row[1]) if row[1] else None, row[2], row[3],
                    invalidated=row[5], synced=bool(row[6]), in_recovery=bool(row[4]))


def retained_wal(conn: psycopg.Connection, name: str) -> tuple[int | None, str | None]:
    """(bytes of WAL the slot keeps on the source, its wal_status); (None, None) when there is no such slot."""
    row = conn.execute(
        """SELECT pg_wal_lsn_diff(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_receive_lsn()
                                       ELSE pg_current_wal_lsn() END, restart_lsn)::bigint, wal_status
           FROM pg_replication_slots WHERE slot_name = %s""",
        (name,),
    ).fetchone()
    return (row[0], row[1]) if row else (None, None)


def rebootstrap(workflow: str) -> str:
    """A workflow's way out when its slot can no longer supply what it needs."""
    return (f"the stream cannot continue without losing changes: re-bootstrap with "
            f"`sluicegate workflow delete {workflow}` and create it again")


def check_slot(conn: psycopg.Connection, name: str, position: int, way_out: str,
               consumer: str = "the target's position") -> SlotInfo:
    """The slot can still supply everything after `position` (`consumer` names it in the error), or a
    terminal error ending with `way_out` (re-bootstrap, in the reader's terms)."""
    return judge_slot(conn, name, slot_info(conn, name), position, way_out, consumer)


def judge_slot(conn: psycopg.Connection, name: str, info: SlotInfo | None, position: int, way_out: str,
               consumer: str) -> SlotInfo:
    """check_slot on the slot as already read (`info`): read it before `position` when a running reader
    moves both, as it records its position and then confirms."""
    if info is None:
        why = release_note(conn, name)  # a Replicate sink's slot released by the retention governor
        raise TerminalError(f"{why or f'replication slot {name} is gone from the source {describe_conn(conn)}'}"
                            f"{_not_synced(conn)}; {way_out}")
    if info.in_recovery:
        # Reached only when the source URL lets libpq take a standby (connect.primary_only asks for the primary).
        what = "is a synchronized copy there, readable only once it is promoted" if info.synced else "is not readable"
        raise TerminalError(f"the source {describe_conn(conn)} is a standby (in recovery): replication slot {name} "
                            f"{what}; the source URL must reach the primary (list its hosts with "
                            f"target_session_attrs=read-write), else {way_out}")
    if info.wal_status == "lost" or info.restart_lsn is None:
        raise TerminalError(f"replication slot {name} was invalidated (WAL removed); {way_out}")
    if info.invalidated:  # e.g. rows_removed: a standby's copy whose catalog rows its primary removed
        raise TerminalError(f"replication slot {name} was invalidated by the source ({info.invalidated}); {way_out}")
    # Sluicegate confirms only what its reader durably handled (replication.py answers keepalives with that
    # position, never theirs): a slot further on was read by someone else, and changes may be gone.
    if info.confirmed_flush is not None and info.confirmed_flush > position:
        raise TerminalError(
            f"replication slot {name} was consumed up to {format_lsn(info.confirmed_flush)}, past {consumer} "
            f"{format_lsn(position)}; {way_out}"
        )
    return info


def _not_synced(conn: psycopg.Connection) -> str:
    """Why a slot may be missing after a failover: it was never synchronized to the server promoted."""
    if conn.info.server_version < FAILOVER_VERSION:
        return (" (after a failover: a slot follows a promoted standby only from PostgreSQL 17 on, as a failover "
                "slot)")
    return (" (after a failover: the promoted standby had no synchronized copy of it; the standby needs "
            "sync_replication_slots = on, hot_standby_feedback = on and a primary_slot_name)")


RELEASE_MARK = "sluicegate: "


def release_note(conn: psycopg.Connection, publication: str) -> str | None:
    """Why a slot was released on purpose (cluster/governor.py), as the comment on its publication (a slot
    and its publication share a name) says; None if nothing says."""
    row = conn.execute("SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = %s",
                       (publication,)).fetchone()
    note = row[0] if row else None
    return note[len(RELEASE_MARK):] if note and note.startswith(RELEASE_MARK) else None


def set_release_note(conn: psycopg.Connection, publication: str, note: str | None) -> None:
    text = RELEASE_MARK + note if note else None
    conn.execute(sql.SQL("COMMENT ON PUBLICATION {} IS {}").format(sql.Identifier(publication), sql.Literal(text)))


def release_slot(conn: psycopg.Connection, name: str, info: SlotInfo, timeout: float = 10.0) -> None:
    """End a reader still attached to the slot: a walsender whose play task was killed (one driver runs a
    workflow at a time, so the slot's reader is a leftover). `conn` must be in autocommit."""
    if not info.active_pid:
        return
    conn.execute("SELECT pg_terminate_backend(%s)", (info.active_pid,))
    deadline = time.monotonic() + timeout
    while (current := slot_info(conn, name)) is not None and current.active_pid:
        if time.monotonic() > deadline:
            raise RetryableError(f"replication slot {name} is still in use by pid {current.active_pid}; will retry")
        time.sleep(0.02)


def advance_slot(conn: psycopg.Connection, name: str, position: int) -> None:
    """Confirm the slot up to `position`: only ever with a position the target has committed."""
    info = slot_info(conn, name)
    if info is None or info.confirmed_flush is None or info.confirmed_flush >= position:
        return
    conn.execute("SELECT pg_replication_slot_advance(%s, %s::pg_lsn)", (name, format_lsn(position)))


def wal_flush_position(conn: psycopg.Connection):
    """(flushed WAL position, source clock): decoding can read everything before it. The clock is read
    first: a transaction that committed before that moment has its commit record in the WAL before the
    position (safe time relies on it; cluster/safetime.py)."""
    now, lsn = conn.execute("SELECT clock_timestamp(), pg_current_wal_flush_lsn()::text").fetchone()
    return parse_lsn(lsn), now


def wal_insert_position(conn: psycopg.Connection) -> int:
    """Where the source's next WAL record will go: nothing was written since a position at or after it."""
    return parse_lsn(conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])


def drop_capture(conn: psycopg.Connection, slot: str, publication: str) -> list[str]:
    """Drop the slot and publication if present; what was dropped. `conn` must be in autocommit."""
    dropped = []
    info = slot_info(conn, slot)
    if info is not None:
        # A reader may still hold it (a driver's cancelled task whose worker is on its way out): end it and
        # wait until the slot is free, or the drop fails with "is active for PID".
        release_slot(conn, slot, info)
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        dropped.append(f"replication slot {slot}")
    if conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (publication,)).fetchone():
        with locks.guard(conn, f"dropping publication {publication}", side="source"):
            conn.execute(sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(publication)))
        dropped.append(f"publication {publication}")
    return dropped

"""Durable workflow state in the target's `sluicegate` schema: the truth the engine re-reads every step.

workflows (name, kind, source, options, the driver's heartbeat) 1─n streams (state, position, message, lag
marks) 1─n copy_state (one row per table: its description, lastpk, rows copied, done).
Source URLs are stored without their password (libpq's pgpass file or environment supplies it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime

import psycopg
from psycopg import sql

from .. import config
from ..errors import TerminalError, UsageError, did_you_mean
from ..names import object_name  # noqa: F401 - its home; callers name it here
from ..position import format_lsn, parse_lsn
from ..postgres import locks
from ..postgres.catalog import Table
from ..postgres.connect import strip_password
from .loop import COPYING, ERROR, INIT, RUNNING, STOPPED  # noqa: F401 - the states, named here too

SCHEMA_DDL = """
CREATE SCHEMA IF NOT EXISTS sluicegate;
CREATE TABLE IF NOT EXISTS sluicegate.workflows (
    name text PRIMARY KEY,
    kind text NOT NULL,
    source_url text NOT NULL,
    options jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS sluicegate.streams (
    id bigserial PRIMARY KEY,
    workflow text NOT NULL REFERENCES sluicegate.workflows ON DELETE CASCADE,
    source_shard text NOT NULL DEFAULT '0',
    slot_name text NOT NULL,
    publication text NOT NULL,
    state text NOT NULL,
    message text NOT NULL DEFAULT '',
    position pg_lsn,
    caught_up_at timestamptz,      -- source clock: every change committed before it is applied
    transaction_time timestamptz,  -- commit time of the last applied source transaction
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS sluicegate.copy_state (
    stream_id bigint NOT NULL REFERENCES sluicegate.streams ON DELETE CASCADE,
    table_name text NOT NULL,
    ordinal int NOT NULL,
    spec jsonb NOT NULL,
    lastpk jsonb,
    rows_copied bigint NOT NULL DEFAULT 0,
    done boolean NOT NULL DEFAULT false,
    PRIMARY KEY (stream_id, table_name)
);
-- VDiff runs (vdiff/store.py): a request, then the ranges compared so far, kept for --resume.
CREATE TABLE IF NOT EXISTS sluicegate.vdiffs (
    id bigserial PRIMARY KEY,
    workflow text NOT NULL REFERENCES sluicegate.workflows ON DELETE CASCADE,
    state text NOT NULL,            -- pending, running, completed, error
    tables jsonb NOT NULL,          -- qualified names to compare
    options jsonb NOT NULL DEFAULT '{}',
    source_position pg_lsn,         -- the consistent point of the last comparison
    message text NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL DEFAULT now(),
    started_at timestamptz,
    completed_at timestamptz
);
CREATE TABLE IF NOT EXISTS sluicegate.vdiff_ranges (
    vdiff_id bigint NOT NULL REFERENCES sluicegate.vdiffs ON DELETE CASCADE,
    table_name text NOT NULL,
    generation int NOT NULL,        -- one per comparison point (a resumed vdiff takes a new one)
    idx int NOT NULL,
    lo jsonb,                       -- lo < key <= hi; NULL is open
    hi jsonb,
    done boolean NOT NULL DEFAULT false,
    compared bigint NOT NULL DEFAULT 0,
    missing bigint NOT NULL DEFAULT 0,
    extra bigint NOT NULL DEFAULT 0,
    mismatched bigint NOT NULL DEFAULT 0,
    samples jsonb NOT NULL DEFAULT '[]',
    PRIMARY KEY (vdiff_id, table_name, generation, idx)
);
-- Reshard: a stream per source shard, each with its own source (NULL: the workflow's source_url).
ALTER TABLE sluicegate.streams ADD COLUMN IF NOT EXISTS source_url text;
-- Indexes dropped for a table's first copy cycle: the statements that build them again (postgres/indexes.py).
ALTER TABLE sluicegate.copy_state ADD COLUMN IF NOT EXISTS deferred_indexes jsonb;
-- The driver's heartbeat (workflow/heartbeat.py): when `workflow run` was last seen, and which process.
ALTER TABLE sluicegate.workflows ADD COLUMN IF NOT EXISTS driver_seen_at timestamptz;
ALTER TABLE sluicegate.workflows ADD COLUMN IF NOT EXISTS driver_pid int;
ALTER TABLE sluicegate.workflows ADD COLUMN IF NOT EXISTS driver_host text;
-- The source database's identity (postgres/identity.py), to tell at create whether a target feeds a source.
ALTER TABLE sluicegate.streams ADD COLUMN IF NOT EXISTS source_identity jsonb;
-- What a stream has replayed (metrics, progress lines): counted in each batch's transaction.
ALTER TABLE sluicegate.streams ADD COLUMN IF NOT EXISTS rows_applied bigint NOT NULL DEFAULT 0;
ALTER TABLE sluicegate.streams ADD COLUMN IF NOT EXISTS batches bigint NOT NULL DEFAULT 0;
-- Safe time (cluster/safetime.py): the source time up to which the stream has applied every committed
-- transaction; only ever moved forward, and only while the stream is Running.
ALTER TABLE sluicegate.streams ADD COLUMN IF NOT EXISTS safe_time timestamptz;
-- The retention governor's samples of the source's WAL position (cluster/governor.py): how old the WAL a
-- slot holds is.
-- Durable stream control (workflow/stream_control.py): the player stops itself once it has applied exactly up
-- to stop_position (or at its next batch, with a reason and no position), and marks the stream Stopped.
ALTER TABLE sluicegate.streams ADD COLUMN IF NOT EXISTS stop_position pg_lsn;
ALTER TABLE sluicegate.streams ADD COLUMN IF NOT EXISTS stop_reason text NOT NULL DEFAULT '';
-- A MoveTables' traffic (workflow/traffic.py): where its writes go, the number and source position of the
-- last switch, and (on a reverse workflow) the forward one. Older versions kept these in options.
ALTER TABLE sluicegate.workflows ADD COLUMN IF NOT EXISTS traffic text;
ALTER TABLE sluicegate.workflows ADD COLUMN IF NOT EXISTS traffic_epoch int;
ALTER TABLE sluicegate.workflows ADD COLUMN IF NOT EXISTS traffic_position pg_lsn;
ALTER TABLE sluicegate.workflows ADD COLUMN IF NOT EXISTS reverse_of text;
CREATE TABLE IF NOT EXISTS sluicegate.wal_samples (
    workflow text NOT NULL REFERENCES sluicegate.workflows ON DELETE CASCADE,
    lsn pg_lsn NOT NULL,
    taken_at timestamptz NOT NULL,
    PRIMARY KEY (workflow, lsn)
);
"""
# What the last statements above add: a schema with all of them needs no DDL (whose ALTER TABLE locks would
# wait for every reader of the state, the status commands and running drivers included).
_NEWEST_COLUMNS = [("workflows", "driver_seen_at"), ("workflows", "driver_pid"), ("workflows", "driver_host"),
                   ("streams", "source_identity"), ("copy_state", "deferred_indexes"),
                   ("streams", "source_url"), ("streams", "rows_applied"), ("streams", "batches"),
                   ("streams", "safe_time"), ("wal_samples", "lsn"), ("streams", "stop_position"),
                   ("streams", "stop_reason"), ("workflows", "traffic"), ("workflows", "traffic_epoch"),
                   ("workflows", "traffic_position"), ("workflows", "reverse_of")]
_TABLES = ["workflows", "streams", "copy_state", "vdiffs", "vdiff_ranges", "wal_samples"]
NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,99}")


@dataclass
class TableState:
    table: Table
    lastpk: list[str] | None
    rows_copied: int
    done: bool
    rule: dict | None = None  # CompiledRule.to_json(): the table is written through a rule
    # Indexes dropped for the first copy cycle and built when it is recorded (postgres/indexes.py).
    deferred_indexes: list[dict] | None = None

    @property
    def mode(self) -> str:
        """How replayed changes to this table are treated during copy: all, up to lastpk, or skipped."""
        if self.done:
            return "all"
        return "skip" if self.lastpk is None else "upto"


@dataclass
class Stream:
    id: int
    workflow: str
    source_shard: str
    source_url: str | None
    slot_name: str
    publication: str
    state: str
    message: str
    position: int | None
    caught_up_at: datetime | None
    transaction_time: datetime | None
    updated_at: datetime
    tables: list[TableState] = field(default_factory=list)
    rows_applied: int = 0  # rows replayed into the target (catchup, fast-forward, replicate)
    batches: int = 0  # replay batches committed
    stop_position: int | None = None  # durable stream control (stream_control.py)
    stop_reason: str = ""

    def copying_table(self) -> TableState | None:
        return next((t for t in self.tables if not t.done), None)


@dataclass(frozen=True)
class Driver:
    """The last heartbeat of a `workflow run` (workflow/heartbeat.py), as the target's clock measures it."""

    seen_seconds_ago: float | None  # None: never seen
    pid: int | None  # None after a clean exit
    host: str | None


@dataclass(frozen=True)
class Traffic:
    """Where a MoveTables' writes go (workflow/traffic.py)."""

    state: str = "source"  # source, switched, reversed
    epoch: int | None = None  # the number of the last switch; None: never switched
    position: str = ""  # the source position (LSN text) of the last switch
    reverse_of: str | None = None  # on a reverse workflow: the forward one

    @classmethod
    def from_row(cls, state, epoch, position, reverse_of, options: dict) -> Traffic:
        """The columns, else what an older version kept in the workflow's options."""
        if state is None and epoch is None:
            return cls(options.get("traffic") or "source", int(options["epoch"]) if "epoch" in options else None,
                       options.get("position") or "", options.get("reverse_of"))
        return cls(state or "source", epoch, position or "", reverse_of)


_LEGACY_TRAFFIC_KEYS = ("traffic", "epoch", "position", "reverse_of")


@dataclass
class Workflow:
    name: str
    kind: str
    source_url: str
    options: dict
    streams: list[Stream]
    driver: Driver = Driver(None, None, None)
    traffic: Traffic = Traffic()


def ensure_schema(conn: psycopg.Connection) -> None:
    """Create or upgrade the schema, in the caller's transaction; no DDL at all when it is up to date."""
    if schema_is_current(conn):
        return

    rels = [f"sluicegate.{t}" for t in _TABLES]
    with locks.guard(conn, "creating or upgrading schema sluicegate", rels, then="try again"):
        conn.execute(SCHEMA_DDL)


def schema_is_current(conn: psycopg.Connection) -> bool:
    have = conn.execute(
        """SELECT count(*) FROM unnest(%s::text[], %s::text[]) AS w(rel, col)
           WHERE EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('sluicegate.' || w.rel)
                                                      AND attname = w.col AND NOT attisdropped)""",
        ([r for r, _ in _NEWEST_COLUMNS], [c for _, c in _NEWEST_COLUMNS]),
    ).fetchone()[0]
    if have != len(_NEWEST_COLUMNS):
        return False
    return conn.execute("SELECT bool_and(to_regclass('sluicegate.' || t) IS NOT NULL) FROM unnest(%s::text[]) t",
                        (_TABLES,)).fetchone()[0]


def check_name(name: str) -> None:
    """A new workflow's name: safe in a shell, a log line and an object name."""
    if not NAME_PATTERN.fullmatch(name or ""):
        raise UsageError(f"workflow name {name!r} is not allowed: use 1 to 100 letters, digits, '_', '.' or '-', "
                         f"starting with a letter or '_'")


def check_new_name(conn: psycopg.Connection, name: str) -> None:
    if conn.execute("SELECT 1 FROM sluicegate.workflows WHERE name = %s", (name,)).fetchone():
        raise UsageError(
            f"workflow {name!r} already exists on this target: pick another name, or "
            f"`sluicegate workflow delete {name}` first"
        )


def insert_workflow(conn: psycopg.Connection, name: str, kind: str, source_url: str, options: dict) -> None:
    check_new_name(conn, name)
    config.check_options(options)
    conn.execute(
        "INSERT INTO sluicegate.workflows (name, kind, source_url, options) VALUES (%s, %s, %s, %s)",
        (name, kind, strip_password(source_url), json.dumps(options)),
    )


def add_stream(conn: psycopg.Connection, workflow: str, source_shard: str, source_url: str | None, slot: str,
               tables: list[Table], rules: dict[str, dict] | None = None,
               source_identity: dict | None = None) -> None:
    """A stream of the workflow: its slot (and publication, same name) on its source, its tables."""
    stream_id = conn.execute(
        """INSERT INTO sluicegate.streams (workflow, source_shard, source_url, slot_name, publication, state,
                                           source_identity)
           VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING id""",
        (workflow, source_shard, strip_password(source_url) if source_url else None, slot, slot, INIT,
         json.dumps(source_identity) if source_identity else None),
    ).fetchone()[0]
    append_tables(conn, stream_id, tables, rules)


def append_tables(conn: psycopg.Connection, stream_id: int, tables: list[Table],
                  rules: dict[str, dict] | None = None) -> None:
    """Tables joining a stream, not copied yet (their changes are skipped until their first copy cycle).
    `rules`: by qualified name, the rule a table's spec carries (a keyspace source shard's key range)."""
    first = conn.execute("SELECT COALESCE(max(ordinal) + 1, 0) FROM sluicegate.copy_state WHERE stream_id = %s",
                         (stream_id,)).fetchone()[0]
    rules = rules or {}
    for i, t in enumerate(tables, first):
        spec = t.to_json()
        if t.qualified in rules:
            spec["rule"] = rules[t.qualified]
        conn.execute(
            "INSERT INTO sluicegate.copy_state (stream_id, table_name, ordinal, spec) VALUES (%s, %s, %s, %s)",
            (stream_id, t.qualified, i, json.dumps(spec)),
        )


def missing_schema(name: str) -> str:
    """A target without schema sluicegate: no workflow is left there. Nothing records what ended them (the
    last one's complete, cancel or delete drops the schema, leaving the target as it was): say so."""
    return (f"no workflow {name!r} on this target: schema sluicegate is missing, so no workflow is left here "
            f"(`movetables complete` or `cancel`, or `workflow delete`, of the last one drops it; or none was "
            f"created here): if {name!r} was completed, its tables are the target's own now; to start it, "
            f"create it")


def load_workflow(conn: psycopg.Connection, name: str) -> Workflow:
    if not has_schema(conn):
        raise UsageError(missing_schema(name))
    try:
        return _read_workflow(conn, name)
    except psycopg.errors.UndefinedTable:
        # The last workflow's delete (`movetables complete`) drops the schema: between our statements, it
        # reads as deleted. The transaction is aborted; the caller's `with connect(...)` rolls it back.
        raise UsageError(f"no workflow {name!r} on this target (it was deleted meanwhile)") from None


def _read_workflow(conn: psycopg.Connection, name: str) -> Workflow:
    # to_jsonb(w): a schema made before the heartbeat columns existed reads them as NULL (no DDL here)
    row = conn.execute(
        """SELECT name, kind, source_url, options, (to_jsonb(w) ->> 'driver_seen_at')::timestamptz,
                  (to_jsonb(w) ->> 'driver_pid')::int, to_jsonb(w) ->> 'driver_host', now(),
                  to_jsonb(w) ->> 'traffic', (to_jsonb(w) ->> 'traffic_epoch')::int,
                  to_jsonb(w) ->> 'traffic_position', to_jsonb(w) ->> 'reverse_of'
           FROM sluicegate.workflows w WHERE name = %s""", (name,)
    ).fetchone()
    if row is None:
        names = list_workflows(conn)
        hint = did_you_mean(name, names) or (f"; existing: {', '.join(names)}" if names else "")
        raise UsageError(f"no workflow {name!r} on this target{hint}")
    seen, pid, host, now = row[4:8]
    driver = Driver((now - seen).total_seconds() if seen else None, pid, host)
    options = {k: v for k, v in row[3].items() if k not in _LEGACY_TRAFFIC_KEYS}
    wf = Workflow(row[0], row[1], row[2], options, [], driver, Traffic.from_row(*row[8:12], row[3]))
    for s in conn.execute(
        """SELECT id, workflow, source_shard, COALESCE(source_url, %s), slot_name, publication, state, message,
                  position::text, caught_up_at, transaction_time, updated_at,
                  COALESCE((to_jsonb(s) ->> 'rows_applied')::bigint, 0),
                  COALESCE((to_jsonb(s) ->> 'batches')::bigint, 0), to_jsonb(s) ->> 'stop_position',
                  COALESCE(to_jsonb(s) ->> 'stop_reason', '')
           FROM sluicegate.streams s WHERE workflow = %s ORDER BY id""",
        (wf.source_url, name),
    ).fetchall():
        stream = Stream(*s[:8], parse_lsn(s[8]) if s[8] else None, *s[9:12], rows_applied=s[12],
                        batches=s[13], stop_position=parse_lsn(s[14]) if s[14] else None, stop_reason=s[15])
        # to_jsonb(c): state made before deferred_indexes existed reads as NULL
        for spec, lastpk, rows, done, deferred in conn.execute(
            """SELECT spec, lastpk, rows_copied, done, to_jsonb(c) -> 'deferred_indexes'
               FROM sluicegate.copy_state c WHERE stream_id = %s ORDER BY ordinal""",
            (stream.id,),
        ):
            stream.tables.append(TableState(Table.from_json(spec), lastpk, rows, done, spec.get("rule"),
                                            deferred or None))
        wf.streams.append(stream)
    # Each statement above reads its own snapshot: a workflow deleted between them (`movetables complete`
    # beside its driver) reads torn, with no streams. Deleted by now, it is not found, as it would be.
    torn = not wf.streams or any(not s.tables for s in wf.streams)
    if torn and conn.execute("SELECT 1 FROM sluicegate.workflows WHERE name = %s", (name,)).fetchone() is None:
        raise UsageError(f"no workflow {name!r} on this target (it was deleted meanwhile)")
    return wf


def list_workflows(conn: psycopg.Connection) -> list[str]:
    """Every workflow's name on this target, sorted."""
    if not has_schema(conn):
        return []
    try:
        return [r[0] for r in conn.execute("SELECT name FROM sluicegate.workflows ORDER BY 1")]
    except psycopg.errors.UndefinedTable:
        return []  # dropped since has_schema (the last workflow deleted); the transaction is aborted now


def has_schema(conn: psycopg.Connection) -> bool:
    return conn.execute("SELECT to_regclass('sluicegate.workflows') IS NOT NULL").fetchone()[0]


def set_state(conn: psycopg.Connection, stream_id: int, state: str, message: str = "") -> None:
    """An explicit state change (a user's stop or start, a phase's end) also ends any stop a controller asked
    for (stream_control.py): the newest word on the stream wins."""
    clear = sql.SQL(", stop_position = NULL, stop_reason = ''") if has_control(conn) else sql.SQL("")
    conn.execute(
        sql.SQL("UPDATE sluicegate.streams SET state = %s, message = %s, updated_at = now(){} WHERE id = %s")
        .format(clear),
        (state, message[:2000], stream_id),
    )


_CONTROL_SEEN: set = set()  # (host, port, dbname) of targets whose schema has the stream control columns


def has_control(conn: psycopg.Connection) -> bool:
    """Whether the schema has the stream control columns (a driver whose schema upgrade a lock held up runs
    without them, and no controller can have set them either). Columns are never dropped: cached once seen."""
    key = (conn.info.host, conn.info.port, conn.info.dbname)
    if key in _CONTROL_SEEN:
        return True
    if conn.execute("""SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'sluicegate.streams'::regclass
                                        AND attname = 'stop_reason' AND NOT attisdropped)""").fetchone()[0]:
        _CONTROL_SEEN.add(key)
        return True
    return False


def set_traffic(conn: psycopg.Connection, workflow: str, state: str, epoch: int,
                position: str | None = None, reverse_of: str | None = None) -> None:
    """A MoveTables' traffic, in the caller's transaction (`position`, `reverse_of` None: kept). What an older
    version kept in options moves to the columns here."""
    ensure_schema(conn)
    conn.execute(
        """UPDATE sluicegate.workflows SET
             traffic_position = COALESCE(%s::pg_lsn, traffic_position, NULLIF(options ->> 'position', '')::pg_lsn),
             reverse_of = COALESCE(%s, reverse_of, options ->> 'reverse_of'),
             traffic = %s, traffic_epoch = %s,
             options = options - 'traffic' - 'epoch' - 'position' - 'reverse_of'
           WHERE name = %s""",
        (position or None, reverse_of, state, epoch, workflow),
    )


def set_options(conn: psycopg.Connection, workflow: str, values: dict) -> None:
    """Set keys of the workflow's options (the others stay; a key whose value is None goes), in the caller's
    transaction."""
    conn.execute("UPDATE sluicegate.workflows SET options = (options || %s::jsonb) - %s::text[] "
                 "WHERE name = %s", (json.dumps({k: v for k, v in values.items() if v is not None}),
                                     [k for k, v in values.items() if v is None], workflow))


def restart_stream(conn: psycopg.Connection, stream_id: int, message: str) -> None:
    """Back to Init with no position: the next run makes the slot again and copies every table not done."""
    conn.execute(
        """UPDATE sluicegate.streams SET state = %s, position = NULL, caught_up_at = NULL, message = %s,
                  updated_at = now() WHERE id = %s""", (INIT, message[:2000], stream_id))


def set_message(conn: psycopg.Connection, stream_id: int, message: str) -> None:
    conn.execute(
        "UPDATE sluicegate.streams SET message = %s, updated_at = now() WHERE id = %s", (message[:2000], stream_id)
    )


def lock_stream(conn: psycopg.Connection, stream_id: int) -> tuple[str, int | None]:
    """(state, position) of a stream, row-locked until the caller's transaction ends.

    Every write of data together with a position goes through this lock, so two appliers (a stale Spark
    task and a new one) can never both apply the same batch: the second sees the moved position.
    """
    row = _stream_row(conn, stream_id,
                      "SELECT state, position::text FROM sluicegate.streams WHERE id = %s FOR UPDATE")
    return row[0], parse_lsn(row[1]) if row[1] else None


def _stream_row(conn: psycopg.Connection, stream_id: int, query: str) -> tuple:
    row = conn.execute(query, (stream_id,)).fetchone()
    if row is None:
        raise TerminalError(f"stream {stream_id} no longer exists (workflow deleted)")
    return row


@dataclass(frozen=True)
class Control:
    """A stream's state, position and durable stop (stream_control.py), as one row read."""

    state: str
    position: int | None
    stop_position: int | None
    stop_reason: str


def lock_stream_control(conn: psycopg.Connection, stream_id: int) -> Control:
    """lock_stream with the stream's durable stop (empty on a schema without it)."""
    row = _stream_row(conn, stream_id, """
        SELECT state, position::text, to_jsonb(s) ->> 'stop_position',
               COALESCE(to_jsonb(s) ->> 'stop_reason', '')
        FROM sluicegate.streams s WHERE id = %s FOR UPDATE""")
    return Control(row[0], parse_lsn(row[1]) if row[1] else None, parse_lsn(row[2]) if row[2] else None, row[3])


def read_stream(conn: psycopg.Connection, stream_id: int) -> tuple[str, int | None]:
    """(state, position) of a stream as the caller's snapshot sees it, without a lock."""
    row = _stream_row(conn, stream_id, "SELECT state, position::text FROM sluicegate.streams WHERE id = %s")
    return row[0], parse_lsn(row[1]) if row[1] else None


def counts_applied(conn: psycopg.Connection) -> bool:
    """Whether the schema has the replay counters and safe time (a driver whose schema upgrade a lock held
    up runs without them)."""
    return conn.execute("""SELECT count(*) = 2 FROM pg_attribute
                           WHERE attrelid = 'sluicegate.streams'::regclass
                             AND attname IN ('batches', 'safe_time') AND NOT attisdropped""").fetchone()[0]


def save_position(conn: psycopg.Connection, stream_id: int, position: int, *, caught_up_at=None,
                  transaction_time=None, state: str | None = None, applied: int | None = None,
                  safe: bool = False) -> None:
    """`applied`: the rows of a replay batch committed with this position (counted with one batch); None
    counts nothing (the schema may lack the counters: counts_applied). `safe`: move the stream's safe time
    (the schema has it) to the batch's last commit time or, caught up, to the source's clock."""
    counters = sql.SQL("")
    if applied is not None:
        counters = sql.SQL("rows_applied = rows_applied + {}, batches = batches + 1,").format(
            sql.Literal(applied))
    if safe:  # only while Running: a table still being copied is not all there
        counters += sql.SQL("""safe_time = CASE WHEN COALESCE({state}, state) = 'Running'
                                               THEN GREATEST(safe_time, {txn}, {caught}) ELSE safe_time END,
                            """).format(state=sql.Literal(state), txn=sql.Literal(transaction_time),
                                        caught=sql.Literal(caught_up_at))
    conn.execute(
        sql.SQL(
            """UPDATE sluicegate.streams SET {} position = %s::pg_lsn,
                 caught_up_at = COALESCE(%s, caught_up_at), transaction_time = COALESCE(%s, transaction_time),
                 state = COALESCE(%s, state), message = CASE WHEN %s::text IS NULL THEN message ELSE '' END,
                 updated_at = now()
               WHERE id = %s"""
        ).format(counters),
        (format_lsn(position), caught_up_at, transaction_time, state, state, stream_id),
    )


def save_copy_progress(conn: psycopg.Connection, stream_id: int, table: str, old_lastpk, new_lastpk,
                       rows: int, done: bool) -> bool:
    """Advance a table's lastpk; False if someone else moved it first (the cycle is then redone)."""
    cur = conn.execute(
        """UPDATE sluicegate.copy_state SET lastpk = %s, rows_copied = rows_copied + %s, done = %s
           WHERE stream_id = %s AND table_name = %s AND lastpk IS NOT DISTINCT FROM %s::jsonb""",
        (json.dumps(new_lastpk) if new_lastpk is not None else None, rows, done, stream_id, table,
         json.dumps(old_lastpk) if old_lastpk is not None else None),
    )
    return cur.rowcount == 1


def save_deferred_indexes(conn: psycopg.Connection, stream_id: int, table: str, deferred: list[dict] | None) -> None:
    """Record the indexes dropped for a table's copy (None: built again), in the caller's transaction."""
    if deferred:  # state made by an older version lacks the column: the schema's own DDL adds it
        ensure_schema(conn)
    conn.execute(
        "UPDATE sluicegate.copy_state SET deferred_indexes = %s WHERE stream_id = %s AND table_name = %s",
        (json.dumps(deferred) if deferred else None, stream_id, table),
    )


def workflows_writing(conn: psycopg.Connection, tables: list[str]) -> list[tuple[str, str]]:
    """(table, workflow) for each of `tables` (qualified) that a workflow on this target writes."""
    return [tuple(r) for r in conn.execute(
        """SELECT t, s.workflow FROM sluicegate.copy_state c JOIN sluicegate.streams s ON s.id = c.stream_id,
                  LATERAL (SELECT COALESCE((c.spec -> 'rule' -> 'target' ->> 'schema') || '.'
                                           || (c.spec -> 'rule' -> 'target' ->> 'name'), c.table_name)) AS w(t)
           WHERE t = ANY(%s) ORDER BY 1, 2""", (tables,)).fetchall()]


def delete_workflow(conn: psycopg.Connection, name: str) -> None:
    conn.execute("DELETE FROM sluicegate.workflows WHERE name = %s", (name,))


def save_table_spec(conn: psycopg.Connection, stream_id: int, table: Table) -> None:
    """A table's new description (its columns followed a schema change), in the caller's transaction; what
    else its spec holds (a rule) stays."""
    conn.execute("UPDATE sluicegate.copy_state SET spec = spec || %s::jsonb "
                 "WHERE stream_id = %s AND table_name = %s",
                 (json.dumps(table.to_json()), stream_id, table.qualified))


def table_specs(conn: psycopg.Connection, stream_id: int) -> dict[str, dict]:
    """Qualified name -> the stream's description of each table (its spec), as stored now."""
    return {name: spec for name, spec in conn.execute(
        "SELECT table_name, spec FROM sluicegate.copy_state WHERE stream_id = %s", (stream_id,))}


def save_tables_copied(conn: psycopg.Connection, stream_id: int, rows: dict[str, int]) -> bool:
    """Record whole tables copied in one cycle (table -> rows; workflow/engine.py `_copy_group`): each done,
    with no lastpk (a table copied whole needs none, as a keyless one), in the caller's transaction, one
    statement. False if any of them was no longer pending (the caller rolls back; the cycle is redone)."""
    names = list(rows)
    cur = conn.execute(
        """UPDATE sluicegate.copy_state c SET rows_copied = c.rows_copied + r.n, done = true
           FROM unnest(%s::text[], %s::bigint[]) AS r(name, n)
           WHERE c.stream_id = %s AND c.table_name = r.name AND c.lastpk IS NULL AND NOT c.done""",
        (names, [rows[n] for n in names], stream_id))
    return cur.rowcount == len(names)

"""Last-writer-wins apply for active-active replication: incoming changes meet the target's own versions.

Every version of a row carries (commit time, cluster): for a row on the target, the commit time of the
transaction that wrote it (`pg_xact_commit_timestamp(xmin)`, track_commit_timestamp = on) and the cluster it
was first written on (the transaction's replication origin: 0 is this cluster, a Sluicegate origin names its
peer); for a deleted row, its tombstone. An incoming change wins iff its (commit time, cluster id) is greater:
equal times go to the higher cluster id, the same rule on every side, so both sides keep the same version.

Deleted rows leave tombstones in `sluicegate.tombstones`, so that an older update arriving after a newer
delete does not bring the row back, while a newer one does (with every column: an update that carries only
some cannot make the row, and is refused). Winning incoming deletes record theirs here; the application's own
deletes record theirs by trigger (`install_tombstone_triggers`): the key and the deleting transaction's id,
its commit time read when needed — inside the transaction the commit time does not exist yet, and only the
commit time itself is what the peer receives with the delete and compares. Every conflict resolved is logged
in `sluicegate.conflicts` (see `decide` for which cases are conflicts).

A batch is applied set-based: COPY into a temporary staging table, one statement that locks the target's
rows of the batch, one that classifies every staged row, then at most one statement per effect (conflict
log, delete, update, insert, tombstones), whatever the batch's size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import NamedTuple

import psycopg
from psycopg import sql

from ..errors import TerminalError
from ..postgres import keyrange
from ..postgres.catalog import Table
from .identity import overriding_clause, writes_always_identity
from .keyless import ESCAPE
from .postgres import keep_assignments, staged_columns

LOCAL_ORIGIN = 0  # roident of a transaction without a replication origin: written on this cluster

# Key columns travel into tombstones and the conflict log as the text of each value (`jsonb ["1", "a"]`),
# made under these settings on every path (the trigger function's SET clauses, the applier's set_config), so
# that the application's session and the applier write the same key text for a timestamptz or a float.
_KEY_SETTINGS = {"TimeZone": "UTC", "DateStyle": "ISO, YMD", "IntervalStyle": "postgres",
                 "extra_float_digits": "1", "bytea_output": "hex"}
# Key types whose text form does not depend on those settings (int2/4/8, text, varchar, bpchar, uuid,
# numeric, bool, oid, name): a batch of such keys skips them.
_PLAIN_KEY_TYPES = frozenset((16, 19, 20, 21, 23, 25, 26, 1042, 1043, 1700, 2950))

SCHEMA_SQL = """
CREATE SCHEMA IF NOT EXISTS sluicegate;
CREATE TABLE IF NOT EXISTS sluicegate.tombstones (
    table_name text NOT NULL,
    key jsonb NOT NULL,
    deleted_at timestamptz,     -- NULL for a local delete until read from its transaction's commit time
    cluster_id int NOT NULL,
    xid xid8,                   -- a local delete's transaction
    PRIMARY KEY (table_name, key)
);
CREATE INDEX IF NOT EXISTS tombstones_deleted_at ON sluicegate.tombstones (deleted_at);
CREATE TABLE IF NOT EXISTS sluicegate.conflicts (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT now(),
    table_name text NOT NULL,
    key jsonb NOT NULL,
    type text NOT NULL,
    local_time timestamptz,
    local_cluster int,
    remote_time timestamptz NOT NULL,
    remote_cluster int NOT NULL,
    winner text NOT NULL CHECK (winner IN ('local', 'remote'))
);
CREATE INDEX IF NOT EXISTS conflicts_type ON sluicegate.conflicts (type);
"""

# TG_ARGV: the local cluster id, then the key columns. The key text is made by dynamic SQL over the transition
# table (PL/pgSQL makes it visible to EXECUTE), one statement per DELETE statement, not per row.
_RECORD = """
CREATE OR REPLACE FUNCTION sluicegate.{name}() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp {{settings}} AS $f$
BEGIN
    EXECUTE format(
        'INSERT INTO sluicegate.tombstones AS t (table_name, key, deleted_at, cluster_id, xid) '
        'SELECT $1, jsonb_build_array(%s), NULL, $2, pg_current_xact_id() FROM {rows} '
        'ON CONFLICT (table_name, key) DO UPDATE '
        'SET deleted_at = NULL, cluster_id = EXCLUDED.cluster_id, xid = EXCLUDED.xid',
        (SELECT string_agg(format('{column}::text', c), ', ') FROM unnest(TG_ARGV[1:]) AS c))
    USING TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, TG_ARGV[0]::int{old};
    RETURN NULL;
END
$f$;"""
# The same for an update that changes the key: its old row as a one-row relation `o`.
_TRIGGER_FUNCTIONS = (_RECORD.format(name="record_deletes", rows="sg_old_rows", column="%I", old="")
                      + _RECORD.format(name="record_key_change", rows="(SELECT ($3).*) AS o", column="o.%I",
                                       old=", OLD") + "\n")

# What a staged row found on the target: its row, a tombstone, or nothing.
ROW, TOMBSTONE, NOTHING = "r", "t", "n"

_TYPE_OF = {(ROW, "I"): "insert_exists", (ROW, "U"): "update_exists", (ROW, "D"): "delete_exists",
            (TOMBSTONE, "I"): "insert_deleted", (TOMBSTONE, "U"): "update_deleted",
            (TOMBSTONE, "D"): "delete_deleted", (NOTHING, "U"): "update_missing",
            (NOTHING, "D"): "delete_missing"}


class Incoming(NamedTuple):
    """One key's change in a batch (its net effect, when a key changed several times: the last change).

    `values`: the row's values as text, one per column of the table in its order (None: NULL); a delete needs
    only its key's. `time`: the change's commit time on the cluster it was written on (timestamptz text or an
    aware datetime); `cluster`: that cluster's id. `missing`: positions of columns the change does not carry
    (unchanged TOAST values): they keep the target's value, and the row must exist."""

    op: str  # 'I' insert, 'U' update, 'D' delete
    values: tuple
    time: datetime | str
    cluster: int
    missing: tuple[int, ...] = ()


@dataclass(frozen=True)
class Outcome:
    """What a batch did: rows written by kind, incoming changes that lost, conflicts logged by type."""

    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    lost: int = 0
    conflicts: Mapping[str, int] | None = None


def decide(op: str, found: str, local: tuple | None, remote: tuple) -> tuple[bool, str | None]:
    """The rules, as a pure function (the SQL of `LwwTable.apply` does the same over a whole batch): whether
    the incoming change wins, and the conflict it resolves (None: ordinary replication).

    `found`: ROW, TOMBSTONE or NOTHING for the key on the target; `local`: (time, cluster) of that row or
    tombstone, time None when unknown (a row this transaction wrote, or one older than the commit timestamps
    kept); `remote`: the change's (time, cluster).

    - Nothing there: an insert is ordinary; an update (update_missing) and a delete (delete_missing, which
      then leaves a tombstone) are conflicts that the change wins.
    - A version of unknown time loses to the change, silently: this transaction's own earlier write (a later
      change of the same stream), or a row older than any commit time kept.
    - A version from the change's own cluster is ordinary replication, and the change wins whatever the times:
      that cluster's changes arrive in its commit order (only its own stream carries them), so the version
      here is an earlier change of the same row. Commit times of one cluster's transactions are not quite in
      commit order, and an applier that commits several source transactions at once stamps them all with one
      time: comparing them could drop a later change.
    - Anything else is a conflict (the version came from another cluster), won by the greater
      (time, cluster): insert_exists, update_exists, delete_exists against a row; insert_deleted,
      update_deleted, delete_deleted against a tombstone. A version last written by another cluster counts
      even when the change is newer (as PostgreSQL 18's update_origin_differs): the two clusters wrote the
      row independently, and nothing tells whether the peer had seen this side's version.
    """
    if found == NOTHING:
        return True, _TYPE_OF.get((NOTHING, op))
    if local is None or local[0] is None:
        return True, None
    if local[1] == remote[1]:
        return True, None
    return (remote[0], remote[1]) > (local[0], local[1]), _TYPE_OF[(found, op)]


def ensure_schema(conn: psycopg.Connection) -> None:
    """The tombstone and conflict tables, and the trigger functions that record local deletes.

    DDL: `CREATE INDEX IF NOT EXISTS` takes a SHARE lock on its table even when the index exists, which blocks
    the application's tombstone triggers until the transaction ends. Never in an applier's transaction
    (`schema_ready` first): the applier then waiting for a row the application's delete holds is a deadlock."""
    settings = sql.SQL(" ").join(sql.SQL("SET {} = {}").format(sql.Identifier(k), sql.Literal(v))
                                 for k, v in _KEY_SETTINGS.items())
    conn.execute(SCHEMA_SQL)
    conn.execute(sql.SQL(_TRIGGER_FUNCTIONS).format(settings=settings))


def schema_ready(conn: psycopg.Connection) -> bool:
    """Whether ensure_schema has run on this database: a catalog read, no lock on the tables."""
    return conn.execute(
        "SELECT to_regclass('sluicegate.tombstones') IS NOT NULL AND to_regclass('sluicegate.conflicts') IS NOT "
        "NULL AND to_regprocedure('sluicegate.record_deletes()') IS NOT NULL").fetchone()[0]


def install_tombstone_triggers(conn: psycopg.Connection, table: Table, local_cluster: int) -> None:
    """Triggers on `table` that record a tombstone for every row the application deletes, or whose key it
    changes (the old key is gone as if deleted), stamped with `local_cluster`.

    They are ordinary triggers, so they do not fire for the applier's own writes, which run with
    `session_replication_role = replica` (the applier records its tombstones itself, with the incoming
    change's time and cluster). The same setting also skips foreign-key checks and ON DELETE actions for the
    applier's writes: the origin cluster already ran them, and their effects arrive as changes of their own
    (so a child row may arrive before its parent). User triggers declared ENABLE ALWAYS still fire."""
    ensure_schema(conn)
    args = sql.SQL(", ").join(sql.Literal(str(a)) for a in (local_cluster, *table.key))
    conn.execute(sql.SQL(
        "CREATE OR REPLACE TRIGGER sluicegate_tombstones AFTER DELETE ON {} "
        "REFERENCING OLD TABLE AS sg_old_rows FOR EACH STATEMENT "
        "EXECUTE FUNCTION sluicegate.record_deletes({})").format(table.ident, args))
    old = sql.SQL(", ").join(sql.SQL("OLD.{}").format(sql.Identifier(k)) for k in table.key)
    new = sql.SQL(", ").join(sql.SQL("NEW.{}").format(sql.Identifier(k)) for k in table.key)
    conn.execute(sql.SQL(
        "CREATE OR REPLACE TRIGGER sluicegate_tombstones_key AFTER UPDATE OF {} ON {} FOR EACH ROW "
        "WHEN (ROW({}) IS DISTINCT FROM ROW({})) EXECUTE FUNCTION sluicegate.record_key_change({})"
    ).format(sql.SQL(", ").join(map(sql.Identifier, table.key)), table.ident, old, new, args))


def remove_tombstone_triggers(conn: psycopg.Connection, table: Table) -> None:
    for name in ("sluicegate_tombstones", "sluicegate_tombstones_key"):
        conn.execute(sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(sql.Identifier(name), table.ident))


def origin_ids(conn: psycopg.Connection, clusters: Mapping[str, int]) -> dict[int, int]:
    """roident -> cluster id, from replication origin names -> cluster ids (origins not created yet are left
    out): the `origins` an LwwTable needs."""
    rows = conn.execute("SELECT roname, roident FROM pg_replication_origin WHERE roname = ANY(%s)",
                        (list(clusters),)).fetchall()
    return {int(ident): clusters[name] for name, ident in rows}


def check_commit_timestamps(conn: psycopg.Connection) -> None:
    if conn.execute("SELECT current_setting('track_commit_timestamp')").fetchone()[0] != "on":
        raise TerminalError(
            f"track_commit_timestamp is off on {conn.info.host}:{conn.info.port}/{conn.info.dbname}: "
            f"last-writer-wins needs each row's commit time; set track_commit_timestamp = on and restart")


def collect_tombstones(conn: psycopg.Connection, retention: timedelta = timedelta(days=7),
                       limit: int = 10_000) -> int:
    """Garbage-collect tombstones: first give local ones their commit time (while it is still kept), then
    delete at most `limit` older than `retention`, which must outlive replication lag: a change older than a
    collected tombstone that arrives later would bring its row back. Returns how many were deleted."""
    # A tombstone whose time is lost counts as older than any change: '-infinity', soon collected.
    conn.execute(
        "UPDATE sluicegate.tombstones SET deleted_at = COALESCE(pg_xact_commit_timestamp(xid::xid), "
        "'-infinity'), xid = NULL WHERE ctid = ANY(ARRAY(SELECT ctid FROM sluicegate.tombstones "
        "WHERE deleted_at IS NULL AND xid IS DISTINCT FROM pg_current_xact_id_if_assigned() LIMIT %s))",
        (limit,))
    return conn.execute(
        "DELETE FROM sluicegate.tombstones WHERE ctid = ANY(ARRAY(SELECT ctid FROM sluicegate.tombstones "
        "WHERE deleted_at < now() - %s::interval LIMIT %s))", (retention, limit)).rowcount


def conflict_counts(conn: psycopg.Connection, table_name: str | None = None) -> dict[str, int]:
    """Conflicts resolved on this side, per type (`status --json` "conflicts"); {} before any."""
    if conn.execute("SELECT to_regclass('sluicegate.conflicts')").fetchone()[0] is None:
        return {}
    rows = conn.execute(
        "SELECT type, count(*) FROM sluicegate.conflicts WHERE %(t)s::text IS NULL OR table_name = %(t)s "
        "GROUP BY type ORDER BY type", {"t": table_name}).fetchall()
    return dict(rows)


def copy_lines(rows: Iterable[Incoming], ncols: int) -> str:
    """Staged rows as COPY text: op, missing columns, time, cluster, then the values."""
    lines = []
    for op, values, time, cluster, missing in rows:
        if op not in ("I", "U", "D"):
            raise ValueError(f"unknown change kind {op!r} (I, U or D)")
        if len(values) != ncols:
            raise ValueError(f"a change has {len(values)} values for a table of {ncols} columns")
        keep = "{" + ",".join(map(str, missing)) + "}" if missing else "\\N"
        stamp = time.isoformat() if isinstance(time, datetime) else str(time)
        vals = ("\\N" if v is None else str(v).translate(ESCAPE) for v in values)
        lines.append("\t".join((op, keep, stamp, str(int(cluster)), *vals)))
    return "\n".join(lines) + "\n" if lines else ""


class LwwTable:
    """One replicated table's last-writer-wins plan (statements composed once), applied in the caller's
    transaction; the caller commits (with its position, under the change's replication origin)."""

    def __init__(self, conn: psycopg.Connection, table: Table, *, local_cluster: int,
                 origins: Mapping[int, int] | None = None, index: int = 0, upto: list[str] | None = None):
        """`local_cluster`: this cluster's id; `origins`: roident -> cluster id of every replication origin
        whose transactions wrote rows here (origin_ids); a row of an origin not named counts as local.
        `index`: tells the staging tables of several LwwTables of one session apart. `upto`: a table being
        copied: only changes of keys <= this one apply (the copy brings the rest)."""
        self.upto = upto
        check_commit_timestamps(conn)
        if not schema_ready(conn):  # made by `replicate create`: only a database set up otherwise lacks it
            ensure_schema(conn)
        self.conn, self.table, self.local_cluster = conn, table, local_cluster
        self.origins = {LOCAL_ORIGIN: local_cluster, **(origins or {})}
        self.fixed_settings = any(table.columns[i].type_oid not in _PLAIN_KEY_TYPES
                                  for i in table.key_indices)
        self.statements = 0  # statements sent, for the caller's accounting (and a test that it is bounded)
        # domains staged as their base types: deletes stage NULLs
        staged = staged_columns(conn, table)
        self._plan = compose_plan(table, sql.Identifier(f"sg_lww_{index}"), local_cluster=local_cluster,
                                  origins=self.origins, upto=upto, staged=staged,
                                  always=writes_always_identity(conn, table))

    def _exec(self, cur, statement, params=None):
        self.statements += 1
        return cur.execute(statement, params)

    def apply(self, rows: Iterable[Incoming]) -> Outcome:
        """Apply a batch: at most one incoming change per key (its net effect). The connection must run with
        `session_replication_role = replica` (so that the tombstone triggers and foreign keys leave the
        applier's writes alone), inside the caller's transaction."""
        t, plan = self.table, self._plan
        data = copy_lines(rows, len(t.columns))
        if not data:
            return Outcome(conflicts={})
        with self.conn.cursor() as cur:
            names = ("session_replication_role", *(_KEY_SETTINGS if self.fixed_settings else ()))
            role, *saved = self._exec(cur, sql.SQL("SELECT {}").format(sql.SQL(", ").join(
                sql.SQL("current_setting({})").format(sql.Literal(n)) for n in names))).fetchone()
            if role != "replica":
                raise TerminalError(
                    f"applying changes to {t.qualified} with session_replication_role = {role}: the "
                    f"tombstone triggers would take the applier's deletes for the application's; run the "
                    f"applier with SET session_replication_role = replica")
            self._exec(cur, plan["create"])
            self.statements += 1  # the COPY
            with cur.copy(plan["copy"]) as copy:
                copy.write(data)
            if self.fixed_settings:
                self._set(cur, _KEY_SETTINGS)
            try:
                return self._apply_staged(cur)
            finally:
                failed = self.conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
                if self.fixed_settings and not failed:
                    self._set(cur, dict(zip(_KEY_SETTINGS, saved)))

    def _set(self, cur, settings: dict[str, str]) -> None:
        self._exec(cur, sql.SQL("SELECT {}").format(sql.SQL(", ").join(
            sql.SQL("set_config({}, {}, true)").format(sql.Literal(k), sql.Literal(v))
            for k, v in settings.items())))

    def _apply_staged(self, cur) -> Outcome:
        plan = self._plan
        if plan["trim"] is not None:
            self._exec(cur, plan["trim"])
        self._exec(cur, plan["lock"])
        lost, deletes, updates, inserts, partial, tombstones, revived, conflicts = \
            self._exec(cur, plan["classify"]).fetchone()
        if partial:
            key = self._exec(cur, plan["partial"]).fetchone()[0]
            alter = sql.SQL("ALTER TABLE {} REPLICA IDENTITY FULL").format(self.table.ident)
            raise TerminalError(
                f"an incoming update of {self.table.qualified} key {key} wins but carries only some columns "
                f"(unchanged TOAST values) and the row is missing here: run {alter.as_string(self.conn)} on "
                f"every cluster so updates carry the whole row")
        if conflicts:
            self._exec(cur, plan["conflicts"])
        deleted = self._exec(cur, plan["delete"]).rowcount if deletes else 0
        updated = self._exec(cur, plan["update"]).rowcount if updates and plan["update"] is not None else 0
        inserted = self._exec(cur, plan["insert"]).rowcount if inserts else 0
        if tombstones:
            self._exec(cur, plan["tombstone"])
        if revived:
            self._exec(cur, plan["untombstone"])
        self._exec(cur, plan["clear"])
        return Outcome(inserted=inserted, updated=updated, deleted=deleted, lost=lost,
                       conflicts=conflicts or {})


def _key_json(table: Table, alias: str) -> sql.Composable:
    return sql.SQL("jsonb_build_array({})").format(sql.SQL(", ").join(
        sql.SQL("{}::text").format(sql.Identifier(alias, k)) for k in table.key))


def _cluster_of(origins: Mapping[int, int], local_cluster: int, roident: sql.Composable) -> sql.Composable:
    whens = sql.SQL(" ").join(sql.SQL("WHEN {} THEN {}").format(sql.Literal(o), sql.Literal(c))
                              for o, c in sorted(origins.items()))
    return sql.SQL("CASE {} {} ELSE {} END").format(roident, whens, sql.Literal(local_cluster))


def compose_plan(t: Table, stage: sql.Identifier, *, local_cluster: int, origins: Mapping[int, int],
                 upto: list[str] | None, staged: sql.Composable, always: bool) -> dict:
    """A table's last-writer-wins statements (pure: the caller read the target's facts). `origins`: roident ->
    cluster id, this cluster's own (LOCAL_ORIGIN) included; `staged`: the staging table's columns
    (staged_columns); `always`: the target has an identity column GENERATED ALWAYS (writes_always_identity)."""
    name = sql.Literal(t.qualified)
    cols = sql.SQL(", ").join(map(sql.Identifier, t.column_names))
    s_cols = sql.SQL(", ").join(sql.Identifier("s", c) for c in t.column_names)
    keys = sql.SQL(", ").join(map(sql.Identifier, t.key))
    match = keyrange.key_equal(t, "d", "s")
    first_key = sql.Identifier("d", t.key[0])  # key columns are NOT NULL: NULL here is "no row"
    non_key = [c for c in t.column_names if c not in t.key]
    assign = keep_assignments(t, non_key)
    d_keys = sql.SQL(", ").join(sql.Identifier("d", k) for k in t.key)
    local_time = sql.SQL("COALESCE(tb.deleted_at, pg_xact_commit_timestamp(tb.xid::xid))")
    types = sql.SQL(" ").join(sql.SQL("WHEN {} THEN {}").format(sql.Literal(f + o), sql.Literal(ty))
                              for (f, o), ty in _TYPE_OF.items())
    plan = {
        "create": sql.SQL(
            """CREATE TEMP TABLE IF NOT EXISTS {} ON COMMIT DROP AS SELECT NULL::"char" AS _sg_op,
               NULL::int[] AS _sg_keep, NULL::timestamptz AS _sg_time, NULL::int AS _sg_cluster,
               NULL::"char" AS _sg_found, NULL::timestamptz AS _sg_ltime, NULL::int AS _sg_lcluster,
               NULL::bool AS _sg_win, NULL::text AS _sg_conflict, {} FROM {} WITH NO DATA"""
        ).format(stage, staged, t.ident),
        "copy": sql.SQL("COPY {} (_sg_op, _sg_keep, _sg_time, _sg_cluster, {}) FROM STDIN").format(
            stage, cols),
        # The target's rows of the batch stay as classified until the transaction ends: the application
        # cannot change or delete them in between (a row it inserts meanwhile meets the insert's ON
        # CONFLICT). In key order, as other appliers lock.
        "lock": sql.SQL("SELECT count(*) FROM (SELECT 1 FROM {} AS d JOIN {} AS s ON {} ORDER BY {} "
                        "FOR UPDATE OF d) AS l").format(t.ident, stage, match, d_keys),
        "classify": sql.SQL(
            """WITH x AS (
                 SELECT s.ctid AS sid, s._sg_op AS op, s._sg_time AS rtime, s._sg_cluster AS rcl,
                        CASE WHEN {first} IS NOT NULL THEN 'r' WHEN tb.key IS NOT NULL THEN 't'
                             ELSE 'n' END AS found,
                        CASE WHEN {first} IS NOT NULL THEN v.timestamp ELSE {ltime} END AS ltime,
                        CASE WHEN {first} IS NOT NULL THEN {origin} ELSE tb.cluster_id END AS lcl
                 FROM {stage} AS s LEFT JOIN {target} AS d ON {match}
                 LEFT JOIN LATERAL pg_xact_commit_timestamp_origin(d.xmin) AS v ON true
                 LEFT JOIN sluicegate.tombstones AS tb
                   ON {first} IS NULL AND tb.table_name = {name} AND tb.key = {skey}
               ), y AS (
                 SELECT x.*,
                        (found = 'n' OR ltime IS NULL OR lcl = rcl OR (rtime, rcl) > (ltime, lcl)) AS win,
                        (found = 'n' AND op = 'I') OR (found <> 'n' AND (ltime IS NULL OR lcl = rcl))
                          AS ordinary
                 FROM x
               ), u AS (
                 UPDATE {stage} AS s SET _sg_found = y.found, _sg_ltime = y.ltime, _sg_lcluster = y.lcl,
                        _sg_win = y.win,
                        _sg_conflict = CASE WHEN NOT y.ordinary
                                            THEN CASE y.found::text || y.op::text {types} END END
                 FROM y WHERE s.ctid = y.sid
                 RETURNING s._sg_op AS op, s._sg_found AS found, s._sg_win AS win,
                           s._sg_keep IS NOT NULL AS partial, s._sg_conflict AS conflict
               )
               SELECT count(*) FILTER (WHERE NOT win),
                      count(*) FILTER (WHERE win AND op = 'D' AND found = 'r'),
                      count(*) FILTER (WHERE win AND op <> 'D' AND found = 'r'),
                      count(*) FILTER (WHERE win AND op <> 'D' AND found <> 'r'),
                      count(*) FILTER (WHERE win AND op <> 'D' AND found <> 'r' AND partial),
                      count(*) FILTER (WHERE win AND op = 'D'),
                      count(*) FILTER (WHERE win AND op <> 'D' AND found = 't'),
                      (SELECT jsonb_object_agg(conflict, n) FROM (SELECT conflict, count(*) AS n FROM u
                         WHERE conflict IS NOT NULL GROUP BY conflict) AS c)
               FROM u"""
        ).format(first=first_key, ltime=local_time, origin=_cluster_of(origins, local_cluster, sql.SQL("v.roident")),
                 stage=stage, target=t.ident, match=match, name=name, skey=_key_json(t, "s"),
                 types=types),
        "partial": sql.SQL(
            "SELECT {}::text FROM {} AS s WHERE s._sg_win AND s._sg_op <> 'D' AND s._sg_found <> 'r' "
            "AND s._sg_keep IS NOT NULL LIMIT 1").format(_key_json(t, "s"), stage),
        "conflicts": sql.SQL(
            "INSERT INTO sluicegate.conflicts (table_name, key, type, local_time, local_cluster, "
            "remote_time, remote_cluster, winner) SELECT {}, {}, s._sg_conflict, s._sg_ltime, "
            "s._sg_lcluster, s._sg_time, s._sg_cluster, "
            "CASE WHEN s._sg_win THEN 'remote' ELSE 'local' END FROM {} AS s "
            "WHERE s._sg_conflict IS NOT NULL").format(name, _key_json(t, "s"), stage),
        "delete": sql.SQL("DELETE FROM {} AS d USING {} AS s WHERE s._sg_op = 'D' AND s._sg_win "
                          "AND s._sg_found = 'r' AND {}").format(t.ident, stage, match),
        "update": sql.SQL("UPDATE {} AS d SET {} FROM {} AS s WHERE s._sg_op <> 'D' AND s._sg_win "
                          "AND s._sg_found = 'r' AND {}").format(t.ident, assign, stage, match)
        if non_key else None,
        # A row the application inserted after the classification is a version like any other.
        # An identity key GENERATED ALWAYS keeps the peer's value (each side's sequence draws its own).
        "insert": sql.SQL(
            "INSERT INTO {} AS d ({}){} SELECT {} FROM {} AS s WHERE s._sg_op <> 'D' AND s._sg_win "
            "AND s._sg_found <> 'r' ON CONFLICT ({}) {}"
        ).format(t.ident, cols, overriding_clause(always), s_cols, stage, keys,
                 _insert_conflict(t, stage, non_key, origins, local_cluster)),
        "tombstone": sql.SQL(
            "INSERT INTO sluicegate.tombstones AS tb (table_name, key, deleted_at, cluster_id) "
            "SELECT {}, {}, s._sg_time, s._sg_cluster FROM {} AS s WHERE s._sg_op = 'D' AND s._sg_win "
            "ON CONFLICT (table_name, key) DO UPDATE SET deleted_at = EXCLUDED.deleted_at, "
            "cluster_id = EXCLUDED.cluster_id, xid = NULL WHERE EXCLUDED.cluster_id = tb.cluster_id "
            "OR (EXCLUDED.deleted_at, EXCLUDED.cluster_id) > (COALESCE({}, '-infinity'), tb.cluster_id)"
        ).format(name, _key_json(t, "s"), stage, local_time),
        "untombstone": sql.SQL(
            "DELETE FROM sluicegate.tombstones AS tb USING {} AS s WHERE s._sg_op <> 'D' AND s._sg_win "
            "AND s._sg_found = 't' AND tb.table_name = {} AND tb.key = {}").format(
                stage, name, _key_json(t, "s")),
        "clear": sql.SQL("TRUNCATE {}").format(stage),
        "trim": sql.SQL("DELETE FROM {} AS s WHERE NOT {}").format(
            stage, keyrange.compare(t, "<=", upto, alias="s")) if upto is not None else None,
    }
    return plan


def _insert_conflict(t: Table, stage: sql.Identifier, non_key: list[str], origins: Mapping[int, int],
                     local_cluster: int) -> sql.Composable:
    """ON CONFLICT's action: the incoming row replaces the one the application inserted meanwhile only if
    it is the later version (in DO UPDATE, `d` is the existing row, EXCLUDED the incoming one)."""
    if not non_key:
        return sql.SQL("DO NOTHING")
    assign = sql.SQL(", ").join(
        sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(c), sql.Identifier(c)) for c in non_key)
    same = sql.SQL(" AND ").join(
        sql.SQL("s.{} = EXCLUDED.{}").format(sql.Identifier(k), sql.Identifier(k)) for k in t.key)
    local = sql.SQL("(SELECT (COALESCE(v.timestamp, '-infinity'), {}) "
                    "FROM pg_xact_commit_timestamp_origin(d.xmin) AS v)").format(
                        _cluster_of(origins, local_cluster, sql.SQL("v.roident")))
    return sql.SQL(
        "DO UPDATE SET {} WHERE (SELECT ROW(s._sg_time, s._sg_cluster) FROM {} AS s WHERE {}) > {}"
    ).format(assign, stage, same, local)

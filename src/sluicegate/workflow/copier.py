"""The copy phase: cycles of (snapshot, fast-forward, copy rows above lastpk) — VReplication's vcopier.

A cycle plans its key ranges inside the snapshot, then Spark tasks copy the ranges in parallel: each task
imports the exported snapshot and pipes `COPY (SELECT …) TO STDOUT` straight into `COPY … FROM STDIN` on
the target (raw passthrough, no Python per row: copy_task.py; binary when the types allow). Target
rows above lastpk are by definition not yet copied, so a cycle first deletes them: a cycle killed halfway is
simply redone. A whole table copied in one cycle is split by heap pages instead of keys: a TID range scan
reads its pages in order with no index walk, whatever the key's type. Many small tables share a cycle
(`small_group`): one snapshot, one Spark job whose tasks each copy several of them whole.

`Copier.copy_next` is the phase's step: the engine (engine.py) dispatches a Copying stream to it each turn.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
from dataclasses import dataclass, replace

import psycopg
from psycopg import sql

from ..config import Settings
from ..errors import TerminalError
from ..faults import fault_point
from ..postgres import capture, collation, durable, indexes, keyrange, locks, origins, standby_flush
from ..postgres.catalog import Table
from ..postgres.connect import connect, first_line
from ..postgres.snapshot import committed_since, take_snapshot
from . import denial, live, rule_copy
from . import state as st
from .cluster_model import direction as cluster_direction
from .copy_task import CopyTask, TablesTask, copy_range, copy_tables, rows_of

log = logging.getLogger("sluicegate")


@dataclass(frozen=True)
class CopyRange:
    """One Spark task's share of a cycle: rows with lo < key <= hi, read in `snapshot`."""

    source_url: str
    target_url: str
    table: dict  # Table.to_json(): plain data pickles small
    snapshot: str
    lo: list[str] | None
    hi: list[str] | None
    pages: tuple[int, int | None] | None = None  # instead of lo/hi: heap pages first <= page < end (None: open)


@dataclass(frozen=True)
class CyclePlan:
    ranges: list[tuple[list[str] | None, list[str]]]
    new_lastpk: list[str] | None
    rows: int
    done: bool  # the table has no rows left after new_lastpk in this snapshot
    pages: list[tuple[int, int | None]] | None = None  # the whole table by heap pages (then ranges is empty)

    def tasks(self, source_url: str, target_url: str, table: Table, snapshot: str) -> list[CopyRange]:
        spec = table.to_json()
        if self.pages is not None:
            return [CopyRange(source_url, target_url, spec, snapshot, None, None, p) for p in self.pages]
        return [CopyRange(source_url, target_url, spec, snapshot, lo, hi) for lo, hi in self.ranges]


def plan_cycle(snap_conn: psycopg.Connection, table: Table, lastpk: list[str] | None, cycle_rows: int,
               chunk_rows: int, slots: int = 1, by_pages: bool = False) -> CyclePlan:
    """Split the next `cycle_rows` keys above lastpk into ranges of `chunk_rows`, inside the snapshot.

    Each bound is the chunk_rows-th key above the previous one (`ORDER BY key OFFSET n-1 LIMIT 1`, an
    index-only walk); only the table's last, shorter chunk is counted. A whole table that fits in one cycle
    is split by heap pages when `by_pages` (`_plan_by_pages`), else, with one integer key column, by value
    (`_plan_by_value`), into a multiple of `slots` ranges (the tasks Spark runs at once) so that no slot idles
    through the last wave (_tasks).
    """
    if table.keyless:
        return _plan_keyless(snap_conn, table, chunk_rows, slots)
    fast = (_plan_by_pages(snap_conn, table, lastpk, cycle_rows, chunk_rows, slots) if by_pages else None) \
        or _plan_by_value(snap_conn, table, lastpk, cycle_rows, chunk_rows, slots)
    if fast is not None:
        return fast
    keys, order, order_desc = keyrange.key_texts(table), keyrange.key_order(table), keyrange.key_order(table, "DESC")
    ranges: list[tuple[list[str] | None, list[str]]] = []
    lo, total, done = lastpk, 0, False
    while total < cycle_rows:
        step = min(chunk_rows, cycle_rows - total)
        where = keyrange.in_range(table, lo, None)
        row = snap_conn.execute(
            sql.SQL("SELECT {} FROM {} WHERE {} ORDER BY {} OFFSET {} LIMIT 1").format(
                keys, table.scan, where, order, sql.Literal(step - 1))
        ).fetchone()
        if row is not None:
            n = step
        else:  # fewer than `step` rows left: the last one ends the table
            row = snap_conn.execute(
                sql.SQL("SELECT {}, count(*) OVER () FROM (SELECT {} FROM {} WHERE {} ORDER BY {} LIMIT {}) s "
                        "ORDER BY {} LIMIT 1").format(
                    keys, order, table.scan, where, order, sql.Literal(step), order_desc)
            ).fetchone()
            done = True
            if row is None:
                break
            n, row = row[-1], row[:-1]
        hi = list(row)
        ranges.append((lo, hi))
        lo, total = hi, total + n
        if done:
            break
    return CyclePlan(ranges, lo, total, done)


_INTEGER_TYPES = (20, 21, 23)  # int8, int2, int4


def _plan_by_value(snap_conn: psycopg.Connection, table: Table, lastpk: list[str] | None, cycle_rows: int,
                   chunk_rows: int, slots: int = 1) -> CyclePlan | None:
    """The first cycle of a table whose integer key's whole span fits in one cycle: equal-width value ranges
    between its smallest and greatest key — two index lookups, where walking every key costs time in
    proportion to the rows. Chunks are as even as the keys are dense; the cycle ends at the greatest key, so it copies
    every row whatever the estimate said. None when that does not apply (the walk is used)."""
    if lastpk is not None or len(table.key) != 1:
        return None
    column = next(c for c in table.columns if c.name == table.key[0])
    if column.type_oid not in _INTEGER_TYPES:
        return None
    est, _ = _estimate(snap_conn, table)
    if est is None or est > cycle_rows:
        return None
    key = sql.Identifier(column.name)
    lo, hi = snap_conn.execute(sql.SQL("SELECT min({}), max({}) FROM {}").format(key, key, table.scan)).fetchone()
    if lo is None:
        return CyclePlan([], None, 0, True)
    n = min(_tasks(est, chunk_rows, slots), hi - lo + 1)
    bounds = [lo - 1 + (hi - lo + 1) * i // n for i in range(1, n + 1)]
    ranges = [([str(a)] if i else None, [str(b)]) for i, (a, b) in enumerate(zip([lo - 1, *bounds], bounds))]
    return CyclePlan(ranges, [str(hi)], est, True)


def _plan_by_pages(snap_conn: psycopg.Connection, table: Table, lastpk: list[str] | None, cycle_rows: int,
                   chunk_rows: int, slots: int = 1) -> CyclePlan | None:
    """The first cycle of a table that fits in one cycle, split into ranges of heap pages (TID range scans,
    PostgreSQL 14+): every row version visible in the snapshot sits on exactly one page, so each is copied
    once, and each task reads only its pages. The last range is open: pages added since are covered too. The
    cycle ends at the greatest key (one index lookup). None when that does not apply."""
    if lastpk is not None or snap_conn.info.server_version < 140000:
        return None
    est, pages = _estimate(snap_conn, table)
    if est is None or est > cycle_rows:
        return None
    last = snap_conn.execute(
        sql.SQL("SELECT {} FROM {} ORDER BY {} LIMIT 1").format(
            keyrange.key_texts(table), table.scan, keyrange.key_order(table, "DESC"))
    ).fetchone()
    if last is None:
        return CyclePlan([], None, 0, True)
    n = max(1, min(_tasks(est, chunk_rows, slots), pages))
    bounds = [pages * i // n for i in range(n)] + [None]
    return CyclePlan([], list(last), est, True, pages=list(itertools.pairwise(bounds)))


def _plan_keyless(snap_conn: psycopg.Connection, table: Table, chunk_rows: int, slots: int) -> CyclePlan:
    """A table without a key in one cycle, whatever its size: there is no lastpk to resume from (a ctid moves
    when its row is updated), so the snapshot brings every row at once, split by heap pages (TID range scans,
    PostgreSQL 14+; before, one task) into tasks Spark runs in parallel. A cycle that does not finish is redone
    from an empty table (engine.py: clear_above with no lastpk empties it in the transaction that starts the
    cycle). The table is done (and lastpk stays None): its changes after the snapshot all apply."""
    est, pages = _estimate(snap_conn, table)
    if est is None:  # never analyzed: the pages say how much there is, at about 100 rows each
        est = pages * 100
    n = max(1, min(_tasks(est, chunk_rows, slots), pages)) if snap_conn.info.server_version >= 140000 else 1
    bounds = [pages * i // n for i in range(n)] + [None]
    return CyclePlan([], None, est, True, pages=list(itertools.pairwise(bounds)))


def _estimate(snap_conn: psycopg.Connection, table: Table) -> tuple[int | None, int]:
    """(rows, pages): the planner's own estimate, rows per page at the last ANALYZE times the pages there are
    now (None without statistics), and the pages there are now."""
    est, pages = snap_conn.execute(
        sql.SQL("""SELECT CASE WHEN reltuples > 0 AND relpages > 0 THEN reltuples / relpages * pages END, pages
                   FROM (SELECT reltuples, relpages,
                                pg_relation_size(oid) / current_setting('block_size')::int AS pages
                         FROM pg_class WHERE oid = {}::regclass) c""").format(
            sql.Literal(table.ident.as_string(snap_conn)))
    ).fetchone()
    return (None if est is None else int(est)), int(pages)


def _tasks(est: int, chunk_rows: int, slots: int) -> int:
    """Tasks of about chunk_rows rows, in whole waves of the slots that run them: rounded down (tasks up to
    twice chunk_rows), not up. Each wave boundary costs every slot a task's start (two sessions, the snapshot
    imported, a commit) and the last wave's slowest task."""
    n = max(1, -(-est // chunk_rows))
    return max(1, n // slots) * slots


def truncate(target: psycopg.Connection, table: Table) -> None:
    """Empty a table whose first cycle did not finish (its indexes deferred): nothing else wrote to it."""
    with locks.guard(target, f"emptying {table.qualified} for its copy", [table.ident.as_string(target)]):
        target.execute(sql.SQL("TRUNCATE {}").format(table.ident))


def defer_indexes(target: psycopg.Connection, stream_id: int, state: st.TableState) -> None:
    """Drop the table's indexes for its first cycle and record them (postgres/indexes.py), in the caller's
    transaction; `state.deferred_indexes` says what was dropped (None: nothing)."""
    state.deferred_indexes = indexes.defer(target, state.table) or None
    if state.deferred_indexes:
        st.save_deferred_indexes(target, stream_id, state.table.qualified, state.deferred_indexes)


def build_deferred_indexes(target: psycopg.Connection, stream_id: int, state: st.TableState) -> None:
    """Build the indexes `defer_indexes` dropped and clear their record, in the caller's transaction."""
    indexes.build(target, state.table, state.deferred_indexes)
    st.save_deferred_indexes(target, stream_id, state.table.qualified, None)
    state.deferred_indexes = None


def clear_above(target: psycopg.Connection, table: Table, lastpk: list[str] | None,
                mine: sql.Composable | None = None) -> int:
    """Delete target rows above lastpk: leftovers of a cycle that did not finish. `mine`: only rows this
    stream writes (a Reshard's target table is filled by one stream per source shard)."""
    where = [keyrange.compare(table, ">", lastpk)] if lastpk is not None else []
    if mine is not None:
        where.append(mine)
    cond = sql.SQL(" AND ").join(where) if where else sql.SQL("true")
    if lastpk is not None:
        # Rows above lastpk are few or none: an index range scan, never a scan of all that was copied (the
        # planner has no statistics for a table the copy just filled). Local to the caller's transaction.
        target.execute("SET LOCAL enable_seqscan = off")
    with locks.guard(target, f"clearing {table.qualified} above its copy position", [table.ident.as_string(target)],
                     "RowExclusiveLock"):
        return target.execute(sql.SQL("DELETE FROM {} WHERE {}").format(table.ident, cond)).rowcount


def task_where(table: Table, task: CopyRange) -> sql.Composable:
    """The rows of one task: its heap pages, or its key range."""
    if task.pages is None:
        return keyrange.in_range(table, task.lo, task.hi)
    first, end = task.pages
    where = sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({first},0)"))
    if end is not None:
        where = sql.SQL("{} AND ctid < {}::tid").format(where, sql.Literal(f"({end},0)"))
    return where


def prepare(task: CopyRange) -> CopyTask:
    """The task as a worker runs it (copy_task.py): its two COPY statements, written here on the driver."""
    table = Table.from_json(task.table)
    select, insert = _copy_sql(table, task_where(table, task))
    return CopyTask(task.source_url, task.target_url, task.snapshot, select, insert)


def _copy_sql(table: Table, where: sql.Composable | None = None) -> tuple[str, str]:
    """(COPY … TO STDOUT, COPY … FROM STDIN) of the table's rows (`where`: those only)."""
    fmt = sql.SQL("binary" if table.binary_copy_safe else "text")
    cols = sql.SQL(", ").join(map(sql.Identifier, table.column_names))
    rows = sql.SQL(" WHERE {}").format(where) if where is not None else sql.SQL("")
    select = sql.SQL("COPY (SELECT {} FROM {}{}) TO STDOUT (FORMAT {})").format(cols, table.scan, rows, fmt)
    insert = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT {})").format(table.ident, cols, fmt)
    return select.as_string(None), insert.as_string(None)


# -- many small tables: one cycle copies them all ---------------------------------------------------------
# The most tables one cycle takes. Its snapshot locks each (SHARE, briefly) and each task's sessions hold a
# lock on each of theirs: well within the lock table of a server with default settings (max_locks_per_transaction
# 64 per connection, shared by all).
MAX_GROUP_TABLES = 256
# A small table: estimated at most chunk_rows // SMALL_SHARE rows (copy_state's estimate: the planner's at
# create, counted when the table was never analyzed). It is copied whole by one task, with others.
SMALL_SHARE = 4


def small_group(tables: list[st.TableState], chunk_rows: int) -> list[st.TableState]:
    """The tables to copy together in the next cycle, the stream's first pending table first: pending (no row
    copied), small, keyed, no rule, no indexes dropped by an earlier cycle; up to chunk_rows rows and
    MAX_GROUP_TABLES in all. Fewer than two: [] (the table's own cycle is as cheap, and splits it by pages).
    A group's tables keep their indexes: a few hundred rows each cost less to index as they come than to
    index again after, which would take a statement per index per table."""
    def small(t: st.TableState) -> bool:
        return (not t.done and t.lastpk is None and t.rule is None and not t.table.keyless
                and not t.deferred_indexes and t.table.estimated_rows <= chunk_rows // SMALL_SHARE)

    pending = [t for t in tables if not t.done]
    if not pending or not small(pending[0]):
        return []
    group, rows = [], 0
    for t in pending:
        if len(group) == MAX_GROUP_TABLES:
            break
        if small(t) and rows + max(t.table.estimated_rows, 0) <= chunk_rows:
            group.append(t)
            rows += max(t.table.estimated_rows, 0)
    return group if len(group) > 1 else []


def group_tasks(source_url: str, target_url: str, tables: list[Table], snapshot: str, slots: int,
                origin: str = "", label: str = "") -> list[TablesTask]:
    """One task per slot (at most one per table), the tables dealt out by estimated rows, largest first to the
    least loaded: each task copies its tables whole, one after another, and commits them together."""
    n = max(1, min(slots, len(tables)))
    shares: list[list[Table]] = [[] for _ in range(n)]
    load = [0] * n
    for t in sorted(tables, key=lambda t: -max(t.estimated_rows, 0)):
        i = load.index(min(load))
        shares[i].append(t)
        load[i] += max(t.estimated_rows, 1)
    return [TablesTask(source_url, target_url, snapshot, tuple((t.qualified, *_copy_sql(t)) for t in share),
                       origin, label)
            for share in shares if share]


def with_rows(target: psycopg.Connection, tables: list[Table]) -> list[Table]:
    """Those of `tables` that have a row on the target (a cycle that did not finish left them), in one query:
    a group's cycle clears only those."""
    if not tables:
        return []
    probes = sql.SQL(" UNION ALL ").join(
        sql.SQL("SELECT {} WHERE EXISTS (SELECT 1 FROM {})").format(sql.Literal(i), t.ident)
        for i, t in enumerate(tables))
    return [tables[i] for (i,) in target.execute(probes).fetchall()]


# -- the copy phase's steps, as the driver runs them ------------------------------------------------------------
class Copier:
    """The copy phase of one engine's stream (VReplication's vcopier): the engine dispatches a Copying stream
    here each turn. `engine` gives the Spark runner, the stop event, its jobs' tag, the play task that catches
    up and fast-forwards (engine.play) and the stream's rules (engine.rule_runners)."""

    def __init__(self, engine):
        self.engine = engine
        self.target_url: str = engine.target_url
        # stream id -> (position, txid snapshot) of its last copy cycle: the target has everything committed as
        # of that snapshot. Lets the next cycle skip catchup and fast-forward when nothing committed since.
        self._copied_as_of: dict[int, tuple[int, str]] = {}

    def copy_next(self, wf: st.Workflow, stream: st.Stream) -> None:
        """One step of the copy phase (vcopier's copyNext): catch up, take a snapshot, fast-forward to it, copy
        the next cycle of the first table not done (or a group of small tables), record it. The last table
        done: the foreign keys, then Running."""
        settings = Settings.from_options(wf.options, f"workflow {wf.name}")
        current = stream.copying_table()
        if current is None:
            with connect(self.target_url, role="target") as dst:
                st.lock_stream(dst, stream.id)
                add_foreign_keys(dst, wf)
                st.set_state(dst, stream.id, st.RUNNING)
            return
        # Nothing copied yet: every change before the snapshot is to rows the copy brings; catchup and
        # fast-forward would read them all and skip each one.
        untouched = all(t.lastpk is None and not t.done for t in stream.tables)
        # Catchup: replay what happened since the last cycle until the lag is small. A source that has
        # committed nothing since the stream's position has nothing to replay (a quiet source's next table):
        # no play task, whose replication connection and Spark job would cost more than a small table's copy.
        nothing_to_replay = untouched or self._nothing_committed_since(stream)
        while not self.engine.stop.is_set() and not nothing_to_replay:
            result = self.engine.play(wf, stream, until="caught_up", expect=st.COPYING)
            if result.interrupted:
                return
            stream.position = result.position
            if result.caught_up:
                break
            fault_point("catchup.between_batches")
        if self.engine.stop.is_set():
            return
        fault_point("catchup.done")
        table = current.table
        # Many small tables: one cycle (one snapshot, one Spark job) copies them all, whole.
        group = small_group(stream.tables, settings.chunk_rows)
        with take_snapshot(stream.source_url, [t.table for t in group] or table, stop=self.engine.stop) as snap:
            # Nothing committed since the last cycle's snapshot (checked now, after this one's position was
            # read): nothing lies between the two positions either, so none to fast-forward through.
            skip_to_snapshot = untouched or (stream.position < snap.position
                                             and self._nothing_committed_since(stream))
            if skip_to_snapshot and stream.position < snap.position:
                with connect(self.target_url, role="target") as dst:
                    durable.flush_on_commit(dst)  # the slot may be confirmed up to it (_confirm_slot)
                    state, position = st.lock_stream(dst, stream.id)
                    if state != st.COPYING or position != stream.position:
                        return  # moved under us: the next turn re-reads
                    st.save_position(dst, stream.id, snap.position)
                stream.position = snap.position  # the next play task confirms the slot up to it
                # (with the target's standbys to wait for, the next play task's gate confirms it: not here)
                if untouched and not standby_flush.enabled(wf.options):
                    self._confirm_slot(stream)
            # Fast-forward: everything up to the snapshot's position, for rows already copied.
            while stream.position < snap.position:
                fault_point("fastforward.start")
                result = self.engine.play(wf, stream, until="position", stop_at=snap.position, expect=st.COPYING)
                if result.interrupted:
                    return
                stream.position = result.position
                if self.engine.stop.is_set():
                    return
            if group:
                self._copy_group(wf, stream, group, snap)
                return
            rule = self.engine.rule_runners(stream).get((table.schema, table.name))
            origin, _ = cluster_direction(wf)
            with connect(self.target_url, role="target") as dst:
                if origin:  # a bidirectional sink: the clearing below must not be sent back as deletes
                    origins.acquire(dst, origin)
                    # nor leave tombstones: it is the applier's, not the application's (appliers/lww.py)
                    dst.execute("SET session_replication_role = replica")
                # Catchup and fast-forward may have added columns the source added (schema_changes.py): the
                # cycle copies the table as the snapshot has it.
                table = current.table = Table.from_json(st.table_specs(dst, stream.id)[table.qualified])
                if current.deferred_indexes:  # a first cycle that did not finish: its rows are all there is
                    truncate(dst, table)
                elif rule is None:
                    clear_above(dst, table, current.lastpk)
                    # Only this stream writes the table (a rule's target may be shared): build its indexes
                    # after the first cycle, not row by row.
                    if current.lastpk is None and settings.defer_indexes:
                        defer_indexes(dst, stream.id, current)
                else:
                    clear_above(dst, rule.rule.target, current.lastpk, rule.rule.target_keyrange())
                cycle_rows = settings.cycle_rows
                # No cycle edge for the target to misplace (postgres/collation.py)
                if collation.key_orders_differ(snap.conn, dst, table):
                    cycle_rows = sys.maxsize
                    log.warning("copying %s in one cycle: its key sorts by the database's default collation, "
                                "which differs between source and target", table.qualified)
            # The plan needs Spark's task slots: under `workflow run`, the first moment that waits for Spark.
            plan = plan_cycle(snap.conn, table, current.lastpk, cycle_rows, settings.chunk_rows,
                                     slots=self.engine.runner.parallelism(), by_pages=rule is None)
            # What the progress view adds to rows_copied while the cycle runs (live.py)
            progress = live.cycle_started(self.target_url, wf.name, stream.id, current.table.qualified,
                                          current.rows_copied, self.engine.runner.counter())
            if rule is not None:  # the rule's SELECT runs in Spark between the source's rows and the target
                self.engine.runner.sc.setJobDescription(f"copy {table.qualified} through its rule")
                try:
                    rows = rule_copy.copy_cycle_with_rule(rule, stream.source_url, self.target_url, snap.name,
                                                          plan.ranges, snap.conn, progress.label,
                                                          progress.finished) if plan.ranges else 0
                except Exception:
                    # The tasks that finished committed their rows: above lastpk, not copied by definition. A
                    # stream in Error leaves the target as of its last committed cycle.
                    self._clear_above(rule.rule.target, current.lastpk, rule.rule.target_keyrange())
                    raise
            else:
                ranges = plan.tasks(stream.source_url, self.target_url, table, snap.name)
                tasks = [replace(prepare(t), origin=origin, label=progress.label) for t in ranges]
                log.info("copying %s in %d tasks", table.qualified, len(tasks))
                rows = sum(self.engine.runner.map(copy_range, tasks, f"copy {table.qualified}",
                                                  tag=self.engine.tag, counter=progress.finished))
            with self._recording(stream, snap) as dst:
                if dst is None or not st.save_copy_progress(dst, stream.id, table.qualified, current.lastpk,
                                                            plan.new_lastpk, rows, plan.done):
                    return
                self._copied_as_of[stream.id] = (snap.position, snap.xids)
                if current.deferred_indexes:  # with the cycle: a kill before this commit redoes the cycle
                    fault_point("copy.before_index_build")
                    build_deferred_indexes(dst, stream.id, current)
                if plan.done and origin:  # a bidirectional sink: the application may write the table now
                    denial.undeny(dst, [table])
                if plan.done and all(t.done for t in stream.tables if t is not current):
                    add_foreign_keys(dst, wf)
                    st.set_state(dst, stream.id, st.RUNNING)
            live.cycle_recorded(progress, current.rows_copied + rows)
        log.info("copied %s rows of %s (done=%s)", rows, table.qualified, plan.done)

    def _copy_group(self, wf: st.Workflow, stream: st.Stream, group: list[st.TableState], snap) -> None:
        """One cycle of many small tables (small_group), in the snapshot `snap` the stream has been
        fast-forwarded to: each Spark task copies several of them whole and commits them together, and one
        target transaction records them all done. A cycle that does not finish leaves them pending, and the
        next clears what its tasks committed (lastpk None: every row is above it) and copies them again."""
        origin, _ = cluster_direction(wf)
        with connect(self.target_url, role="target") as dst:
            specs = st.table_specs(dst, stream.id)  # as catchup and fast-forward left them (schema_changes.py)
            for t in group:
                t.table = Table.from_json(specs[t.table.qualified])
            leftovers = with_rows(dst, [t.table for t in group])
            if leftovers and origin:  # a bidirectional sink: the clearing must not be sent back, nor leave tombstones
                origins.acquire(dst, origin)
                dst.execute("SET session_replication_role = replica")
            for table in leftovers:
                clear_above(dst, table, None)
        tables = [t.table for t in group]
        progress = [live.cycle_started(self.target_url, wf.name, stream.id, t.table.qualified, t.rows_copied)
                    for t in group]
        tasks = group_tasks(stream.source_url, self.target_url, tables, snap.name, self.engine.runner.parallelism(),
                            origin, live.APP_PREFIX + f"{len(tables)} tables")
        log.info("copying %d tables (%s … %s) in %d tasks", len(tables), tables[0].qualified, tables[-1].qualified,
                 len(tasks))
        copied: dict[str, int] = {}
        for result in self.engine.runner.map(copy_tables, tasks, f"copy {len(tables)} tables",
                                             tag=self.engine.tag, counter=self.engine.runner.counter(), count=rows_of):
            copied.update(result)
        with self._recording(stream, snap) as dst:
            if dst is None:
                return
            if not st.save_tables_copied(dst, stream.id, copied):
                dst.rollback()  # one of them moved meanwhile: the next turn re-reads and redoes the cycle
                return
            self._copied_as_of[stream.id] = (snap.position, snap.xids)
            if origin:  # a bidirectional sink: the application may write the tables now
                denial.undeny(dst, tables)
            names = {t.qualified for t in tables}
            if all(t.done for t in stream.tables if t.table.qualified not in names):
                add_foreign_keys(dst, wf)
                st.set_state(dst, stream.id, st.RUNNING)
        for t, entry in zip(group, progress):
            t.done, t.rows_copied = True, t.rows_copied + copied[t.table.qualified]
            live.cycle_recorded(entry, t.rows_copied)
        log.info("copied %d rows of %d tables (%s … %s)", sum(copied.values()), len(tables), tables[0].qualified,
                 tables[-1].qualified)

    @contextlib.contextmanager
    def _recording(self, stream: st.Stream, snap):
        """The target transaction that records a cycle, under the stream's row lock, once the source's standbys
        have the snapshot's position (the rows were read as the primary has them: a failover may lose what its
        standby never had). Gives None when the stream moved meanwhile: the next turn re-reads and redoes it."""
        capture.wait_standbys(snap.conn, snap.position, self.engine.stop)
        fault_point("copy.before_progress")
        with connect(self.target_url, role="target") as dst:
            state, position = st.lock_stream(dst, stream.id)
            yield dst if state == st.COPYING and position == snap.position else None

    def _confirm_slot(self, stream: st.Stream) -> None:
        """Confirm the slot up to the stream's position (saved on the target) before a first copy cycle, which
        reads no changes. On PostgreSQL 17+ a standby's copy of a failover slot lasts only once the slot has
        moved past the transactions the standby knew of when it made the copy (the slot's catalog_xmin): the
        sooner the slot moves, the sooner a failover finds it on the promoted standby. Best effort: the next
        play task confirms it anyway."""
        try:
            with connect(stream.source_url, role="source", autocommit=True) as src:
                capture.advance_slot(src, stream.slot_name, stream.position)
        except Exception as exc:  # noqa: BLE001 - the copy goes on; the slot is confirmed later
            log.debug("could not confirm replication slot %s before the copy: %s", stream.slot_name, exc)

    def _clear_above(self, table: Table, lastpk, mine) -> None:
        """Best effort (the target may be what failed): the next cycle clears them anyway."""
        try:
            with connect(self.target_url, role="target") as dst:
                clear_above(dst, table, lastpk, mine)
        except Exception:  # noqa: BLE001
            log.debug("could not clear %s above its copy position", table.qualified)

    def _nothing_committed_since(self, stream: st.Stream) -> bool:
        """Whether the source has committed nothing since the stream's position: it has written no WAL since,
        or the position is the last copy cycle's and no transaction has ended since its snapshot (WAL of no
        transaction, a checkpoint or a running-transactions record, does not count)."""
        copied_as_of = self._copied_as_of.get(stream.id)
        with connect(stream.source_url, role="source", autocommit=True) as src:
            if capture.wal_insert_position(src) <= stream.position:
                return True
            return (copied_as_of is not None and copied_as_of[0] == stream.position
                    and not committed_since(src, copied_as_of[1]))


def add_foreign_keys(dst: psycopg.Connection, wf: st.Workflow) -> None:
    """Every table is copied: the foreign keys between them (table_definition.py), with the state that says
    so, in the caller's transaction. A row that breaks one (the source's own key is not valid) fails the
    validation: the stream stops in Error naming it."""
    pending = wf.options.get("foreign_keys")
    if not pending:
        return
    from ..postgres import table_definition

    try:
        with dst.transaction():
            added = table_definition.add_foreign_keys(dst, pending)
    except psycopg.errors.ForeignKeyViolation as exc:
        raise TerminalError(f"adding the foreign keys of workflow {wf.name} after its copy failed: "
                            f"{first_line(exc)}; fix the rows on the target and `workflow start` it, or drop the "
                            f"key from the source and re-create the workflow") from None
    st.set_options(dst, wf.name, {"foreign_keys": None})
    for name in added:
        log.info("added foreign key %s", name)

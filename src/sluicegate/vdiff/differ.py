"""Executing a vdiff (Vitess VDiff on Spark): a consistent point, then parallel range comparisons.

The point: snapshot the source tables at position P (the copy's LOCK SHARE + exported snapshot), let the
stream apply exactly the transactions that commit before P (a fast-forward, as in the copy phase; a stopped
stream is played just for this), then export a target snapshot and check, inside it, that the stream stands
at P. Both snapshots then hold the same set of source transactions, whatever the source and the stream do
afterwards, so the comparison reports no false differences while writes go on.

The comparison: the tables' keys above where the vdiff stands are split into ranges inside the source
snapshot, and one Spark task per range compares it (compare.py) and records its result. The driver holds
only the two snapshot connections and the plan.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from ..errors import RetryableError, SluicegateError, TerminalError, UsageError
from ..position import format_lsn
from ..postgres import keyrange
from ..postgres.catalog import Table
from ..postgres.connect import connect, first_line
from ..postgres.snapshot import TableSnapshot, take_snapshot
from ..rules.compile import CompiledRule
from ..workflow import state as st
from ..workflow import stream_control
from . import store
from .compare import RangeTask, compare_range, text_compared_columns, text_hashed_columns
from .labels import choose, label
from .rule_compare import RuleRanges, compare_rule_ranges

log = logging.getLogger("sluicegate")

SAMPLED_KEYS_PER_RANGE = 200  # keys sampled per planned range, for its bounds
MIN_RANGE_ROWS, MAX_RANGE_ROWS = 50_000, 1_000_000  # rows per comparison task, unless --range-rows says
SAMPLE_SIZE = 10  # differing rows kept per table
SYNC_ATTEMPTS = 5


def check_comparable(wf: st.Workflow) -> None:
    """A vdiff compares finished copies: refuse a stream that is still copying or failed."""
    if len(wf.streams) > 1 and any(s.state != st.STOPPED for s in wf.streams):
        raise UsageError(
            f"workflow {wf.name} has several streams into this target shard; a vdiff brings each to its own "
            f"point, which needs them stopped: `sluicegate workflow stop {wf.name}`, vdiff, then `workflow start`"
        )
    for s in wf.streams:
        if s.state in (st.INIT, st.COPYING):
            done = sum(t.done for t in s.tables)
            raise UsageError(
                f"workflow {wf.name} is still copying ({done} of {len(s.tables)} tables done): run vdiff once "
                f"`sluicegate workflow status {wf.name}` shows Running"
            )
        if s.state == st.ERROR:
            raise UsageError(
                f"workflow {wf.name} is in Error ({s.message}): fix that and `sluicegate workflow start "
                f"{wf.name}` before a vdiff"
            )


def entries(wf: st.Workflow) -> dict[str, tuple[st.Stream, st.TableState]]:
    """What a vdiff compares, by name: each stream's tables ('public.t', or 'public.t <- -80' per source
    shard in a Reshard)."""
    several = len(wf.streams) > 1 or wf.kind == "Reshard"
    return {label(t.table.qualified, s.source_shard if several else None): (s, t)
            for s in wf.streams for t in s.tables}


def select_tables(wf: st.Workflow, names: list[str] | None) -> list[str]:
    """The workflow's qualified table names, or those of `names` (qualified or bare)."""
    return choose(list(entries(wf)), names, wf.name)


@dataclass
class _Point:
    sources: dict[int, TableSnapshot]  # per stream: its source's snapshot at the stream's point
    target: psycopg.Connection  # holds the exported target snapshot
    target_snapshot: str

    def close(self) -> None:
        for source in self.sources.values():
            source.close()
        try:
            self.target.rollback()
        finally:
            self.target.close()


@dataclass
class Prepared:
    point: _Point
    tasks: list[RangeTask] = field(default_factory=list)
    rule_jobs: list[RuleRanges] = field(default_factory=list)  # tables written through a rule


class VDiffRun:
    """One executor's run of one vdiff: claim, prepare (the point and the plan), compare, finish."""

    def __init__(self, target_url: str, vdiff_id: int, runner, *, stop: threading.Event | None = None):
        self.target_url = target_url
        self.vdiff_id = vdiff_id
        self.runner = runner
        self.stop = stop or threading.Event()
        self.lock_conn: psycopg.Connection | None = None
        self.on_point = None  # called once the point is taken, before the streams are released

    def claim(self, executor: str) -> bool:
        """Become the one executor of a pending vdiff (a session lock held until release())."""
        conn = connect(self.target_url, role="target", autocommit=True)
        if not store.try_lock(conn, self.vdiff_id) or store.load(conn, self.vdiff_id).state != store.PENDING:
            conn.close()
            return False
        store.set_state(conn, self.vdiff_id, store.RUNNING, f"compared by {executor} (pid {os.getpid()})")
        self.lock_conn = conn
        return True

    def release(self) -> None:
        if self.lock_conn is not None:
            self.lock_conn.close()  # ends the session lock too
            self.lock_conn = None

    def prepare(self, wf: st.Workflow, streams: list[st.Stream], play) -> Prepared | None:
        """The consistent point and the ranges still to compare; None when nothing is left."""
        vd = store.load(self.lock_conn, self.vdiff_id)
        specs = {name: e for name, e in entries(wf).items() if e[0].id in {s.id for s in streams}}
        missing = [n for n in vd.tables if n not in specs]
        if missing:
            raise UsageError(f"vdiff {vd.id}: {', '.join(missing)} no longer in workflow {wf.name}")
        with self.lock_conn.transaction():
            progress = [store.resume_progress(self.lock_conn, vd.id, n) for n in vd.tables]
        todo = [p for p in progress if not p.done]
        if not todo:
            return None
        by_stream: dict[int, list[Table]] = {}
        for p in todo:
            stream, t = specs[p.table]
            by_stream.setdefault(stream.id, []).append(t.table)
        started = time.monotonic()
        point = self._sync(wf, [s for s in streams if s.id in by_stream], by_stream, play)
        first = next(iter(point.sources.values()))
        log.info("vdiff %s: consistent point %s after %.2fs", vd.id, format_lsn(first.position),
                 time.monotonic() - started)
        try:
            store.set_state(self.lock_conn, vd.id, store.RUNNING, None, source_position=first.position)
            fixed = vd.options.get("range_rows")
            sample = int(vd.options.get("sample", SAMPLE_SIZE))
            prepared = Prepared(point)
            with connect(self.target_url, role="target") as probe:
                for p in todo:
                    stream, t = specs[p.table]
                    table, source = t.table, point.sources[stream.id]
                    estimate = self._estimate(source.conn, table)
                    rows = int(fixed) if fixed else self._range_rows(estimate)
                    ranges = plan_ranges(source.conn, table, p.lastpk, rows, estimate)
                    store.add_ranges(self.lock_conn, vd.id, p.table, p.generation, ranges)
                    with connect(stream.source_url, role="source") as sprobe:
                        if t.rule is not None:
                            rule = CompiledRule.from_json(t.rule, table)
                            prepared.rule_jobs.append(RuleRanges(
                                stream.source_url, self.target_url, vd.id, p.table, t.rule, table.to_json(),
                                p.generation, ranges, source.name, point.target_snapshot,
                                text_compared_columns(probe, rule.target, sprobe), sample))
                            continue
                        hash_text = text_hashed_columns([sprobe, probe], table)
                        text_cols = text_compared_columns(probe, table, sprobe)
                    prepared.tasks += [
                        RangeTask(stream.source_url, self.target_url, vd.id, table.to_json(), p.generation, i, lo,
                                  hi, source.name, point.target_snapshot, text_cols, hash_text, sample)
                        for i, (lo, hi) in enumerate(ranges)
                    ]
            log.info("vdiff %s: %d ranges planned after %.2fs", vd.id, len(prepared.tasks), time.monotonic() - started)
            return prepared
        except BaseException:
            point.close()
            raise

    @staticmethod
    def _estimate(conn: psycopg.Connection, table: Table) -> float:
        reltuples = conn.execute("SELECT reltuples FROM pg_class WHERE oid = %s::regclass",
                                 (table.ident.as_string(conn),)).fetchone()[0]
        return max(reltuples, table.estimated_rows)  # -1: never analyzed

    def _range_rows(self, estimate: float) -> int:
        """One range per Spark slot (a task costs time to set up, and fewer, longer range scans are cheaper
        per row), within [50k, 1M] rows."""
        slots = max(1, int(self.runner.parallelism()))
        return int(min(MAX_RANGE_ROWS, max(MIN_RANGE_ROWS, estimate / slots)))

    def compare(self, prepared: Prepared | None) -> None:
        """Run the range comparisons as one Spark job, then record the vdiff as completed."""
        try:
            if prepared is not None:
                try:
                    started = time.monotonic()
                    self.runner.map(compare_range, prepared.tasks, f"vdiff {self.vdiff_id}")
                    for job in prepared.rule_jobs:  # through the rule, in Spark: a job per table
                        if self.stop.is_set():
                            raise RetryableError("interrupted")
                        compare_rule_ranges(self.runner.spark, job)
                    log.info("vdiff %s: ranges compared in %.2fs", self.vdiff_id, time.monotonic() - started)
                finally:
                    prepared.point.close()
            store.set_state(self.lock_conn, self.vdiff_id, store.COMPLETED, None)
        except Exception as exc:  # recorded for the waiting command, then re-raised
            self.fail(exc)
            raise
        finally:
            self.release()

    def fail(self, exc: BaseException) -> None:
        """Record why the vdiff stopped: interrupted ones wait for the next executor, others are errors."""
        try:
            conn = self.lock_conn or connect(self.target_url, role="target", autocommit=True)
            if self.stop.is_set():
                store.set_state(conn, self.vdiff_id, store.PENDING, "interrupted; resumes from the last finished range")
            else:
                text = str(exc) if isinstance(exc, SluicegateError) else first_line(exc)
                store.set_state(conn, self.vdiff_id, store.ERROR, text)
        except Exception:  # the target may be what failed
            log.debug("could not record the vdiff's failure", exc_info=True)
        finally:
            self.release()

    def _sync(self, wf: st.Workflow, streams: list[st.Stream], tables: dict[int, list[Table]], play) -> _Point:
        """Per stream: a source snapshot at P, the stream applied exactly up to P; then one target snapshot
        in which every stream stands at its P.

        A Running stream goes through its durable stop (workflow/stream_control.py): held, the snapshot taken,
        then played to exactly P — by its driver, or here through `play` when none runs (None: this is the
        driver) — and released once the target's snapshot is exported. A stream its user stopped has no
        driver: it is played here to P and stays Stopped."""
        reason = f"vdiff {self.vdiff_id}"
        for _ in range(SYNC_ATTEMPTS):
            sources: dict[int, TableSnapshot] = {}
            held: list[int] = []
            try:
                for stream in streams:
                    state, _ = self._reload(wf.name, stream)
                    if state == st.RUNNING:
                        stream.position = stream_control.hold(self.target_url, stream.id, reason)
                        held.append(stream.id)
                        source = sources[stream.id] = take_snapshot(stream.source_url, tables[stream.id])
                        stream_control.stop_at(self.target_url, stream.id, source.position, reason)
                        if play is not None:
                            play(wf, stream, until="position", stop_at=source.position, expect=st.RUNNING)
                        stream_control.wait_stopped(self.target_url, stream.id, source.position, reason,
                                                    self.stop)
                    else:
                        source = sources[stream.id] = take_snapshot(stream.source_url, tables[stream.id])
                        self._play_stopped(wf, stream, source.position, play)
                if self.stop.is_set():
                    raise RetryableError("interrupted while the stream caught up to the vdiff's point")
                target = connect(self.target_url, role="target")
                target.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                name = target.execute("SELECT pg_export_snapshot()").fetchone()[0]
                if all(st.read_stream(target, s.id)[1] == sources[s.id].position for s in streams):
                    if self.on_point is not None:  # before the release below lets the stream go on
                        self.on_point()
                    return _Point(sources, target, name)
                target.close()
                log.info("vdiff %s: a stream is not at its point; taking a new one", self.vdiff_id)
            except RetryableError as exc:
                if self.stop.is_set():
                    raise
                log.info("vdiff %s: %s; taking a new point", self.vdiff_id, exc)
            except BaseException:
                for source in sources.values():
                    source.close()
                raise
            finally:
                for stream_id in held:  # (after the target's snapshot: the comparison runs while it replicates)
                    stream_control.release(self.target_url, stream_id, reason)
            for source in sources.values():
                source.close()
        raise RetryableError(f"the stream of workflow {wf.name} kept moving past the vdiff's point: is another "
                             f"process playing it?")

    def _play_stopped(self, wf: st.Workflow, stream: st.Stream, position: int, play) -> None:
        """A stream stopped by its user, to exactly `position` (its state left as it is)."""
        state = stream.state
        while stream.position < position and not self.stop.is_set():
            if play is None:  # the driver of a stopped stream has exited: this cannot be the driver
                raise RetryableError(f"stream {stream.id} is {state}")
            result = play(wf, stream, until="position", stop_at=position, expect=state)
            if result.interrupted:
                state, _ = self._reload(wf.name, stream)
                if stream.position > position:
                    raise RetryableError(f"stream {stream.id} moved past the vdiff's point")
            else:
                stream.position = result.position

    def _reload(self, name: str, stream: st.Stream) -> tuple[str, int]:
        with connect(self.target_url, role="target") as conn:
            fresh = next(s for s in st.load_workflow(conn, name).streams if s.id == stream.id)
            if fresh.state == st.STOPPED and fresh.stop_reason:  # another controller's, or a killed one's
                if not stream_control.lapsed(conn, stream.id, stream_control.hold_seconds()):
                    raise RetryableError(f"stream {stream.id} is held for {fresh.stop_reason}")
                conn.commit()
                log.warning("vdiff %s: released stream %s, held for %s (its controller is gone?)", self.vdiff_id,
                            stream.id, fresh.stop_reason)
                fresh.state, fresh.stop_reason = st.RUNNING, ""
        if fresh.state not in (st.RUNNING, st.STOPPED):
            raise TerminalError(f"stream {stream.id} went {fresh.state} during the vdiff: {fresh.message}")
        stream.state, stream.position = fresh.state, fresh.position
        return fresh.state, fresh.position


def plan_ranges(snap_conn: psycopg.Connection, table: Table, lastpk: list[str] | None, range_rows: int,
                estimate: float) -> list[tuple[list[str] | None, list[str] | None]]:
    """Key ranges above lastpk that cover the whole rest of the key space (the last one is open-ended, so
    target rows beyond the source's last key are found too), about `range_rows` each.

    Bounds come from a block sample of the keys (TABLESAMPLE SYSTEM): sizes only steer the parallelism,
    and walking the whole index for exact bounds would cost as much as a good part of the comparison.
    """
    count = math.ceil(max(estimate, 1) / range_rows)
    if count <= 1 or table.keyless:  # keyless: compared whole, as one multiset (compare.multiset_compare)
        return [(lastpk, None)]
    percent = min(100.0, 100.0 * SAMPLED_KEYS_PER_RANGE * count / max(estimate, 1))
    sample = [list(r) for r in snap_conn.execute(
        sql.SQL("SELECT {} FROM {} TABLESAMPLE SYSTEM ({}) WHERE {} ORDER BY {}").format(
            keyrange.key_texts(table), table.scan, sql.Literal(percent), keyrange.in_range(table, lastpk, None),
            keyrange.key_order(table))
    ).fetchall()]
    bounds = []
    for i in range(1, count):
        key = sample[len(sample) * i // count] if sample else None
        if key is not None and (not bounds or key != bounds[-1]):
            bounds.append(key)
    edges = [lastpk, *bounds, None]
    return list(itertools.pairwise(edges))

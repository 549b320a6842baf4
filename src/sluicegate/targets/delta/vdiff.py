"""`sluicegate vdiff W --target delta:PATH`: the source's moved tables against the Delta tables, at one point.

The point: snapshot the source tables at position P (the copy's LOCK SHARE + exported snapshot), have the
stream played to exactly P and a point recorded there in the consistent-read log. The source snapshot and the
Delta tables at that point then hold the same source transactions, while the source keeps taking writes.

The point comes through the stream's durable control (control.py), the order making it race-free:
  1. the vdiff holds the stream (stop_reason "vdiff <id>"); the player, at its next batch boundary, stops:
     state Stopped at its position A, which is final then;
  2. only then the vdiff takes its snapshot, at P >= A (the player reads flushed WAL only, and the snapshot's
     position is the WAL insert position read after the stop);
  3. it writes stop_position P and state Running: the player plays to exactly P (a batch ending there, or none
     when P == A), records the point there and stops again, Stopped at P;
  4. the vdiff reads each table's version (the stream stands at P: they hold exactly the transactions up to P,
     and a direct write to a table counts), pins them against vacuum (pins.py), and releases the stream;
  5. it compares at those versions by time travel while replication goes on past P, and unpins at the end,
     also on failure.
Taking the snapshot first and asking for P afterwards could find a fast driver already past P (no point there,
and none can be made); retrying would not be sure to end under steady writes. The hold costs the driver the
time of one snapshot. A killed vdiff's stop lapses: the driver releases it after config's stream_hold_seconds.

Beside a running driver, its player does all that (Delta keeps old versions, so the driver need not stop for
the comparison). With no driver, the vdiff holds the run lock for its whole life (a `workflow run` started
then says the workflow is being run), marks the stream Stopped itself in step 1 and plays it to P in step 3
through the same player; the release puts the state back as it was (Running stays Running, Stopped stays
Stopped): a later `workflow run` replays from P on.

The comparison, in Spark: the source side is read by Spark tasks, each importing the snapshot and reading one
key range as text, converted by targets/delta/types.py exactly as the copy and the stream convert it (so numeric is
compared as decimal, timestamptz as a UTC timestamp, json as text...); for a table written through a rule, those
rows go through the rule as the copy's do (rule_vdiff.py). The Delta side is targets/delta/read.py's
`tables_as_of` at P. A full outer join on the Delta table's key says which rows are missing, extra or
mismatched. The report names each table as the workflow does (its source table, as a PostgreSQL target's vdiff).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass

from ...config import Settings
from ...errors import RetryableError, TerminalError, UsageError
from ...faults import fault_point
from ...position import format_lsn
from ...postgres import keyrange
from ...postgres.catalog import Table
from ...postgres.snapshot import take_snapshot
from ...vdiff.differ import MAX_RANGE_ROWS, MIN_RANGE_ROWS, plan_ranges
from ...vdiff.labels import choose
from . import control, location, pins, rule_player, rule_vdiff
from .copy import snapshot_batches
from .engine import LakeEngine
from .player import LakePlayTask, play
from .read import Point, tables_as_of
from .state import COPYING, ERROR, INIT, RUNNING, STOPPED, open_store
from .types import SPECIAL, arrow_schema

log = logging.getLogger("sluicegate")

SIDE_S, SIDE_T = "_sg_source", "_sg_target"


@dataclass(frozen=True)
class SourceRange:
    """One Spark task's share of the source side: a key range of a table, read in the exported snapshot."""

    source_url: str
    table: dict  # Table.to_json()
    snapshot: str
    lo: list | None
    hi: list | None
    rule: dict | None = None  # a rule that only moves columns (CompiledRule.to_json()), as copy.LakeCopyTask's


def read_range(task: SourceRange):
    """Runs in a Spark task: the range's rows in the snapshot as Arrow batches of the Delta table's schema."""

    table = Table.from_json(task.table)
    columns = into = None
    if task.rule is not None:  # its columns, under its names: as copy.copy_range reads them
        from ...rules.compile import CompiledRule
        from .rules import lake_table

        rule = CompiledRule.from_json(task.rule, table)
        into, columns = lake_table(rule), [table.columns[ref] for _, ref in rule.outputs]
    yield from snapshot_batches(task.source_url, task.snapshot, table, keyrange.in_range(table, task.lo, task.hi),
                                columns=columns, into=into)


def _read_tasks(batches):
    """mapInArrow's function: each input row is one SourceRange (JSON); out come its rows."""
    for batch in batches:
        for raw in batch.column(0).to_pylist():
            d = json.loads(raw)
            yield from read_range(SourceRange(**d))


def check_comparable(store, name: str) -> None:
    wf = store.load(name)
    if wf.state in (INIT, COPYING) or any(not t.done for t in wf.tables):
        done = sum(t.done for t in wf.tables)
        raise UsageError(f"workflow {name} is still copying ({done} of {len(wf.tables)} tables done): run vdiff "
                         f"once `sluicegate workflow status {name} --target delta:{store.root}` shows Running")
    if wf.state == ERROR:
        raise UsageError(f"workflow {name} is in Error ({wf.message}): fix that and `sluicegate workflow start "
                         f"{name} --target delta:{store.root}` before a vdiff")


def run(name: str, target: str, runner, *, tables: list[str] | None = None, sample: int = 10,
        range_rows: int | None = None, stop: threading.Event | None = None) -> dict:
    """Compare, return the report (vdiff/report.py's shape: workflow, state, source_position, equal,
    differences, and per table rows_compared, missing, extra, mismatched, samples)."""
    store = open_store(target)
    check_comparable(store, name)
    if store.is_running(name):
        return _at_point(name, target, store, runner, tables, sample, range_rows, stop, None)
    try:
        lock = store.hold_run_lock(name)  # no driver plays the stream while we stand it at our point
    except UsageError:  # a driver started meanwhile
        return _at_point(name, target, store, runner, tables, sample, range_rows, stop, None)
    try:
        check_comparable(store, name)  # (a state change between the check and the lock)
        return _at_point(name, target, store, runner, tables, sample, range_rows, stop, lock)
    finally:
        lock.close()


def _at_point(name, target, store, runner, tables, sample, range_rows, stop, lock) -> dict:
    """The point through the stream's durable control (control.py), then the comparison at its versions.
    `lock`: the run lock, held by this vdiff (no driver): it marks Stopped itself and plays the stream to
    P through the same player; else the running driver does both."""
    wf = store.load(name)
    # What the release puts back: with no driver, the state as it was (Stopped stays Stopped)
    back = (wf.state, wf.message) if lock is not None else (RUNNING, "")
    who = "the running driver" if lock is None else "the vdiff's own play"
    chosen = choose([t.qualified for t in wf.tables], tables, name)
    specs = {t.qualified: t.spec for t in wf.tables if t.qualified in chosen}
    vid = uuid.uuid4().hex[:12]
    reason = f"vdiff {vid}"
    started = time.monotonic()
    control.hold(store, name, reason, state=STOPPED if lock is not None else None)
    try:
        held = _wait_stopped(store, name, reason, None, HOLD_WAIT_SECONDS, "hold its position for the vdiff",
                             stop, lock)
        with take_snapshot(wf.source_url, list(specs.values()), stop=stop) as snap:
            position = snap.position
            if position < held.position:  # cannot be: the player reads flushed WAL only
                raise RetryableError(f"workflow {name}: the stream is past the vdiff's point "
                                     f"{format_lsn(position)}; run the vdiff again")
            pins.add(store, name, vid, position, {})  # (vacuum reads the pins, then the points)
            try:
                control.play_to(store, name, reason, position)
                if lock is not None:
                    _play_to(target, store.load(name), held.position, position, runner, stop)
                _wait_stopped(store, name, reason, position, POINT_SECONDS, f"stop at {format_lsn(position)}",
                              stop, lock)
                # Each table's version now (the stream stands at P): a direct write since the log's point counts
                point = _point_now(target, store.load(name), position)
                pins.add(store, name, vid, position, point.versions)
                fault_point("lake.vdiff.stopped_at_point")
                control.release(store, name, reason, *back)
                log.info("vdiff %s: consistent point %s from %s (held at %s) after %.2fs", name,
                         format_lsn(position), who, format_lsn(held.position), time.monotonic() - started)
                return _compare_at(name, target, store.load(name), chosen, snap, runner, sample, range_rows,
                                   stop, point)
            finally:
                pins.remove(store, name, vid)
    finally:
        control.release(store, name, reason, *back)


def _play_to(target: str, wf, held: int, position: int, runner, stop) -> None:
    """The vdiff's own play of the stream (no driver runs) to the position it set, by the driver's player:
    the socket player, or the rule player for a workflow written through rules (engine.replicate_step's
    choice). It returns once the stream stopped there; _wait_stopped says if it did not."""
    settings = Settings.from_options(wf.options, f"workflow {wf.name}")
    if rule_player.takes(wf):
        engine = LakeEngine(target, wf.name, runner, stop=stop)  # the vdiff holds the run lock for it
        rule_player.play(engine, wf, settings.batch_changes, POINT_SECONDS)
        return
    result = runner.map(play, [LakePlayTask.of(target, wf.name, held, settings)],
                        f"vdiff {wf.name}: play to {format_lsn(position)}")[0]
    log.debug("vdiff %s: %s", wf.name, result.interrupted)


HOLD_WAIT_SECONDS = 60.0  # the driver's way to its next batch boundary: one batch
POINT_SECONDS = 120.0  # the driver's way from its held position to the snapshot's: one or a few batches


def _wait_stopped(store, name: str, reason: str, position: int | None, timeout: float, what: str, stop, lock):
    """Poll the state until the player stopped for `reason` (at `position`, when given): the workflow then.
    A one-line error when the hold goes (a user's `workflow stop`/`start`, or the driver's lapse), the stream
    stops elsewhere, the driver ends, or `timeout` passes."""
    deadline = time.monotonic() + timeout
    way = f"`sluicegate workflow status {name} --target delta:{store.root}`"
    while True:
        wf = store.load(name)
        if wf.stop_reason != reason:
            raise RetryableError(f"workflow {name}: the vdiff's hold went while it waited for the stream to "
                                 f"{what} (state {wf.state}: {wf.message or 'no message'}); run the vdiff again")
        if wf.state == STOPPED and wf.stop_position == position:
            if position is not None and wf.position != position:
                raise RetryableError(f"workflow {name}: the stream stopped at {format_lsn(wf.position)}, not at "
                                     f"the vdiff's point {format_lsn(position)}; run the vdiff again")
            return wf
        if wf.state not in (RUNNING, STOPPED):
            raise UsageError(f"workflow {name} went {wf.state} while the vdiff waited for the stream to "
                             f"{what}: {wf.message}; run the vdiff again ({way})")
        if lock is not None:  # the vdiff's own play returned without stopping there
            raise RetryableError(f"workflow {name}: the stream did not {what} (at {format_lsn(wf.position)}: "
                                 f"{wf.message or 'no message'}); run the vdiff again")
        if not store.is_running(name):
            raise UsageError(f"workflow {name}: its driver stopped while the vdiff waited for the stream to "
                             f"{what}; run the vdiff again ({way})")
        if stop is not None and stop.is_set():
            raise RetryableError("interrupted")
        if time.monotonic() > deadline:
            raise RetryableError(f"workflow {name}: its driver did not {what} within {timeout:.0f}s; see "
                                 f"{way} and the driver's log, then run the vdiff again")
        time.sleep(0.05)


def _point_now(target: str, wf, position: int):
    """The point at `position` where the stream stands stopped for the vdiff: every table's current version
    holds exactly the source's transactions up to it. Read now, not from the log: a direct write to a table
    since the log's point at `position` must count."""
    from deltalake import DeltaTable


    loc = location.parse(target)
    lakes = [t.lake for t in wf.tables]  # (the points name a table written through a rule by its Delta table)
    versions = {lake.qualified: DeltaTable(loc.table(lake.schema, lake.name)).version() for lake in lakes}
    return Point(wf.name, position, format_lsn(position), None, versions)


def _compare_at(name, target, wf, chosen, snap, runner, sample, range_rows, stop, point: Point) -> dict:
    root = location.parse(target).uri
    position = snap.position
    tables = {t.qualified: t for t in wf.tables if t.qualified in chosen}  # added columns
    lakes = {q: t.lake for q, t in tables.items()}  # a rule's output table, or the source table's
    report = {"vdiff_id": None, "workflow": name, "target": f"delta:{root}", "state": "completed",
              "message": "", "source_position": format_lsn(position), "tables": {}}
    runner.spark.conf.set("spark.sql.session.timeZone", "UTC")  # timestamps' text in the samples
    frames = tables_as_of(runner.spark, root, name, [lake.qualified for lake in lakes.values()], point)
    for q, t in tables.items():
        if stop is not None and stop.is_set():
            raise RetryableError("interrupted")
        ranges = _ranges(runner, t.spec, snap, range_rows)
        rule = t.compiled
        if rule is None or rule.moves_only:  # (a rule's columns read under its names, as copy.copy_range)
            source = moved_frame(runner, wf.source_url, t.spec, snap.name, ranges, lakes[q], t.rule)
        else:  # through the rule in Spark, as its copy cycles run (copy.copy_cycle_through_rule)
            source = rule_vdiff.source_frame(runner, wf.source_url, rule, snap.name, ranges)
        report["tables"][q] = compare(source, frames[lakes[q].qualified], lakes[q], sample)
    report["differences"] = sum(t["missing"] + t["extra"] + t["mismatched"] for t in report["tables"].values())
    report["equal"] = report["differences"] == 0
    return report


def _ranges(runner, spec: Table, snap, range_rows: int | None) -> list:
    """The source table's key ranges in the snapshot, one Spark task each."""
    estimate = snap.conn.execute("SELECT reltuples FROM pg_class WHERE oid = %s::regclass",
                                 (spec.ident.as_string(snap.conn),)).fetchone()[0]
    estimate = max(estimate, spec.estimated_rows, 1)
    slots = max(1, int(runner.parallelism()))
    rows = range_rows or int(min(MAX_RANGE_ROWS, max(MIN_RANGE_ROWS, estimate / slots)))
    return plan_ranges(snap.conn, spec, None, rows, estimate)


def moved_frame(runner, source_url: str, spec: Table, snapshot: str, ranges: list, lake: Table | None = None,
                rule: dict | None = None):
    """The source's rows of `spec` in `ranges` of the snapshot, as a DataFrame read by Spark tasks (one per
    range), in the Delta table's schema; with a `rule` that only moves columns, its columns in its table's
    (`lake`)."""
    from dataclasses import asdict

    from pyspark.sql.pandas.types import from_arrow_schema


    tasks = [json.dumps(asdict(SourceRange(source_url, spec.to_json(), snapshot, lo, hi, rule))) for lo, hi in ranges]
    spark = runner.spark
    rdd = spark.sparkContext.parallelize([(t,) for t in tasks], len(tasks))
    schema = from_arrow_schema(arrow_schema(lake or spec))
    return spark.createDataFrame(rdd, "task string").mapInArrow(_read_tasks, schema)


def _has_map(dtype) -> bool:
    from pyspark.sql import types as T

    if isinstance(dtype, T.MapType):
        return True
    if isinstance(dtype, T.ArrayType):
        return _has_map(dtype.elementType)
    if isinstance(dtype, T.StructType):
        return any(_has_map(f.dataType) for f in dtype.fields)
    return False


def compare(source, target, spec: Table, sample: int) -> dict:
    """Full outer join on the key: counts, and the first `sample` differing rows by key."""
    from pyspark.sql import functions as F

    names = list(spec.column_names)
    missing_cols = [c for c in names if c not in target.columns]
    if missing_cols:
        raise TerminalError(f"Delta table of {spec.qualified} has no column {missing_cols[0]}: was it replaced? "
                            f"Re-create the workflow to copy it again")
    if SPECIAL in source.columns:
        names.append(SPECIAL)
    types = dict(source.dtypes)
    fields = {f.name: f.dataType for f in source.schema.fields}

    def comparable(col, name: str):
        # Spark cannot compare maps (hstore, `_sg_special`): compare their JSON, whose order is the value's
        return F.to_json(col) if _has_map(fields[name]) else col

    s = source.select(*[comparable(F.col(c), c).alias(f"s{i}") for i, c in enumerate(names)],
                      F.lit(True).alias(SIDE_S))
    t = target.select(*[comparable(F.col(c).cast(types[c]), c).alias(f"t{i}") for i, c in enumerate(names)],
                      F.lit(True).alias(SIDE_T))
    keys = [names.index(k) for k in spec.key]
    joined = s.join(t, [F.col(f"s{i}") == F.col(f"t{i}") for i in keys], "full_outer")  # (ANDed)
    differs = F.lit(False)
    for i in range(len(names)):
        if i not in keys:
            differs = differs | ~F.col(f"s{i}").eqNullSafe(F.col(f"t{i}"))
    s_side, t_side = F.col(SIDE_S).isNotNull(), F.col(SIDE_T).isNotNull()
    kind = (F.when(~t_side, "missing").when(~s_side, "extra").when(differs, "mismatched"))
    joined = joined.withColumn("_sg_kind", kind)
    kinds = ("missing", "extra", "mismatched")
    counts = joined.agg(F.count(F.lit(1)).alias("compared"),
                        *(F.sum(F.when(F.col("_sg_kind") == k, 1).otherwise(0)).alias(k) for k in kinds),
                        ).collect()[0]
    out = {"rows_compared": int(counts["compared"]), **{k: int(counts[k] or 0) for k in kinds}, "samples": []}
    if sample and any(out[k] for k in kinds):
        order = [F.coalesce(F.col(f"s{i}"), F.col(f"t{i}")) for i in keys]
        texts = [F.col("_sg_kind"), s_side.alias("_sg_s"), t_side.alias("_sg_t")]
        texts += [F.col(f"{p}{i}").cast("string").alias(f"{p}{i}") for p in "st" for i in range(len(names))]
        for r in joined.where(F.col("_sg_kind").isNotNull()).orderBy(*order).select(*texts).limit(sample).collect():
            side = "s" if r["_sg_s"] else "t"
            out["samples"].append({
                "kind": r["_sg_kind"],
                "key": [r[f"{side}{i}"] for i in keys],
                "source": {c: r[f"s{i}"] for i, c in enumerate(names)} if r["_sg_s"] else None,
                "target": {c: r[f"t{i}"] for i, c in enumerate(names)} if r["_sg_t"] else None,
            })
    return out

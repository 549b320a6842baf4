"""Replaying the slot into Delta tables through the workflow's rules: one Spark job a batch, as for a
PostgreSQL target (workflow/rule_player.py, whose reading side this shares), with the Delta apply.

The driver plans a batch by positions alone, [position, upto): upto is the source's WAL insert position, or a
controller's stop position (control.py), or the next table's skip threshold (below). The job, one task:

    per table: peek the slot (rule_player.read_changes) -> its rule (Spark SQL; in Python for a rule that only
    moves columns)  \\  union -> apply_batch

`apply_batch` folds each table's rule output, in source order, into the net effect per target key
(apply.NetEffect, the Arrow path of the socket player): a change the rule keeps upserts its target row, one it
drops (its WHERE) deletes the target key, a delete deletes it, and a change of the source key (kept by every
rule) deletes the old key first (read_changes sends it as a delete). A value the source did not send
(unchanged TOAST) is kept from the Delta table when the rule passes the column through; a rule that computes
from it stops the stream (rules/replicator.needs_full). Then one MERGE per table carrying the app
transaction (version = the batch's end), the point, and the position in the state document; only then does
the driver confirm the slot. A table skips what it has already: below its first copy's snapshot, or below
its app transaction's version (a kill after its MERGE, before the state); a batch never spans a table's
threshold, so a table takes part in a batch whole or not at all.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime
from functools import partial, reduce

import pyarrow as pa
import pyarrow.compute as pc

from ...errors import RetryableError, TerminalError, pack, unpack
from ...faults import fault_point
from ...postgres import capture, slot_reader
from ...postgres.catalog import Table
from ...postgres.connect import connect
from ...postgres.pgoutput import UNCHANGED
from ...rules.compile import CompiledRule
from ...rules.evaluate import KEEP, RuleRunner, target_columns
from ...spark import errors as spark_errors
from ...workflow import play_loop, rule_player
from ...workflow.play_loop import PlayResult
from ...workflow.player import PlayTask
from . import apply, control, durable, location, netframe, points
from .player import stop_for_controller
from .state import RUNNING, STOPPED, LakeWorkflow, app_id, open_store
from .types import convert_column


@dataclass(frozen=True)
class LakeBatch:
    """What the applying task needs besides the reading side's BatchSpec."""

    target: str  # delta:PATH
    workflow: str
    batch: rule_player.BatchSpec
    lakes: tuple[dict, ...]  # per table (as in batch.task.tables): the Delta table's description (Table json)
    stop: tuple[str, int] | None = None  # a controller's (reason, position) the batch ends at


def takes(wf: LakeWorkflow) -> bool:
    """The workflow's stream goes through its rules (this module), not the socket player."""
    return any(t.rule for t in wf.tables)


def play(engine, wf: LakeWorkflow, batch_changes: int, max_seconds: float, idle_poll: float = 0.2,
         heartbeat_seconds: float = 1.0) -> PlayResult:
    """Batches until stopped, `max_seconds` pass (housekeeping is due), or the stream leaves Running: the one
    play loop (workflow/play_loop.py), each batch a Spark job."""
    way_out = capture.rebootstrap(wf.name)
    with connect(wf.source_url, role="source", autocommit=True) as src:
        slot_reader.take_slot(src, wf.slot, wf.position, way_out)
        sink = _RuleSink(engine, wf, src, batch_changes, idle_poll)
        limits = play_loop.Limits(max_seconds=max_seconds, heartbeat_seconds=heartbeat_seconds)
        return play_loop.run(sink, slot_reader.PeekedSlot(src, wf.slot), src, wf.slot, way_out, wf.position,
                             limits, engine.stop)


class _RuleSink(play_loop.Sink):
    """A Delta stream through its rules: each batch one Spark job whose task merges every table's rule output
    and records the point and the position (apply_batch); a table takes part from its threshold on."""

    def __init__(self, engine, wf: LakeWorkflow, src, batch_changes: int, idle_poll: float):
        self.engine, self.wf, self.src = engine, wf, src
        self.batch_changes, self.idle_poll = batch_changes, idle_poll
        self.lakes = [t.lake for t in wf.tables]
        self.lakes_json = tuple(lake.to_json() for lake in self.lakes)
        self.rules = {t.qualified: t.rule for t in wf.tables if t.rule}
        self.runners = {}
        for t in wf.tables:
            rule = t.compiled
            if rule is not None and not rule.moves_only:
                self.runners[(rule.source.schema, rule.source.name)] = RuleRunner(engine.runner.spark, rule)
        self.thresholds = _thresholds(engine, wf, self.lakes)
        self.current = wf

    def control(self, position: int):
        current = self.current = self.engine.store.load(self.wf.name)
        if current.options != self.wf.options:  # (`lake schedule`, `workflow set`: the driver plans again)
            return current, "the workflow's options changed"
        if current.state != RUNNING or current.position != position:  # (stopped already for a controller too)
            return current, f"stream is {current.state} at {current.position}"
        return current, ""

    def stop_here(self, ctl, position: int) -> str:
        _stop(self.engine.root, self.engine.store, ctl, self.lakes)
        return control.stopped_message(position, ctl.stop_reason)

    def apply(self, stream, framing, position, flushed, stop_at):
        wf = self.wf
        upto = stop_at if stop_at is not None else capture.wal_insert_position(self.src)
        stop = None if stop_at is None else (self.current.stop_reason, stop_at)  # (the job marks Stopped there)
        ahead = [th for th in self.thresholds if th > position]
        if ahead and min(ahead) < upto:  # a table takes part from its threshold on: the batch ends there
            upto, stop = min(ahead), None
        if upto <= position:  # nothing written since: the loop may note that the stream is caught up
            self.engine.stop.wait(self.idle_poll)
            return play_loop.Batch(position)
        slot_reader.wait_flushed(self.src, upto)
        active = tuple(i for i, th in enumerate(self.thresholds) if th <= position)
        task = PlayTask(wf.source_url, self.engine.target, wf.name, 0, wf.slot, wf.publication,
                        [(t.table, "replicate", None) for t in wf.tables], position, RUNNING, "slice",
                        batch_changes=self.batch_changes)
        spec = LakeBatch(self.engine.target, wf.name,
                         rule_player.BatchSpec(task, self.rules, position, upto, None, active), self.lakes_json,
                         stop)
        summary = _run(self.engine, spec, self.runners)
        if summary["interrupted"]:
            return play_loop.Batch(position, ends=summary["interrupted"])
        self.thresholds = [max(th, summary["position"]) if i in active else th
                           for i, th in enumerate(self.thresholds)]
        return play_loop.Batch(summary["position"], rows=summary["rows"], wrote=True)

    def record(self, batch, ctl, stop_at, stopping, source_now):
        if not batch.wrote:  # a heartbeat: the stream is caught up where it stands
            with self.engine.store.update(self.wf.name) as w:
                if w.position == batch.position and w.state == RUNNING:
                    w.caught_up_at = time.time()
            return None
        fault_point("lake.replicate.before_confirm")
        return batch.position  # (at the controller's stop, the job marked the stream Stopped)


def _thresholds(engine, wf: LakeWorkflow, lakes: list[Table]) -> list[int]:
    """Per table: the position from which it takes changes (its first copy's snapshot, or what its app
    transaction says it has)."""
    from deltalake import DeltaTable

    app = app_id(wf.name)
    out = []
    for t, lake in zip(wf.tables, lakes):
        have = DeltaTable(engine.location.table(lake.schema, lake.name)).transaction_version(app)
        out.append(max(have or 0, t.copy_from or 0))
    return out


def _stop(root: str, store, current: LakeWorkflow, lakes: list[Table]) -> None:
    """Stop for the controller at the current position: at its stop position, with the point there."""
    def point() -> None:
        from deltalake import DeltaTable

        loc = location.parse(root)
        versions = {lake.qualified: DeltaTable(loc.table(lake.schema, lake.name)).version() for lake in lakes}
        points.record(root, current.name, current.position, None, versions)

    stop_for_controller(store, current, current.position, point)


def _run(engine, spec: LakeBatch, runners: dict) -> dict:
    """The batch as one Spark job; its summary. An error of the applying task is raised here, its type kept."""
    from pyspark.sql import functions as F

    batch = spec.batch
    if batch.active:
        parts = [rule_player.table_frame(engine, batch, runners, i).select(F.lit(i).alias("__sg_t"), "*")
                 for i in batch.active]
        frame = reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), parts)
    else:  # no table takes changes yet: only the position moves
        frame = engine.runner.spark.range(0, 1, 1, numPartitions=1).select(F.lit(-1).alias("__sg_t"))
    out = frame.coalesce(1).mapInArrow(partial(apply_batch, spec), "summary string")
    try:
        rows = rule_player.collect(engine, out, f"replicate {spec.workflow} through its rules")
    except Exception as exc:
        if batch.active and spark_errors.is_data_error(exc):
            raise rule_player.diagnose(engine, batch, runners, exc) from None
        raise  # a lost worker, a cancelled job: the engine retries
    summary = json.loads(rows[0][0])
    if summary.get("error"):
        raise unpack(summary["error"])
    return summary


# -- in the task --------------------------------------------------------------------------------------------


def apply_batch(spec: LakeBatch, batches):
    """Runs in the batch's task: every table's rule output merged, then the point and the position. Yields one
    summary row (JSON), errors included (pickled: they keep their type across the executor boundary)."""
    summary = {"position": spec.batch.start, "rows": 0, "interrupted": "", "error": None}
    try:
        _apply(spec, batches, summary)
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which raises it
        summary["error"] = pack(exc)
    yield pa.RecordBatch.from_arrays([pa.array([json.dumps(summary)], pa.string())], names=["summary"])


def _apply(spec: LakeBatch, batches, summary: dict) -> None:
    from deltalake import DeltaTable

    batch = spec.batch
    store = open_store(spec.target)
    current = store.load(spec.workflow)
    if current.state != RUNNING or current.position != batch.start:
        summary["interrupted"] = f"stream is {current.state} at {current.position}"
        return
    parts: dict[int, list] = {i: [] for i in batch.active}
    for b in batches:
        for i in batch.active:
            part = b.filter(pc.equal(b.column("__sg_t"), i))
            if part.num_rows:
                parts[i].append(part)
    loc = location.parse(spec.target)
    app = app_id(spec.workflow)
    markers, effects, dts = {}, {}, {}
    for i in batch.active:
        source = Table.from_json(batch.task.tables[i][0])
        lake = Table.from_json(spec.lakes[i])
        rule_json = batch.rules.get(source.qualified)
        effect = effects[i] = apply.NetEffect(lake)
        if parts[i]:
            rows = pa.Table.from_batches(parts[i]).sort_by(rule_player.SEQ)
            markers[i] = _fold(effect, source, lake, rule_json, rows, i)
            summary["rows"] += effect.changes
        dts[i] = DeltaTable(loc.table(lake.schema, lake.name))
    if set(markers) != set(batch.active):
        raise RetryableError(f"a batch of workflow {spec.workflow} came without every table's end; will retry")
    ends = {(m["position"], m["limited"]) for m in markers.values()}
    if len(ends) > 1:  # a replayable peek gives every table the same end: something moved the slot
        raise RetryableError(f"the tables of workflow {spec.workflow} read different batches; will retry")
    meta = next(iter(markers.values())) if markers else {"position": batch.upto, "limited": False,
                                                          "commit_time": None, "transactions": 0}
    end = max(meta["position"], batch.start)
    commits = durable.Versions({i: dts[i] for i in batch.active})
    todo = [i for i in batch.active if effects[i].changes and (dts[i].transaction_version(app) or 0) < end]
    for i in todo:  # before any MERGE: nothing of the batch applied if one cannot be
        if not effects[i].truncated:
            _check_kept_rows(dts[i], effects[i], Table.from_json(batch.task.tables[i][0]).qualified)
    merged = []
    for i in todo:
        effect, dt = effects[i], dts[i]
        lake = effect.table
        if effect.truncated:
            apply.truncate(dt, app, None if effect.nonempty else end)
        if effect.nonempty:
            apply.merge(dt, lake, effect, app, end)
        merged.append(i)
        fault_point("lake.replicate.between_tables")
    commits.sync(merged)  # on disk before the state and the slot move past them
    commit_time = datetime.fromisoformat(meta["commit_time"]) if meta.get("commit_time") else None
    copied_to = max((t.copied_to or 0) for t in current.tables)
    first = not current.first_point and end >= copied_to
    controlled = spec.stop is not None and end == spec.stop[1]
    if (merged and current.first_point) or first or controlled:
        for dt in dts.values():
            dt.update_incremental()
        versions = {}
        for i, lake_json in enumerate(spec.lakes):
            lake = Table.from_json(lake_json)
            dt = dts.get(i) or DeltaTable(loc.table(lake.schema, lake.name))
            versions[lake.qualified] = dt.version()
        points.record(loc.uri, spec.workflow, end, commit_time, versions)
    fault_point("lake.replicate.before_state")
    depends = ((("tables",),) if first else ()) + (control.FIELDS if controlled else ())
    with store.update(spec.workflow, depends=depends) as w:
        if w.position != batch.start:
            raise RetryableError(f"workflow {spec.workflow}: its position moved under the batch; will retry")
        w.position = end
        w.first_point = w.first_point or (first and all(t.done for t in w.tables))
        if commit_time is not None:
            w.transaction_time = commit_time.isoformat()
        if not meta["limited"]:
            w.caught_up_at = time.time()
        for i in merged:
            w.tables[i].applied = end
        if controlled and (w.stop_reason, w.stop_position) == spec.stop:
            w.state = STOPPED  # with the position: it is final now (control.py)
            w.message = control.stopped_message(end, w.stop_reason)
    summary["position"] = end


def _check_kept_rows(dt, effect: apply.NetEffect, source: str) -> None:
    """A row whose upsert keeps a column's value from the Delta table (unchanged TOAST) must be there, or the
    MERGE would insert NULL: an update that changes the key, or brings the row into a rule's WHERE, does not
    carry that value (read_changes sends a key change as a delete and an upsert)."""
    import pyarrow.dataset as ds

    lake, frame = effect.table, effect.frame()
    if not netframe.has_keep(frame):
        return
    keeps = frame.column(netframe.KEEP).to_pylist()
    ops = frame.column(netframe.OP).to_pylist()
    rows = [j for j, (op, keep) in enumerate(zip(ops, keeps)) if op == "U" and keep]
    if not rows:
        return
    index = lake.key_indices
    texts = [[frame.column(f"c{k}")[j].as_py() for j in rows] for k in index]
    typed = [convert_column(lake.columns[k], t, lake.type_tree) for k, t in zip(index, texts)]
    first = lake.columns[index[0]].name
    found = dt.to_pyarrow_dataset().to_table(columns=list(lake.key), filter=ds.field(first).isin(typed[0]))
    have = set(zip(*(found.column(k).to_pylist() for k in lake.key)))
    for n, key in enumerate(zip(*(a.to_pylist() for a in typed))):
        if key not in have:
            column = lake.columns[keeps[rows[n]][0]].name
            shown = ", ".join(str(t[n]) for t in texts)
            raise TerminalError(
                f"table {source}: an update of row ({', '.join(lake.key)})=({shown}) left column {column!r} "
                f"unchanged as a large (TOASTed) value the change does not carry, and Delta table {lake.qualified} "
                f"does not have the row to keep it from (the update changed its key, or brought it into its "
                f"rule's WHERE): run ALTER TABLE {source} REPLICA IDENTITY FULL on the source, then re-create "
                f"the workflow")


def _fold(effect: apply.NetEffect, source: Table, lake: Table, rule_json: dict | None, rows, i: int) -> dict | None:
    """Table i's rows of the batch (the rule's output, in source order) into `effect`, the net effect per
    target key; the batch's end marker."""
    rule = CompiledRule.from_json(rule_json, source) if rule_json else None
    ops = rows.column(rule_player.OP).to_pylist()
    unch = rows.column(rule_player.UNCH).to_pylist()
    keeps = rows.column(KEEP).to_pylist()
    meta = rows.column(rule_player.META).to_pylist()
    struct = rows.column(f"__sg_o{i}").combine_chunks()
    fields = struct.flatten()
    names = [struct.type.field(j).name for j in range(struct.type.num_fields)]
    n = len(source.columns)
    result = pa.RecordBatch.from_arrays(fields, names=names)
    if rule is None:
        values = list(zip(*(f.to_pylist() for f in fields[:n])))
        raw_of = list(range(n))  # target column -> source column
    else:
        values = list(zip(*(c.to_pylist() for c in target_columns(rule, result))))
        raw_of = [ref if kind == "raw" else None for kind, ref in rule.outputs]
    keys = list(zip(*(fields[k].to_pylist() for k in source.key_indices))) if ops else []
    width = len(lake.columns)
    marker = None
    for j, op in enumerate(ops):
        if op in ("M", "E"):
            if op == "E":
                raise unpack(meta[j])
            marker = json.loads(meta[j])
            continue
        if op == "T":
            effect.truncate()
            continue
        if op == "U" and keeps[j]:
            row = values[j]
            if unch[j]:  # unchanged TOAST: the Delta table's own value (a column passed through)
                unchanged = {int(c) for c in unch[j].split(",")}
                row = tuple(UNCHANGED if raw_of[c] in unchanged else v for c, v in enumerate(row))
            # (an upsert with a value to keep is folded row by row: apply.NetEffect._update)
            effect.add("U" if UNCHANGED in row else "I", None, row)
        else:  # deleted, or no longer selected by the rule: gone from the target
            row = [None] * width
            for pos, v in zip(lake.key_indices, keys[j]):
                row[pos] = v
            effect.add("D", tuple(row), None)
    return marker


"""Replaying a stream whose tables go through Spark SQL rules: one Spark job a batch, no rows on the driver.

A rule is Spark SQL, so it runs where Spark evaluates SQL, in the executors. The driver plans a batch by
positions alone: it ends at the source's WAL insert position (no record straddles it), or at a fast-forward's
snapshot position. The job, one task:

    per table: peek the slot for the batch (read_changes)  ->  the table's rule (Spark SQL)  \\
    ...                                                                                      union -> apply_changes

`read_changes` decodes the batch's transactions (their commit record begins in [position, end)), keeps one
table's changes and ends with a marker row telling where the batch ended (the peek may stop early, after
`batch_changes` rows, at a commit's end). The rule runs over every change, its WHERE as a column, so a row it
drops is known and deleted on the target. `apply_changes` stages the rows with the PostgreSQL applier and
commits them with the stream's new position in one target transaction, under the stream's row lock, after
checking that the position is still the batch's start (exactly once). Only then does the driver confirm the
slot. A peek is replayable: a task that dies leaves nothing behind, and the retry reads the same changes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from functools import partial, reduce

from ..appliers.postgres import PostgresApplier, TargetTable, check_columns
from ..errors import RetryableError, TerminalError, pack, unpack
from ..faults import fault_point
from ..postgres import capture, durable, peek, slot_reader
from ..postgres.assembler import Change, Framing, TruncateChange, assemble
from ..postgres.catalog import Table
from ..postgres.connect import connect
from ..postgres.pgoutput import UNCHANGED, Begin, Commit
from ..postgres.standby_flush import StandbyGate
from ..spark import errors as spark_errors
from . import play_loop, stream_control
from . import state as st
from .play_loop import PlayResult
from .player import PlayTask, limits, way_out
from .rule_copy import MAX_PROBES, count_rows
from .schema_changes import rule_input

log = logging.getLogger("sluicegate")

SEQ, OP, UNCH, META = "__sg_seq", "__sg_op", "__sg_unch", "__sg_meta"
READER = "sluicegate rule reader"  # application_name of a batch's peek at the slot
EXTRA = [SEQ, OP, UNCH, META]
ROWS_PER_BATCH = 4096
UNCHANGED_WINDOW = 20_000  # keys whose last values a reader remembers, to fill in unchanged TOAST values


@dataclass(frozen=True)
class BatchSpec:
    """One batch of one stream: what its tasks need (pickled into them)."""

    task: PlayTask
    rules: dict  # source qualified name -> rule json, for the tables with a rule
    start: int
    upto: int
    source_now: object  # the source's clock when the batch was planned: its caught-up time
    active: tuple[int, ...] = field(default=())  # indexes into task.tables whose changes are applied


# -- the driver ------------------------------------------------------------------------------------------


def play(engine, task: PlayTask, runners: dict) -> PlayResult:
    """Like player.play, for a stream with Spark SQL rules (`runners`: source (schema, name) -> RuleRunner):
    batches until `task.until` says enough, each one Spark job, through the one play loop (play_loop.py).
    Runs on the driver; touches no rows."""
    with connect(task.source_url, role="source", autocommit=True) as src, \
            connect(task.target_url, role="target", autocommit=True) as dst:
        durable.flush_on_commit(dst)  # the slot is confirmed after each commit: it must be on disk
        sink = _RuleSink(engine, task, runners, src, dst)
        slot_reader.take_slot(src, task.slot, task.position, way_out(task), sink.confirm_recorded)
        return play_loop.run(sink, slot_reader.PeekedSlot(src, task.slot), src, task.slot, way_out(task),
                             task.position, limits(task), engine.stop)


class _RuleSink(play_loop.Sink):
    """The sink of a stream with Spark SQL rules: each batch is a Spark job whose task applies the batch and
    commits it with its position on the target (apply_changes); the driver reads the control and confirms."""

    def __init__(self, engine, task: PlayTask, runners: dict, src, dst):
        self.engine, self.task, self.runners, self.src, self.dst = engine, task, runners, src, dst
        self.gate = StandbyGate(task.confirm_after_standbys)
        self.active = tuple(i for i, (_, mode, _) in enumerate(task.tables) if mode != "skip")
        self.rules = {name: runner.rule.to_json() for name, runner in _by_name(runners).items()}

    def confirm_recorded(self, position: int) -> None:
        """A position the target recorded before a restart, not yet confirmed (take_slot's confirm)."""
        if (ready := self._ready(self.gate.recorded(self.dst, position))) is not None:
            capture.advance_slot(self.src, self.task.slot, ready)

    def _ready(self, ready: int | None) -> int | None:
        if (note := self.gate.note_changed()) is not None:  # waits for the target's standbys, or no longer
            st.set_message(self.dst, self.task.stream_id, note)
        return ready

    def control(self, position: int):
        with self.dst.transaction():
            control = st.lock_stream_control(self.dst, self.task.stream_id)
        if control.state != self.task.expect_state or control.position != position:
            return control, f"stream is {control.state} at {control.position}"
        return control, ""

    def stop_here(self, control, position: int) -> str:
        self._mark_stopped(control)
        return stream_control.stopped_message(control.stop_position, control.stop_reason)

    def _mark_stopped(self, control) -> None:
        """Stopped, under the row lock again (the control was read in a transaction of its own), while the
        stream still stands as it was read then."""
        with self.dst.transaction():
            now = st.lock_stream_control(self.dst, self.task.stream_id)
            if (now.state, now.stop_position, now.stop_reason) == (control.state, control.stop_position,
                                                                    control.stop_reason):
                stream_control.mark_stopped(self.dst, self.task.stream_id, now)

    def apply(self, stream, framing, position, flushed, stop_at):
        task = self.task
        upto = stop_at if stop_at is not None else capture.wal_insert_position(self.src)
        if upto <= position:  # nothing written since: the loop may note that the stream is caught up
            if task.until != "caught_up":
                self.engine.stop.wait(task.idle_poll)
            return play_loop.Batch(position)
        this = task if stop_at == task.stop_at else replace(task, stop_at=stop_at)  # (not caught up at a stop)
        slot_reader.wait_flushed(self.src, upto)
        _, source_now = capture.wal_flush_position(self.src)
        spec = BatchSpec(this, self.rules, position, upto, source_now, self.active)
        summary = _run_batch(self.engine, spec, self.runners)
        if summary["interrupted"]:  # the stream moved before the job could apply anything
            return play_loop.Batch(position, ends=summary["interrupted"])
        return play_loop.Batch(summary["position"], summary["limited"], summary["rows"],
                               summary["transactions"], wrote=True)

    def record(self, batch, control, stop_at, stopping, source_now):
        if not batch.wrote:  # a heartbeat: the stream is caught up where it stands
            _save_idle(self.dst, self.task, batch.position, source_now)
            return None
        if stopping:
            self._mark_stopped(control)
        fault_point("rule_batch.before_advance")
        return self._ready(self.gate.recorded(self.dst, batch.position))  # after the target's commit

    def keep(self) -> int | None:
        return self._ready(self.gate.release(self.dst))  # the standbys may have caught up since the last batch


def _by_name(runners: dict) -> dict:
    return {f"{schema}.{name}": runner for (schema, name), runner in runners.items()}


def _save_idle(dst, task: PlayTask, position: int, source_now) -> None:
    """The stream is caught up at `position`: say so (its lag), if it still stands there."""
    with dst.transaction():
        state, current = st.lock_stream(dst, task.stream_id)
        if state == task.expect_state and current == position:
            st.save_position(dst, task.stream_id, position, caught_up_at=source_now)


def _run_batch(engine, spec: BatchSpec, runners: dict) -> dict:
    """The batch as one Spark job (one task: every table's changes, one target transaction)."""
    from pyspark.sql import functions as F

    task = spec.task
    if not spec.active:  # no table takes changes yet (all wait for their copy): only the position moves
        return _apply_without_rows(spec)
    parts = [table_frame(engine, spec, runners, i).select(F.lit(i).alias("__sg_t"), "*") for i in spec.active]
    batch = reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), parts)
    try:
        rows = collect(engine, batch.coalesce(1).mapInArrow(partial(apply_changes, spec), "summary string"),
                       f"replicate {task.workflow} through its rules")
    except Exception as exc:
        if not spark_errors.is_data_error(exc):
            raise  # a lost worker, a cancelled job: the engine retries
        raise diagnose(engine, spec, runners, exc) from None
    summary = json.loads(rows[0][0])
    if summary.get("error"):
        raise unpack(summary["error"])
    return summary


def collect(engine, frame, description: str) -> list:
    """frame.collect() as one of the engine's jobs: a stop cancels it (Engine._cancel_on_stop)."""
    sc = engine.runner.sc
    sc.setJobDescription(description)
    sc.addJobTag(engine.tag)
    try:
        return frame.collect()
    finally:
        sc.removeJobTag(engine.tag)


def table_frame(engine, spec: BatchSpec, runners: dict, i: int, seq: tuple[int, int] | None = None,
                 ruled: bool = True):
    """Table i's changes of the batch after its rule: a struct `__sg_o{i}` of the rule's output (raw
    columns first, as the copy's), the change's own columns, and KEEP. `seq`: only changes [lo, hi)."""
    from pyspark.sql import functions as F

    from ..rules.compile import OUT, RAW, quote
    from ..rules.evaluate import KEEP

    table = Table.from_json(spec.task.tables[i][0])
    runner = runners.get((table.schema, table.name))
    owner = runner.session if runner is not None else engine.runner.spark
    raw = owner.range(0, 1, 1, numPartitions=1).mapInArrow(partial(read_changes, spec, i, seq=seq),
                                                           raw_schema(table))
    n = len(table.columns)
    if runner is None or not ruled:
        return raw.select(F.struct(*[F.col(RAW.format(j)) for j in range(n)]).alias(f"__sg_o{i}"),
                          *[F.col(c) for c in EXTRA], F.lit(True).alias(KEEP))
    out = runner.transform_changes(raw, EXTRA)
    exprs = [name for kind, name in runner.rule.outputs if kind == "expr"]
    return out.select(F.struct(*[F.col(OUT.format(j)) for j in range(n)],
                               *[F.col(quote(e)) for e in exprs]).alias(f"__sg_o{i}"),
                      *[F.col(f"{c}_").alias(c) for c in EXTRA], F.col(f"{KEEP}_").alias(KEEP))


def diagnose(engine, spec: BatchSpec, runners: dict, exc: BaseException) -> TerminalError:
    """A rule failed on a row (Spark says how, not where): find the table and the row by halving the batch's
    changes, each half a small Spark job (the peek is replayable), and name its key. An error path: the
    stream stops in Error here, so the seconds this takes are spent once."""
    what = spark_errors.message(exc)
    probes = 0
    for i in spec.active:
        table = Table.from_json(spec.task.tables[i][0])
        runner = runners.get((table.schema, table.name))
        if runner is None:
            continue
        label = runner.rule.rule.split(":", 1)[0]
        try:
            n = _count(engine, table_frame(engine, spec, runners, i, ruled=False))
            if _fails(engine, spec, runners, i, (0, n)) is None:
                continue
            lo, hi = 0, n
            while hi - lo > 1 and probes < MAX_PROBES:
                mid = (lo + hi) // 2
                probes += 1
                lo, hi = (lo, mid) if _fails(engine, spec, runners, i, (lo, mid)) else (mid, hi)
        except Exception:  # the diagnosis is a courtesy: report what is known
            log.debug("could not find the row rule %s fails on", label, exc_info=True)
            break
        where = f"a change of {table.qualified}"
        if hi - lo == 1:
            key = _key_at(engine, spec, runners, i, lo)
            if key is not None:
                where = (f"{table.qualified} row ({', '.join(table.key)})=({', '.join(map(str, key))})")
        return TerminalError(f"rule {label!r} fails on {where}: {what} Nothing of this batch was applied: "
                             f"change the rule (e.g. try_cast) and re-create the workflow")
    return TerminalError(f"a rule of workflow {spec.task.workflow} fails on a replicated row: {what} Nothing of "
                         f"this batch was applied: change the rule (e.g. try_cast) and re-create the workflow")


def _count(engine, frame) -> int:
    rows = collect(engine, frame.mapInArrow(count_rows, "n long"), "find the row a rule fails on")
    return sum(r[0] for r in rows)


def _fails(engine, spec, runners, i, seq) -> BaseException | None:
    try:
        _count(engine, table_frame(engine, spec, runners, i, seq))
        return None
    except Exception as exc:
        if spark_errors.is_data_error(exc):
            return exc
        raise


def _key_at(engine, spec, runners, i, seq_no: int) -> list | None:
    from ..rules.compile import RAW

    table = Table.from_json(spec.task.tables[i][0])
    frame = table_frame(engine, spec, runners, i, (seq_no, seq_no + 1), ruled=False)
    rows = collect(engine, frame.select(*[frame[f"__sg_o{i}"][RAW.format(j)] for j in table.key_indices]),
                    "find the row a rule fails on")
    return list(rows[0]) if rows else None


def _apply_without_rows(spec: BatchSpec) -> dict:
    task = spec.task
    summary = {"position": spec.upto, "rows": 0, "transactions": 0, "limited": False, "interrupted": ""}
    with connect(task.target_url, role="target") as dst:
        state, position = st.lock_stream(dst, task.stream_id)
        if state != task.expect_state or position != spec.start:
            summary["interrupted"] = f"stream is {state} at {position}"
            return summary
        st.save_position(dst, task.stream_id, spec.upto)
        dst.commit()
    return summary


def raw_schema(table: Table):
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from ..rules.compile import RAW

    return StructType([StructField(RAW.format(i), StringType()) for i in range(len(table.columns))]
                      + [StructField(SEQ, LongType()), StructField(OP, StringType()),
                         StructField(UNCH, StringType()), StructField(META, StringType())])


# -- in the task: reading ----------------------------------------------------------------------------------


def read_changes(spec: BatchSpec, index: int, _ids, seq: tuple[int, int] | None = None):
    """Runs in the batch's task: table `index`'s changes of the batch as raw text rows in commit order (a
    key change is a delete of the old key, then the new row), then one marker row (op 'M': where the batch
    ended) — or, if reading fails, an error row (op 'E') the applying side raises again, type and all."""
    builder = _Rows(spec, index, seq)
    try:
        yield from _read(spec, index, builder)
    except Exception as exc:  # noqa: BLE001 - carried to apply_changes, which rolls back and reports it
        yield from builder.flush()
        yield from builder.marker("E", pack(exc))


def _read(spec: BatchSpec, index: int, builder):
    from ..rules.compile import CompiledRule

    task = spec.task
    table = Table.from_json(task.tables[index][0])
    rule_json = spec.rules.get(table.qualified)
    compiled = CompiledRule.from_json(rule_json, table) if rule_json else None
    needs = set(compiled.needs) if compiled else set()
    # what the rule reads: a change of another column of the table goes on (schema_changes.rule_input)
    reads = needs | {i for kind, i in compiled.outputs if kind == "raw"} if compiled else set()
    key_idx = table.key_indices
    checked: dict[int, object] = {}  # relation oid -> the Relation checked (a new one comes after a change)
    shapes: dict[int, tuple | None] = {}  # relation oid -> where the table's columns are in its rows
    recent: dict[tuple, list] = {}  # key -> its last values: unchanged TOAST values filled in from them
    counted = 0
    taking = False
    last_end = None
    transactions, commit_time = 0, None
    with connect(task.source_url, role="source", application_name=READER) as conn:
        def counting(rows):
            nonlocal counted
            for row in rows:
                counted += 1
                yield row

        rows = counting(peek.peek(conn, task.slot, task.publication, spec.upto, task.batch_changes))
        for ev in assemble(peek.in_range(rows, spec.start, spec.upto), Framing()):
            if isinstance(ev, Change):
                if not taking or (ev.relation.schema, ev.relation.name) != (table.schema, table.name):
                    continue
                if checked.get(ev.relation.oid) is not ev.relation:
                    if compiled is not None:
                        shapes[ev.relation.oid] = rule_input(ev.relation, table, reads,
                                                             f"the rule for {table.qualified}")
                    else:
                        check_columns(ev.relation, table)
                    checked[ev.relation.oid] = ev.relation
                old_row, new_row = ev.old, ev.new
                if (shape := shapes.get(ev.relation.oid)) is not None:  # in the shape the rule was made for
                    old_row, new_row = _reshaped(old_row, shape), _reshaped(new_row, shape)
                if ev.kind == "D":
                    yield from builder.add("D", old_row, None)
                    recent.pop(tuple(old_row[i] for i in key_idx), None)
                    continue
                new = list(new_row)
                key = tuple(new[i] for i in key_idx)
                if old_row is not None and tuple(old_row[i] for i in key_idx) != key:
                    yield from builder.add("D", old_row, None)
                unchanged = None
                if UNCHANGED in new:
                    prev = recent.get(key)
                    for j, v in enumerate(new):
                        if v is not UNCHANGED:
                            continue
                        if old_row is not None and old_row[j] is not None and old_row[j] is not UNCHANGED:
                            new[j] = old_row[j]
                        elif prev is not None and prev[j] is not UNCHANGED:
                            new[j] = prev[j]
                    unchanged = [j for j, v in enumerate(new) if v is UNCHANGED]
                    for j in unchanged:
                        if j in needs:
                            from ..rules.replicator import needs_full

                            needs_full(compiled, j)
                if len(recent) >= UNCHANGED_WINDOW:
                    recent.clear()
                recent[key] = new
                yield from builder.add("U", new, unchanged)
                if builder.past:
                    break  # a probe's range is read (diagnose)
            elif isinstance(ev, Begin):
                taking = True  # in_range passed it: its commit record begins in [start, upto)
            elif isinstance(ev, Commit):
                last_end = ev.end_lsn
                if taking:
                    transactions += 1
                    commit_time = ev.commit_time
                    fault_point("rule_batch.mid_read")
                taking = False
            elif isinstance(ev, TruncateChange) and taking and any(
                    (r.schema, r.name) == (table.schema, table.name) for r in ev.relations):
                yield from builder.add("T", None, None)
    # The server stops after the transaction that reaches `batch_changes` rows: then the batch ends at the
    # last commit it sent; else every transaction beginning its commit before `upto` was read.
    limited = counted >= task.batch_changes and last_end is not None
    end = last_end if limited else spec.upto
    yield from builder.flush()
    if builder.range is None:  # (a probe needs no end)
        yield from builder.marker("M", json.dumps({
            "position": max(end, spec.start), "limited": limited, "transactions": transactions,
            "commit_time": commit_time.isoformat() if commit_time is not None else None}))


def _reshaped(values, shape: tuple[int | None, ...]):
    return None if values is None else tuple(None if at is None else values[at] for at in shape)


class _Rows:
    """Rows into Arrow record batches of the table's raw schema."""

    def __init__(self, spec: BatchSpec, index: int, seq: tuple[int, int] | None = None):
        self.n = len(Table.from_json(spec.task.tables[index][0]).columns)
        self.columns: list[list] = [[] for _ in range(self.n + 4)]
        self.seq = 0
        self.range = seq  # only these changes (a probe of diagnose)

    @property
    def past(self) -> bool:
        return self.range is not None and self.seq >= self.range[1]

    def add(self, op: str, values, unchanged):
        if self.range is not None and not self.range[0] <= self.seq < self.range[1]:
            self.seq += 1
            return
        yield from self._append(op, values, ",".join(map(str, unchanged)) if unchanged else None, None)

    def marker(self, op: str, meta: str):
        yield from self._append(op, None, None, meta)
        yield from self.flush()

    def _append(self, op: str, values, unchanged: str | None, meta: str | None):
        cols, n = self.columns, self.n
        for j, v in enumerate(values if values is not None else (None,) * n):
            cols[j].append(None if v is UNCHANGED else v)
        for j, v in enumerate((self.seq, op, unchanged, meta)):
            cols[n + j].append(v)
        self.seq += 1
        if len(cols[n]) >= ROWS_PER_BATCH:
            yield from self.flush()

    def flush(self):
        import pyarrow as pa

        if not self.columns[self.n]:  # (the sequence column has a value in every row)
            return
        n = self.n
        arrays = [pa.array(c, pa.string()) for c in self.columns[:n]]
        arrays += [pa.array(self.columns[n], pa.int64()), pa.array(self.columns[n + 1], pa.string()),
                   pa.array(self.columns[n + 2], pa.string()), pa.array(self.columns[n + 3], pa.string())]
        from ..rules.compile import RAW

        yield pa.RecordBatch.from_arrays(arrays, names=[RAW.format(j) for j in range(n)] + EXTRA)
        self.columns = [[] for _ in range(n + 4)]


# -- in the task: applying ---------------------------------------------------------------------------------


def apply_changes(spec: BatchSpec, batches):
    """Runs in the batch's task, after every table's rule: apply the rows and save the stream's new position
    in one target transaction. Yields one summary row (JSON), errors included (pickled): they keep their
    type across the executor boundary."""
    import pyarrow as pa

    summary = {"position": spec.start, "rows": 0, "transactions": 0, "limited": False, "interrupted": "",
               "error": None}
    try:
        _apply(spec, batches, summary)
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which raises it
        summary["error"] = pack(exc)
    yield pa.RecordBatch.from_arrays([pa.array([json.dumps(summary)], pa.string())], names=["summary"])


def _apply(spec: BatchSpec, batches, summary: dict) -> None:
    import pyarrow.compute as pc

    from ..rules.compile import CompiledRule
    from ..rules.evaluate import KEEP, target_columns

    task = spec.task
    with connect(task.target_url, role="target") as dst:
        state, position = st.lock_stream(dst, task.stream_id)
        if state != task.expect_state or position != spec.start:
            dst.rollback()
            summary["interrupted"] = f"stream is {state} at {position}"
            return
        targets, rules = {}, {}
        for i in spec.active:
            spec_json, mode, lastpk = task.tables[i]
            source = Table.from_json(spec_json)
            rule_json = spec.rules.get(source.qualified)
            if rule_json is not None:
                rules[i] = CompiledRule.from_json(rule_json, source)
                targets[i] = TargetTable(rules[i].target, mode, lastpk, source=(source.schema, source.name))
            else:
                targets[i] = TargetTable(source, mode, lastpk)
        applier = PostgresApplier(dst, list(targets.values()))
        markers: dict[int, dict] = {}
        try:
            for batch in batches:
                for i in spec.active:
                    part = batch.filter(pc.equal(batch.column("__sg_t"), i))
                    if part.num_rows:
                        _apply_part(applier, targets[i], rules.get(i), part, markers, i, target_columns, KEEP)
                        summary["rows"] += part.num_rows
            if set(markers) != set(spec.active):
                raise RetryableError(f"batch of stream {task.stream_id} came without every table's end; will retry")
            ends = {(m["position"], m["limited"]) for m in markers.values()}
            if len(ends) != 1:  # a replayable peek gives every table the same end: something moved the slot
                raise RetryableError(f"the tables of stream {task.stream_id} read different batches; will retry")
            meta = next(iter(markers.values()))
            applier.flush()
            applier.settle()
        except BaseException:
            applier.abandon()
            raise
        summary["rows"] -= len(markers)
        caught_up = not meta["limited"] and task.stop_at is None
        counting = st.counts_applied(dst)
        st.save_position(dst, task.stream_id, meta["position"],
                         caught_up_at=spec.source_now if caught_up else None,
                         transaction_time=meta["commit_time"],
                         applied=summary["rows"] if meta["transactions"] and counting else None, safe=counting)
        if task.clear_message:
            st.set_message(dst, task.stream_id, "")
        fault_point("replicate.before_commit")
        dst.commit()
        summary.update(position=meta["position"], limited=meta["limited"], transactions=meta["transactions"])


def _apply_part(applier, target, rule, part, markers: dict, index: int, target_columns, keep_name: str) -> None:
    ops = part.column(OP).to_pylist()
    unch = part.column(UNCH).to_pylist()
    keeps = part.column(keep_name).to_pylist()
    struct = part.column(f"__sg_o{index}")
    fields = struct.flatten()
    names = [struct.type.field(j).name for j in range(struct.type.num_fields)]
    if rule is None:
        n = len(target.table.columns)
        values = list(zip(*(f.to_pylist() for f in fields[:n])))
        key_idx = target.table.key_indices
    else:
        import pyarrow as pa

        result = pa.RecordBatch.from_arrays(fields, names=names)
        values = list(zip(*(c.to_pylist() for c in target_columns(rule, result))))
        raw = list(zip(*(f.to_pylist() for f in fields[:len(rule.source.columns)])))
        key_idx = rule.source.key_indices
        key_positions = rule.target.key_indices
        n_target = len(rule.target.columns)
    for j, op in enumerate(ops):
        if op in ("M", "E"):
            meta = part.column(META)[j].as_py()
            if op == "E":
                raise unpack(meta)
            markers[index] = json.loads(meta)
            continue
        if op == "T":
            applier.flush()
            if rule is not None and rule.keyrange is not None:  # a shard's stream clears only its own rows
                applier.delete_where(target, rule.target_keyrange())
            else:
                applier.truncate_tables([target])
            continue
        if rule is None:
            row = values[j]
            key = tuple(row[k] for k in key_idx)
            unchanged = [int(c) for c in unch[j].split(",")] if unch[j] else None
            applier.put(target, "D" if op == "D" else "U", key, row, unchanged if op == "U" else None)
            continue
        key = tuple(raw[j][k] for k in key_idx)
        if op == "U" and keeps[j]:
            unchanged = {int(c) for c in unch[j].split(",")} if unch[j] else set()
            keep = [c for c, (kind, ref) in enumerate(rule.outputs) if kind == "raw" and ref in unchanged]
            applier.put(target, "U", key, values[j], keep or None)
        else:  # deleted, or no longer selected by the rule: gone from the target
            row = [None] * n_target
            for pos, v in zip(key_positions, key):
                row[pos] = v
            applier.put(target, "D", key, tuple(row))



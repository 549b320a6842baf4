"""Replaying the slot into Delta tables. Runs inside a Spark task.

Per batch (read up to a transaction boundary, as workflow/player.py does): the net effect per key of each
table's changes (staged to files when a batch outgrows memory: staging.py), then, per touched table, one
MERGE carrying the app transaction (sluicegate:W, version = the batch's end position); then the point
(points.py); then the stream's position in the state document; then the slot is confirmed up to it. Each
table skips the transactions it already has: those committing before its threshold, the larger of its app
transaction version (a batch a kill interrupted after this table's commit) and the snapshot position of its
first copy cycle (the copy brought them). A kill anywhere resumes from the state's position and applies
each transaction to each table once. Captured DDL statements (targets/delta/ddl.py) reshape a table's rows of the
batch at their place and have the table rewritten in its new shape before its MERGE.

The loop is every target's (workflow/play_loop.py); this module is the Delta target's side of it (_DeltaSink).
"""

from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass, replace
from datetime import datetime

from ...cluster.model import way_out as cluster_way_out
from ...cluster.safetime import advance_safe_time
from ...config import Settings, default
from ...ddl.message import PREFIX as DDL_PREFIX
from ...errors import RetryableError, TerminalError
from ...faults import fault_point
from ...postgres import capture, slot_reader
from ...postgres.assembler import Change, Framing, TruncateChange, assemble
from ...postgres.catalog import Column, Table
from ...postgres.connect import connect
from ...postgres.pgoutput import Begin, Commit, LogicalMessage, decode_row
from ...postgres.replication import ChangeStream
from ...workflow import play_loop
from ...workflow.play_loop import PlayResult
from ...workflow.schema_changes import (
    SchemaStop,
    builtin_type_name,
    by_hand_way_out,
    classify,
    older_rows_text,
    source_columns,
)
from . import apply, durable, location, points, staging
from . import control as control_fields
from .ddl import LakeDdl, ddl_app_id
from .state import RUNNING, STOPPED, LakeWorkflow, app_id, open_store
from .types import sql_literal

_RELID = struct.Struct(">I").unpack_from  # a row message's relation oid, after its kind byte


@dataclass(frozen=True)
class LakePlayTask:
    target: str  # delta:PATH
    workflow: str
    position: int
    max_seconds: float = float("inf")
    batch_changes: int = default("batch_changes")
    stage_rows: int = default("stage_rows")  # changes a batch holds in memory before it stages them (staging.py)
    stage_bytes: int = default("stage_bytes")  # ... or bytes of those changes' messages, whichever comes first
    batch_seconds: float = 0.2
    idle_poll: float = 0.1
    heartbeat_seconds: float = 1.0
    # Seconds between a commit of changes and the next batch (0: none). Each commit rewrites every file it
    # touches: commits further apart carry more transactions each and leave fewer old versions to keep.
    commit_every: float = 0.0
    # Play to exactly this position, recording a point there, then return (a stream's own stop, e.g. before a
    # captured statement it stops for; the state may be Stopped then). A controller's stop position is
    # durable instead: the state's stop_position (control.py).
    stop_at: int | None = None

    @classmethod
    def of(cls, target: str, workflow: str, position: int, settings: Settings, **more) -> LakePlayTask:
        """A play task with the workflow's batch and staging bounds."""
        return cls(target, workflow, position, batch_changes=settings.batch_changes, stage_rows=settings.stage_rows,
                   stage_bytes=settings.stage_bytes, **more)


class _Tables:
    """The workflow's Delta tables, opened once per task, with each one's skip threshold and version."""

    def __init__(self, root: str, wf: LakeWorkflow, src=None):
        from deltalake import DeltaTable

        self.app = app_id(wf.name)
        self.root, self.workflow, self.src = root, wf.name, src  # src: the source's control connection
        # "schema.table" -> {column: text}: columns added in this batch, to set at the table's MERGE in its
        # rows the batch does not touch (the source's older rows hold that value: `_follow`)
        self.fills: dict[str, dict[str, str | None]] = {}
        self.specs: dict[str, Table] = {}
        self.dts = {}
        self.threshold: dict[str, int] = {}
        self.copy_from: dict[str, int] = {}
        # the last captured statement each table's rewrites hold (targets/delta/ddl.py); a batch reads at least past it
        self.markers: dict[str, int] = {}
        self.ddl_app = ddl_app_id(wf.name)
        for t in wf.tables:
            spec = t.spec
            self.specs[t.qualified] = spec
            dt = DeltaTable(location.parse(root).table(spec.schema, spec.name))
            self.dts[t.qualified] = dt
            have = dt.transaction_version(self.app)
            self.threshold[t.qualified] = max(have or 0, t.copy_from or 0)
            self.copy_from[t.qualified] = t.copy_from or 0
            self.markers[t.qualified] = dt.transaction_version(self.ddl_app) or 0

    def refresh(self) -> None:
        for dt in self.dts.values():
            dt.update_incremental()

    def versions(self) -> dict[str, int]:
        return {q: dt.version() for q, dt in self.dts.items()}


def play(task: LakePlayTask) -> PlayResult:
    store = open_store(task.target)
    wf = store.load(task.workflow)
    with connect(wf.source_url, role="source", autocommit=True) as src_ctl:
        way_out = cluster_way_out(wf) or capture.rebootstrap(wf.name)  # a Replicate sink's: its bootstrap
        slot_reader.take_slot(src_ctl, wf.slot, task.position, way_out)
        sink = _DeltaSink(task, store, wf, src_ctl)
        # Logical messages carry the DDL capture's statements (ddl/); none come from a source without it.
        stream = slot_reader.open_stream(src_ctl, wf.source_url, wf.slot, wf.publication, task.position, way_out,
                                         messages=True)
        with stream:
            limits = play_loop.Limits(task.stop_at, max_seconds=task.max_seconds,
                                      heartbeat_seconds=task.heartbeat_seconds)
            return play_loop.run(sink, stream, src_ctl, wf.slot, way_out, task.position, limits)


class _DeltaSink(play_loop.Sink):
    """The Delta target's side of the play loop: each touched table commits the batch (its app transaction
    says how far it is), then the point, then the state document takes the position."""

    def __init__(self, task: LakePlayTask, store, wf: LakeWorkflow, src_ctl):
        self.task, self.store, self.wf = task, store, wf
        self.root = location.parse(task.target).uri
        self.tables = _Tables(self.root, wf, src_ctl)
        self.commits = durable.Versions(self.tables.dts)
        staging.clear(self.root, wf.name)  # a killed task's staged batch: it is read again from the slot
        self.current = wf
        self.last_commit = -math.inf  # (monotonic) when this task last committed changes
        # The pause reads nothing from the replication connection: keep it well inside the server's
        # wal_sender_timeout, which ends a walsender whose client has not answered for that long.
        timeout_ms = int(src_ctl.execute("SELECT setting FROM pg_settings WHERE name = 'wal_sender_timeout'"
                                         ).fetchone()[0])
        self.pause = min(task.commit_every, timeout_ms / 3000) if timeout_ms > 0 else task.commit_every
        self.ddl: LakeDdl | None = None

    def control(self, position: int):
        current = self.current = self.store.load(self.task.workflow)
        if current.position != position:
            return current, f"stream is {current.state} at {current.position}"
        if current.options != self.wf.options:  # e.g. `lake schedule`: the driver plans again
            return current, "the workflow's options changed"
        if self.task.stop_at is not None:  # its own stop: the controller's fields are not its business
            own = replace(current, stop_position=None, stop_reason="")
            if position < self.task.stop_at and current.state not in (RUNNING, STOPPED):
                return own, f"stream is {current.state} at {current.position}"
            return own, ""
        if current.state != RUNNING:  # (stopped already for a controller: nothing to play either)
            return current, f"stream is {current.state} at {current.position}"
        return current, ""

    def stop_here(self, control, position: int) -> str:
        stop_for_controller(self.store, control, position,
                            lambda: _point_here(self.root, self.wf.name, self.tables, position))
        return control_fields.stopped_message(position, control.stop_reason)

    def wait_before(self, stop_at: int | None) -> float:
        return max(0.0, self.last_commit + self.pause - time.monotonic()) if stop_at is None else 0.0

    def apply(self, stream, framing, position, flushed, stop_at):
        this = self.task if stop_at == self.task.stop_at else replace(self.task, stop_at=stop_at)
        self.ddl = LakeDdl(self.wf.name, self.task.target, self.wf.options)
        batch = _read_batch(this, stream, framing, self.tables, position, flushed, self.ddl)
        batch.merged = _commit_tables(self.tables, batch, self.ddl)
        self.commits.sync(batch.merged)  # on disk before the state and the slot move past them
        # Commits are spaced while the stream is light: not when catching up, nor after a full batch (a burst
        # has begun: the next batch carries it on at once instead of after the pause)
        if batch.merged and not batch.limited and batch.rows < self.task.batch_changes:
            self.last_commit = time.monotonic()
        if batch.spills:
            staging.clear(self.root, self.wf.name)
        return batch

    def replay_before(self, position: int, before: int, stop_at: int | None) -> None:
        if stop_at is None:  # (a stop of its own or a controller's comes first: it plays no further)
            play(replace(self.task, position=position, stop_at=before, max_seconds=float("inf")))

    def record(self, batch, control, stop_at, stopping, source_now):
        tables, current, ddl = self.tables, self.current, self.ddl
        name, position = self.wf.name, current.position
        requested = stop_at is not None and batch.position == stop_at
        copied_to = max((t.copied_to or 0) for t in current.tables)
        first = not current.first_point and batch.position >= copied_to
        if stopping:
            tables.refresh()  # (the controller's point: tables a direct write changed meanwhile)
        # Before the stream has passed every table's copy snapshot (the first point), a table copied later is
        # ahead of the others: no point until then, or a reader would see it half-applied.
        if (batch.merged and current.first_point) or first or requested:
            points.record(self.root, name, batch.position, batch.commit_time, tables.versions())
        fault_point("lake.replicate.before_state")
        depends = ((("tables",),) if first else ()) + (control_fields.FIELDS if stopping else ())
        with self.store.update(name, depends=depends) as w:
            if w.position != position:
                raise RetryableError(f"workflow {name}: its position moved under the play task; will retry")
            w.position = batch.position
            # (not once a table was added or reset meanwhile: its copy is still to come)
            w.first_point = w.first_point or (first and all(t.done for t in w.tables))
            if batch.commit_time is not None:
                w.transaction_time = batch.commit_time.isoformat()
            if not batch.limited:
                w.caught_up_at = time.time()
            w.safe_time = advance_safe_time(w.safe_time, batch.commit_time, None if batch.limited else source_now)
            for q in batch.merged:
                w.table(q).applied = batch.position
            for q, spec in batch.reshaped.items():
                w.table(q).table = spec.to_json()
            if ddl.notes:  # statements exec-ignore passed over
                w.message = "; ".join(ddl.notes)
            if stopping and (w.stop_reason, w.stop_position) == (current.stop_reason, stop_at):
                w.state = STOPPED  # with the position: it is final now (control.py)
                w.message = control_fields.stopped_message(batch.position, w.stop_reason)
        return batch.position


@dataclass
class _Batch:
    position: int
    effects: dict
    rows: int = 0
    limited: bool = False
    commit_time: datetime | None = None
    reshaped: dict = None
    spills: dict = None  # "schema.table" -> staging.Spill of a table whose effect was staged
    in_memory: int = 0  # changes folded since the last staging
    in_memory_bytes: int = 0  # ... and the bytes of their messages
    merged: list = None  # the tables that committed the batch
    transactions: int = 0
    ends: str = ""

    @property
    def wrote(self) -> bool:
        return bool(self.merged)


def _folded(task: LakePlayTask, tables: _Tables, batch: _Batch, size: int) -> None:
    """One more change (of a `size`-byte message) folded into the batch: staged once the batch holds enough."""
    batch.rows += 1
    batch.in_memory += 1
    batch.in_memory_bytes += size
    if batch.in_memory >= task.stage_rows or batch.in_memory_bytes >= task.stage_bytes:
        for q, effect in batch.effects.items():
            spill = batch.spills.get(q)
            if spill is None:
                spill = batch.spills[q] = staging.Spill(staging.staging_dir(tables.root, tables.workflow) / q)
            spill.write(effect)
        batch.in_memory = batch.in_memory_bytes = 0


def _point_here(root, workflow: str, tables: _Tables, position: int) -> None:
    """The controller's point at the player's own position (no batch needed to reach it)."""
    tables.refresh()
    points.record(root, workflow, position, None, tables.versions())


def stop_for_controller(store, current: LakeWorkflow, position: int, record_point) -> None:
    """Stop for the controller at `position`, the final one: at its stop position, record the point there
    first (even when nothing merged); then Stopped, while the fields are still those decided on."""
    if current.stop_position == position:
        record_point()
    with store.update(current.name, depends=control_fields.FIELDS) as w:
        if (w.position, w.stop_reason, w.stop_position) == (position, current.stop_reason,
                                                            current.stop_position):
            w.state = STOPPED
            w.message = control_fields.stopped_message(position, w.stop_reason)


class _RowLane:
    """The fast lane of a batch's rows (assemble's `rows`): a row change of a table the batch already applied a
    change of, under the same Relation and in the table's own column order, goes from its bytes straight into
    the table's NetEffect, as the event path would add it, without a Change made and passed up. Transactions
    come in commit order, so a table past its skip threshold stays past it for the rest of the batch; anything
    that may reshape a table or replace its effect (a Relation sent again, a captured statement, a truncation)
    takes it out of the lane until the event path meets its next change."""

    def __init__(self, task: LakePlayTask, tables: _Tables, batch: _Batch, framing: Framing):
        self.ready: dict[int, tuple] = {}  # relation oid -> (Relation, NetEffect)
        self.rels = framing.relations
        self.task, self.tables, self.batch = task, tables, batch

    def take(self, data: bytes) -> bool:
        try:
            relid = _RELID(data, 1)[0]
        except struct.error:  # too short: the event path's decoder says what is wrong with it
            return False
        entry = self.ready.get(relid)
        if entry is None or self.rels.get(relid) is not entry[0]:
            return False
        kind, _, old, new = decode_row(data)
        entry[1].add(kind, old, new)
        _folded(self.task, self.tables, self.batch, len(data))
        return True


def _read_batch(task: LakePlayTask, stream: ChangeStream, framing: Framing, tables: _Tables, position: int,
                flushed: int, ddl: LakeDdl | None = None, fast: bool = True) -> _Batch:
    batch = _Batch(position, {}, reshaped={}, spills={})
    effects = batch.effects
    seen_rels: dict[int, object] = {}
    orders: dict[int, tuple] = {}  # relation oid -> (Relation, table, _order's)
    stop_at = task.stop_at
    reader = slot_reader.BatchReader(stream, position, stop_at)
    # A table rewritten for a statement past the position (a kill came before the batch's MERGE) has the
    # shape after it: the batch reads at least past that statement, so its rows are merged in that shape.
    min_end = max((m for m in tables.markers.values() if m > position), default=None) if stop_at is None else None

    def raw_messages():
        yield from stream.messages(task.batch_changes, task.idle_poll, task.batch_seconds, until=stop_at or flushed)
        while min_end is not None and (reader.last_end is None or reader.last_end <= min_end):
            yield from stream.messages(task.batch_changes, task.idle_poll, task.batch_seconds, until=flushed)

    lane = _RowLane(task, tables, batch, framing) if fast else None
    events = assemble(raw_messages(), framing, lane, messages=DDL_PREFIX if ddl is not None else None)
    for ev in reader.events(events):
        commit_lsn = reader.commit_lsn
        if isinstance(ev, Change):
            rel = ev.relation
            q = f"{rel.schema}.{rel.name}"
            spec = tables.specs.get(q)
            if spec is None:
                continue
            if commit_lsn < tables.threshold[q] or commit_lsn < position:  # this table has it already
                if seen_rels.get(rel.oid) is not rel and _adopt(tables, q, spec, rel, batch):
                    seen_rels[rel.oid] = rel
                continue
            if seen_rels.get(rel.oid) is not rel:
                spec = _follow(tables, q, spec, rel, batch)
                seen_rels[rel.oid] = rel
            effect = effects.get(q)
            if effect is None:
                effect = effects[q] = apply.NetEffect(spec)
            order = orders.get(rel.oid)
            if order is None or order[0] is not rel or order[1] is not spec:
                order = orders[rel.oid] = (rel, spec, _order(rel, spec))
            if order[2] is None:  # the Relation's columns are the table's
                effect.add(ev.kind, ev.old, ev.new)
                if lane is not None:
                    lane.ready[rel.oid] = (rel, effect)
            else:
                effect.add(ev.kind, _in_order(order[2], ev.old), _in_order(order[2], ev.new))
            _folded(task, tables, batch, ev.size)
        elif isinstance(ev, Commit):
            if not reader.earlier:
                batch.commit_time = ev.commit_time
            fault_point("lake.slice.mid_batch")
        elif not isinstance(ev, Begin):
            if lane is not None:  # a statement may reshape a table, a truncation empties its effect
                lane.ready.clear()
            if isinstance(ev, LogicalMessage) and ddl is not None:  # a captured DDL statement, in its place
                try:
                    ddl.met(ev, commit_lsn, tables, batch,
                            lambda q, c=commit_lsn: c < tables.threshold[q] or c < position)
                except SchemaStop as exc:
                    exc.before = commit_lsn  # everything before this transaction may still be applied
                    raise
            elif isinstance(ev, TruncateChange):
                for rel in ev.relations:
                    q = f"{rel.schema}.{rel.name}"
                    if q in tables.specs and commit_lsn >= max(tables.threshold[q], position):
                        effects.setdefault(q, apply.NetEffect(tables.specs[q])).truncate()
                        if q in batch.spills:
                            batch.spills[q].discard()
    end = reader.end()
    batch.position, batch.limited = end.position, end.limited
    return batch


def _adopt(tables: _Tables, q: str, spec: Table, rel, batch: _Batch) -> bool:
    """A Relation met on a change the table already has: columns it adds are in the Delta table already (the
    batch that brought the table past them added and filled them), so they join the description, no more.
    One lacking known columns predates a column the copy adopted (engine.py): False, nothing to do."""
    change = classify(rel, spec)
    if change.unchanged:
        return True
    if not change.only_added:
        return False
    spec = replace(spec, columns=spec.columns + tuple(
        Column(c.name, builtin_type_name(c.type_oid, c.typmod), c.type_oid, False, None, c.typmod)
        for c in change.added))
    tables.specs[q] = batch.reshaped[q] = spec
    return True


def added_only(rel, spec: Table, workflow: str, target: str, since: str):
    """The columns `rel` adds to `spec` (classify's ColumnChanges), None when it changes nothing; any other
    change stops the stream in Error: a Delta target follows added columns only. `since`: when the change
    was made, for the message (" since `movetables create`")."""
    change = classify(rel, spec)
    if change.unchanged:
        return None
    if change.incompatible:
        raise TerminalError(f"table {spec.qualified} changed on the source{since}: {'; '.join(change.describe())}; "
                            f"a Delta target follows added columns only: re-create the workflow "
                            f"(`sluicegate workflow delete {workflow} --target {target} --drop-tables`, then create it "
                            f"again) to copy the table again")
    return change


def _follow(tables: _Tables, q: str, spec: Table, rel, batch: _Batch) -> Table:
    """A table's Relation message: columns the source added join the table, any other change stops the
    stream. Rows older than an added column hold, on the source, the value PostgreSQL recorded for them
    (its "fast default"; or NULL, or the immutable default it wrote): so do the rows this batch staged
    under the old shape, and, at the table's MERGE, the rows of the Delta table (`tables.fills`). A column the
    Delta table has already, not added by Sluicegate, was added by hand: its rows keep their values."""
    effects = batch.effects
    change = added_only(rel, spec, tables.workflow, location.parse(tables.root).target, "")
    if change is None:
        return spec
    source = source_columns(tables.src, rel.oid)
    path = location.parse(tables.root).table(spec.schema, spec.name)
    way_out = by_hand_way_out(f"Delta table {path}", tables.workflow)
    dt = tables.dts[q]
    added, pads, keep = [], {}, set()
    for i, c in enumerate(change.added, start=len(spec.columns)):
        col = source.get(c.name)
        if col is None or (col.type_oid, col.typmod) != (c.type_oid, c.typmod):
            now = "is gone" if col is None else f"is {col.type_sql} now"
            raise SchemaStop(f"column {c.name} was added to source table {q} and changed again since (it {now} "
                             f"on the source); {way_out}")
        added.append(Column(c.name, col.type_sql, c.type_oid, False, None, c.typmod))
        if apply.added_by(dt, c.name) == "":
            keep.add(i)
        else:
            pads[i] = older_rows_text(tables.src, q, col, way_out)  # SchemaStop when the source cannot say
    spec = replace(spec, columns=spec.columns + tuple(added))
    tables.specs[q] = spec
    batch.reshaped[q] = spec
    tables.fills.setdefault(q, {}).update((spec.columns[i].name, v) for i, v in pads.items())
    if q in effects:  # rows staged under the old shape predate the columns
        effects[q] = _padded(effects[q], spec, pads, keep)
    if q in batch.spills:
        batch.spills[q].pads.update(pads)
        batch.spills[q].pad_keep.update(keep)
    return spec


def _padded(old: apply.NetEffect, spec: Table, pads: dict[int, str | None], keep: set[int]) -> apply.NetEffect:
    """`old`'s rows widened to `spec`: each new column holds its value in `pads`; those in `keep`, the
    Delta table's own (upserts only)."""
    tail = tuple(pads.get(i) for i in range(len(old.table.columns), len(spec.columns)))
    return old.reshaped(spec, lambda values, kept: (values + tail, kept | keep))


def _order(rel, spec: Table) -> tuple | None:
    """Where each of the table's columns is in the Relation's rows (None: a column it lacks); None when they
    match (they do unless columns were added)."""
    names = [c.name for c in rel.columns]
    if tuple(names) == spec.column_names:
        return None
    index = {n: i for i, n in enumerate(names)}
    return tuple(index.get(c) for c in spec.column_names)


def _in_order(order: tuple, values: tuple | None) -> tuple | None:
    """A row of the Relation's columns in the table's column order (`_order`'s)."""
    if values is None:
        return None
    return tuple(None if i is None else values[i] for i in order)


def _commit_tables(tables: _Tables, batch: _Batch, ddl: LakeDdl | None = None) -> list[str]:
    """One commit per touched table that does not have the batch yet (first its rewrite, when captured
    statements changed its columns: targets/delta/ddl.py); the tables committed."""
    merged = []
    for q, effect in batch.effects.items():
        if tables.threshold[q] >= batch.position or not effect.changes:
            continue
        if ddl is not None and ddl.rewrite_pending(q, tables):
            fault_point("lake.replicate.rewritten")
        dt = tables.dts[q]
        spec = tables.specs[q]
        spill = batch.spills.get(q)
        staged = spill is not None and spill.generations > 0
        if effect.truncated:  # (with the batch's version when no MERGE follows)
            apply.truncate(dt, tables.app, None if effect.nonempty or staged else batch.position)
        fills = tables.fills.pop(q, None)
        literals = None
        if fills and (staged or effect.nonempty):
            columns = {c.name: c for c in spec.columns}
            literals = {n: sql_literal(columns[n], v, spec.type_tree) for n, v in fills.items()}
            apply.add_columns(dt, spec, list(fills), tables.workflow)  # a column's first commit: unfilled
            fault_point("lake.replicate.columns_added")
        if staged:
            apply.merge_staged(dt, spec, effect, spill, tables.app, batch.position, literals)
        elif effect.nonempty:
            apply.merge(dt, spec, effect, tables.app, batch.position, literals)
        tables.threshold[q] = batch.position
        merged.append(q)
        fault_point("lake.replicate.between_tables")
    return merged

"""Replaying changes from the slot into the target — VReplication's vplayer, used for catchup,
fast-forward and replicate alike. Runs inside a Spark task; the driver only hands it a PlayTask.

A task holds one replication stream (postgres/replication.py) from the stream's position. Each batch:
read messages until a transaction boundary after `batch_changes` messages or `batch_seconds`, or until the
source is idle; apply every transaction that commits at or after the stream's position, and commit the
data together with the new position in one target transaction — after checking, under a row lock, that
the position is still the one this batch started from (exactly-once). Only then is the slot confirmed.
A transaction's commit record starts at or after the position iff it is not yet applied; when the source
is idle, the position moves to what the server says it has sent (heartbeats).

The loop is every target's (play_loop.py); this module is the PostgreSQL target's side of it (_PostgresSink)
and its batch: the appliers, DDL replay and schema changes met in the stream.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from .. import config
from ..appliers.lww_applier import LwwApplier
from ..appliers.plans import TablePlans
from ..appliers.postgres import PostgresApplier, TargetTable
from ..ddl.message import PREFIX as DDL_PREFIX
from ..errors import TerminalError
from ..faults import fault_point
from ..position import format_lsn
from ..postgres import capture, durable, origins, slot_reader
from ..postgres.assembler import Change, Framing, TruncateChange, assemble
from ..postgres.catalog import Table, quote_name
from ..postgres.connect import connect
from ..postgres.pgoutput import Begin, Commit, LogicalMessage, Origin
from ..postgres.replication import ChangeStream
from ..postgres.standby_flush import StandbyGate
from . import play_loop, stream_control
from . import state as st
from .ddl_replay import DdlReplay
from .play_loop import PlayResult
from .schema_changes import SchemaFollower, SchemaStop


@dataclass(frozen=True)
class PlayTask:
    source_url: str
    target_url: str
    workflow: str
    stream_id: int
    slot: str
    publication: str
    tables: list[tuple[dict, str, list[str] | None]]  # (Table json, mode, lastpk)
    position: int  # where the stream stands; the task stops if the target says otherwise
    expect_state: str  # the stream must stay in this state (Copying or Running), else the task returns
    until: str  # "position" (fast-forward to stop_at), "caught_up" (catchup), "slice" (replicate)
    stop_at: int | None = None
    max_seconds: float = 10.0
    batch_changes: int = 20_000
    idle_poll: float = 0.1
    heartbeat_seconds: float = 1.0
    batch_seconds: float = 0.2  # a batch ends at the next transaction boundary after this long: lag stays low
    clear_message: bool = False  # the stream's message tells of a failure this task recovered from
    # (source qualified name, rule json) of tables whose rule only moves columns (a Reshard's key range, say):
    # applied here, in Python. A stream with a Spark SQL rule plays through workflow/rule_player.py instead.
    rules: tuple[tuple[str, dict], ...] = ()
    # What to do when the slot can no longer supply the stream (the workflow kind's own way out); empty: the
    # generic one (capture.rebootstrap).
    way_out: str = ""
    # A bidirectional workflow's direction (cluster/model.py): the replication origin every write of the task
    # carries (stamped with the source's commit position and time), and whether the capture drops transactions
    # that have an origin (they were applied here by the opposite direction: never send them back).
    origin: str = ""
    skip_origins: bool = False
    # A bidirectional direction's (this cluster's id, the peer's): its changes apply by last-writer-wins
    # (appliers/lww_applier.py); (0, 0) for every other stream.
    clusters: tuple[int, int] = (0, 0)
    # Apply with session_replication_role = replica: the target tables have foreign keys between them
    # (postgres/table_definition.py), which a batch may meet child first; the source checked them.
    replica_role: bool = False
    # Confirm a position only once the target's physical standbys have flushed the commit that recorded it
    # (postgres/standby_flush.py): the workflow option confirm_after_target_standbys.
    confirm_after_standbys: bool = False


def play(task: PlayTask, stop=None) -> PlayResult:
    """`stop`: an event that ends the task between batches."""
    with connect(task.source_url, role="source", autocommit=True) as src_ctl, \
            connect(task.target_url, role="target") as dst:
        # Who writes: a MoveTables' denial triggers (workflow/traffic.py) let its own applier through.
        dst.execute("SELECT set_config('sluicegate.applying', %s, false)", (task.workflow,))
        durable.flush_on_commit(dst)  # the slot is confirmed after each commit: it must be on disk
        dst.commit()
        if task.origin:
            origins.acquire(dst, task.origin)
        if task.clusters[0] or task.replica_role:
            # The tombstone triggers must take the applier's deletes for what they are (appliers/lww.py).
            dst.execute("SET session_replication_role = replica")
        if task.clusters[0]:
            # Active-active: in a lock cycle with the application's transaction, PostgreSQL aborts the one
            # whose deadlock_timeout runs out first: let that be the applier (it retries its batch), never the
            # application (1 s by default). A MoveTables' target has no application writing yet: it keeps
            # its default, and its user needs no grant for it (preflight/needs.py).
            dst.execute("SET deadlock_timeout = '20ms'")
        dst.commit()
        gate = StandbyGate(task.confirm_after_standbys)

        def confirm_recorded(position: int) -> None:  # (the target's standbys first, when the task says so)
            if (ready := gate.recorded(dst, position)) is not None:
                capture.advance_slot(src_ctl, task.slot, ready)

        slot_reader.take_slot(src_ctl, task.slot, task.position, way_out(task), confirm_recorded)
        # Logical messages carry the DDL capture's statements (ddl/).
        stream = slot_reader.open_stream(src_ctl, task.source_url, task.slot, task.publication, task.position,
                                         way_out(task), skip_origins=task.skip_origins, messages=True)
        # One writer thread: a chunk goes to the target while the next one is decoded.
        with stream, ThreadPoolExecutor(1, thread_name_prefix="sg-apply") as writer:
            sink = _PostgresSink(task, src_ctl, dst, gate, writer)
            return play_loop.run(sink, stream, src_ctl, task.slot, way_out(task), task.position, limits(task),
                                 stop)


class _PostgresSink(play_loop.Sink):
    """The PostgreSQL target's side of the play loop: a batch's rows and its position commit in one target
    transaction, under the stream's row lock, after checking that the position is still the batch's start."""

    def __init__(self, task: PlayTask, src_ctl, dst, gate: StandbyGate, writer):
        self.task = _current_shapes(dst, task)
        self.src_ctl, self.dst, self.gate, self.writer = src_ctl, dst, gate, writer
        self.rules = _moves_only(task)
        self.lww_plans: dict = {}  # LwwTables kept across the task's batches
        self.plans = TablePlans()  # and the PostgreSQL applier's (appliers/plans.py)
        self.follower = SchemaFollower(src_ctl, dst, task.stream_id, task.workflow)
        self.counting = st.counts_applied(dst)
        self.batches = 0

    def control(self, position: int):
        control = st.lock_stream_control(self.dst, self.task.stream_id)
        if control.state != self.task.expect_state or control.position != position:
            return control, f"stream is {control.state} at {control.position}"
        return control, ""

    def leave(self) -> None:
        self.dst.rollback()

    def stop_here(self, control, position: int) -> str:
        stream_control.mark_stopped(self.dst, self.task.stream_id, control)
        self.dst.commit()
        return stream_control.stopped_message(control.stop_position, control.stop_reason)

    def apply(self, stream, framing, position, flushed, stop_at):
        this = self.task if stop_at == self.task.stop_at else replace(self.task, stop_at=stop_at)
        batch = _apply_batch(this, stream, self.dst, framing, position, flushed, self.rules, self.writer,
                             self.follower, self.lww_plans, self.src_ctl, self.plans)
        batch.wrote = bool(batch.transactions or self.follower.changed)  # (reshaped tables: saved with it)
        return batch

    def abandon(self) -> None:
        self.dst.rollback()

    def replay_before(self, position: int, before: int, stop_at: int | None) -> None:
        play(replace(self.task, position=position, until="position", stop_at=before, max_seconds=float("inf")))

    def record(self, batch, control, stop_at, stopping, source_now):
        task, dst = self.task, self.dst
        self.batches += 1
        caught_up = not batch.limited and stop_at is None
        reshaped = self.follower.changed  # tables whose columns followed the source
        st.save_position(dst, task.stream_id, batch.position, caught_up_at=source_now if caught_up else None,
                         transaction_time=batch.commit_time,
                         applied=batch.rows if self.counting and batch.transactions else None, safe=self.counting)
        if task.clear_message and self.batches == 1:
            st.set_message(dst, task.stream_id, "")
        if (note := self.gate.note_changed()) is not None:  # waits for the target's standbys, or no longer
            st.set_message(dst, task.stream_id, note)
        if task.origin and batch.transactions:  # the rows carry the source's commit time
            origins.xact_setup(dst, format_lsn(batch.commit_end), batch.commit_time)
        if stopping:  # at the durable stop: Stopped with the batch that reached it
            stream_control.mark_stopped(dst, task.stream_id, control)
        fault_point("replicate.before_commit")
        dst.commit()
        if reshaped:
            self.task = _reshaped(task, reshaped)
            self.follower.changed = {}
        return self.gate.recorded(dst, batch.position)

    def keep(self) -> int | None:
        self.dst.rollback()
        return self.gate.release(self.dst)  # the standbys may have caught up since the last commit


def limits(task: PlayTask) -> play_loop.Limits:
    """When the task's loop returns (besides its stream's control): `until` and the task's bounds."""
    return play_loop.Limits(task.stop_at if task.until == "position" else None, caught_up=task.until == "caught_up",
                            max_seconds=task.max_seconds, heartbeat_seconds=task.heartbeat_seconds)


def way_out(task: PlayTask) -> str:
    return task.way_out or capture.rebootstrap(task.workflow)


def _current_shapes(dst, task: PlayTask) -> PlayTask:
    """The task with each table's description as the stream stores it now: columns may have followed the
    source since the driver read them (a task before this one, in the same copy phase)."""
    stored = st.table_specs(dst, task.stream_id)
    dst.rollback()
    return _reshaped(task, {name: Table.from_json(spec) for name, spec in stored.items()})


def _reshaped(task: PlayTask, tables: dict[str, Table]) -> PlayTask:
    """The task with the given tables' new descriptions."""
    out = []
    for spec, mode, lastpk in task.tables:
        name = f"{spec['schema']}.{spec['name']}"
        out.append((tables[name].to_json() if name in tables else spec, mode, lastpk))
    return replace(task, tables=out)


def _moves_only(task: PlayTask) -> dict | None:
    """source (schema, name) -> a runner of its rule, for the task's tables that have one."""
    if not task.rules:
        return None
    from ..rules.compile import CompiledRule
    from ..rules.evaluate import MovesOnly

    sources = {Table.from_json(spec).qualified: Table.from_json(spec) for spec, _, _ in task.tables}
    runners = {}
    for name, rule_json in task.rules:
        source = sources[name]
        runners[(source.schema, source.name)] = MovesOnly(CompiledRule.from_json(rule_json, source))
    return runners


@dataclass
class _Batch:
    position: int
    transactions: int = 0
    rows: int = 0
    limited: bool = False
    commit_time: object = None
    commit_end: int = 0  # end of the last applied transaction's commit record on the source
    tables_changed: bool = False  # a DDL statement changed the stream's set of tables (workflow/ddl_tables.py)
    wrote: bool = False  # something to record even if the position stayed

    @property
    def ends(self) -> str:  # the engine reads the stream again
        return "a schema change changed the stream's tables or types" if self.tables_changed else ""


def _apply_batch(task: PlayTask, stream: ChangeStream, dst, framing: Framing, position: int, flushed: int,
                 rules: dict | None, writer=None, follower: SchemaFollower | None = None,
                 lww_plans: dict | None = None, src=None, plans: TablePlans | None = None) -> _Batch:
    tables = [TargetTable(Table.from_json(spec), mode, lastpk) for spec, mode, lastpk in task.tables]
    placed = (lambda rel: check_placed(src, dst, task, rel)) if src is not None else None
    if task.clusters[0]:
        lww = LwwApplier(dst, tables, local_cluster=task.clusters[0], peer_cluster=task.clusters[1],
                         origin=task.origin, plans=lww_plans, unplaced=placed, schema_changes=follower)
        # A statement replayed here runs under session_replication_role = replica: this side's capture
        # trigger does not fire for it, so it never goes back to the peer (ddl/both_ways.py).
        ddl = DdlReplay(dst, task.target_url, task.workflow, task.stream_id, lww, src=src,
                        publication=task.publication, follower=follower, both_ways=True)
        try:
            return _play_batch(task, stream, lww, framing, position, flushed, lww, None, ddl)
        except BaseException:
            lww.abandon()
            raise
    ruled = {}
    for t in tables:
        runner = (rules or {}).get((t.table.schema, t.table.name))
        if runner is not None:  # the applier writes the rule's target table; the replicator feeds it
            t.source, t.table = (t.table.schema, t.table.name), runner.rule.target
            ruled[t.source] = (runner, t)
    base = applier = PostgresApplier(dst, tables, executor=writer, schema_changes=follower,
                                     unplaced=placed, plans=plans)
    rows = None
    if ruled:
        from ..rules.replicator import RuleReplicator  # with pyarrow: only where a table has a rule

        applier = RuleReplicator(applier, ruled)
    else:  # rows through no rule: most go from their message bytes straight into the applier
        rows = base.row_sink(framing)
    ddl = DdlReplay(dst, task.target_url, task.workflow, task.stream_id, base, renamed=set(ruled), src=src,
                    publication=task.publication, follower=follower)
    try:
        return _play_batch(task, stream, applier, framing, position, flushed, base, rows, ddl)
    except BaseException:
        base.abandon()  # nothing may still be writing when the caller rolls back
        raise


def check_placed(src, dst, task: PlayTask, rel) -> None:
    """A change of a relation that none of the task's tables is: passed over if the stream gained the table
    after the task began, or is about to (replicate add-tables publishes a table first and records it next:
    its copy comes later). A partition or an inheritance child of a table, published under its own name (a
    publication made by hand or by an older Sluicegate), would lose the change: the stream stops instead."""
    name = f"{rel.schema}.{rel.name}"
    if dst.execute("SELECT 1 FROM sluicegate.copy_state WHERE stream_id = %s AND table_name = %s",
                   (task.stream_id, name)).fetchone():
        return
    row = src.execute(
        """SELECT c.relispartition OR EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhrelid = c.oid)
           FROM pg_class c WHERE c.oid = %s""", (rel.oid,)).fetchone()
    if row is not None and not row[0]:
        return
    raise TerminalError(
        f"the source sent a change of {quote_name(rel.schema, rel.name)}, a partition or inheritance child that "
        f"workflow {task.workflow} does not move under its own name (publication {task.publication} publishes "
        f"it so, made by hand or by an older Sluicegate): nothing of that transaction was applied; re-create "
        f"the workflow, whose publication sends a partition's changes as its root's")


def _play_batch(task: PlayTask, stream: ChangeStream, applier, framing: Framing, position: int, flushed: int,
                base, rows=None, ddl: DdlReplay | None = None) -> _Batch:
    batch = _Batch(position)
    skipping = False
    reader = slot_reader.BatchReader(stream, position, task.stop_at)
    begin = getattr(applier, "begin", None)  # an applier that wants each transaction's commit time
    # The fault point at each commit, its setting read once a batch: os.environ read at every commit showed
    # in the replay's profile (bench/README.md).
    mid_batch = f"{task.until}.mid_batch"
    pause_mid_batch = config.from_env("fault_pause") == mid_batch
    # Up to what the source had flushed when the batch began (as peek did), or the fast-forward's point.
    raw = stream.messages(task.batch_changes, task.idle_poll, task.batch_seconds, until=task.stop_at or flushed)
    try:
        for ev in reader.events(assemble(raw, framing, rows, origins=task.skip_origins,
                                         messages=DDL_PREFIX if ddl is not None else None)):
            if isinstance(ev, Change):
                if not skipping:
                    applier.change(ev)
                    batch.rows += 1
            elif isinstance(ev, Begin):
                if begin is not None:
                    begin(ev.commit_time)
                skipping = reader.earlier
                if rows is not None:
                    rows.active = not skipping
            elif isinstance(ev, Origin):
                # Written here by the opposite direction (PostgreSQL 14/15 sends it; 16+ left it out): skip it
                # like one already applied, its position passed all the same.
                skipping = True
                if rows is not None:
                    rows.active = False
            elif isinstance(ev, Commit):
                if not skipping:
                    batch.transactions += 1
                    batch.commit_time = ev.commit_time
                    batch.commit_end = ev.end_lsn
                if pause_mid_batch:
                    fault_point(mid_batch)
                if ddl is not None and (ddl.tables_changed or ddl.ends_batch):
                    # The stream's tables changed (a table joined, was dropped or renamed), or an enum label was
                    # added (usable once committed): the batch ends with this transaction, and the task with the
                    # batch; the engine reads the stream again.
                    batch.tables_changed = True
                    break
            elif isinstance(ev, TruncateChange) and not skipping:
                applier.truncate(ev.relations)
            elif isinstance(ev, LogicalMessage) and not skipping:  # a captured DDL statement, in its place
                applier.flush()
                base.settle()  # the statement's queries use the connection: the chunk's error, if any, first
                ddl.met(ev)
    except SchemaStop as exc:
        exc.before = reader.commit_lsn or None  # everything before this transaction may still be applied
        raise
    applier.flush()
    base.settle()  # the batch's rows are on the target before its position is saved
    if rows is not None:
        batch.rows += rows.taken
    end = reader.end(cut=batch.tables_changed)  # (a cut: no further than the transaction that changed them)
    batch.position, batch.limited = end.position, end.limited
    return batch

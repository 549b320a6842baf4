"""Replaying changes from the slot into the target — VReplication's vplayer, used for catchup,
fast-forward and replicate alike. Runs inside a Spark task; the driver only hands it a PlayTask.

A task holds one replication stream (postgres/replication.py) from the stream's position. Each batch:
read messages until a transaction boundary after `batch_changes` messages or `batch_seconds`, or until the
source is idle; apply every transaction that commits at or after the stream's position, and commit the
data together with the new position in one target transaction — after checking, under a row lock, that
the position is still the one this batch started from (exactly-once). Only then is the slot confirmed.
A transaction's commit record starts at or after the position iff it is not yet applied; when the source
is idle, the position moves to what the server says it has sent (heartbeats).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from .. import config
from ..appliers.lww_applier import LwwApplier
from ..appliers.plans import TablePlans
from ..appliers.postgres import PostgresApplier, TargetTable
from ..ddl.message import PREFIX as DDL_PREFIX
from ..errors import RetryableError, TerminalError
from ..position import format_lsn
from ..postgres import capture, durable, origins, slot_reader
from ..postgres.assembler import Change, Framing, TruncateChange, assemble
from ..postgres.catalog import Table, quote_name
from ..postgres.connect import connect
from ..postgres.pgoutput import Begin, Commit, LogicalMessage, Origin
from ..postgres.replication import ChangeStream
from ..postgres.standby_flush import StandbyGate
from . import state as st
from . import stream_control
from .ddl_replay import DdlReplay
from .faults import fault_point
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


@dataclass
class PlayResult:
    position: int
    batches: int = 0
    transactions: int = 0
    rows: int = 0
    caught_up: bool = False
    interrupted: str = ""  # why it returned early: the stream's state or position moved


def play(task: PlayTask, stop=None) -> PlayResult:
    """`stop`: an event that ends the task between batches."""
    rules = _moves_only(task)
    result = PlayResult(task.position)
    deadline = time.monotonic() + task.max_seconds  # max_seconds may be inf: until interrupted
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
        lww_plans: dict = {}  # LwwTables kept across the task's batches
        plans = TablePlans()  # and the PostgreSQL applier's (appliers/plans.py)
        gate = StandbyGate(task.confirm_after_standbys)

        def confirm_recorded(position: int) -> None:  # (the target's standbys first, when the task says so)
            if (ready := gate.recorded(dst, position)) is not None:
                capture.advance_slot(src_ctl, task.slot, ready)

        slot_reader.take_slot(src_ctl, task.slot, task.position, way_out(task), confirm_recorded)
        framing = Framing()  # Relation messages of this task's decoding session
        task = _current_shapes(dst, task)
        follower = SchemaFollower(src_ctl, dst, task.stream_id, task.workflow)
        last_write = 0.0
        counting = st.counts_applied(dst)
        # Logical messages carry the DDL capture's statements (ddl/).
        stream = slot_reader.open_stream(src_ctl, task.source_url, task.slot, task.publication, result.position,
                                         way_out(task), skip_origins=task.skip_origins, messages=True)
        # One writer thread: a chunk goes to the target while the next one is decoded.
        with stream, ThreadPoolExecutor(1, thread_name_prefix="sg-apply") as writer:
            while True:
                if task.until == "position" and result.position < task.stop_at:
                    slot_reader.wait_flushed(src_ctl, task.stop_at)
                flushed, source_now = capture.wal_flush_position(src_ctl)
                control = st.lock_stream_control(dst, task.stream_id)
                if control.state != task.expect_state or control.position != result.position:
                    dst.rollback()
                    result.interrupted = f"stream is {control.state} at {control.position}"
                    return result
                # The stream's durable stop (stream_control.py) before the task's own limit: a vdiff's point
                # may be the very position a fast-forward ends at.
                action = stream_control.decide(result.position, control.stop_position, control.stop_reason)
                if action is stream_control.Action.STOP:
                    stream_control.mark_stopped(dst, task.stream_id, control)
                    dst.commit()
                    result.interrupted = stream_control.stopped_message(control.stop_position, control.stop_reason)
                    return result
                if task.until == "position" and result.position >= task.stop_at:
                    dst.rollback()
                    result.caught_up = True
                    return result
                if stop is not None and stop.is_set():
                    dst.rollback()
                    result.interrupted = "stopping"
                    return result
                this = task
                if action is stream_control.Action.PLAY_TO and (task.stop_at is None
                                                                or control.stop_position < task.stop_at):
                    this = replace(task, stop_at=control.stop_position)
                    slot_reader.wait_flushed(src_ctl, this.stop_at)
                try:
                    batch = _apply_batch(this, stream, dst, framing, result.position, flushed, rules, writer,
                                         follower, lww_plans, src_ctl, plans)
                except SchemaStop as exc:
                    # A schema change the stream does not follow: what came before the transaction that met it
                    # is applied (the target is then made to match from a clean point), nothing of it.
                    dst.rollback()
                    if exc.before is not None and exc.before > result.position:
                        stream.close()
                        play(replace(task, position=result.position, until="position", stop_at=exc.before,
                                     max_seconds=float("inf")))
                    raise
                except RetryableError:
                    # The stream broke: the slot may be gone or invalidated — say so with the way out, never skip.
                    capture.check_slot(src_ctl, task.slot, result.position, way_out(task))
                    raise
                result.batches += 1
                result.transactions += batch.transactions
                result.rows += batch.rows
                new_position = batch.position
                caught_up = not batch.limited and this.stop_at is None
                stopping = (control.stop_reason and control.stop_position is not None
                            and new_position >= control.stop_position)
                now = time.monotonic()
                reshaped = follower.changed  # tables whose columns followed the source: saved with the batch
                if (new_position > result.position or batch.transactions or reshaped
                        or now - last_write >= task.heartbeat_seconds):
                    st.save_position(dst, task.stream_id, new_position,
                                     caught_up_at=source_now if caught_up else None,
                                     transaction_time=batch.commit_time,
                                     applied=batch.rows if counting and batch.transactions else None,
                                     safe=counting)
                    if task.clear_message and result.batches == 1:
                        st.set_message(dst, task.stream_id, "")
                    if (note := gate.note_changed()) is not None:  # waits for the target's standbys, or no longer
                        st.set_message(dst, task.stream_id, note)
                    if task.origin and batch.transactions:  # the rows carry the source's commit time
                        origins.xact_setup(dst, format_lsn(batch.commit_end), batch.commit_time)
                    if stopping:  # at the durable stop: Stopped with the batch that reached it
                        stream_control.mark_stopped(dst, task.stream_id, control)
                    fault_point("replicate.before_commit")
                    dst.commit()
                    last_write = now
                    if (ready := gate.recorded(dst, new_position)) is not None:
                        stream.confirm(ready)
                    if reshaped:
                        task = _reshaped(task, reshaped)
                        follower.changed = {}
                else:
                    dst.rollback()
                    # The standbys may have caught up since the last commit.
                    if (ready := gate.release(dst)) is not None:
                        stream.confirm(ready)
                result.position = new_position
                if stopping:
                    result.interrupted = stream_control.stopped_message(control.stop_position, control.stop_reason)
                    return result
                if batch.tables_changed:
                    result.interrupted = "a schema change changed the stream's tables or types"
                    return result
                if task.until == "caught_up" and not batch.limited:
                    result.caught_up = True
                    return result
                if time.monotonic() >= deadline:
                    return result


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

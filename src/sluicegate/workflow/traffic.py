"""MoveTables traffic: switch writes to the target, reverse them back, complete or cancel (Vitess's
SwitchTraffic, ReverseTraffic, Complete, Cancel).

The reverse workflow `<W>_reverse` is a MoveTables of its own, target -> source, kept in the SOURCE's
`sluicegate` schema; its slot and publication are on the target. Which side takes writes is decided by one
commit on the side that gives them up:

- switch-traffic: one source transaction locks the moved tables (reads go on), waits until the forward stream
  has applied everything before the source's position P, then creates (or restarts) the reverse workflow and the
  denial triggers, and commits. Before that commit nothing changed on the source; a kill leaves it writable.
  The target's part (forward stream Stopped, its denials gone) follows in a target transaction held open
  across the source's commit.
- reverse-traffic: the same the other way: one target transaction locks the tables, waits until the reverse
  stream has everything before the target's position, denies the tables on the target and restarts the forward
  stream at the source's position of that moment (the source's WAL between P and it holds only the reverse
  applier's writes), and commits; then the source's part (reverse stream Stopped, denials gone).

Both sides record an `epoch` with the traffic state; a side behind the other had its part interrupted by a
kill between the two commits, and every traffic command (and status) finishes that part first.
Appliers identify themselves with the session setting `sluicegate.applying` (player.py): a denial trigger lets
the one workflow that carries the traffic write.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from ..errors import RetryableError, UsageError
from ..faults import fault_point
from ..position import format_lsn, parse_lsn
from ..postgres import capture, locks
from ..postgres.catalog import Table
from ..postgres.connect import connect, describe, strip_password
from ..postgres.table_definition import advance_sequences, may_apply_as_replica
from . import state as st
from . import stream_control
from .denial import deny, undeny
from .heartbeat import is_running
from .shards import load_all

log = logging.getLogger("sluicegate")

SOURCE, SWITCHED, REVERSED = "source", "switched", "reversed"
SWITCH, REVERSE = "switch-traffic", "reverse-traffic"  # the stop reasons of the streams they stop


def reverse_name(name: str) -> str:
    return f"{name}_reverse"


@dataclass
class SwitchResult:
    workflow: str
    traffic: str  # SWITCHED or REVERSED
    position: int  # where the side giving up writes stood when they were blocked
    blocked_seconds: float  # from the lock granted to the commit
    lag_seconds: float | None  # the stream's lag when the switch began
    sequences: list[str] = field(default_factory=list)
    finished_interrupted: str = ""  # a part of an earlier, killed command this one finished first


@dataclass
class Sides:
    """The forward workflow (on the target) and the reverse one (on the source, None before any switch)."""

    forward: st.Workflow
    reverse: st.Workflow | None
    target_url: str

    @property
    def source_url(self) -> str:
        return self.forward.source_url

    @property
    def traffic(self) -> str:
        return self.forward.traffic.state

    @property
    def tables(self) -> list[Table]:
        return [t.table for t in self.forward.streams[0].tables]


# -- reading and finishing the state ---------------------------------------------------------------------
def load(name: str, target_url: str) -> Sides:
    with connect(target_url, role="target") as dst:
        forward = st.load_workflow(dst, name)
    if forward.kind != "MoveTables":
        raise UsageError(f"workflow {name} is a {forward.kind}: only a MoveTables switches traffic")
    if len(forward.streams) != 1:
        raise UsageError(f"workflow {name} has {len(forward.streams)} streams: traffic switching takes one")
    with connect(forward.source_url, role="source") as src:
        reverse = _load_reverse(src, name)
    return Sides(forward, reverse, target_url)


def _load_reverse(src: psycopg.Connection, name: str) -> st.Workflow | None:
    if not st.has_schema(src) or reverse_name(name) not in st.list_workflows(src):
        return None
    return st.load_workflow(src, reverse_name(name))


def _epoch(wf: st.Workflow | None) -> int:
    return (wf.traffic.epoch or 0) if wf is not None else 0


def reconcile(name: str, target_url: str) -> tuple[Sides, str]:
    """The sides, with the part a killed command left undone finished; (sides, what was finished or '')."""
    sides = load(name, target_url)
    fwd, rev = _epoch(sides.forward), _epoch(sides.reverse)
    if rev > fwd:  # a switch committed on the source; the target's part is missing
        with connect(target_url, role="target") as dst:
            _target_part_of_switch(dst, sides, rev, sides.reverse.traffic.position)
        return load(name, target_url), "the target's part of an interrupted switch-traffic"
    if fwd > rev and sides.reverse is not None and sides.reverse.traffic.state == SWITCHED:
        with connect(sides.source_url, role="source") as src:
            _source_part_of_reverse(src, sides, fwd, sides.forward.traffic.position)
        _drop_reverse_capture(sides)
        return load(name, target_url), "the source's part of an interrupted reverse-traffic"
    return sides, ""


def set_reverse_state(name: str, target_url: str, verb: str) -> str | None:
    """`workflow stop|start` of a MoveTables whose traffic is switched: the stream that runs is the reverse
    workflow's (on the source); the forward one stays stopped. Its new state, or None when not switched."""
    sides, _ = reconcile(name, target_url)
    if sides.traffic != SWITCHED or sides.reverse is None:
        return None
    stream = sides.reverse.streams[0]
    with connect(sides.source_url, role="source") as src:
        st.lock_stream(src, stream.id)
        new = st.STOPPED if verb == "stop" else st.RUNNING  # a reverse stream never copies
        st.set_state(src, stream.id, new, "stopped by user" if verb == "stop" else "")
    return new


def active_stream(name: str, target_url: str) -> tuple[str, str] | None:
    """(workflow, its target URL) that the driver of MoveTables `name` runs now: the forward workflow, or the
    reverse one after a switch; None when neither runs (stopped by a user, completed, in Error)."""
    try:
        sides, _ = reconcile(name, target_url)
    except UsageError:
        return None  # deleted meanwhile (complete, cancel)
    except psycopg.Error:  # e.g. a deadlock with the delete: moot once the workflow is gone
        with connect(target_url, role="target") as dst:
            if name not in st.list_workflows(dst):
                return None
        raise
    if sides.forward.streams[0].state in (st.INIT, st.COPYING, st.RUNNING):
        return name, target_url
    if sides.traffic == SWITCHED and sides.reverse is not None \
            and sides.reverse.streams[0].state == st.RUNNING:
        return sides.reverse.name, sides.source_url
    return None


# -- switch-traffic --------------------------------------------------------------------------------------
def switch_traffic(name: str, target_url: str, *, lock_timeout: float = 2.0, timeout: float = 30.0,
                   max_lag: float = 30.0) -> SwitchResult:
    """Writes to the moved tables go to the target from now on; the reverse workflow keeps the source current."""
    sides, finished = reconcile(name, target_url)
    if sides.traffic == SWITCHED and finished:  # a killed switch-traffic's, finished now: what was asked
        return SwitchResult(name, SWITCHED, parse_lsn(sides.forward.traffic.position), 0.0, None, [], finished)
    if sides.traffic == SWITCHED:
        raise UsageError(f"workflow {name}: traffic is already switched to the target; "
                         f"`sluicegate movetables reverse-traffic {name}` moves it back")
    _check_no_rules(sides)
    stream = sides.forward.streams[0]
    lag = _check_ready(sides.forward, stream, sides.source_url, "source", max_lag, timeout, SWITCH)
    tables = sides.tables
    rev = reverse_name(name)
    slot = st.object_name("sg", rev)
    epoch = max(_epoch(sides.forward), _epoch(sides.reverse)) + 1
    # A slot or publication of a killed attempt: nothing reads it (no reverse workflow runs).
    with connect(target_url, role="target", autocommit=True) as ctl:
        capture.drop_capture(ctl, slot, slot)
        capture.ensure_publication(ctl, slot, tables)
    fault_point("switch.publication")
    src = connect(sides.source_url, role="source")
    dst = None
    committed = False
    try:
        position, granted = _lock(src, tables, lock_timeout, "source", name)
        fault_point("switch.locked")
        _wait_applied(target_url, stream.id, position, sides.source_url, timeout, "forward", name, SWITCH)
        fault_point("switch.caught_up")
        with connect(target_url, role="target", autocommit=True) as seq_dst:
            sequences = advance_sequences(src, seq_dst, tables)
        fault_point("switch.sequences")
        start = _create_slot(target_url, slot, timeout)
        fault_point("switch.slot")
        st.ensure_schema(src)
        _save_reverse(src, sides, rev, slot, start, epoch, position)
        deny(src, tables, rev, f"writes go to the target {describe(target_url)} since workflow {name} switched "
                               f"traffic there; write to the target, or run `sluicegate movetables "
                               f"reverse-traffic {name}`")
        fault_point("switch.denied")
        # The target's part, held open across the source's commit: a kill before that commit rolls both back.
        if sides.traffic == REVERSED:
            # The target's denials go first: a kill before the source's commit then leaves both sides taking
            # writes (traffic still on the source), never neither.
            with connect(target_url, role="target") as undo, \
                    locks.guard(undo, "dropping the target's write denials",
                                [t.ident.as_string(undo) for t in tables], "ShareRowExclusiveLock"):
                undeny(undo, tables)
        dst = connect(target_url, role="target")
        _target_part_of_switch(dst, sides, epoch, format_lsn(position), commit=False)
        fault_point("switch.before_commit")
        src.commit()
        committed = True
        blocked = time.monotonic() - granted
        fault_point("switch.source_committed")
        dst.commit()
    except BaseException:
        _rollback(src, dst)
        if not committed:  # else the switch happened: status and the next command finish the target's part
            _release(target_url, stream.id, SWITCH)
            with connect(target_url, role="target", autocommit=True) as ctl:
                capture.drop_capture(ctl, slot, slot)  # best effort; the next attempt drops what stays
        raise
    finally:
        src.close()
        if dst is not None:
            dst.close()
    log.info("workflow %s: traffic switched to the target at %s", name, format_lsn(position))
    return SwitchResult(name, SWITCHED, position, blocked, lag, sequences, finished)


def _target_part_of_switch(dst: psycopg.Connection, sides: Sides, epoch: int, position: str,
                           commit: bool = True) -> None:
    stream = sides.forward.streams[0]
    st.lock_stream(dst, stream.id)
    st.set_state(dst, stream.id, st.STOPPED, f"traffic switched to the target at {position}; the reverse "
                                             f"workflow {reverse_name(sides.forward.name)} carries writes back")
    undeny(dst, sides.tables)
    st.set_traffic(dst, sides.forward.name, SWITCHED, epoch, position)
    if commit:
        dst.commit()


def _save_reverse(src: psycopg.Connection, sides: Sides, rev: str, slot: str, start: int, epoch: int,
                  position: int) -> None:
    """The reverse workflow, Running from the slot's start, in the source's transaction."""
    # Foreign keys between the moved tables hold on the source too: a batch may bring a child before its
    # parent, so the reverse applier writes as the forward one does (postgres/table_definition.py).
    options = {"apply_as_replica": True} if (sides.forward.options.get("apply_as_replica")
                                             and may_apply_as_replica(src)) else {}
    if sides.reverse is None:
        st.insert_workflow(src, rev, "MoveTables", strip_password(sides.target_url), options)
        st.add_stream(src, rev, "0", None, slot, sides.tables)
        stream_id = src.execute("SELECT id FROM sluicegate.streams WHERE workflow = %s", (rev,)).fetchone()[0]
        src.execute("UPDATE sluicegate.copy_state SET done = true WHERE stream_id = %s", (stream_id,))
    else:
        stream_id = sides.reverse.streams[0].id
        st.lock_stream(src, stream_id)
        if options:
            st.set_options(src, rev, options)
    st.set_traffic(src, rev, SWITCHED, epoch, format_lsn(position), reverse_of=sides.forward.name)
    src.execute("""UPDATE sluicegate.streams SET state = %s, position = %s::pg_lsn, message = '',
                          caught_up_at = now(), updated_at = now() WHERE id = %s""",
                (st.RUNNING, format_lsn(start), stream_id))


# -- reverse-traffic -------------------------------------------------------------------------------------
def reverse_traffic(name: str, target_url: str, *, lock_timeout: float = 2.0, timeout: float = 30.0,
                    max_lag: float = 30.0) -> SwitchResult:
    """Writes go back to the source; the forward workflow resumes from the source's current position."""
    sides, finished = reconcile(name, target_url)
    if sides.traffic == REVERSED and finished:  # a killed reverse-traffic's, finished now: what was asked
        return SwitchResult(name, REVERSED, parse_lsn(sides.forward.traffic.position), 0.0, None, [], finished)
    if sides.traffic != SWITCHED or sides.reverse is None:
        raise UsageError(f"workflow {name}: traffic is on the source ({sides.traffic}); nothing to reverse")
    rev_stream = sides.reverse.streams[0]
    lag = _check_ready(sides.forward, rev_stream, target_url, "target", max_lag, timeout, REVERSE)
    tables = sides.tables
    epoch = max(_epoch(sides.forward), _epoch(sides.reverse)) + 1
    dst = connect(target_url, role="target")
    src = None
    committed = False
    try:
        position, granted = _lock(dst, tables, lock_timeout, "target", name)
        fault_point("reverse.locked")
        _wait_applied(sides.source_url, rev_stream.id, position, target_url, timeout, "reverse", name, REVERSE)
        fault_point("reverse.caught_up")
        with connect(sides.source_url, role="source", autocommit=True) as seq_src:
            sequences = advance_sequences(dst, seq_src, tables, sides=("target", "source"))
            # Everything on the source before this is applied on the target or is the reverse applier's own.
            resume = capture.wal_insert_position(seq_src)
            seq_src.execute("SELECT pg_current_xact_id()")  # flushed: the forward slot can be confirmed there
        stream = sides.forward.streams[0]
        st.lock_stream(dst, stream.id)
        dst.execute("""UPDATE sluicegate.streams SET state = %s, position = %s::pg_lsn, message = '',
                              updated_at = now() WHERE id = %s""", (st.RUNNING, format_lsn(resume), stream.id))
        deny(dst, tables, name, f"writes go to the source {describe(sides.source_url)} since workflow {name} "
                                f"reversed traffic there; write to the source, or run `sluicegate movetables "
                                f"switch-traffic {name}`")
        st.set_traffic(dst, name, REVERSED, epoch, format_lsn(position))
        src = connect(sides.source_url, role="source")
        _source_part_of_reverse(src, sides, epoch, format_lsn(position), commit=False)
        fault_point("reverse.before_commit")
        dst.commit()
        committed = True
        blocked = time.monotonic() - granted
        fault_point("reverse.target_committed")
        src.commit()
    except BaseException:
        _rollback(dst, src)
        if not committed:
            _release(sides.source_url, rev_stream.id, REVERSE)
        raise
    finally:
        dst.close()
        if src is not None:
            src.close()
    _drop_reverse_capture(sides)
    return SwitchResult(name, REVERSED, position, blocked, lag, sequences, finished)


def _source_part_of_reverse(src: psycopg.Connection, sides: Sides, epoch: int, position: str,
                            commit: bool = True) -> None:
    rev = sides.reverse
    st.lock_stream(src, rev.streams[0].id)
    st.set_state(src, rev.streams[0].id, st.STOPPED, f"traffic reversed to the source at {position} (a position "
                                                     f"of the target)")
    undeny(src, sides.tables)
    st.set_traffic(src, rev.name, REVERSED, epoch)
    if commit:
        src.commit()


def _drop_reverse_capture(sides: Sides) -> None:
    """The stopped reverse stream's slot and publication on the target: a next switch makes them again."""
    slot = st.object_name("sg", reverse_name(sides.forward.name))
    try:
        _wait_reader_gone(sides.target_url, slot)
        with connect(sides.target_url, role="target", autocommit=True) as ctl:
            capture.drop_capture(ctl, slot, slot)
    except Exception as exc:  # noqa: BLE001 - left for complete, cancel or the next switch to drop
        log.warning("could not drop the reverse workflow's slot %s on the target: %s", slot, exc)


def _wait_reader_gone(url: str, slot: str, timeout: float = 10.0) -> None:
    """The driver's task on a stream just Stopped leaves its slot within a batch: let it, so that dropping the
    slot does not cut it off mid-batch (drop_capture ends a reader still there)."""
    deadline = time.monotonic() + timeout
    with connect(url, role="target", autocommit=True) as ctl:
        while (info := capture.slot_info(ctl, slot)) is not None and info.active_pid \
                and time.monotonic() < deadline:
            time.sleep(0.05)


# -- complete and cancel ---------------------------------------------------------------------------------
def complete(name: str, target_url: str, drop_source_tables: bool = False) -> list[str]:
    """After a switch: drop the reverse workflow, the denials, the forward workflow; what was dropped."""
    from .create import delete_workflow

    sides, _ = reconcile(name, target_url)
    if sides.traffic != SWITCHED:
        raise UsageError(f"workflow {name}: traffic is on the source ({sides.traffic}): complete follows "
                         f"`sluicegate movetables switch-traffic {name}`; `movetables cancel {name}` drops the "
                         f"workflow and keeps the source")
    dropped: list[str] = []
    with connect(sides.source_url, role="source") as src:
        st.lock_stream(src, sides.reverse.streams[0].id)
        st.set_state(src, sides.reverse.streams[0].id, st.STOPPED, "completing")
    _wait_reader_gone(target_url, st.object_name("sg", reverse_name(name)))
    dropped += delete_workflow(reverse_name(name), sides.source_url)
    with connect(sides.source_url, role="source") as src:
        dropped += undeny(src, sides.tables)
        if drop_source_tables:
            src.execute(sql.SQL("DROP TABLE {}").format(sql.SQL(", ").join(t.ident for t in sides.tables)))
            dropped += [f"source table {t.qualified}" for t in sides.tables]
        dropped += _drop_empty_schema(src, "source")
    dropped += _delete_forward(name, target_url)
    return dropped


def cancel(name: str, target_url: str, keep_target_tables: bool = False) -> list[str]:
    """Before a switch (or after a reverse): drop everything Sluicegate made; the source stays as it was."""
    with connect(target_url, role="target") as dst:
        kind = st.load_workflow(dst, name).kind
    if kind != "MoveTables":
        raise UsageError(f"workflow {name} is a {kind}: {cancel_command(kind, name)} cancels it")
    sides, _ = reconcile(name, target_url)
    refuse_switched(sides.forward)
    from .create import delete_workflow

    slot = st.object_name("sg", reverse_name(name))
    drop: list[Table] = []
    if not keep_target_tables:  # refused before anything changes
        with connect(target_url, role="target") as dst:
            drop = _droppable(dst, name, target_tables(sides.forward), "the target", ignore_publication=slot)
    dropped: list[str] = []
    if sides.reverse is not None:
        dropped += delete_workflow(reverse_name(name), sides.source_url)
    with connect(target_url, role="target", autocommit=True) as ctl:
        dropped += capture.drop_capture(ctl, slot, slot)  # a killed switch's leftover
    with connect(sides.source_url, role="source") as src:
        dropped += undeny(src, sides.tables)  # none unless a switch was half-undone by hand
        dropped += _drop_empty_schema(src, "source")
    with connect(target_url, role="target") as dst:
        st.lock_stream(dst, sides.forward.streams[0].id)
        st.set_state(dst, sides.forward.streams[0].id, st.STOPPED, "cancelling")
        dropped += undeny(dst, sides.tables)
    dropped += _delete_forward(name, target_url, drop)
    return dropped


def refuse_switched(wf: st.Workflow) -> None:
    if wf.traffic.state == SWITCHED:
        raise UsageError(f"workflow {wf.name}: traffic is switched to the target; cancel would drop the tables "
                         f"that take the writes: `sluicegate movetables reverse-traffic {wf.name}` first, or "
                         f"`movetables complete {wf.name}`")


def _delete_forward(name: str, target_url: str, drop: list[Table] = ()) -> list[str]:
    from .create import delete_workflow

    dropped = delete_workflow(name, target_url)
    with connect(target_url, role="target") as dst:
        dropped += _drop_tables(dst, drop, "")
        dropped += _drop_empty_schema(dst, "target")
    return dropped


# -- cancel of any kind (materialize cancel, reshard cancel, workflow delete --drop-target-tables) ----------
CANCEL_COMMANDS = {"MoveTables": "movetables cancel", "Materialize": "materialize cancel",
                   "Reshard": "reshard cancel"}


def cancel_command(kind: str, name: str) -> str:
    """The command that cancels a workflow of `kind`, for messages."""
    if kind in CANCEL_COMMANDS:
        return f"`sluicegate {CANCEL_COMMANDS[kind]} {name}`"
    return f"`sluicegate workflow delete {name} --drop-target-tables`"


def cancel_workflow(name: str, target_url: str, keep_target_tables: bool = False,
                    kind: str | None = None) -> list[str]:
    """Stop and delete workflow `name` everywhere (every source shard's slot and publication, every target
    shard's state) and drop the tables it writes on its target(s) unless kept; what was dropped. `kind`:
    the kind the command is for (None: any)."""
    from .create import delete_workflow

    shards = load_all(name, target_url)
    wf = shards[0][2]
    if kind is not None and wf.kind != kind:
        raise UsageError(f"workflow {name} is a {wf.kind}, not a {kind}: {cancel_command(wf.kind, name)} "
                         f"cancels it")
    if wf.kind == "MoveTables":
        return cancel(name, target_url, keep_target_tables)
    refuse_switched(wf)
    drop: dict[str, list[Table]] = {}
    if not keep_target_tables:  # every shard checked before anything changes
        for shard, url, w in shards:
            with connect(url, role="target") as dst:
                drop[url] = _droppable(dst, name, target_tables(w), _where(shard))
    for _, url, w in shards:  # a running driver's engines notice within a batch and end
        with connect(url, role="target") as dst:
            for s in w.streams:
                st.lock_stream(dst, s.id)
                st.set_state(dst, s.id, st.STOPPED, "cancelling")
    for _, _, w in shards:
        for s in w.streams:
            _wait_reader_gone(s.source_url or w.source_url, s.slot_name)
    dropped: list[str] = []
    for _, url, _ in shards:
        dropped += delete_workflow(name, url)
    for shard, url, _ in shards:
        with connect(url, role="target") as dst:
            dropped += _drop_tables(dst, drop.get(url, []), shard)
            dropped += _drop_empty_schema(dst, _where(shard)[len("the "):])
    return dropped


def target_tables(wf: st.Workflow) -> list[Table]:
    """The tables `wf` writes on its target, each once: a rule's target table, else the source table's name."""
    tables: dict[str, Table] = {}
    for s in wf.streams:
        for t in s.tables:
            table = Table.from_json(t.rule["target"]) if t.rule is not None else t.table
            tables.setdefault(table.qualified, table)
    return list(tables.values())


def _where(shard: str) -> str:
    return f"the target shard {shard}" if shard else "the target"


def _droppable(conn: psycopg.Connection, name: str, tables: list[Table], where: str,
               ignore_publication: str = "") -> list[Table]:
    """`tables`, once it is clear that dropping them breaks no other workflow: none writes them on this
    target, and no publication here (another workflow's source) reads them. Else an error naming them."""
    names = [t.qualified for t in tables]
    shared = [f"{t} (workflow {w} writes it)" for t, w in st.workflows_writing(conn, names) if w != name]
    shared += [f"{t} (publication {p} reads it)" for t, p in conn.execute(
        """SELECT schemaname || '.' || tablename, pubname FROM pg_publication_tables
           WHERE schemaname || '.' || tablename = ANY(%s) AND pubname <> %s ORDER BY 1, 2""",
        (names, ignore_publication)).fetchall()]
    if shared:
        raise UsageError(f"workflow {name}: not dropping tables on {where} that others use: {'; '.join(shared)}; "
                         f"nothing was changed: keep the tables (--keep-target-tables, or `workflow delete` "
                         f"without --drop-target-tables), or delete the other workflow first")
    return tables


def _drop_tables(conn: psycopg.Connection, tables: list[Table], shard: str) -> list[str]:
    """Drop those of `tables` that exist, in `conn`'s transaction; what was dropped."""
    existing = [t for t in tables
                if conn.execute("SELECT to_regclass(%s)", (t.ident.as_string(conn),)).fetchone()[0]]
    if not existing:
        return []
    conn.execute(sql.SQL("DROP TABLE {}").format(sql.SQL(", ").join(t.ident for t in existing)))
    on = f" on target shard {shard}" if shard else ""
    return [f"target table {t.qualified}{on}" for t in existing]


def _drop_empty_schema(conn: psycopg.Connection, side: str) -> list[str]:
    """Schema sluicegate when no workflow is left in it (`conn`'s transaction commits with the caller's)."""
    if not st.has_schema(conn) or st.list_workflows(conn):
        return []
    # In the order a driver's load_workflow reads them: DROP SCHEMA alone locks in catalog order, and a driver
    # holding workflows while it waits for streams would deadlock with it.
    conn.execute("LOCK TABLE sluicegate.workflows, sluicegate.streams, sluicegate.copy_state IN ACCESS EXCLUSIVE MODE")
    conn.execute("DROP SCHEMA sluicegate CASCADE")
    return [f"schema sluicegate on the {side}"]


# -- steps -----------------------------------------------------------------------------------------------
def _check_no_rules(sides: Sides) -> None:
    ruled = [t.table.qualified for t in sides.forward.streams[0].tables if t.rule is not None]
    if ruled:
        raise UsageError(f"workflow {sides.forward.name} writes {', '.join(ruled)} through rules: the target "
                         f"rows are not the source's, and no reverse workflow can carry them back")


def _check_ready(forward: st.Workflow, stream: st.Stream, source_url: str, side: str, max_lag: float,
                 timeout: float, reason: str) -> float:
    """The stream that must catch up is Running, driven, and close behind; its lag (the source's clock). A
    stream a killed run of this command left held counts as Running: this run takes it over."""
    if stream.state != st.RUNNING and not (stream.state == st.STOPPED and stream.stop_reason == reason):
        raise UsageError(f"workflow {stream.workflow}: its stream is {stream.state}"
                         f"{': ' + stream.message if stream.message else ''}; traffic switches only while it is "
                         f"Running (copy finished, `sluicegate workflow run {forward.name}` running)")
    if not is_running(forward.driver):
        raise UsageError(f"workflow {forward.name}: no driver running, so nothing would catch up; start "
                         f"`sluicegate workflow run {forward.name}` first")
    if stream.caught_up_at is None:
        raise UsageError(f"workflow {stream.workflow} has not caught up with its {side} yet; try again once "
                         f"`sluicegate workflow status {forward.name}` shows a lag")
    with connect(source_url, role=side, autocommit=True) as conn:
        lag = max(0.0, (conn.execute("SELECT now()").fetchone()[0] - stream.caught_up_at).total_seconds())
    if lag > min(max_lag, timeout):
        raise UsageError(f"workflow {stream.workflow} lags {lag:.1f} s behind its {side} (over "
                         f"{min(max_lag, timeout):g} s): writes would stay blocked while it catches up; try "
                         f"again when the lag is small")
    return lag


def _lock(conn: psycopg.Connection, tables: list[Table], lock_timeout: float, side: str,
          name: str) -> tuple[int, float]:
    """Lock `tables` in EXCLUSIVE mode in `conn`'s transaction (reads go on, writes wait); (the side's WAL
    position once every earlier writer has committed, when the lock was granted). On a timeout: rolled back,
    and an error that names the blocking sessions."""
    conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(lock_timeout * 1000)}ms",))
    try:
        conn.execute(sql.SQL("LOCK TABLE {} IN EXCLUSIVE MODE").format(sql.SQL(", ").join(t.ident for t in tables)))
    except psycopg.errors.LockNotAvailable:
        conn.rollback()
        blockers = locks.describe_holders(conn, [t.ident.as_string(conn) for t in tables], "ExclusiveLock")
        conn.rollback()
        raise RetryableError(f"workflow {name}: the moved tables could not be locked on the {side} within "
                             f"{lock_timeout:g} s{blockers}; nothing was changed, the {side} takes writes as "
                             f"before; end that session's transaction (or wait for it) and try again") from None
    granted = time.monotonic()
    conn.execute("SELECT set_config('lock_timeout', '0', true)")
    # The insert position, not the flushed one: an asynchronous commit's record may not be flushed yet.
    return capture.wal_insert_position(conn), granted


def _wait_applied(state_url: str, stream_id: int, position: int, source_url: str, timeout: float,
                  which: str, name: str, reason: str) -> None:
    """Until the stream (its row on `state_url`) has applied everything before `position` of its source, and
    stopped there: its durable stop (stream_control.py). The caller releases it if the switch does not
    happen."""
    with connect(source_url, role="source", autocommit=True) as src:
        # Decoding reads flushed WAL only: a committed transaction of nothing flushes everything before it.
        src.execute("SELECT pg_current_xact_id()")
    stream_control.stop_when_past(state_url, stream_id, position, reason)
    try:
        stream_control.wait_stopped(state_url, stream_id, position, reason, threading.Event(), timeout=timeout,
                                    at_least=True)
    except RetryableError as exc:
        raise RetryableError(f"workflow {name}: the {which} stream did not stop at {format_lsn(position)}: {exc}; "
                             f"nothing was changed; check `sluicegate workflow status {name}` and try again, or "
                             f"give a longer --timeout") from None


def _release(state_url: str, stream_id: int, reason: str) -> None:
    """Best effort, after a failed switch: the stream goes on (a killed command's hold lapses instead)."""
    try:
        stream_control.release(state_url, stream_id, reason)
    except Exception:  # noqa: BLE001 - the side may be what failed
        log.warning("could not release stream %s after %s; its driver does after %g s", stream_id, reason,
                    stream_control.hold_seconds())


def _create_slot(url: str, slot: str, timeout: float) -> int:
    """The reverse stream's slot, on an autocommit connection (its snapshot waits for the side's running
    transactions: bounded by `timeout`); its start position."""
    with connect(url, role="target", autocommit=True) as conn:
        conn.execute("SELECT set_config('statement_timeout', %s, false)", (f"{int(timeout * 1000)}ms",))
        try:
            return capture.create_slot(conn, slot)
        except psycopg.errors.QueryCanceled:
            raise RetryableError(f"creating replication slot {slot} on the target waited {timeout:g} s for its "
                                 f"running transactions{locks.describe_transactions(conn)}; nothing was changed; "
                                 f"try again") from None


def _rollback(*conns) -> None:
    for conn in conns:
        if conn is None or conn.closed:
            continue
        try:
            conn.rollback()
        except psycopg.Error:
            log.debug("rollback failed (the connection is gone: the server rolls back)")


# -- status ----------------------------------------------------------------------------------------------
def traffic_status(wf: st.Workflow, target_url: str) -> dict:
    """`traffic` for `workflow status`: source, switched or reversed; when switched, the reverse stream."""
    out: dict = {"state": wf.traffic.state}
    if wf.kind != "MoveTables" or out["state"] == SOURCE and wf.traffic.epoch is None:
        return out
    try:
        with connect(wf.source_url, role="source", autocommit=True, connect_timeout=3) as src:
            reverse = _load_reverse(src, wf.name)
            now = src.execute("SELECT now()").fetchone()[0]
    except Exception as exc:  # noqa: BLE001 - status goes on without the source
        out["error"] = str(exc)
        return out
    if reverse is not None and _epoch(reverse) != _epoch(wf):
        out["interrupted"] = (f"a traffic command was interrupted; run `sluicegate movetables "
                              f"{'switch' if _epoch(reverse) > _epoch(wf) else 'reverse'}-traffic {wf.name}` "
                              f"again to finish it")
    if reverse is not None and reverse.streams:
        s = reverse.streams[0]
        lag = None
        if s.state == st.RUNNING and s.caught_up_at is not None:
            lag = round(max(0.0, (now - s.caught_up_at).total_seconds()), 3)
        out["reverse"] = {"workflow": reverse.name, "state": s.state, "message": s.message,
                          "position": format_lsn(s.position) if s.position is not None else None,
                          "lag_seconds": lag, "slot": s.slot_name}
    return out

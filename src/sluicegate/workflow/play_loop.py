"""One play loop for every target and batch source (VReplication's vplayer).

Each turn, at a batch boundary:
  1. the sink reads its stream's durable control (state, position, stop position and reason) and says whether
     the task may go on: a stream that moved, or left the state the task plays in, ends the task;
  2. the durable stop (stream_control.py): at it, the sink marks the stream Stopped and the task returns; below
     it, the batch ends there (a vdiff's point, a traffic switch);
  3. a batch is read and applied by the sink: from the replication socket (postgres/slot_reader.py), in the
     Spark task that runs the loop, or, through Spark SQL rules, by a Spark job a batch that peeks the slot,
     applies and records (the loop then runs on the driver);
  4. the sink records the batch's end position with its rows (or, when nothing came, now and then as a
     heartbeat), and the slot is confirmed up to what the sink says is durable on the target;
  5. the task returns at its own stop, caught up (catchup), at the durable stop, or at its deadline.

The sinks: the PostgreSQL target's commits rows and position in one transaction under the stream's row lock
(workflow/player.py); the Delta target's commits each table, then its state document (targets/delta/player.py);
through rules, workflow/rule_player.py and targets/delta/rule_player.py.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ..errors import RetryableError
from ..postgres import capture, slot_reader
from ..postgres.assembler import Framing
from ..postgres.relation_changes import SchemaStop
from ..postgres.replication import ChangeStream
from . import stream_control


@dataclass
class PlayResult:
    position: int
    batches: int = 0
    transactions: int = 0
    rows: int = 0
    caught_up: bool = False
    interrupted: str = ""  # why it returned early: the stream's state or position moved


@dataclass
class Batch:
    """What a sink's apply() returns, at the least (a sink may return its own object with these fields)."""

    position: int
    limited: bool = False
    rows: int = 0
    transactions: int = 0
    wrote: bool = False  # something to record even if the position stayed (a job that committed it, say)
    ends: str = ""  # why the task returns after this batch


@dataclass(frozen=True)
class Limits:
    """When a task's loop returns (besides its stream's control)."""

    stop_at: int | None = None  # play to exactly here, then return (a fast-forward's point, a stream's own stop)
    caught_up: bool = False  # return once a batch found nothing more to read (catchup)
    max_seconds: float = float("inf")
    heartbeat_seconds: float = 1.0  # a position recorded at least this often while the source is quiet


class Sink:
    """A target's side of the loop. Each method runs at a batch boundary of the loop's single thread."""

    def control(self, position: int) -> tuple[object, str]:
        """The stream's control (state, position, stop_position, stop_reason), and why the task must return now
        ('' to go on). The PostgreSQL sink takes the stream's row lock, held until record() or leave()."""
        raise NotImplementedError

    def leave(self) -> None:
        """The turn ends without a batch: give back what control() took."""

    def stop_here(self, control, position: int) -> str:
        """The durable stop is reached at `position`: mark the stream Stopped (the controller reads it); the
        stream's message."""
        raise NotImplementedError

    def wait_before(self, stop_at: int | None) -> float:
        """Seconds to wait before the next batch (the Delta sink spaces its commits); 0: none."""
        return 0.0

    def apply(self, stream: ChangeStream, framing: Framing, position: int, flushed: int, stop_at: int | None):
        """Read a batch (slot_reader.BatchReader) and apply it, not yet recorded: an object with `position`,
        `limited`, `rows`, `transactions`, `wrote` (something to record even if the position stayed) and `ends`
        (why the task returns after it; '')."""
        raise NotImplementedError

    def abandon(self) -> None:
        """apply() stopped for a schema change: nothing of the batch may stay."""

    def replay_before(self, position: int, before: int, stop_at: int | None) -> None:
        """A schema change stops the stream in the transaction committing at `before`: apply what comes before
        it (its own play, on a fresh stream), so that the stream stops exactly there."""

    def record(self, batch, control, stop_at: int | None, stopping: bool, source_now) -> int | None:
        """Record the batch's end position with its rows (`stopping`: and Stopped, at the durable stop); the
        position the slot may be confirmed to now, or None."""
        raise NotImplementedError

    def keep(self) -> int | None:
        """Nothing to record this turn; a position the slot may be confirmed to now (a standby caught up)."""
        return None


def run(sink: Sink, stream: ChangeStream, src_ctl, slot: str, way_out: str, position: int, limits: Limits,
        stop: threading.Event | None = None) -> PlayResult:
    """Batches from `position` until `limits` or the stream's control say so (`stop`: between batches).
    `stream`: the batch source the sink reads (a ChangeStream, or what stands for a peeked slot: `confirm`
    and `close`)."""
    result = PlayResult(position)
    deadline = time.monotonic() + limits.max_seconds
    framing = Framing()  # Relation messages of this stream's decoding session
    last_write = 0.0
    while True:
        if limits.stop_at is not None and result.position < limits.stop_at:
            slot_reader.wait_flushed(src_ctl, limits.stop_at)
        control, why = sink.control(result.position)
        if why:
            sink.leave()
            result.interrupted = why
            return result
        # The durable stop before the task's own: a vdiff's point may be the very position a fast-forward ends at.
        action = stream_control.decide(result.position, control.stop_position, control.stop_reason)
        if action is stream_control.Action.STOP:
            result.interrupted = sink.stop_here(control, result.position)
            return result
        if limits.stop_at is not None and result.position >= limits.stop_at:
            sink.leave()
            result.caught_up = True
            return result
        if stop is not None and stop.is_set():
            sink.leave()
            result.interrupted = "stopping"
            return result
        stop_at = limits.stop_at
        if action is stream_control.Action.PLAY_TO and (stop_at is None or control.stop_position < stop_at):
            stop_at = control.stop_position
            slot_reader.wait_flushed(src_ctl, stop_at)
        if (wait := sink.wait_before(stop_at)) > 0:
            sink.leave()
            if time.monotonic() >= deadline:
                return result
            # (in short sleeps: the next turn reads the control again, so a stop or a hold is served within one)
            time.sleep(min(1.0, wait))
            continue
        flushed, source_now = capture.wal_flush_position(src_ctl)
        try:
            batch = sink.apply(stream, framing, result.position, flushed, stop_at)
        except SchemaStop as exc:
            # What came before the transaction that met it is applied (the target is then made to match from
            # a clean point), nothing of it.
            sink.abandon()
            if exc.before is not None and exc.before > result.position:
                stream.close()
                sink.replay_before(result.position, exc.before, stop_at)
            raise
        except RetryableError:
            # The stream broke: the slot may be gone or invalidated — say so with the way out, never skip.
            capture.check_slot(src_ctl, slot, result.position, way_out)
            raise
        result.batches += 1
        result.transactions += batch.transactions
        result.rows += batch.rows
        stopping = bool(control.stop_reason) and control.stop_position is not None \
            and batch.position >= control.stop_position
        now = time.monotonic()
        if batch.position > result.position or batch.wrote or now - last_write >= limits.heartbeat_seconds:
            ready = sink.record(batch, control, stop_at, stopping, source_now)
            last_write = now
        else:
            ready = sink.keep()
        if ready is not None:
            stream.confirm(ready)
        result.position = batch.position
        if stopping:
            result.interrupted = stream_control.stopped_message(control.stop_position, control.stop_reason)
            return result
        if batch.ends:
            result.interrupted = batch.ends
            return result
        if limits.caught_up and not batch.limited:
            result.caught_up = True
            return result
        if time.monotonic() >= deadline:
            return result

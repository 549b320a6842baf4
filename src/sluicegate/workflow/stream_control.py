"""Durable stream control: "stop the stream at position P", one way for every controller.

As Vitess's vplayer stops itself at its stream's durable `stop_pos` and never knows who asked, a player here
reads two fields of its stream's row with every batch (`streams.stop_position`, `streams.stop_reason`):
  reason, no position   a hold: the player stops at its next batch boundary
  reason, position P    the player applies exactly up to P (a batch ends there), then stops
and "stops" means it writes Stopped itself, keeping both fields, in the transaction of its last position: the
controller then reads a final position. A controller (a vdiff taking its consistent point) releases the stream
when done: both fields cleared, Running again, only if the reason is still its own — any explicit state change
(`workflow stop`, `workflow start`) clears them, and the newest word wins.

The controller's protocol for a consistent point (vdiff/differ.py):
  1. hold(): Stopped at once. The UPDATE waits for the row lock that every batch holds until it commits, so
     when it returns no batch is in flight and the position A is final;
  2. the source's snapshot at P >= A (decoding reads only flushed WAL, and P is the insert position);
  3. stop_at(P): Running with P; the driver's loop plays on to exactly P and stops (with no driver, the
     controller plays it itself through the same player);
  4. wait_stopped(): Stopped at P; 5. the target's snapshot; 6. release().
A driver whose stream is Stopped with a reason waits for the release instead of exiting; a hold whose
controller died is released by the driver after HOLD_SECONDS (`lapsed`).
"""

from __future__ import annotations

import logging
import threading
import time
from enum import Enum

import psycopg

from .. import config
from ..errors import RetryableError
from ..position import format_lsn
from ..postgres.connect import connect
from . import state as st

log = logging.getLogger("sluicegate")


class Action(Enum):
    PLAY = "play"  # no control: play as the task says
    PLAY_TO = "play_to"  # play, but no further than the stop position
    STOP = "stop"  # write Stopped and return


def decide(position: int | None, stop_position: int | None, stop_reason: str) -> Action:
    """What a player at `position` does under its stream's durable stop (pure)."""
    if not stop_reason:
        return Action.PLAY
    if stop_position is None or (position is not None and position >= stop_position):
        return Action.STOP
    return Action.PLAY_TO


def stopped_message(stop_position: int | None, reason: str) -> str:
    where = f"at {format_lsn(stop_position)} " if stop_position is not None else ""
    return f"stopped {where}for {reason}"


def hold_seconds() -> float:
    return config.from_env("stream_hold_seconds")


def mark_stopped(conn: psycopg.Connection, stream_id: int, control: st.Control) -> None:
    """The player's own stop, in its transaction (the stream row is locked): both fields stay for the
    controller to see."""
    conn.execute("UPDATE sluicegate.streams SET state = %s, message = %s, updated_at = now() WHERE id = %s",
                 (st.STOPPED, stopped_message(control.stop_position, control.stop_reason)[:2000], stream_id))


# -- the controller's side ------------------------------------------------------------------------------------


def hold(target_url: str, stream_id: int, reason: str) -> int | None:
    """Stop a Running stream now; its (final) position. Raises RetryableError when it is not Running (a
    user's stop or start, or another controller's stop, came first)."""
    with connect(target_url, role="target") as conn:
        control = st.lock_stream_control(conn, stream_id)  # waits for the batch in flight to commit
        if control.state != st.RUNNING or control.stop_reason:
            raise RetryableError(f"stream {stream_id} is {control.state}"
                                 + (f" ({control.stop_reason})" if control.stop_reason else "")
                                 + f"; {reason} tries again")
        conn.execute("""UPDATE sluicegate.streams SET state = %s, stop_position = NULL, stop_reason = %s,
                          message = %s, updated_at = now() WHERE id = %s""",
                     (st.STOPPED, reason, stopped_message(None, reason), stream_id))
        return control.position


def stop_at(target_url: str, stream_id: int, position: int, reason: str) -> None:
    """Running again, to stop at exactly `position`; refused (RetryableError) if the hold is no longer ours."""
    with connect(target_url, role="target") as conn:
        cur = conn.execute("""UPDATE sluicegate.streams SET state = %s, stop_position = %s::pg_lsn, message = '',
                                updated_at = now()
                              WHERE id = %s AND state = %s AND stop_reason = %s""",
                           (st.RUNNING, format_lsn(position), stream_id, st.STOPPED, reason))
        if cur.rowcount != 1:
            raise RetryableError(f"stream {stream_id}: the hold for {reason} was taken away (a user's stop or "
                                 f"start, or the driver released a lapsed hold)")


def stop_when_past(state_url: str, stream_id: int, position: int, reason: str) -> None:
    """Stop a Running stream once it has applied everything before `position` (one already past it stops at
    once) — a traffic switch's: the moved tables are locked, so nothing between `position` and where it stops
    touches them. A hold left by a killed run of the same controller is taken over; another's is refused."""
    with connect(state_url, role="target") as conn:
        control = st.lock_stream_control(conn, stream_id)
        ours = control.stop_reason == reason
        if not (control.state == st.RUNNING and not control.stop_reason or ours and control.state in (
                st.RUNNING, st.STOPPED)):
            raise RetryableError(f"stream {stream_id} is {control.state}"
                                 + (f", held for {control.stop_reason}" if control.stop_reason else "")
                                 + f"; {reason} cannot stop it now: try again")
        conn.execute("""UPDATE sluicegate.streams SET state = %s, stop_position = %s::pg_lsn, stop_reason = %s,
                          updated_at = now() WHERE id = %s""",
                     (st.RUNNING, format_lsn(position), reason, stream_id))


def wait_stopped(state_url: str, stream_id: int, position: int, reason: str, stop: threading.Event, *,
                 timeout: float = float("inf"), at_least: bool = False, poll: float = 0.02) -> int:
    """Until the player has stopped the stream at `position` (`at_least`: at or past it) for `reason`; where
    it stopped. Raises RetryableError when the control was taken away, the stream stopped elsewhere, or
    `timeout` seconds passed."""
    deadline = time.monotonic() + timeout
    with connect(state_url, role="target", autocommit=True) as conn:
        while not stop.is_set():
            control = st.lock_stream_control(conn, stream_id)
            if control.stop_reason != reason or control.state not in (st.RUNNING, st.STOPPED):
                raise RetryableError(f"stream {stream_id} is {control.state} ({control.stop_reason or 'no stop'})"
                                     f" while {reason} waited for it at {format_lsn(position)}")
            if control.state == st.STOPPED:
                if control.position == position or at_least and control.position > position:
                    return control.position
                raise RetryableError(f"stream {stream_id} stopped at {format_lsn(control.position)}, not at "
                                     f"{format_lsn(position)}, for {reason}")
            if time.monotonic() > deadline:
                raise RetryableError(f"stream {stream_id} did not reach {format_lsn(position)} within {timeout:g} s "
                                     f"(it is at {format_lsn(control.position) if control.position else 'none'})")
            stop.wait(poll)
    raise RetryableError(f"interrupted while stream {stream_id} played to {format_lsn(position)} for {reason}")


def release(target_url: str, stream_id: int, reason: str) -> bool:
    """Running again with no stop, if the stream is still under `reason`'s control; whether it was."""
    with connect(target_url, role="target") as conn:
        cur = conn.execute("""UPDATE sluicegate.streams SET state = %s, stop_position = NULL, stop_reason = '',
                                message = '', updated_at = now()
                              WHERE id = %s AND stop_reason = %s AND state IN (%s, %s)""",
                           (st.RUNNING, stream_id, reason, st.RUNNING, st.STOPPED))
        return cur.rowcount == 1


def lapsed(conn: psycopg.Connection, stream_id: int, seconds: float) -> bool:
    """The driver's side: release a stream held Stopped by a controller for longer than `seconds` (its
    controller died: a killed vdiff); whether it did. In the caller's transaction."""
    cur = conn.execute("""UPDATE sluicegate.streams SET state = %s, stop_position = NULL, stop_reason = '',
                            message = '', updated_at = now()
                          WHERE id = %s AND state = %s AND stop_reason <> ''
                            AND updated_at < now() - make_interval(secs => %s)""",
                       (st.RUNNING, stream_id, st.STOPPED, seconds))
    return cur.rowcount == 1


def wait_released(target_url: str, stream_id: int, stop: threading.Event, poll: float = 0.02) -> None:
    """The driver's loop, its stream held by a controller: until the stream is no longer Stopped under a
    reason, or its hold lapsed (released here, with a warning)."""
    seconds = hold_seconds()
    deadline = time.monotonic() + seconds
    while not stop.is_set():
        with connect(target_url, role="target") as conn:
            control = st.lock_stream_control(conn, stream_id)
            if control.state != st.STOPPED or not control.stop_reason:
                return
            if time.monotonic() >= deadline and lapsed(conn, stream_id, seconds):
                conn.commit()
                log.warning("stream %s was held for %s longer than %g s: released (its controller is gone?)",
                            stream_id, control.stop_reason, seconds)
                return
        stop.wait(poll)

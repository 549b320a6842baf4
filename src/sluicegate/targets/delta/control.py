"""Durable stream control of a Delta workflow: the player stops itself at a position its state names.

Two fields of the state document (LakeWorkflow.stop_position, stop_reason), the same semantics as a
PostgreSQL target's streams (the Vitess vplayer's `stop_pos`: the player never knows who asked):
  reason set, position None    a hold: the player stops at its next batch boundary
  reason set, position P       the player plays to exactly P (a batch ends there) and stops
"Stops": the player writes state Stopped ("stopped at P for <reason>"), keeping both fields, in the update of
its last position; that position is then final. The controller (a vdiff) releases the stream when done: both
fields cleared, the state back to what it was, only while the reason is still its own (a user's `workflow
stop`/`start` in between wins). A driver that finds its stream Stopped with a reason waits for the release;
one stopped for longer than the hold lapse (a dead controller's) it releases itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import RetryableError
from ...workflow import stream_control
from .state import RUNNING, STOPPED, update_retrying

PLAY, PLAY_TO, STOP, IDLE = "play", "play to", "stop", "idle"
# The fields a controller's decision reads: a concurrent change to one of them makes DeltaStore's update
# retry on the fresh document instead of merging over it.
FIELDS = (("state",), ("stop_position",), ("stop_reason",), ("position",))


@dataclass(frozen=True)
class Decision:
    action: str  # PLAY (as usual), PLAY_TO `position`, STOP here, IDLE (stopped already: play nothing)
    position: int | None = None


def decide(state: str, stop_position: int | None, stop_reason: str, position: int) -> Decision:
    """What a player at a batch boundary at `position` does, given its stream's durable control fields: a
    PostgreSQL stream's decision (workflow/stream_control.py), and IDLE once it is stopped already."""
    if stop_reason and state != RUNNING:  # stopped already (or in Error: nothing to play either way)
        return Decision(IDLE)
    action = stream_control.decide(position, stop_position, stop_reason)
    if action is stream_control.Action.PLAY:
        return Decision(PLAY)
    if action is stream_control.Action.STOP:  # a hold, or at P (past it: against the protocol, and the
        return Decision(STOP, position)       # controller finds it is not its P)
    return Decision(PLAY_TO, stop_position)


stopped_message = stream_control.stopped_message


def hold(store, name: str, reason: str, state: str | None = None) -> None:
    """Ask for a hold (and, with `state`, set it: a controller with no driver marks Stopped itself). Refused
    while another controller holds the stream."""
    def change(w) -> None:
        if w.stop_reason and w.stop_reason != reason:
            raise RetryableError(f"workflow {name} is held by {w.stop_reason}; run again once it is released")
        w.stop_reason, w.stop_position = reason, None
        if state is not None:
            w.state = state
            if state == STOPPED:
                w.message = stopped_message(w.position, reason)

    update_retrying(store, name, change, depends=FIELDS)


def play_to(store, name: str, reason: str, position: int) -> None:
    """Step 4 of the protocol: the stream plays on to `position` (Running) and stops there."""
    def change(w) -> None:
        if w.stop_reason != reason:
            raise RetryableError(f"workflow {name}: the vdiff's hold ({reason}) was released under it "
                                 f"(state {w.state}: {w.message or 'no message'}); run it again")
        w.stop_position, w.state, w.message = position, RUNNING, ""

    update_retrying(store, name, change, depends=FIELDS)


def release(store, name: str, reason: str, state: str = RUNNING, message: str = "") -> bool:
    """Clear the fields and put the state back, if the stream is still held for `reason`; False if not."""
    released = []

    def change(w) -> None:
        released.clear()
        if w.stop_reason != reason:
            return
        w.stop_reason, w.stop_position = "", None
        if w.state in (RUNNING, STOPPED):  # (an Error the player met meanwhile stays)
            w.state, w.message = state, message
        released.append(True)

    update_retrying(store, name, change, depends=FIELDS)
    return bool(released)

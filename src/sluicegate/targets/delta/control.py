"""Durable stream control of a Delta workflow: workflow/stream_control.py's two fields and protocol, kept in the
state document (LakeWorkflow.stop_position, stop_reason); the player stops itself, writing state Stopped in the
update of its last position, and the controller (a vdiff) puts the state back as it was when it releases.
"""

from __future__ import annotations

from ...errors import RetryableError
from ...workflow import stream_control
from .state import RUNNING, STOPPED, update_retrying

# The fields a controller's decision reads: a concurrent change to one of them makes DeltaStore's update
# retry on the fresh document instead of merging over it.
FIELDS = (("state",), ("stop_position",), ("stop_reason",), ("position",))


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

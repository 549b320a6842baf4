"""The player's decision under its stream's durable stop (workflow/stream_control.py): pure, no server."""

from __future__ import annotations

import pytest

from sluicegate.workflow.stream_control import Action, decide, stopped_message


@pytest.mark.parametrize("position, stop_position, reason, expected", [
    (100, None, "", Action.PLAY),  # no control
    (100, 500, "", Action.PLAY),  # a position without a reason is no control (cleared together)
    (100, None, "vdiff 3", Action.STOP),  # a hold: stop at the next batch boundary
    (100, 500, "vdiff 3", Action.PLAY_TO),  # below the stop: play, no further than it
    (500, 500, "vdiff 3", Action.STOP),  # at it
    (600, 500, "vdiff 3", Action.STOP),  # past it (a controller that asked too late): stop, it will see
    (None, 500, "vdiff 3", Action.PLAY_TO),
])
def test_decide(position, stop_position, reason, expected):
    assert decide(position, stop_position, reason) is expected


def test_stopped_message_names_the_point_and_the_reason():
    assert stopped_message(0x1_0000_0010, "vdiff 7") == "stopped at 1/10 for vdiff 7"
    assert stopped_message(None, "vdiff 7") == "stopped for vdiff 7"

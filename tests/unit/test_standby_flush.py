"""The target-failover gate's queue (postgres/standby_flush.py): what is released for a standby flush position."""

from collections import deque

from sluicegate.postgres.standby_flush import MAX_PENDING, push, take


def test_the_newest_position_the_standbys_have_is_released():
    pending = deque()
    for target_lsn, position in ((100, 10), (200, 20), (300, 30)):
        pending = push(pending, target_lsn, position)
    assert take(pending, 99) is None and len(pending) == 3
    assert take(pending, 250) == 20  # 10 and 20: the newest is confirmed
    assert list(pending) == [(300, 30)]
    assert take(pending, 300) == 30 and not pending


def test_a_position_not_past_the_newest_adds_nothing():
    pending = push(deque([(100, 10)]), 200, 10)
    assert list(pending) == [(100, 10)]


def test_a_long_queue_is_thinned_never_releasing_early():
    pending = deque()
    for i in range(1, 3 * MAX_PENDING):
        pending = push(pending, 100 * i, i)
    assert len(pending) <= MAX_PENDING
    assert pending[-1] == (100 * (3 * MAX_PENDING - 1), 3 * MAX_PENDING - 1)  # the newest is always kept
    # every pair left is one that was pushed: a position is never released before its commit is flushed
    assert all(lsn == 100 * pos for lsn, pos in pending)
    assert take(pending, 100 * (MAX_PENDING + 5)) <= MAX_PENDING + 5


def test_the_note_is_said_once_and_cleared_once():
    from sluicegate.postgres.standby_flush import StandbyGate

    gate = StandbyGate(True)
    assert gate.note_changed() is None  # nothing to say yet
    gate.note = "waits"
    assert gate.note_changed() == "waits" and gate.note_changed() is None
    gate.note = ""
    assert gate.note_changed() == "" and gate.note_changed() is None

"""Where a batch read from the slot ends (postgres/slot_reader.py BatchReader), the rule both socket players use:
each case is the batch's start and stop, the transactions the stream sends, how the read ended and what the
server says it sent, beside the position and 'limited' expected. No server."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

import pytest

from sluicegate.postgres.pgoutput import Begin, Commit
from sluicegate.postgres.slot_reader import BatchEnd, BatchReader

T = datetime(2026, 1, 1, tzinfo=timezone.utc)


@dataclass
class _Stream:
    ended_by: str
    sent_upto: int


def _events(commits: list[tuple[int, int]]):
    """(commit record start, its end) of each transaction, as Begin … Commit."""
    for start, end in commits:
        yield Begin(start, T, 1)
        yield Commit(0, start, end, T)


CASES = [
    # start, stop_at, transactions (commit start, end), ended_by, sent_upto, cut  ->  position, limited
    ("caught up: the server sent up to 900", 100, None, [(200, 210), (300, 310)], "reached", 900, False, 900, False),
    ("caught up, nothing sent", 100, None, [], "reached", 100, False, 100, False),
    ("full: ends at the last commit read", 100, None, [(200, 210), (300, 310)], "count", 900, False, 310, True),
    ("timed out before any commit", 100, None, [], "time", 900, False, 100, True),
    ("idle socket: not caught up", 100, None, [(200, 210)], "idle", 900, False, 210, True),
    ("a stop: the transaction at it is not read", 100, 300, [(200, 210), (300, 310)], "count", 900, False, 300,
     False),
    ("sent past the stop: at the stop", 100, 300, [(200, 210)], "idle", 350, False, 300, True),
    ("sent short of the stop", 100, 300, [(200, 210)], "reached", 250, False, 250, False),
    ("cut after a commit", 100, None, [(200, 210), (300, 310)], "reached", 900, True, 310, True),
    ("earlier transactions count to the end", 500, None, [(200, 210)], "count", 900, False, 500, True),
]


@pytest.mark.parametrize(("start", "stop_at", "commits", "ended_by", "sent", "cut", "position", "limited"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_batch_end(start, stop_at, commits, ended_by, sent, cut, position, limited):
    reader = BatchReader(_Stream(ended_by, sent), start, stop_at)
    read = list(reader.events(_events(commits)))
    assert all(ev.final_lsn < stop_at for ev in read if isinstance(ev, Begin)) if stop_at else True
    assert reader.end(cut=cut) == BatchEnd(position, limited)


def test_earlier_transactions_are_marked():
    reader = BatchReader(_Stream("reached", 900), 250)
    seen = [(ev.final_lsn, reader.earlier) for ev in reader.events(_events([(200, 210), (300, 310)]))
            if isinstance(ev, Begin)]
    assert seen == [(200, True), (300, False)]

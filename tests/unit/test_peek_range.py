"""peek.in_range: which of a peek's messages a batch [start, end) keeps, read from their bytes before decoding
(pgoutput.begin_final_lsn). No server."""

from __future__ import annotations

import struct

from sluicegate.postgres import peek


def _begin(final_lsn: int) -> bytes:
    return b"B" + struct.pack(">QqI", final_lsn, 0, 7)


def _commit(end_lsn: int) -> bytes:
    return b"C" + struct.pack(">BQQq", 0, end_lsn - 16, end_lsn, 0)


def test_keeps_the_transactions_committing_in_the_range_and_every_relation():
    rows = [(1, _begin(100)), (2, b"Ia"), (3, _commit(116)),  # before the range
            (4, b"Rrel"),  # a table's description: always, a later transaction may need it
            (5, _begin(200)), (6, b"Ib"), (7, _commit(216)),  # in it
            (8, _begin(300)), (9, b"Ic"), (10, _commit(316))]  # at its end: the next batch's
    assert list(peek.in_range(iter(rows), 150, 300)) == [(4, b"Rrel"), (5, _begin(200)), (6, b"Ib"),
                                                          (7, _commit(216))]
    assert [lsn for lsn, _ in peek.in_range(iter(rows), 100, 101)] == [1, 2, 3, 4]

"""Last-writer-wins rules as a pure function (appliers/lww.decide), and the staging COPY lines."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from sluicegate.appliers.lww import NOTHING, ROW, TOMBSTONE, Incoming, copy_lines, decide

T = datetime(2026, 1, 1, tzinfo=timezone.utc)
EARLIER = datetime(2025, 12, 31, tzinfo=timezone.utc)
LATER = datetime(2026, 1, 2, tzinfo=timezone.utc)


@pytest.mark.parametrize(("local", "remote", "win"), [
    ((EARLIER, 1), (T, 2), True),   # newer remote wins
    ((LATER, 1), (T, 2), False),    # older remote loses
    ((T, 1), (T, 2), True),         # a tie goes to the higher cluster id...
    ((T, 2), (T, 1), False),        # ...on both sides
    ((LATER, 1), (T, 3), False),    # time first, cluster id only on a tie
])
def test_greater_time_then_cluster_wins(local, remote, win):
    assert decide("U", ROW, local, remote)[0] is win


def test_both_sides_pick_the_same_winner():
    a, b = (T, 1), (T, 2)
    # side A holds a, receives b; side B holds b, receives a: both keep b
    assert decide("U", ROW, a, b) == (True, "update_exists")
    assert decide("U", ROW, b, a) == (False, "update_exists")


@pytest.mark.parametrize(("op", "found", "local", "remote", "expected"), [
    ("I", NOTHING, None, (T, 2), (True, None)),                      # plain insert
    ("U", NOTHING, None, (T, 2), (True, "update_missing")),
    ("D", NOTHING, None, (T, 2), (True, "delete_missing")),           # leaves a tombstone
    ("U", ROW, (EARLIER, 2), (T, 2), (True, None)),                   # the same peer's earlier version
    ("U", ROW, (T, 2), (T, 2), (True, None)),                         # ...whatever the times: its stream is
    ("D", ROW, (LATER, 2), (T, 2), (True, None)),                     # in its commit order
    ("U", ROW, (EARLIER, 1), (T, 2), (True, "update_exists")),        # another cluster's version
    ("I", ROW, (EARLIER, 1), (T, 2), (True, "insert_exists")),
    ("D", ROW, (LATER, 1), (T, 2), (False, "delete_exists")),
    ("U", TOMBSTONE, (EARLIER, 1), (T, 2), (True, "update_deleted")),  # newer update: the row comes back
    ("U", TOMBSTONE, (LATER, 1), (T, 2), (False, "update_deleted")),   # older update: no resurrection
    ("I", TOMBSTONE, (EARLIER, 2), (T, 2), (True, None)),             # the peer deleted, then inserted again
    ("I", TOMBSTONE, (LATER, 1), (T, 2), (False, "insert_deleted")),
    ("D", TOMBSTONE, (EARLIER, 1), (T, 2), (True, "delete_deleted")),  # deleted on both: the later stays
    ("U", ROW, (None, 1), (T, 2), (True, None)),                      # this transaction's own earlier write
])
def test_conflict_types(op, found, local, remote, expected):
    assert decide(op, found, local, remote) == expected


def test_copy_lines_escape_and_null():
    text = copy_lines([Incoming("U", ("1", "a\tb\\c\nd", None), T, 2, (2,)),
                       Incoming("D", ("2", None, None), "2026-01-01 00:00:00+00", 3)], 3)
    assert text.splitlines() == [
        "U\t{2}\t2026-01-01T00:00:00+00:00\t2\t1\ta\\tb\\\\c\\nd\t\\N",
        "D\t\\N\t2026-01-01 00:00:00+00\t3\t2\t\\N\t\\N",
    ]


def test_copy_lines_refuse_bad_rows():
    with pytest.raises(ValueError, match="unknown change kind"):
        copy_lines([Incoming("X", ("1",), T, 2)], 1)
    with pytest.raises(ValueError, match="2 values for a table of 3 columns"):
        copy_lines([Incoming("U", ("1", "a"), T, 2)], 3)


def _staged_update(identity: str, old):
    """The Incoming LwwApplier stages for an update of key 1 whose `doc` (a large value) is unchanged."""
    from sluicegate.appliers.lww_applier import LwwApplier
    from sluicegate.appliers.postgres import TargetTable
    from sluicegate.postgres.assembler import Change
    from sluicegate.postgres.catalog import Column, Table
    from sluicegate.postgres.pgoutput import UNCHANGED, Relation
    from sluicegate.postgres.pgoutput import Column as RelColumn

    table = Table("public", "docs", (Column("id", "integer", 23, True, None), Column("doc", "text", 25, False, None),
                                     Column("n", "integer", 23, False, None)), ("id",))
    rel = Relation(7, "public", "docs", identity, (RelColumn(1, "id", 23, -1), RelColumn(int(identity == "f"),
                                                   "doc", 25, -1), RelColumn(int(identity == "f"), "n", 23, -1)))
    applier = LwwApplier(None, [TargetTable(table)], local_cluster=1, peer_cluster=2, origin="")
    applier.begin(T)
    applier.change(Change("U", rel, old, ("1", UNCHANGED, "5"), 0))
    return applier.staged[("public", "docs")][("1",)]


def test_an_update_under_replica_identity_full_carries_its_unchanged_large_values():
    """REPLICA IDENTITY FULL: the old row is whole, so the new one is completed from it and can recreate a row
    the other cluster deleted; without it the value is missing (the apply refuses, naming FULL)."""
    full = _staged_update("f", ("1", "x" * 5000, "4"))
    assert full.values == ("1", "x" * 5000, "5") and full.missing == ()
    default = _staged_update("d", None)
    assert default.values == ("1", None, "5") and default.missing == (1,)

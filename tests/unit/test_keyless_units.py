"""Tables without a key: their description round-trips, their chunk is a multiset delta, and the C fast lane
never stages their rows (it stages by key)."""

from __future__ import annotations

import pytest

from sluicegate.appliers import postgres
from sluicegate.appliers.keyless import KeylessRows
from sluicegate.errors import TerminalError
from sluicegate.postgres.assembler import Change, Framing
from sluicegate.postgres.catalog import Table
from sluicegate.postgres.pgoutput import UNCHANGED as U
from sluicegate.postgres.pgoutput import Column, Relation

from .test_applier_net_effect import _row


class Recording(postgres.PostgresApplier):
    """Writes nothing: records each flushed chunk's keyless deltas."""

    def __init__(self, *args, **kwargs):
        self.written: list = []
        super().__init__(None, *args, **kwargs)

    def _write(self, chunk: list) -> None:
        self.written.append([(t.table.name, dict(rows.delta)) for t, rows, _ in chunk])

SPEC = {"schema": "public", "name": "t", "key": [], "keyless": True, "columns": [
    ["a", "integer", 23, False, None, -1], ["b", "text", 25, False, None, -1], ["c", "text", 25, False, None, -1]]}


def relation(oid: int = 16401) -> Relation:
    return Relation(oid, "public", "t", "f", tuple(Column(1, n, 23 if n == "a" else 25, -1) for n in "abc"))


def test_description_round_trips_and_old_json_loads():
    t = Table.from_json(SPEC)
    assert t.keyless and t.key == () and Table.from_json(t.to_json()) == t
    old = {k: v for k, v in SPEC.items() if k != "keyless"}
    old["key"] = ["a"]
    assert Table.from_json(old).keyless is False  # stored before keyless tables existed


def test_a_chunk_is_a_multiset_delta():
    t = Table.from_json(SPEC)
    rows = KeylessRows()
    rows.stage(t, "I", None, ("1", "x", None))
    rows.stage(t, "I", None, ("1", "x", None))  # a duplicate: two copies
    rows.stage(t, "I", None, ("2", "y", "z"))
    rows.stage(t, "D", ("2", "y", "z"), None)  # inserted and deleted in the chunk: nothing
    rows.stage(t, "U", ("1", "x", None), ("1", "x2", None))  # one of the two copies changes
    rows.stage(t, "U", ("5", "big", "kept"), ("6", "big", U))  # an unchanged TOAST value: from the old row
    rows.stage(t, "D", ("7", None, None), None)  # a row the target has
    assert rows.delta == {("1", "x", None): 1, ("1", "x2", None): 1, ("5", "big", "kept"): -1,
                          ("6", "big", "kept"): 1, ("7", None, None): -1}
    rows.stage(t, "U", ("1", "x2", None), ("1", "x2", None))  # an update to the same value: no change
    assert rows.delta[("1", "x2", None)] == 1
    with pytest.raises(TerminalError, match="public.t.*REPLICA IDENTITY FULL"):
        rows.stage(t, "D", None, None)  # no old row: the source's identity is no longer FULL


def test_the_c_paths_decline_keyless_rows():
    applier = Recording([postgres.TargetTable(Table.from_json(SPEC))], chunk_rows=100, chunk_bytes=1 << 30)
    target = applier.by_name[("public", "t")]
    assert isinstance(target.rows, KeylessRows) and target.key_indices is None
    if postgres._stage_change_c is not None:
        assert postgres._stage_change_c(target.rows, target.key_indices,
                                        Change("I", relation(), None, ("1", "x", "y"), 1), U) is False
    framing = Framing()
    sink = applier.row_sink(framing)
    if sink is not None:
        sink.active = True
        framing.relations[16401] = relation()
        applier.change(Change("I", framing.relations[16401], None, ("0", "x", "y"), 1, 10))  # checks the Relation
        assert sink.take(_row("I", 16401, None, ("1", "x", "y"))) is False
        assert sink.take(_row("D", 16401, ("0", "x", "y"), None, b"O")) is False
    applier.change(Change("I", relation(), None, ("0", "x", "y"), 1, 10))  # a duplicate, by the Python path
    assert target.rows.delta == {("0", "x", "y"): 2}
    applier.flush()
    assert applier.written == [[("t", {("0", "x", "y"): 2})]]
    assert isinstance(target.rows, KeylessRows) and not target.rows  # a fresh chunk, still not a dict

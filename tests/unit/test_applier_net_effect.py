"""The PostgreSQL applier's net effect of a chunk (PostgresApplier.change): the same staged rows, in the same
order, whether the C path (postgres/_pgoutput_rows.c stage_change) or the Python one stages them."""

from __future__ import annotations

import pytest

from sluicegate.appliers import postgres
from sluicegate.appliers.postgres import PostgresApplier, TargetTable
from sluicegate.postgres.assembler import Change
from sluicegate.postgres.catalog import Table
from sluicegate.postgres.pgoutput import UNCHANGED, Column, Relation

U = UNCHANGED


def table(key: list[str]) -> Table:
    return Table.from_json({"schema": "public", "name": "t", "key": key, "columns": [
        ["a", "integer", 23, True, None], ["b", "text", 25, "b" in key, None], ["c", "text", 25, False, None]]})


def relation(key: list[str]) -> Relation:
    return Relation(16400, "public", "t", "d", tuple(Column(int(n in key), n, 23 if n == "a" else 25, -1)
                                                      for n in ("a", "b", "c")))


# (kind, old, new) in order: the net effect of each case is what the next case starts from.
CHANGES = [
    ("I", None, ("1", "x", "one")),
    ("I", None, ("2", "y", None)),  # a NULL value
    ("U", None, ("1", "x", "uno")),  # a whole-row update: replaces the insert, keeps its place
    ("U", None, ("2", "y", U)),  # an unchanged TOAST value: taken from the row staged earlier
    ("U", None, ("3", "z", U)),  # ... and kept as the target has it when nothing was staged
    ("D", ("1", None, None), None),  # a key-only old row
    ("U", ("2", None, None), ("4", "y", "moved")),  # the key changed: a delete of the old key, then the row
    ("D", ("9", "w", "full"), None),  # a full old row (REPLICA IDENTITY FULL)
    ("I", None, ("1", "x", "again")),  # inserted again after its delete: the same key's entry, now an upsert
    ("I", None, ("5", None, "null key part")),
]


@pytest.fixture(params=["c", "python"])
def mode(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(postgres, "_stage_change_c", None)
    elif postgres._stage_change_c is None:
        pytest.skip("the C extension is not built")
    return request.param


def stage(key: list[str]) -> TargetTable:
    t = TargetTable(table(key))
    applier = PostgresApplier(conn=None, tables=[t], chunk_rows=1000, chunk_bytes=1 << 30)
    rel = relation(key)
    for lsn, (kind, old, new) in enumerate(CHANGES, 1):
        applier.change(Change(kind, rel, old, new, lsn, 10))
    assert applier.pending_rows == len(CHANGES) and applier.pending_bytes == 10 * len(CHANGES)
    return t


def test_one_column_key(mode):
    t = stage(["a"])
    assert list(t.rows.items()) == [
        (("1",), ("U", ("1", "x", "again"), None)),
        (("2",), ("D", ("2", None, None), None)),
        (("3",), ("U", ("3", "z", U), [2])),
        (("4",), ("U", ("4", "y", "moved"), None)),
        (("9",), ("D", ("9", "w", "full"), None)),
        (("5",), ("U", ("5", None, "null key part"), None)),
    ]
    assert t.has_keep


def test_two_column_key(mode):
    t = stage(["a", "b"])
    # The old rows above carry no b: under this key they name other rows than the inserts'.
    assert list(t.rows) == [("1", "x"), ("2", "y"), ("3", "z"), ("1", None), ("2", None), ("4", "y"),
                            ("9", "w"), ("5", None)]
    assert t.rows[("2", "y")] == ("U", ("2", "y", None), None)  # its unchanged value: the staged NULL
    assert t.rows[("1", "x")] == ("U", ("1", "x", "again"), None)
    assert t.rows[("1", None)] == ("D", ("1", None, None), None)


def test_c_and_python_stage_alike(monkeypatch):
    if postgres._stage_change_c is None:
        pytest.skip("the C extension is not built")
    by_c = stage(["a"]).rows
    monkeypatch.setattr(postgres, "_stage_change_c", None)
    by_python = stage(["a"]).rows
    assert list(by_c.items()) == list(by_python.items())


def test_c_declines_what_it_does_not_handle():
    stage_c = postgres._stage_change_c
    if stage_c is None:
        pytest.skip("the C extension is not built")
    rel = relation(["a"])
    rows: dict = {}
    for ch in (Change("U", rel, ("1", None, None), ("2", "b", "c"), 1),  # an old row: maybe a key change
               Change("U", rel, None, ("1", "b", U), 1),  # an unchanged TOAST value
               Change("D", rel, None, None, 1)):  # no old row (not a delete pgoutput sends)
        assert stage_c(rows, (0,), ch, U) is False
    assert stage_c(rows, (7,), Change("I", rel, None, ("1", "b", "c"), 1), U) is False  # no such column
    assert rows == {}
    assert stage_c(rows, (0,), Change("I", rel, None, ("1", "b", "c"), 1), U) is True
    assert rows == {("1",): ("U", ("1", "b", "c"), None)}

"""The PostgreSQL applier's net effect of a chunk (PostgresApplier.change): the same staged rows, in the same
order, whether the C path (postgres/_pgoutput_rows.c stage_change) or the Python one stages them."""

from __future__ import annotations

import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from sluicegate.appliers import postgres
from sluicegate.appliers.postgres import PostgresApplier, TargetTable
from sluicegate.postgres.assembler import Change, Framing, assemble
from sluicegate.postgres.catalog import Table
from sluicegate.postgres.pgoutput import UNCHANGED, Begin, Column, Relation

from .accelerated import c_or_python

U = UNCHANGED


def table(key: list[str]) -> Table:
    return Table.from_json({"schema": "public", "name": "t", "key": key, "columns": [
        ["a", "integer", 23, True, None], ["b", "text", 25, "b" in key, None],
        ["c", "text", 25, False, None]]})


def relation(key: list[str], oid: int = 16400) -> Relation:
    return Relation(oid, "public", "t", "d", tuple(Column(int(n in key), n, 23 if n == "a" else 25, -1)
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
    return c_or_python(request, monkeypatch, postgres, "_stage_change_c")


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


# -- the fast lane: row messages staged by the RowSink straight from their bytes (assemble's `rows`) -------

def _tuple(values) -> bytes:
    out = struct.pack(">H", len(values))
    for v in values:
        if v is None:
            out += b"n"
        elif v is U:
            out += b"u"
        else:
            out += b"t" + struct.pack(">I", len(v.encode())) + v.encode()
    return out


def _relation(oid: int, name: str, key: list[str]) -> bytes:
    out = b"R" + struct.pack(">I", oid) + b"public\0" + name.encode() + b"\0d" + struct.pack(">H", 3)
    for n in ("a", "b", "c"):
        out += bytes([n in key]) + n.encode() + b"\0" + struct.pack(">Ii", 23 if n == "a" else 25, -1)
    return out


def _row(kind: str, oid: int, old, new, old_marker: bytes = b"K") -> bytes:
    out = kind.encode() + struct.pack(">I", oid)
    if old is not None:
        out += old_marker + _tuple(old)
    if new is not None:
        out += b"N" + _tuple(new)
    return out


def _transaction(xid: int, lsn: int, rows: list[bytes]) -> list[bytes]:
    return ([b"B" + struct.pack(">QqI", lsn, 0, xid)] + rows
            + [b"C" + struct.pack(">BQQq", 0, lsn, lsn + 8, 0)])


class Recording(PostgresApplier):
    """Writes nothing: records each flushed chunk (what the target would get) in order."""

    def __init__(self, *args, **kwargs):
        self.written: list = []
        super().__init__(None, *args, **kwargs)

    def _write(self, chunk: list) -> None:
        self.written.append([(t.table.name, list(rows.items()), has_keep) for t, rows, has_keep in chunk])


T1, T2, OTHER = 16401, 16402, 16403


def _messages() -> list[bytes]:
    """Two tables, one not replicated, a transaction to skip, a Relation sent again, every kind of change."""
    msgs = [_relation(T1, "t", ["a"]), _relation(T2, "u", ["a", "b"]), _relation(OTHER, "other", ["a"])]
    msgs += _transaction(700, 1000, [
        _row("I", T1, None, ("1", "x", "one")),
        _row("I", T1, None, ("2", "y", None)),
        _row("I", T2, None, ("1", "x", "t2")),
        _row("I", OTHER, None, ("1", "x", "not replicated")),
        _row("U", T1, None, ("1", "x", "uno")),
        _row("U", T1, None, ("2", "y", U)),  # unchanged TOAST: the Python path
        _row("U", T1, ("2", None, None), ("4", "y", "moved")),  # a key change: the Python path
        _row("D", T2, ("1", "x", None), None),
        _row("D", T1, ("9", "w", "full"), None, b"O"),
    ])
    msgs += _transaction(701, 2000, [_row("I", T1, None, (str(i), "s", "skipped")) for i in range(10, 14)])
    msgs += [_relation(T1, "t", ["a"])]  # sent again (a new decoding session or a schema change)
    msgs += _transaction(702, 3000, [_row("I", T1, None, (str(i), "z", "after")) for i in range(20, 45)]
                         + [_row("D", T1, ("20", None, None), None)])
    return msgs


def _replay(msgs: list[bytes], use_sink: bool, skip_xids=(701,)):
    """The player's loop (workflow/player._play_batch) over `msgs`, with the fast lane or without it."""
    tables = [TargetTable(table(["a"])), TargetTable(Table.from_json({
        "schema": "public", "name": "u", "key": ["a", "b"], "columns": [
            ["a", "integer", 23, True, None], ["b", "text", 25, True, None],
            ["c", "text", 25, False, None]]}))]
    applier = Recording(tables, chunk_rows=7, chunk_bytes=1 << 30)
    framing = Framing()
    sink = applier.row_sink(framing) if use_sink else None
    skipping, rows = False, 0
    for ev in assemble(((lsn, m) for lsn, m in enumerate(msgs, 1)), framing, sink):
        if isinstance(ev, Change):
            if not skipping:
                applier.change(ev)
                rows += 1
        elif isinstance(ev, Begin):
            skipping = ev.xid in skip_xids
            if sink is not None:
                sink.active = not skipping
    applier.flush()
    return applier.written, rows + (sink.taken if sink is not None else 0)


def test_the_fast_lane_stages_and_flushes_as_the_python_path():
    if postgres._RowSink is None:
        pytest.skip("the C extension is not built")
    msgs = _messages()
    with_sink, rows_with = _replay(msgs, True)
    without, rows_without = _replay(msgs, False)
    assert with_sink == without
    assert rows_with == rows_without == 35  # the skipped transaction's 4 are not counted
    flat = [row for chunk in without for _, rows, _ in chunk for row in rows]
    assert (("20",), ("D", ("20", None, None), None)) in flat
    assert not any(values[2] == "skipped" for _, (_, values, _) in flat)
    assert len(without) == 5  # chunks of 7 changes


def test_the_fast_lane_takes_only_what_it_stages_alike():
    if postgres._RowSink is None:
        pytest.skip("the C extension is not built")
    applier = Recording([TargetTable(table(["a"]))], chunk_rows=100, chunk_bytes=1 << 30)
    framing = Framing()
    sink = applier.row_sink(framing)
    insert = _row("I", T1, None, ("1", "x", "one"))
    sink.active = True
    assert sink.take(insert) is False  # no Relation message yet
    framing.relations[T1] = relation(["a"], T1)
    assert sink.take(insert) is False  # the applier has not checked this Relation yet
    applier.change(Change("I", framing.relations[T1], None, ("0", "x", "first"), 1, 10))
    assert sink.take(insert) is True
    for declined in (_row("U", T1, None, ("1", "x", U)), _row("U", T1, ("1", None, None), ("2", "x", "y")),
                     insert + b"trailing", insert[:-2], b"T" + insert[1:]):
        assert sink.take(declined) is False
    sink.active = False
    assert sink.take(insert) is False
    assert sink.taken == 1
    assert applier.pending_rows == 2 and applier.pending_bytes == 10 + len(insert)
    assert list(applier.by_name[("public", "t")].rows) == [("0",), ("1",)]


def test_a_free_writer_takes_each_step_and_a_busy_one_lets_the_chunk_grow(mode):
    # A writer thread: its first chunk is held until `gate` opens, as a target busy with it would hold it.
    gate = threading.Event()

    class Slow(Recording):
        def _write(self, chunk: list) -> None:
            assert gate.wait(10)
            super()._write(chunk)

    rel = relation(["a"])

    def insert(applier, keys) -> None:
        for k in keys:
            applier.change(Change("I", rel, None, (str(k), "x", "y"), k, 10))

    with ThreadPoolExecutor(1) as writer:
        applier = Slow([TargetTable(table(["a"]))], chunk_rows=80, chunk_bytes=1 << 30, executor=writer)
        insert(applier, range(10))  # a step (chunk_rows / 8) with the writer free: written at once
        assert applier._writing is not None and applier.held_rows == 0
        insert(applier, range(10, 80))  # the writer busy: the next chunk grows, step by step
        assert applier.held_rows == 70 and not applier.written
        gate.set()
        applier.settle()
        insert(applier, range(80, 90))  # 80 rows: written whatever the writer does
        applier.settle()
        insert(applier, range(90, 100))  # the writer free again: a step is a chunk
        assert applier.held_rows == 0
        applier.settle()
    assert [sum(len(rows) for _, rows, _ in chunk) for chunk in applier.written] == [10, 80, 10]
    assert [k for chunk in applier.written for _, rows, _ in chunk for (k,), _ in rows] == \
        [str(k) for k in range(100)]


def test_without_a_writer_a_chunk_is_written_whole():
    applier = Recording([TargetTable(table(["a"]))], chunk_rows=80, chunk_bytes=1 << 30)
    rel = relation(["a"])
    for k in range(170):
        applier.change(Change("I", rel, None, (str(k), "x", "y"), k, 10))
    applier.flush()
    assert [sum(len(rows) for _, rows, _ in chunk) for chunk in applier.written] == [80, 80, 10]

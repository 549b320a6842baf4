"""The Delta target's pure parts: the type mapping, the net effect per key and the merge it makes."""

from __future__ import annotations

from datetime import date, datetime, timezone
from decimal import Decimal

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from sluicegate.errors import TerminalError, UsageError
from sluicegate.postgres.catalog import Column, Table
from sluicegate.postgres.pgoutput import UNCHANGED
from sluicegate.targets.delta import points, read
from sluicegate.targets.delta.apply import NetEffect, merge
from sluicegate.targets.delta.state import LakeWorkflow, Store, TableState
from sluicegate.targets.delta.types import arrow_schema, arrow_type, convert_column, record_batch


def col(name, oid, typmod=-1, type_sql="x"):
    return Column(name, type_sql, oid, False, None, typmod)


def numeric(p, s):
    return ((p << 16) | s) + 4


@pytest.mark.parametrize("column, expected", [
    (col("a", 16), pa.bool_()),
    (col("a", 21), pa.int16()),
    (col("a", 23), pa.int32()),
    (col("a", 20), pa.int64()),
    (col("a", 700), pa.float32()),
    (col("a", 701), pa.float64()),
    (col("a", 1700, numeric(12, 2)), pa.decimal128(12, 2)),
    (col("a", 1700, -1), pa.string()),  # unbounded numeric: its exact text
    (col("a", 1700, numeric(50, 2)), pa.string()),  # wider than decimal128
    (col("a", 1184), pa.timestamp("us", tz="UTC")),
    (col("a", 1114), pa.timestamp("us")),
    (col("a", 1082), pa.date32()),
    (col("a", 1083), pa.string()),  # time: Delta has no time-of-day type
    (col("a", 17), pa.binary()),
    (col("a", 3802), pa.string()),  # jsonb
    (col("a", 114), pa.string()),  # json
    (col("a", 1007), pa.string()),  # int4[]
    (col("a", 2950), pa.string()),  # uuid
    (col("a", 40000), pa.string()),  # an enum (a user type)
])
def test_arrow_type(column, expected):
    assert arrow_type(column) == expected


def test_text_values_convert():
    cases = [
        (col("b", 16), ["t", "f", None], [True, False, None]),
        (col("i", 20), ["-9223372036854775808", "7"], [-9223372036854775808, 7]),
        (col("n", 1700, numeric(12, 2)), ["12.50", "-0.01"], [Decimal("12.50"), Decimal("-0.01")]),
        (col("n", 1700), ["1e-30", "NaN"], ["1e-30", "NaN"]),
        (col("t", 1184), ["2024-01-02 03:04:05.123456+00"],
         [datetime(2024, 1, 2, 3, 4, 5, 123456, tzinfo=timezone.utc)]),
        (col("t", 1114), ["2024-01-02 03:04:05"], [datetime(2024, 1, 2, 3, 4, 5)]),
        (col("d", 1082), ["2024-02-29"], [date(2024, 2, 29)]),
        (col("x", 17), ["\\x00ff"], [b"\x00\xff"]),
        (col("f", 701), ["NaN", "1.5"], [None, 1.5]),
    ]
    for column, texts, want in cases:
        got = convert_column(column, texts).to_pylist()
        if column.type_oid == 701:
            assert got[0] != got[0] and got[1] == 1.5  # NaN stays NaN
        else:
            assert got == want, column


def test_value_without_a_form_is_a_terminal_error():
    with pytest.raises(TerminalError, match="column n"):
        convert_column(col("n", 1700, numeric(5, 2)), ["NaN"])


def table(*extra):
    return Table("public", "items", (Column("id", "bigint", 20, True, None, -1),
                                     Column("qty", "integer", 23, False, None, -1),
                                     Column("note", "text", 25, False, None, -1), *extra), ("id",))


def test_schema_key_not_nullable():
    s = arrow_schema(table())
    assert not s.field("id").nullable and s.field("qty").nullable


def test_record_batch_empty_and_rows():
    assert record_batch(table(), []).num_rows == 0
    b = record_batch(table(), [("1", "2", None)])
    assert b.to_pylist() == [{"id": 1, "qty": 2, "note": None}]


def test_net_effect_last_state_per_key():
    e = NetEffect(table())
    e.add("I", None, ("1", "0", "a"))
    e.add("U", None, ("1", "5", "b"))
    e.add("I", None, ("2", "0", "x"))
    e.add("D", ("2", None, None), None)
    e.add("U", ("3", None, None), ("4", "1", "moved"))  # a key change: 3 goes, 4 comes
    src = e.merge_source().to_pylist()
    by_id = {r["id"]: r for r in src}
    assert by_id[1] == {"id": 1, "qty": 5, "note": "b", "_op": "U"}
    assert by_id[2]["_op"] == "D"
    assert by_id[3]["_op"] == "D" and by_id[4] == {"id": 4, "qty": 1, "note": "moved", "_op": "U"}
    assert len(src) == 4


def test_net_effect_unchanged_toast():
    e = NetEffect(table())
    e.add("I", None, ("1", "0", "big"))
    e.add("U", None, ("1", "1", UNCHANGED))  # taken from the earlier change in the batch
    e.add("U", None, ("2", "1", UNCHANGED))  # kept as the table has it: a flag column says so
    src = e.merge_source()
    assert "__u_2" in src.column_names
    rows = {r["id"]: r for r in src.to_pylist()}
    assert rows[1]["note"] == "big" and rows[1]["__u_2"] is False
    assert rows[2]["note"] is None and rows[2]["__u_2"] is True


def test_net_effect_moved_key_without_toast_value_stops():
    e = NetEffect(table())
    with pytest.raises(TerminalError, match="REPLICA IDENTITY FULL"):
        e.add("U", ("1", None, None), ("2", "1", UNCHANGED))


def test_merge_applies_net_effect_with_app_transaction(tmp_path):
    from deltalake import DeltaTable

    t = table()
    path = str(tmp_path / "items")
    dt = DeltaTable.create(path, arrow_schema(t))
    first = NetEffect(t)
    for i in range(1, 4):
        first.add("I", None, (str(i), "0", f"n{i}"))
    merge(dt, t, first, "sluicegate:w", 100)
    second = NetEffect(t)
    second.add("U", None, ("1", "9", UNCHANGED))  # keeps n1
    second.add("D", ("2", None, None), None)
    second.add("I", None, ("5", "5", "five"))
    merge(dt, t, second, "sluicegate:w", 200)
    assert dt.transaction_version("sluicegate:w") == 200
    rows = sorted(ds.dataset(DeltaTable(path).file_uris()).to_table().to_pylist(), key=lambda r: r["id"])
    assert rows == [{"id": 1, "qty": 9, "note": "n1"}, {"id": 3, "qty": 0, "note": "n3"},
                    {"id": 5, "qty": 5, "note": "five"}]


def test_merge_adds_a_column_the_source_added(tmp_path):
    from deltalake import DeltaTable

    t = table()
    path = str(tmp_path / "items")
    dt = DeltaTable.create(path, arrow_schema(t))
    e = NetEffect(t)
    e.add("I", None, ("1", "0", "a"))
    merge(dt, t, e, "sluicegate:w", 1)
    wider = table(Column("price", "numeric(8,2)", 1700, False, None, numeric(8, 2)))
    e = NetEffect(wider)
    e.add("I", None, ("2", "0", "b", "3.50"))
    merge(dt, wider, e, "sluicegate:w", 2)
    rows = sorted(ds.dataset(DeltaTable(path).file_uris()).to_table().to_pylist(), key=lambda r: r["id"])
    assert rows == [{"id": 1, "qty": 0, "note": "a", "price": None},
                    {"id": 2, "qty": 0, "note": "b", "price": Decimal("3.50")}]


def test_points_record_once_per_position(tmp_path):
    assert points.record(tmp_path, "w", 10, None, {"public.b": 1, "public.a": 2})
    assert not points.record(tmp_path, "w", 10, None, {"public.a": 2})  # replayed after a kill
    assert points.record(tmp_path, "w", 20, datetime(2024, 1, 1, tzinfo=timezone.utc), {"public.a": 3})
    got = read.points(tmp_path, "w")
    assert [(p.position, p.position_text, p.versions) for p in got] == [
        (10, "0/A", {"public.a": 2, "public.b": 1}), (20, "0/14", {"public.a": 3})]
    from deltalake import DeltaTable

    schema = DeltaTable(read.points_uri(tmp_path)).schema().to_arrow()
    assert [f.name for f in schema] == ["workflow", "position", "position_text", "committed_at", "versions"]
    assert got[1].committed_at == datetime(2024, 1, 1, tzinfo=timezone.utc)


def test_state_document_round_trip_and_lock(tmp_path):
    store = Store(tmp_path)
    wf = LakeWorkflow("w", "postgresql://x", "sg_w", "sg_w", [TableState(table().to_json())])
    store.create(wf)
    with pytest.raises(UsageError, match="already exists"):
        store.create(wf)
    with store.update("w") as w:
        w.position = 42
        w.table("public.items").lastpk = ["7"]
    again = store.load("w")
    assert again.position == 42 and again.tables[0].lastpk == ["7"] and again.tables[0].spec == table()
    held = store.hold_run_lock("w")
    try:
        assert store.is_running("w")
        with pytest.raises(UsageError, match="already being run"):
            store.hold_run_lock("w")
    finally:
        held.close()
    assert not store.is_running("w")
    assert not list((tmp_path / "_sluicegate" / "workflows" / "w").glob(".state.*"))  # no temp left


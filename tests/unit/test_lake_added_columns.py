"""Pure parts of following a column added on the source into Delta: the fill value as delta-rs SQL, rows of
the old shape padded (in memory and staged), the MERGE's fill of the rows it does not touch."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from sluicegate.errors import TerminalError
from sluicegate.postgres.catalog import Column, Table
from sluicegate.postgres.pgoutput import Column as RelColumn
from sluicegate.postgres.pgoutput import Relation
from sluicegate.targets.delta.apply import NetEffect, add_columns, added_by, merge, merge_clauses
from sluicegate.targets.delta.player import _adopt, _Batch, _padded
from sluicegate.targets.delta.staging import Spill
from sluicegate.targets.delta.types import convert_column, sql_literal

BASE = Table("public", "items", (Column("id", "bigint", 20, True, None, -1),
                                 Column("v", "text", 25, False, None, -1)), ("id",))
NUMERIC_10_2 = ((10 << 16) | 2) + 4


def widened(*extra: Column) -> Table:
    return replace(BASE, columns=BASE.columns + extra)


def rows(path) -> list[dict]:
    from deltalake import DeltaTable

    return sorted(ds.dataset(DeltaTable(str(path)).file_uris()).to_table().to_pylist(), key=lambda r: r["id"])


LITERALS = [
    (Column("s", "smallint", 21, False, None, -1), "-3"),
    (Column("i", "integer", 23, False, None, -1), "7"),
    (Column("l", "bigint", 20, False, None, -1), "9007199254740993"),
    (Column("f4", "real", 700, False, None, -1), "Infinity"),
    (Column("f8", "double precision", 701, False, None, -1), "0.1"),
    (Column("n", "numeric(10,2)", 1700, False, None, NUMERIC_10_2), "-1.50"),
    (Column("u", "numeric", 1700, False, None, -1), "1.000000000000000000000000000000000000001"),
    (Column("b", "bytea", 17, False, None, -1), "\\x00ff27"),
    (Column("d", "date", 1082, False, None, -1), "2024-02-29"),
    (Column("ts", "timestamp without time zone", 1114, False, None, -1), "2024-01-02 03:04:05.123456"),
    (Column("tz", "timestamp with time zone", 1184, False, None, -1), "2024-01-02 03:04:05+00"),
    (Column("ok", "boolean", 16, False, None, -1), "f"),
    (Column("t", "text", 25, False, None, -1), "it's \\ 'quoted'"),
    (Column("j", "jsonb", 3802, False, None, -1), '{"a": [1, "x"]}'),
    (Column("z", "text", 25, False, None, -1), None),
]


def test_fill_literals_give_the_streams_values(tmp_path):
    """Every older row gets exactly what the stream's conversion of the same text gives."""
    from deltalake import write_deltalake

    write_deltalake(str(tmp_path), pa.table({"id": pa.array([1, 2], pa.int64()), "v": ["a", "b"]}))
    from deltalake import DeltaTable

    dt = DeltaTable(str(tmp_path))
    spec = widened(*(c for c, _ in LITERALS))
    add_columns(dt, spec, [c.name for c, _ in LITERALS], "w")
    add_columns(dt, spec, [c.name for c, _ in LITERALS], "w")  # again (a replay): nothing to add
    fills = {c.name: sql_literal(c, text) for c, text in LITERALS}
    effect = NetEffect(spec)
    effect.add("I", None, ("3", "c", *(None for _ in LITERALS)))
    merge(dt, spec, effect, "sluicegate:w", 5, fills)
    got = rows(tmp_path)
    want = {c.name: convert_column(c, [text])[0].as_py() for c, text in LITERALS}
    for r in got[:2]:
        assert {k: r[k] for k in want} == want
    assert all(got[2][c.name] is None for c, _ in LITERALS)  # the batch's own row: its values
    assert dt.transaction_version("sluicegate:w") == 5
    assert added_by(dt, "n") == "w" and added_by(dt, "v") == "" and added_by(dt, "nope") is None


def test_a_fill_value_without_a_delta_form_stops():
    with pytest.raises(TerminalError, match="column n"):
        sql_literal(LITERALS[5][0], "NaN")


def test_rows_of_the_old_shape_are_padded():
    old = NetEffect(BASE)
    old.add("I", None, ("1", "a"))
    old.add("D", ("2", None), None)
    old.add("U", ("3", "c"), ("3", "C"))
    spec = widened(Column("tag", "text", 25, False, None, -1), Column("k", "text", 25, False, None, -1))
    fresh = _padded(old, spec, {2: "plain"}, {3})
    assert fresh.rows == {("1",): ("U", ("1", "a", "plain", None), frozenset({3})),
                          ("2",): ("D", None, frozenset()),
                          ("3",): ("U", ("3", "C", "plain", None), frozenset({3}))}
    assert fresh.changes == 3 and fresh.table is spec


def test_staged_rows_of_the_old_shape_are_padded(tmp_path):
    old = NetEffect(BASE)
    old.add("I", None, ("1", "a"))
    old.add("D", ("2", None), None)
    spill = Spill(tmp_path / "s")
    spill.write(old)
    spec = widened(Column("tag", "text", 25, False, None, -1))
    spill.pads[2] = "plain"
    later = NetEffect(spec)
    later.add("I", None, ("4", "d", "given"))
    parts = {k: v for p in spill.partitions(later) for k, v in p.rows.items()}
    assert parts == {("1",): ("U", ("1", "a", "plain"), frozenset()), ("2",): ("D", None, frozenset()),
                     ("4",): ("U", ("4", "d", "given"), frozenset())}


def test_a_row_keeping_its_own_value_of_a_column_being_filled_takes_the_fill():
    spec = widened(Column("tag", "text", 25, False, None, -1))
    schema = pa.schema([("id", pa.int64()), ("v", pa.string()), ("tag", pa.string()), ("_op", pa.string()),
                        ("__u_2", pa.bool_())])
    _, updates, _ = merge_clauses(spec, schema, {"tag": "'plain'"})
    assert updates['"tag"'] == """CASE WHEN s."__u_2" THEN 'plain' ELSE s."tag" END"""
    _, updates, _ = merge_clauses(spec, schema)
    assert updates['"tag"'] == """CASE WHEN s."__u_2" THEN t."tag" ELSE s."tag" END"""


class _Tables:
    def __init__(self):
        self.specs = {"public.items": BASE}


def rel(*names: str) -> Relation:
    types = {"id": 20, "v": 25}
    return Relation(1, "public", "items", "d",
                    tuple(RelColumn(1 if n == "id" else 0, n, types.get(n, 25), -1) for n in names))


def test_a_relation_on_changes_the_table_has_only_joins_added_columns():
    tables, batch = _Tables(), _Batch(0, {}, reshaped={}, spills={})
    assert _adopt(tables, "public.items", BASE, rel("id", "v"), batch) and not batch.reshaped
    # An older shape (before a column the copy adopted): ignored, not read as a dropped column.
    assert not _adopt(tables, "public.items", BASE, rel("id"), batch) and not batch.reshaped
    assert _adopt(tables, "public.items", BASE, rel("id", "v", "tag"), batch)
    assert [c.name for c in batch.reshaped["public.items"].columns] == ["id", "v", "tag"]
    assert tables.specs["public.items"] is batch.reshaped["public.items"]


def test_decimal_fill_is_exact():
    c = LITERALS[5][0]
    assert sql_literal(c, "-1.50") == "CAST('-1.50' AS DECIMAL(10,2))"
    assert convert_column(c, ["-1.50"])[0].as_py() == Decimal("-1.50")


def test_a_change_other_than_added_columns_stops_naming_it_and_the_way_out():
    from sluicegate.targets.delta.player import added_only

    same = Relation(1, "public", "items", "d", (RelColumn(1, "id", 20, -1), RelColumn(0, "v", 25, -1)))
    assert added_only(same, BASE, "w", "delta:/lake", "") is None
    more = Relation(1, "public", "items", "d", (*same.columns, RelColumn(0, "tag", 25, -1)))
    assert [c.name for c in added_only(more, BASE, "w", "delta:/lake", "").added] == ["tag"]
    dropped = Relation(1, "public", "items", "d", (RelColumn(1, "id", 20, -1),))
    with pytest.raises(TerminalError) as stop:
        added_only(dropped, BASE, "w", "delta:/lake", " since the workflow was created")
    text = str(stop.value)
    assert "public.items changed on the source since the workflow was created" in text and " v" in text
    assert "`sluicegate workflow delete w --target delta:/lake --drop-tables`" in text
    retyped = Relation(1, "public", "items", "d", (RelColumn(1, "id", 20, -1), RelColumn(0, "v", 23, -1)))
    with pytest.raises(TerminalError, match="follows added columns only"):
        added_only(retyped, BASE, "w", "delta:/lake", "")

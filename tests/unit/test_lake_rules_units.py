"""A rule's output as a Delta table (targets/delta/rules.py) and folded into the net effect per target key
(targets/delta/rule_player.py): pure, no server, no Spark."""

from __future__ import annotations

from datetime import date, datetime, timezone
from decimal import Decimal

import pyarrow as pa
import pytest

from sluicegate.errors import UsageError
from sluicegate.postgres.catalog import Column, Table
from sluicegate.rules import types as rule_types
from sluicegate.rules.compile import OUT, CompiledRule
from sluicegate.rules.evaluate import KEEP
from sluicegate.targets.delta import apply, types
from sluicegate.targets.delta.rule_player import _fold
from sluicegate.targets.delta.rules import computed_column, lake_table, target_batch
from sluicegate.workflow import rule_player

SOURCE = Table("public", "orders", (
    Column("id", "bigint", 20, True, None, -1),
    Column("price", "numeric(10,2)", 1700, True, None, ((10 << 16) | 2) + 4),
    Column("name", "text", 25, False, None, -1),
), ("id",), type_tree={"oids": {}, "dims": {}})


def rule(outputs, target_columns, filtered=True) -> CompiledRule:
    target = Table("public", "out", tuple(target_columns), ("order_id",))
    return CompiledRule("out: SELECT …", SOURCE, target, "SELECT …", "orders", tuple(outputs), (1, 2),
                        filtered=filtered)


RULE = rule([("raw", 0), ("raw", 1), ("expr", "total"), ("expr", "shout")],
            [Column("order_id", "bigint", 20, True, None), Column("cost", "numeric(10,2)", 1700, True, None),
             Column("total", "numeric(21,2)", 0, False, None), Column("shout", "text", 0, False, None)])


@pytest.mark.parametrize(("spark_type", "arrow"), [
    ("tinyint", pa.int16()), ("smallint", pa.int16()), ("int", pa.int32()), ("bigint", pa.int64()),
    ("float", pa.float32()), ("double", pa.float64()), ("boolean", pa.bool_()), ("string", pa.string()),
    ("date", pa.date32()), ("timestamp", pa.timestamp("us", tz="UTC")), ("timestamp_ntz", pa.timestamp("us")),
    ("binary", pa.binary()), ("decimal(12,3)", pa.decimal128(12, 3)), ("decimal(38,0)", pa.decimal128(38, 0)),
])
def test_every_type_a_rule_may_compute_has_its_delta_type(spark_type, arrow):
    pg = rule_types.pg_type(spark_type)
    column = computed_column("'r'", Column("c", pg, 0, False, None))
    assert types.arrow_type(column, {"oids": {}, "dims": {}}) == arrow


def test_a_type_without_a_mapping_is_refused_with_the_way_out():
    with pytest.raises(UsageError, match=r"rule 'r': column 'c' is interval.*CAST it"):
        computed_column("'r'", Column("c", "interval", 0, False, None))


def test_the_lake_table_keeps_passed_columns_types_and_names_the_rules_columns():
    lake = lake_table(RULE)
    assert lake.column_names == ("order_id", "cost", "total", "shout") and lake.key == ("order_id",)
    schema = types.arrow_schema(lake)
    assert [schema.field(n).type for n in lake.column_names] == [
        pa.int64(), pa.decimal128(10, 2), pa.decimal128(21, 2), pa.string()]
    assert not schema.field("order_id").nullable


def test_spark_values_reach_delta_as_they_were():
    """A computed column's Arrow value -> PostgreSQL text (rules/types.pg_text) -> the Delta column's value."""
    values = {
        "int": pa.array([1, None, -7], pa.int32()),
        "bigint": pa.array([2**40, 0, None], pa.int64()),
        "double": pa.array([1.5, -0.25, None], pa.float64()),
        "boolean": pa.array([True, False, None]),
        "decimal(12,3)": pa.array([Decimal("1.500"), Decimal("-2.125"), None], pa.decimal128(12, 3)),
        "date": pa.array([date(2024, 1, 31), None, date(1970, 1, 1)], pa.date32()),
        "timestamp": pa.array([datetime(2024, 1, 1, 12, 30, 1, 5, tzinfo=timezone.utc), None,
                               datetime(1999, 12, 31, tzinfo=timezone.utc)], pa.timestamp("us", tz="UTC")),
        "timestamp_ntz": pa.array([datetime(2024, 1, 1, 12, 30, 1, 5), None, datetime(2000, 2, 29)],
                                  pa.timestamp("us")),
        "binary": pa.array([b"\x00\xff", None, b""], pa.binary()),
        "string": pa.array(["a", None, "ü"], pa.string()),
    }
    columns = [computed_column("'r'", Column(f"c{i}", rule_types.pg_type(t), 0, False, None))
               for i, t in enumerate(values)]
    lake = Table("public", "t", tuple(columns), (), type_tree={"oids": {}, "dims": {}})
    converted = types.convert_text_arrays(lake, [rule_types.pg_text(a) for a in values.values()])
    for (spark_type, want), got in zip(values.items(), converted):
        assert got.to_pylist() == want.to_pylist(), spark_type


def test_target_batch_is_the_rules_output_in_the_delta_schema():
    n = len(SOURCE.columns)
    result = pa.table({**{f"__sg_out_{i}": pa.array([v], pa.string()) for i, v in enumerate(["5", "1.25", "x"])},
                       "total": pa.array([Decimal("6.25")], pa.decimal128(21, 2)),
                       "shout": pa.array(["X"])})
    assert n == 3
    batch = target_batch(RULE, lake_table(RULE), result)
    assert batch.to_pylist()[0] | {} == {"order_id": 5, "cost": Decimal("1.25"), "total": Decimal("6.25"),
                                         "shout": "X", "_sg_special": None}


def changes(rows: list[tuple]) -> pa.Table:
    """A table's rows of a batch as table_frame gives them: the rule's output struct, the change, KEEP."""
    struct = pa.StructArray.from_arrays(
        [pa.array([r[2][j] if r[2] else None for r in rows], pa.string()) for j in range(3)]
        + [pa.array([r[3] for r in rows], pa.decimal128(21, 2)), pa.array([r[4] for r in rows], pa.string())],
        names=[OUT.format(j) for j in range(3)] + ["total", "shout"])
    return pa.table({"__sg_o0": struct,
                     rule_player.SEQ: pa.array(range(len(rows)), pa.int64()),
                     rule_player.OP: pa.array([r[0] for r in rows]),
                     rule_player.UNCH: pa.array([r[5] if len(r) > 5 else None for r in rows], pa.string()),
                     rule_player.META: pa.array([r[1] for r in rows], pa.string()),
                     KEEP: pa.array([r[6] if len(r) > 6 else (r[0] == "U") for r in rows])})


def test_folding_a_rules_output_deletes_what_leaves_the_filter():
    end = '{"position": 100, "limited": false, "transactions": 3, "commit_time": null}'
    rows = changes([
        ("U", None, ("1", "2.00", "a"), Decimal("2.00"), "A"),                       # kept
        ("U", None, ("2", "3.00", "b"), Decimal("3.00"), "B"),
        ("U", None, ("2", "3.00", "b"), None, None, None, False),                    # left the filter
        ("D", None, ("3", None, None), None, None, None, False),                     # deleted
        ("U", None, ("4", "1.00", "d"), Decimal("5.00"), "D", "2"),                  # name unchanged TOAST
        ("M", end, None, None, None),
    ])
    lake = lake_table(RULE)
    effect = apply.NetEffect(lake)
    marker = _fold(effect, SOURCE, lake, RULE.to_json(), rows, 0)
    assert marker["position"] == 100
    got = {k: (op, v, set(keep)) for k, (op, v, keep) in effect.rows.items()}
    assert got == {("1",): ("U", ("1", "2.00", "2.00", "A"), set()),
                   ("2",): ("D", None, set()),
                   ("3",): ("D", None, set()),
                   ("4",): ("U", ("4", "1.00", "5.00", "D"), set())}


def test_a_passed_through_column_not_sent_is_kept_from_the_delta_table():
    passthrough = rule([("raw", 0), ("raw", 2)], [Column("order_id", "bigint", 20, True, None),
                                                  Column("label", "text", 25, False, None)], filtered=False)
    end = '{"position": 7, "limited": false, "transactions": 1, "commit_time": null}'
    rows = changes([("U", None, ("9", "1.00", None), None, None, "2"), ("M", end, None, None, None)])
    lake = lake_table(passthrough)
    effect = apply.NetEffect(lake)
    _fold(effect, SOURCE, lake, passthrough.to_json(), rows, 0)
    assert effect.rows == {("9",): ("U", ("9", None), frozenset({1}))}

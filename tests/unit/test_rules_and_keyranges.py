"""Pure parts of rules and sharding: rule syntax, YAML rule files, key ranges, PostgreSQL text of Arrow values."""

from __future__ import annotations

import datetime
import decimal

import pyarrow as pa
import pytest

from sluicegate.errors import UsageError
from sluicegate.postgres.catalog import Column
from sluicegate.rules import types
from sluicegate.rules.spec import load_rules_file, parse_rule, parse_rules, wrap_select
from sluicegate.sharding.keyrange import KeyRange, check_partition, keyspace_id


def test_rule_syntax():
    r = parse_rule("items_eu: SELECT id, name FROM items WHERE region = 'eu: west'")
    assert (r.target, r.select) == ("items_eu", "SELECT id, name FROM items WHERE region = 'eu: west'")
    assert not r.is_pattern and parse_rule("item*: SELECT * FROM `item*`").is_pattern
    assert parse_rule("item*: select 1 from x").matches("public", "items")
    for bad in ("SELECT id FROM items", "x:", ": SELECT 1", "x: UPDATE items SET a = 1"):
        with pytest.raises(UsageError):
            parse_rule(bad)
    with pytest.raises(UsageError, match="two rules"):
        parse_rules(["a: SELECT 1 FROM t", "a: SELECT 2 FROM t"])
    assert wrap_select("  select a FROM t", ["x AS y"]) == "  select x AS y, a FROM t"


def test_rules_file(tmp_path):
    f = tmp_path / "rules.yaml"
    f.write_text("rules:\n  - 'a: SELECT id FROM a'\n  - b: SELECT id FROM b\n  - {target: c, select: SELECT id FROM c}\n")
    assert load_rules_file(str(f)) == ["a: SELECT id FROM a", "b: SELECT id FROM b", "c: SELECT id FROM c"]
    f.write_text("rules: nope\n")
    with pytest.raises(UsageError, match="list of rules"):
        load_rules_file(str(f))


def test_key_ranges():
    assert str(KeyRange.parse("-80")) == "-80" and str(KeyRange.parse("55-AA")) == "55-aa"
    assert KeyRange.parse("-80").overlaps(KeyRange.parse("55-aa"))
    assert not KeyRange.parse("-55").overlaps(KeyRange.parse("80-"))
    assert not KeyRange.parse("-80").overlaps(KeyRange.parse("80-"))  # the upper bound is exclusive
    assert KeyRange.parse("-80").intersect(KeyRange.parse("55-aa")) == KeyRange.parse("55-80")
    whole = KeyRange.parse("-")
    assert whole.contains("0" * 16) and whole.contains("f" * 16)
    assert KeyRange.parse("80-").contains("8000000000000000") and not KeyRange.parse("-80").contains("8000000000000000")
    assert keyspace_id("1") == "c4ca4238a0b92382"  # md5('1'), as PostgreSQL and Spark compute it
    check_partition("target", ["-55", "55-aa", "aa-"])
    for bad, why in ((["-80", "70-"], "overlaps"), (["-80", "90-"], "gap"), (["-80"], "nothing covers"),
                     (["80-"], "gap")):
        with pytest.raises(UsageError, match=why):
            check_partition("target", bad)
    for bad in ("zz", "80", "aa-55"):
        with pytest.raises(UsageError):
            KeyRange.parse(bad)


def test_spark_casts_and_postgres_types():
    col = lambda t: Column("c", t, 0, False, None)
    assert types.spark_expr(col("bigint"), "r") == "CAST(r AS BIGINT)"
    assert types.spark_expr(col("numeric(12,2)"), "r") == "CAST(r AS DECIMAL(12,2))"
    assert types.spark_expr(col("numeric"), "r") == "r"  # no Spark decimal holds every value
    assert types.spark_expr(col("numeric(40,2)"), "r") == "r"
    assert types.spark_expr(col("timestamp(3) with time zone"), "r") == "try_cast(r AS TIMESTAMP)"
    assert types.spark_expr(col("jsonb"), "r") == "r"
    assert types.pg_type("decimal(21,2)") == "numeric(21,2)" and types.pg_type("array<int>") is None
    values = [
        (pa.array([1, None], pa.int64()), ["1", None]),
        (pa.array([decimal.Decimal("1.50")], pa.decimal128(10, 2)), ["1.50"]),
        (pa.array([True, False]), ["true", "false"]),
        (pa.array([b"\x01\xff", None]), ["\\x01ff", None]),
        (pa.array([datetime.datetime(2024, 1, 2, 3, 4, 5, 6)], pa.timestamp("us", tz="UTC")),
         ["2024-01-02 03:04:05.000006Z"]),
        (pa.array([0.1, float("nan")]), ["0.1", "nan"]),
    ]
    for arr, text in values:
        assert types.pg_text(arr).to_pylist() == text


@pytest.mark.parametrize("spark_type,pg,fit", [
    ("int", "bigint", True), ("bigint", "integer", False), ("smallint", "numeric", True),
    ("decimal(10,2)", "numeric", True), ("decimal(10,2)", "numeric(12,2)", True),
    ("decimal(10,2)", "numeric(10,1)", False), ("decimal(38,6)", "bigint", False), ("decimal(5,0)", "integer", True),
    ("double", "integer", False), ("double", "real", False), ("float", "double precision", True),
    ("double", "text", True), ("string", "text", True), ("string", "uuid", None), ("bigint", "bigint", True),
])
def test_a_computed_column_fits_a_target_column_or_is_a_lossy_cast(spark_type, pg, fit):
    from sluicegate.rules.types import fits

    assert fits(spark_type, pg) is fit


def test_the_cast_that_fits_a_target_column():
    from sluicegate.rules.types import spark_cast_type, spark_type_of

    assert spark_cast_type("integer") == "INT" and spark_cast_type("numeric(12,2)") == "DECIMAL(12,2)"
    assert spark_type_of("numeric(10,2)") == "decimal(10,2)" and spark_type_of("smallint") == "smallint"
    assert spark_type_of("double precision") == "double" and spark_type_of("jsonb") is None

"""PostgreSQL's text forms parsed (lake/pgtext.py) and converted to the Delta columns' values (lake/types.py)."""

from __future__ import annotations

from datetime import date, datetime, timezone
from decimal import Decimal

import pyarrow as pa
import pytest

from sluicegate.errors import TerminalError
from sluicegate.postgres.catalog import Column, Table
from sluicegate.targets.delta import pgtext
from sluicegate.targets.delta.types import (
    DATE_INFINITY,
    SPECIAL,
    TS_INFINITY,
    arrow_schema,
    arrow_type,
    convert_column,
    record_batch,
)


@pytest.mark.parametrize("text, want, dims", [
    ("{}", [], 0),
    ("{1,2,3}", ["1", "2", "3"], 1),
    ("{NULL,\"NULL\",null}", [None, "NULL", None], 1),
    ('{"a b","c,d","e\\"f","g\\\\h",""}', ["a b", "c,d", 'e"f', "g\\h", ""], 1),
    ("{{1,2},{3,NULL}}", [["1", "2"], ["3", None]], 2),
    ("{{{1},{2}},{{3},{4}}}", [[["1"], ["2"]], [["3"], ["4"]]], 3),
    ('{"{x}","(1,2)"}', ["{x}", "(1,2)"], 1),
])
def test_array(text, want, dims):
    assert pgtext.parse_array(text) == (want, dims)


def test_array_box_delimiter_and_bounds():
    assert pgtext.parse_array("{(1,1),(0,0);(2,2),(1,1)}", ";") == (["(1,1),(0,0)", "(2,2),(1,1)"], 1)
    with pytest.raises(pgtext.Unrepresentable):
        pgtext.parse_array("[2:3]={1,2}")
    with pytest.raises(ValueError):
        pgtext.parse_array("{1,2")


@pytest.mark.parametrize("text, want", [
    ("(1,\"a b\",,\"\")", ["1", "a b", None, ""]),
    ('(1,"(x,2)","say ""hi""","back\\\\slash")', ["1", "(x,2)", 'say "hi"', "back\\slash"]),
    ("(,)", [None, None]),
    ('("{1,2}",t)', ["{1,2}", "t"]),
])
def test_composite(text, want):
    assert pgtext.parse_composite(text) == want


def test_hstore():
    text = '"a"=>"1", "b"=>NULL, "c d"=>"x\\"y", "NULL"=>"NULL", ""=>""'
    assert pgtext.parse_hstore(text) == [("a", "1"), ("b", None), ("c d", 'x"y'), ("NULL", "NULL"), ("", "")]
    assert pgtext.parse_hstore("") == []


@pytest.mark.parametrize("text, want", [
    ("[1,5)", ("1", "5", True, False, False)),
    ("empty", (None, None, False, False, True)),
    ("(,5]", (None, "5", False, True, False)),
    ("[3,)", ("3", None, True, False, False)),
    ('["2024-01-01 00:00:00+00",infinity)', ("2024-01-01 00:00:00+00", "infinity", True, False, False)),
    ('["a ""b""",)', ('a "b"', None, True, False, False)),
])
def test_range(text, want):
    assert pgtext.parse_range(text) == want


def test_multirange():
    assert pgtext.parse_multirange("{}") == []
    assert pgtext.parse_multirange("{[1,3), [5,7)}") == [("1", "3", True, False, False), ("5", "7", True, False, False)]


US = 1_000_000


@pytest.mark.parametrize("text, want", [
    ("00:00:00", (0, 0, 0)),
    ("1 year 2 mons 3 days 04:05:06.789", (14, 3, (4 * 3600 + 5 * 60 + 6) * US + 789_000)),
    ("-1 years -2 mons +3 days -04:05:06", (-14, 3, -(4 * 3600 + 5 * 60 + 6) * US)),
    ("1 day -00:00:00.000001", (0, 1, -1)),
    ("-178956970 years -8 mons -2147483648 days -2562047788:00:54.775808",
     (-2147483648, -2147483648, -(2**63))),
    ("P1Y2M3DT4H5M6.789S", (14, 3, (4 * 3600 + 5 * 60 + 6) * US + 789_000)),
    ("P-1Y-2M3DT-4H-5M-6S", (-14, 3, -(4 * 3600 + 5 * 60 + 6) * US)),
    ("PT0S", (0, 0, 0)),
])
def test_interval(text, want):
    assert pgtext.parse_interval(text) == want


def test_dates_by_arithmetic():
    assert pgtext.parse_date("1970-01-01") == 0
    assert pgtext.parse_date("2024-02-29") == (date(2024, 2, 29) - date(1970, 1, 1)).days
    assert pgtext.parse_date("0001-01-01") == (date(1, 1, 1) - date(1970, 1, 1)).days
    assert pgtext.parse_date("0001-12-31 BC") == pgtext.parse_date("0001-01-01") - 1  # year 0 = 1 BC
    assert pgtext.parse_date("0044-03-15 BC") == pgtext.days_from_civil(-43, 3, 15)
    assert pgtext.parse_date("12000-01-01") == pgtext.days_from_civil(12000, 1, 1) > 0
    assert pgtext.parse_date("infinity") == "infinity"
    assert pgtext.parse_date("4714-11-24 BC") == -2440588  # PostgreSQL's first day (Julian day 0)


def test_timestamps_by_arithmetic():
    at = datetime(2024, 1, 2, 3, 4, 5, 123456, tzinfo=timezone.utc)
    micros = (at - datetime(1970, 1, 1, tzinfo=timezone.utc)) // datetime.resolution
    assert pgtext.parse_timestamp("2024-01-02 03:04:05.123456") == micros
    assert pgtext.parse_timestamp("2024-01-02 03:04:05.123456+00") == micros
    assert pgtext.parse_timestamp("2024-01-02 05:04:05.123456+02") == micros
    assert pgtext.parse_timestamp("2024-01-02 03:34:05.123456+00:30") == micros
    assert pgtext.parse_timestamp("0044-03-15 12:00:00+00 BC") == (pgtext.days_from_civil(-43, 3, 15) * 86400
                                                                   + 12 * 3600) * US
    assert pgtext.parse_timestamp("10000-01-01 00:00:00") == pgtext.days_from_civil(10000, 1, 1) * 86400 * US
    assert pgtext.parse_timestamp("-infinity") == "-infinity"


def col(name, oid, typmod=-1, type_sql="x"):
    return Column(name, type_sql, oid, False, None, typmod)


def numeric(p, s):
    return ((p << 16) | s) + 4


# Table.type_tree as catalog.describe_types gives it: a composite with a nested composite and an array, hstore,
# ranges, arrays of numeric(10,2)/text/enum, geometry
TYPES = {"oids": {
    "23": {"kind": "b", "name": "int4"}, "25": {"kind": "b", "name": "text"}, "1700": {"kind": "b", "name": "numeric"},
    "1007": {"kind": "b", "name": "_int4", "elem": 23, "delim": ","},
    "1009": {"kind": "b", "name": "_text", "elem": 25, "delim": ","},
    "1231": {"kind": "b", "name": "_numeric", "elem": 1700, "delim": ","},
    "1186": {"kind": "b", "name": "interval"}, "1082": {"kind": "b", "name": "date"},
    "1184": {"kind": "b", "name": "timestamptz"},
    "20000": {"kind": "c", "name": "inner_t", "attrs": [["x", 25, -1, 0], ["n", 23, -1, 0]]},
    "20001": {"kind": "c", "name": "outer_t", "attrs": [["a", 23, -1, 0], ["inner", 20000, -1, 0],
                                                        ["tags", 1009, -1, 1]]},
    "20002": {"kind": "b", "name": "hstore"},
    "20003": {"kind": "e", "name": "mood"}, "20004": {"kind": "b", "name": "_mood", "elem": 20003, "delim": ","},
    "20005": {"kind": "b", "name": "geometry"},
    "3904": {"kind": "r", "name": "int4range", "sub": 23}, "3910": {"kind": "r", "name": "tstzrange", "sub": 1184},
    "4451": {"kind": "m", "name": "int4multirange", "range": 3904},
    "20006": {"kind": "d", "name": "posint", "base": 23, "basemod": -1},
}, "dims": {"grid": 2}, "columns": ["a", "grid", "c", "h", "r", "m", "g", "i", "d", "e", "t", "id", "n"]}
RANGE = pa.struct([("lower", pa.int32()), ("upper", pa.int32()), ("lower_inclusive", pa.bool_()),
                   ("upper_inclusive", pa.bool_()), ("empty", pa.bool_())])


@pytest.mark.parametrize("column, want", [
    (col("a", 1007), pa.list_(pa.int32())),
    (col("grid", 1007), pa.list_(pa.list_(pa.int32()))),
    (col("a", 1231, numeric(10, 2)), pa.list_(pa.decimal128(10, 2))),
    (col("a", 20004), pa.list_(pa.string())),
    (col("c", 20001), pa.struct([("a", pa.int32()), ("inner", pa.struct([("x", pa.string()), ("n", pa.int32())])),
                                 ("tags", pa.list_(pa.string()))])),
    (col("h", 20002), pa.map_(pa.string(), pa.string())),
    (col("r", 3904), RANGE),
    (col("m", 4451), pa.list_(RANGE)),
    (col("g", 20005), pa.binary()),
    (col("i", 1186), pa.struct([("months", pa.int32()), ("days", pa.int32()), ("microseconds", pa.int64())])),
    (col("d", 20006), pa.int32()),
    (col("e", 20003), pa.string()),
])
def test_mapped_types(column, want):
    assert arrow_type(column, TYPES) == want


def test_legacy_description_keeps_text():
    assert arrow_type(col("a", 1007)) == pa.string() and arrow_type(col("i", 1186)) == pa.string()
    # a column added after the description was made: the first mapping too
    assert arrow_type(col("added", 1007), TYPES) == pa.string()
    assert arrow_type(col("added", 1082), TYPES) == pa.date32()


def test_values_converted():
    cases = [
        (col("a", 1007), "{1,NULL,3}", [1, None, 3]),
        (col("grid", 1007), "{{1,2},{3,4}}", [[1, 2], [3, 4]]),
        (col("a", 1007), "{}", []),
        (col("a", 1231, numeric(10, 2)), "{1.50,NULL}", [Decimal("1.50"), None]),
        (col("a", 20004), '{happy,"sad face"}', ["happy", "sad face"]),
        (col("c", 20001), '(1,"(""a b"",2)","{x,NULL}")', {"a": 1, "inner": {"x": "a b", "n": 2},
                                                          "tags": ["x", None]}),
        (col("c", 20001), "(,,)", {"a": None, "inner": None, "tags": None}),
        (col("h", 20002), '"k"=>"v", "n"=>NULL', [("k", "v"), ("n", None)]),
        (col("r", 3904), "[1,5)", {"lower": 1, "upper": 5, "lower_inclusive": True, "upper_inclusive": False,
                                   "empty": False}),
        (col("r", 3904), "empty", {"lower": None, "upper": None, "lower_inclusive": False,
                                   "upper_inclusive": False, "empty": True}),
        (col("m", 4451), "{[1,3),[5,)}", [{"lower": 1, "upper": 3, "lower_inclusive": True,
                                           "upper_inclusive": False, "empty": False},
                                          {"lower": 5, "upper": None, "lower_inclusive": True,
                                           "upper_inclusive": False, "empty": False}]),
        (col("g", 20005), "0101000020E6100000000000000000F03F0000000000000040",
         bytes.fromhex("0101000020E6100000000000000000F03F0000000000000040")),
        (col("i", 1186), "1 mon -2 days 00:00:01", {"months": 1, "days": -2, "microseconds": 1_000_000}),
    ]
    for column, text, want in cases:
        got = convert_column(column, [text, None], TYPES).to_pylist()
        assert got == [want, None], column


def test_infinities_are_sentinels():
    dates = convert_column(col("d", 1082), ["infinity", "-infinity", "0044-03-15 BC"], TYPES)
    assert dates.cast(pa.int32()).to_pylist() == [DATE_INFINITY, -DATE_INFINITY, pgtext.days_from_civil(-43, 3, 15)]
    ts = convert_column(col("t", 1184), ["infinity", "-infinity", "12000-01-01 00:00:00+00"], TYPES)
    assert ts.cast(pa.int64()).to_pylist()[:2] == [TS_INFINITY, -TS_INFINITY]
    rng = convert_column(col("r", 3910), ["[2024-01-01 00:00:00+00,infinity)"], TYPES)
    assert rng.field("upper").cast(pa.int64()).to_pylist() == [TS_INFINITY]


def table():
    return Table("public", "t", (Column("id", "integer", 23, True, None, -1),
                                 Column("n", "numeric(10,2)", 1700, False, None, numeric(10, 2)),
                                 Column("a", "integer[]", 1007, False, None, -1),
                                 Column("d", "date", 1082, False, None, -1)), ("id",), type_tree=TYPES)


def test_unrepresentable_values_go_to_special():
    t = table()
    assert arrow_schema(t).names == ["id", "n", "a", "d", SPECIAL]
    rows = [("1", "NaN", "[0:1]={1,2}", "5874897-12-31"), ("2", "-Infinity", "{{1}}", "2024-01-01"),
            ("3", "1.25", "{1}", None)]
    got = record_batch(t, rows).to_pylist()
    assert got[0] == {"id": 1, "n": None, "a": None, "d": None,
                      SPECIAL: [("n", "NaN"), ("a", "[0:1]={1,2}"), ("d", "5874897-12-31")]}
    assert got[1]["n"] is None and got[1]["a"] is None and got[1][SPECIAL] == [("n", "-Infinity"), ("a", "{{1}}")]
    assert got[1]["d"] == date(2024, 1, 1)
    assert got[2] == {"id": 3, "n": Decimal("1.25"), "a": [1], "d": None, SPECIAL: None}


def test_legacy_table_without_special_stops_with_a_way_out():
    t = Table("public", "t", table().columns, ("id",))
    assert SPECIAL not in arrow_schema(t).names
    with pytest.raises(TerminalError, match="re-create the workflow"):
        record_batch(t, [("1", "NaN", None, None)])


@pytest.mark.parametrize("text", ["2024-01-02 03:04:05.123456+00", "1999-12-31 23:59:59", "0001-01-01 00:00:00+00",
                                  "2024-02-29 12:00:00.5+05:30", "1969-12-31 23:59:59.999999"])
def test_fast_path_agrees_with_the_arithmetic(text):
    from sluicegate.targets.delta import types

    assert types._timestamp(text) == pgtext.parse_timestamp(text)
    day = text[:10]
    assert types._date(day) == pgtext.parse_date(day)


def test_a_kept_toasted_column_keeps_its_special_entry(tmp_path):
    """An update that does not carry an unchanged TOASTed column keeps the column's value and its
    `_sg_special` entry; the row's other entries are the update's."""
    from deltalake import DeltaTable

    from sluicegate.postgres.pgoutput import UNCHANGED
    from sluicegate.targets.delta.apply import NetEffect, merge

    t = table()
    DeltaTable.create(str(tmp_path), arrow_schema(t))
    first = NetEffect(t)
    first.add("I", None, ("1", "NaN", "[0:1]={1,2}", "2024-01-01"))
    first.add("I", None, ("2", "1.00", "{1}", None))
    first.add("I", None, ("3", "NaN", "{5}", None))
    merge(DeltaTable(str(tmp_path)), t, first, "sluicegate:w", 1)
    second = NetEffect(t)
    second.add("U", None, ("1", "2.50", UNCHANGED, None))  # n's entry goes, a's stays
    second.add("U", None, ("2", "NaN", UNCHANGED, None))  # a kept, with no entry: n's new one
    second.add("U", None, ("3", "NaN", "{{1}}", None))  # nothing kept
    merge(DeltaTable(str(tmp_path)), t, second, "sluicegate:w", 2)
    import pyarrow.dataset as ds

    rows = {r["id"]: r for r in ds.dataset(DeltaTable(str(tmp_path)).file_uris()).to_table().to_pylist()}
    assert rows[1]["n"] == Decimal("2.50") and rows[1]["a"] is None
    assert rows[1][SPECIAL] == [("a", "[0:1]={1,2}")]
    assert rows[2]["a"] == [1] and rows[2][SPECIAL] == [("n", "NaN")]
    assert rows[3][SPECIAL] == [("n", "NaN"), ("a", "{{1}}")]


def test_a_key_without_a_delta_form_stops_naming_the_way_out():
    t = Table("public", "t", (Column("k", "numeric(10,2)", 1700, True, None, numeric(10, 2)),), ("k",), type_tree=TYPES)
    with pytest.raises(TerminalError, match="column k .*cannot key a row by it"):
        record_batch(t, [("NaN",)])

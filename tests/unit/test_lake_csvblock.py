"""The copy's block path (COPY … (FORMAT csv) -> csvblock.string_arrays -> types.convert_text_arrays) gives the
same Arrow values as the per-value path (types.record_batch over text tuples), for every type types.py maps:
NULLs, empty strings, quotes, delimiters, newlines, backslashes, unicode, extremes, and the values Arrow's
casts refuse (NaN in numeric(p,s), BC dates, infinities), which go value by value."""

from __future__ import annotations

import random
import struct

import numpy as np
import pyarrow as pa
import pytest

from sluicegate.errors import TerminalError
from sluicegate.postgres.catalog import Column, Table
from sluicegate.targets.delta.csvblock import string_arrays
from sluicegate.targets.delta.types import (
    DATE_INFINITY,
    SPECIAL,
    arrow_schema,
    convert_text_arrays,
    record_batch,
)

from .test_lake_pgtext import TYPES as STRUCTURED
from .test_lake_pgtext import numeric


def pg_csv(rows: list[tuple]) -> bytes:
    """Rows of text values as PostgreSQL's COPY … (FORMAT csv) writes them (copyto.c, CopyAttributeOutCSV):
    NULL an unquoted empty field; a value quoted if it is empty, is `\\.`, or holds a delimiter, a quote, a
    newline or a carriage return; quotes doubled inside; one line a row."""
    out = []
    for row in rows:
        fields = []
        for v in row:
            if v is None:
                fields.append("")
            elif v in ("", "\\.") or any(c in v for c in ',"\n\r'):
                fields.append('"' + v.replace('"', '""') + '"')
            else:
                fields.append(v)
        out.append(",".join(fields) + "\n")
    return "".join(out).encode()


def col(name, oid, typmod=-1, key=False):
    return Column(name, "x", oid, key, None, typmod)


TEXTS = ["", " ", "a,b", 'say "hi"', '"', '""', "line\nbreak", "cr\r\nlf", "back\\slash", "\\.", "\\N", "NULL",
         "ünïcødé ✓ 日本", "\t tab", "trailing ", "x" * 5000, ",", "\n"]
# (column, values): every scalar mapping, then the structured ones (types.py's _Mapper over a type tree)
COLUMNS = [
    (col("id", 20, key=True), None),  # filled with row numbers
    (col("flag", 16), ["t", "f"]),
    (col("i2", 21), ["32767", "-32768", "0"]),
    (col("i4", 23), ["2147483647", "-2147483648", "7"]),
    (col("i8", 20), ["9223372036854775807", "-9223372036854775808"]),
    (col("oid", 26), ["4294967295", "0"]),
    (col("f4", 700), ["1.5", "NaN", "Infinity", "-Infinity", "-0", "3.4028235e+38", "1e-45", "1.1754944e-38",
                      "0.1", "16777217"]),
    (col("f8", 701), ["1.7976931348623157e+308", "5e-324", "NaN", "-Infinity", "-0", "0.1", "2.2250738585072014e-308"]),
    (col("dec", 1700, numeric(12, 2)), ["1234567890.12", "-0.01", "0.00", "-9999999999.99"]),
    (col("dec38", 1700, numeric(38, 10)), ["9999999999999999999999999999.9999999999", "-1.0000000000"]),
    (col("num", 1700), ["NaN", "1e-30", "123.456000", "-Infinity", ""]),
    (col("text", 25), TEXTS),
    (col("vc", 1043), ["a", "", "é"]),
    (col("bpchar", 1042), ["ab   ", "  "]),
    (col("name", 19), ["pg_catalog"]),
    (col("uuid", 2950), ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"]),
    (col("json", 114), ['{"a": "b,\\"c\\"\\n"}', "[]"]),
    (col("bytea", 17), ["\\x", "\\x00ff2c22", "\\x0a0d"]),
    (col("date", 1082), ["2024-02-29", "0001-01-01", "9999-12-31", "1970-01-01", "1969-12-31"]),
    (col("ts", 1114), ["2024-02-29 23:59:59.999999", "0001-01-01 00:00:00", "9999-12-31 23:59:59.999999",
                       "1970-01-01 00:00:00", "1969-12-31 23:59:59.5", "2000-01-01 00:00:00.000001"]),
    (col("tstz", 1184), ["2024-02-29 23:59:59.999999+00", "0001-01-01 00:00:00+00", "1970-01-01 00:00:00+00",
                         "9999-12-31 23:59:59.999999+00"]),
    (col("interval", 1186), ["1 mon -2 days 00:00:01", "00:00:00", "-178000000 years"]),
]
STRUCTURED_COLUMNS = [
    (col("a", 1007), ["{1,NULL,3}", "{}", '{"1"}']),
    (col("grid", 1007), ["{{1,2},{3,4}}"]),
    (col("c", 20001), ['(1,"(""a b"",2)","{x,NULL}")', "(,,)", '(2,"(""line\nbreak"",3)","{""q\\""""}")']),
    (col("h", 20002), ['"k"=>"v", "n"=>NULL', '"a,b"=>"c\\"d"', ""]),
    (col("r", 3904), ["[1,5)", "empty", "(,)"]),
    (col("m", 4451), ["{[1,3),[5,)}", "{}"]),
    (col("g", 20005), ["0101000020E6100000000000000000F03F0000000000000040"]),
    (col("i", 1186), ["1 mon -2 days 00:00:01"]),
    (col("d", 1082), ["2024-01-01"]),
    (col("t", 1184), ["2024-01-01 00:00:00+00"]),
    (col("e", 20003), ["happy", ""]),
]
# values Arrow's casts refuse: NULL in their column, their text in _sg_special (the per-value path's)
SPECIAL_VALUES = {"dec": ["NaN", "Infinity"], "date": ["0044-03-15 BC", "infinity", "-infinity", "12345-01-01"],
                  "ts": ["infinity", "0044-03-15 10:00:00 BC", "-infinity"],
                  "tstz": ["infinity", "0001-12-31 23:59:59+00 BC"], "d": ["infinity"], "t": ["-infinity"]}


def table(columns, key=("id",), types=None):
    return Table("public", "t", tuple(c for c, _ in columns), key, type_tree=types)


def rows_of(columns, special=False, n=60, seed=1):
    """`n` rows: each column cycles through its values and NULL (the key: the row number)."""
    rnd = random.Random(seed)
    out = []
    for r in range(n):
        row = []
        for c, values in columns:
            if values is None:
                row.append(str(r))
                continue
            pool = values + SPECIAL_VALUES.get(c.name, []) if special else values
            row.append(None if rnd.random() < 0.15 else pool[(r + rnd.randint(0, 3)) % len(pool)])
        out.append(tuple(row))
    return out


def exact(batch: pa.RecordBatch) -> list:
    """The batch's values, floats by their bits (NaN and -0.0 compared exactly)."""
    def norm(v):
        if isinstance(v, float):
            return ("float", struct.pack("<d", v))
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v

    plain = pa.schema([f.with_type(_plain(f.type)) for f in batch.schema])
    return [{k: norm(v) for k, v in row.items()} for row in batch.cast(plain).to_pylist()]


def _plain(dtype: pa.DataType) -> pa.DataType:
    """`dtype` with dates and timestamps as their integers (infinity sentinels have no Python date)."""
    if pa.types.is_date32(dtype):
        return pa.int32()
    if pa.types.is_timestamp(dtype):
        return pa.int64()
    if pa.types.is_struct(dtype):
        return pa.struct([f.with_type(_plain(f.type)) for f in dtype])
    if pa.types.is_list(dtype):
        return pa.list_(_plain(dtype.value_type))
    return dtype


def block_path(t: Table, rows: list[tuple]) -> pa.RecordBatch:
    texts = string_arrays(len(t.columns), pg_csv(rows))
    return pa.RecordBatch.from_arrays(convert_text_arrays(t, texts), schema=arrow_schema(t))


def assert_same(t, rows):
    want = record_batch(t, rows)
    got = block_path(t, rows)
    assert got.schema == want.schema
    assert exact(got) == exact(want)
    return got


def test_every_scalar_type_legacy_mapping():
    """Tables described before the type tree (no _sg_special): scalars typed, the rest text."""
    assert_same(table(COLUMNS), rows_of(COLUMNS))


def test_every_type_with_its_structure_and_special_values():
    columns = COLUMNS + STRUCTURED_COLUMNS
    types = {**STRUCTURED, "columns": [c.name for c, _ in columns]}
    t = table(columns, types=types)
    got = assert_same(t, rows_of(columns, special=True, n=200))
    specials = [s for s in got.column(SPECIAL).to_pylist() if s]
    assert {k for s in specials for k, _ in s} == {"dec", "c"}  # (dates: infinities as sentinels, BC by arithmetic)
    assert DATE_INFINITY in got.column("date").cast(pa.int32()).to_pylist()


def test_text_nulls_empty_and_quoting_round_trip():
    t = table([(col("id", 20, key=True), None), (col("text", 25), TEXTS)])
    rows = [(str(i), v) for i, v in enumerate([*TEXTS, None])]
    got = assert_same(t, rows)
    assert got.column("text").to_pylist() == [*TEXTS, None]


def test_a_row_of_one_null_is_an_empty_line():
    t = Table("public", "t", (col("v", 25, key=False),), ())
    rows = [(None,), ("",), (None,), ("x",), (None,)]
    assert pg_csv(rows) == b'\n""\n\nx\n\n'  # the NULLs are empty lines
    assert block_path(t, rows).column("v").to_pylist() == [None, "", None, "x", None]


def test_float4_and_float8_bits_at_random():
    rnd = np.random.default_rng(7)
    f4 = rnd.integers(0, 2**32, 20_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    f8 = rnd.integers(0, 2**63, 20_000, dtype=np.uint64).view(np.float64)
    # shortest round-trip text, as PostgreSQL 12+ writes floats (extra_float_digits 1)
    t4 = [str(v) if np.isfinite(v) else ("NaN" if np.isnan(v) else ("Infinity" if v > 0 else "-Infinity"))
          for v in f4]
    t8 = [repr(float(v)) if np.isfinite(v) else ("NaN" if np.isnan(v) else ("Infinity" if v > 0 else "-Infinity"))
          for v in f8]
    columns = [(col("id", 20, key=True), None), (col("f4", 700), None), (col("f8", 701), None)]
    rows = [(str(i), a, b) for i, (a, b) in enumerate(zip(t4, t8))]
    assert_same(table(columns), rows)


def test_many_blocks_and_dates_at_random():
    rnd = random.Random(3)
    rows = []
    for i in range(5000):
        days = rnd.randint(-719162, 2932896)  # 0001-01-01 .. 9999-12-31
        d = np.datetime64("1970-01-01") + np.timedelta64(days, "D")
        us = rnd.randint(0, 86_400_000_000 - 1)
        ts = np.datetime64(str(d)) + np.timedelta64(us, "us")
        text = str(ts).replace("T", " ")
        text = text.rstrip("0").rstrip(".") if "." in text else text
        rows.append((str(i), str(d), text, text + "+00",
                     f"{rnd.randint(-10**9, 10**9)}.{rnd.randint(0, 99):02d}"))
    columns = [(col("id", 20, key=True), None), (col("d", 1082), None), (col("ts", 1114), None),
               (col("tstz", 1184), None), (col("n", 1700, numeric(12, 2)), None)]
    assert_same(table(columns), rows)


def test_a_key_value_without_a_form_is_terminal_both_ways():
    t = table([(col("id", 1082, key=True), None)], types={"oids": {}, "dims": {}, "columns": ["id"]})
    rows = [("2024-01-01",), ("infinity",), ("0044-03-15 BC",), ("5874897-12-31",)]
    assert_same(t, rows[:3])
    with pytest.raises(TerminalError, match="column id"):
        record_batch(t, rows)
    with pytest.raises(TerminalError, match="column id"):
        block_path(t, rows)


def test_scalars_take_the_vectorized_path():
    """The values above (bar the refused ones) are cast by Arrow, not value by value: the equality above is
    the vectorized path's."""
    from sluicegate.targets.delta.types import _vectorized, arrow_type

    vectorized = {"flag", "i2", "i4", "i8", "oid", "f4", "f8", "dec", "dec38", "num", "text", "vc", "bpchar", "name",
                  "uuid", "json", "date", "ts", "tstz", "interval"}  # (interval: text, legacy)
    for c, values in COLUMNS[1:]:
        got = _vectorized(arrow_type(c), pa.array(values, pa.string()))
        assert (got is not None) == (c.name in vectorized), c.name

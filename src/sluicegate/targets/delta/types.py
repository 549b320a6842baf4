"""PostgreSQL columns as Arrow (Delta) columns, and PostgreSQL's text form of a value as the Arrow value.

One conversion path for the copy and the stream: the copy reads every column as its output function's text
and the stream's pgoutput values are that text, both with Sluicegate's session settings (ISO dates, UTC,
hex bytea, IntervalStyle postgres). targets/delta/pgtext.py parses the structured forms.

The mapping (README, "Delta Lake target", has the table): arrays -> lists (nested as the column's declared
dimensions), composites -> structs, hstore -> map<string, string>, ranges -> struct of bounds, multiranges ->
lists of those, interval -> struct{months, days, microseconds}, PostGIS geometry/geography -> binary EWKB,
dates and timestamps by arithmetic (BC and years past 9999 included; ±infinity as sentinels), what Arrow has
no faithful type for (unbounded numeric, json, xml, enums, time, ...) PostgreSQL's text.

A value a column's Arrow type cannot hold (NaN or ±Infinity in numeric(p,s), an array with other dimensions
or lower bounds than 1, a date or timestamp past the sentinels) is NULL in its column and kept, as
PostgreSQL's exact text, in the table's `_sg_special` map (column name -> text): nothing the source holds
stops the stream, and nothing is lost.

Tables described before the types' structure was kept (Table.type_tree None) keep the first mapping: only
scalars typed, everything else text, no `_sg_special`; their Delta tables were made so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import date, datetime, timedelta, timezone

import pyarrow as pa
import pyarrow.compute as pc

from ...errors import TerminalError
from ...postgres.catalog import Column, Table
from . import pgtext

BOOL, BYTEA, INT8, INT2, INT4, TEXT, OID = 16, 17, 20, 21, 23, 25, 26
FLOAT4, FLOAT8 = 700, 701
BPCHAR, VARCHAR, NAME = 1042, 1043, 19
DATE, TIMESTAMP, TIMESTAMPTZ, INTERVAL = 1082, 1114, 1184, 1186
NUMERIC, UUID = 1700, 2950
MAX_DECIMAL128 = 38

SPECIAL = "_sg_special"
SPECIAL_TYPE = pa.map_(pa.string(), pa.string())
# ±infinity: timestamps as DuckDB's own infinities (±(2^63-1) microseconds); dates at the last day delta-rs
# can write statistics for (262142-12-31, and its mirror): the int32 extremes make delta-rs panic.
TS_INFINITY = 2**63 - 1
DATE_INFINITY = 95_026_236
INTERVAL_TYPE = pa.struct([("months", pa.int32()), ("days", pa.int32()), ("microseconds", pa.int64())])
WKB_TYPES = ("geometry", "geography")


def numeric_precision(typmod: int | None) -> tuple[int, int] | None:
    """numeric(p,s)'s (p, s) from its atttypmod; None for an unbounded numeric."""
    if typmod is None or typmod < 4:
        return None
    mod = typmod - 4
    return (mod >> 16) & 0xFFFF, mod & 0xFFFF


def _scalar(oid: int, typmod: int | None) -> pa.DataType | None:
    if oid == BOOL:
        return pa.bool_()
    if oid == INT2:
        return pa.int16()
    if oid == INT4:
        return pa.int32()
    if oid in (INT8, OID):
        return pa.int64()
    if oid == FLOAT4:
        return pa.float32()
    if oid == FLOAT8:
        return pa.float64()
    if oid == NUMERIC:
        ps = numeric_precision(typmod)
        if ps is not None and ps[0] <= MAX_DECIMAL128 and ps[1] <= ps[0]:
            return pa.decimal128(*ps)
        return pa.string()  # unbounded (any scale) or wider than decimal128: the exact text
    if oid == BYTEA:
        return pa.binary()
    if oid == DATE:
        return pa.date32()
    if oid == TIMESTAMP:
        return pa.timestamp("us")
    if oid == TIMESTAMPTZ:
        return pa.timestamp("us", tz="UTC")
    return None


class _Mapper:
    """Arrow types and converters of the types in a Table.type_tree description."""

    def __init__(self, types: dict | None):
        self.oids = (types or {}).get("oids", {})
        self.dims = (types or {}).get("dims", {})
        self.legacy = types is None

    def desc(self, oid: int) -> dict | None:
        return self.oids.get(str(oid))

    def arrow(self, oid: int, typmod: int | None, dims: int = 0) -> pa.DataType:
        scalar = _scalar(oid, typmod)
        if scalar is not None:
            return scalar
        d = self.desc(oid)
        if self.legacy or d is None:
            return pa.string()
        kind = d["kind"]
        if kind == "d":
            return self.arrow(d["base"], d["basemod"], dims)
        if d.get("elem"):
            dtype = self.arrow(d["elem"], typmod)
            for _ in range(max(dims, 1)):
                dtype = pa.list_(dtype)
            return dtype
        if kind == "c":
            return pa.struct([pa.field(n, self.arrow(o, m, nd)) for n, o, m, nd in d["attrs"]])
        if kind == "r":
            sub = self.arrow(d["sub"], -1)
            return pa.struct([("lower", sub), ("upper", sub), ("lower_inclusive", pa.bool_()),
                              ("upper_inclusive", pa.bool_()), ("empty", pa.bool_())])
        if kind == "m":
            return pa.list_(self.arrow(d["range"], -1))
        if oid == INTERVAL:
            return INTERVAL_TYPE
        if d["name"] == "hstore":
            return pa.map_(pa.string(), pa.string())
        if d["name"] in WKB_TYPES:
            return pa.binary()
        return pa.string()  # enums, json, xml, time, inet, uuid, money, ...: PostgreSQL's text

    def convert(self, oid: int, typmod: int | None, dims: int = 0) -> Callable[[str], object]:
        """PostgreSQL's text of a non-null value -> the Python value Arrow stores for `arrow(...)`; raises
        pgtext.Unrepresentable (or ValueError) for a value the type cannot hold."""
        dtype = self.arrow(oid, typmod, dims)
        if pa.types.is_string(dtype):
            return str
        if pa.types.is_boolean(dtype):
            return _bool
        if pa.types.is_integer(dtype):
            return int
        if pa.types.is_floating(dtype):
            return float  # 'NaN', 'Infinity', '-Infinity' read as Python's
        if pa.types.is_decimal(dtype):
            return _decimal
        if pa.types.is_binary(dtype):
            return _bytea if oid == BYTEA else _hex
        if pa.types.is_date(dtype):
            return _date
        if pa.types.is_timestamp(dtype):
            return _timestamp
        d = self.desc(oid)
        if d["kind"] == "d":
            return self.convert(d["base"], d["basemod"], dims)
        if d.get("elem"):
            return self._array(self.convert(d["elem"], typmod), max(dims, 1), d.get("delim") or ",")
        if d["kind"] == "c":
            return self._composite([(n, self.convert(o, m, nd)) for n, o, m, nd in d["attrs"]])
        if d["kind"] == "r":
            sub = self.convert(d["sub"], -1)
            return lambda text: _range_value(sub, pgtext.parse_range(text))
        if d["kind"] == "m":
            sub = self.convert(self.desc(d["range"])["sub"], -1)
            return lambda text: [_range_value(sub, r) for r in pgtext.parse_multirange(text)]
        if oid == INTERVAL:
            return _interval
        if d["name"] == "hstore":
            return pgtext.parse_hstore
        raise AssertionError(f"no converter for {dtype}")

    @staticmethod
    def _array(element: Callable, dims: int, delim: str) -> Callable[[str], list]:
        def walk(items: list, depth: int) -> list:
            if depth == 1:
                if any(isinstance(v, list) for v in items):
                    raise pgtext.Unrepresentable("array of more dimensions than the column's")
                return [None if v is None else element(v) for v in items]
            if not all(isinstance(v, list) for v in items):
                raise pgtext.Unrepresentable("array of fewer dimensions than the column's")
            return [walk(v, depth - 1) for v in items]

        def convert(text: str) -> list:
            items, found = pgtext.parse_array(text, delim)
            if found == 0:
                return []
            if found != dims:
                raise pgtext.Unrepresentable(f"array of {found} dimensions in a column of {dims}")
            return walk(items, dims)

        return convert

    @staticmethod
    def _composite(attrs: list[tuple[str, Callable]]) -> Callable[[str], dict]:
        def convert(text: str) -> dict:
            fields = pgtext.parse_composite(text)
            if len(fields) != len(attrs):
                raise ValueError(f"composite value has {len(fields)} fields, its type {len(attrs)}")
            return {n: None if v is None else fn(v) for (n, fn), v in zip(attrs, fields)}

        return convert


def _range_value(sub: Callable, parsed: tuple) -> dict:
    lo, hi, lo_inc, hi_inc, empty = parsed
    return {"lower": None if lo is None else sub(lo), "upper": None if hi is None else sub(hi),
            "lower_inclusive": lo_inc, "upper_inclusive": hi_inc, "empty": empty}


def _described(column: Column, types: dict | None) -> dict | None:
    """`types` if it describes the column, else None (the first mapping): a column added to the source
    after the description was made."""
    if types is None or column.name not in types.get("columns", ()):
        return None
    return types


def arrow_type(column: Column, types: dict | None = None) -> pa.DataType:
    m = _Mapper(_described(column, types))
    return m.arrow(column.type_oid, column.typmod, m.dims.get(column.name, 0))


def may_be_special(column: Column, types: dict | None) -> bool:
    """A value of the column may be one its Arrow type cannot hold (text, bytes, booleans, integers and
    floats always fit)."""
    dtype = arrow_type(column, types)
    return not (pa.types.is_string(dtype) or pa.types.is_binary(dtype) or pa.types.is_boolean(dtype)
                or pa.types.is_integer(dtype) or pa.types.is_floating(dtype))


def has_special(table: Table) -> bool:
    """The table has the `_sg_special` column (every table described with its types' structure)."""
    return table.type_tree is not None


def arrow_schema(table: Table) -> pa.Schema:
    """The Delta table's schema: the key columns are not nullable; `_sg_special` last."""
    fields = [pa.field(c.name, arrow_type(c, table.type_tree), nullable=c.name not in table.key) for c in table.columns]
    if has_special(table):
        fields.append(pa.field(SPECIAL, SPECIAL_TYPE))
    return pa.schema(fields)


def _bool(text: str) -> bool:
    return text in ("t", "true")


def _bytea(text: str) -> bytes:
    if text.startswith("\\x"):
        return bytes.fromhex(text[2:])
    raise ValueError(f"bytea value not in hex form: {text[:20]!r}")


def _hex(text: str) -> bytes:
    """PostGIS's output: hex EWKB (the SRID inside)."""
    return bytes.fromhex(text)


def _decimal(text: str):
    from decimal import Decimal

    value = Decimal(text)
    if not value.is_finite():
        raise pgtext.Unrepresentable(f"numeric value {text} has no decimal128 form")
    return value


_EPOCH_ORDINAL = 719163  # date(1970, 1, 1).toordinal()
_EPOCH = datetime(1970, 1, 1)
_EPOCH_UTC = datetime(1970, 1, 1, tzinfo=timezone.utc)
_US = timedelta(microseconds=1)


def _date(text: str) -> int:
    try:  # the common case, in C; BC, years past 9999 and infinities by pgtext's arithmetic
        return date.fromisoformat(text).toordinal() - _EPOCH_ORDINAL
    except ValueError:
        pass
    return _within(pgtext.parse_date(text), DATE_INFINITY, f"date {text} is past the Delta date range")


def _timestamp(text: str) -> int:
    try:  # as _date
        at = datetime.fromisoformat(text)
        return (at - (_EPOCH_UTC if at.tzinfo else _EPOCH)) // _US
    except ValueError:
        pass
    return _within(pgtext.parse_timestamp(text), TS_INFINITY, f"timestamp {text} is past 64-bit microseconds")


def _within(value: int, sentinel: int, past: str) -> int:
    """PostgreSQL's ±infinity as the ±sentinel; a finite value at or past a sentinel cannot be told from it."""
    if value == pgtext.INFINITY:
        return sentinel
    if value == pgtext.NEG_INFINITY:
        return -sentinel
    if not -sentinel < value < sentinel:
        raise pgtext.Unrepresentable(past)
    return value


def _interval(text: str) -> dict:
    months, days, micros = pgtext.parse_interval(text)
    return {"months": months, "days": days, "microseconds": micros}


def converter(column: Column, types: dict | None = None) -> Callable[[str], object]:
    """PostgreSQL's text of a non-null value -> the Python value Arrow stores for `arrow_type(column)`."""
    m = _Mapper(_described(column, types))
    return m.convert(column.type_oid, column.typmod, m.dims.get(column.name, 0))


def _terminal(table: Table, column: Column, dtype, exc) -> Exception:
    where = f"table {table.qualified} column {column.name} ({column.type_sql}): a value has no {dtype} form ({exc})"
    if column.name in table.key:  # a key must be a value of its column: it finds the row
        return TerminalError(f"{where}; a Delta table cannot key a row by it: leave the table out "
                             f"(--exclude-tables), or key it by another column on the source")
    return TerminalError(f"{where}; a Delta table made before `{SPECIAL}` was kept cannot hold it: re-create "
                         f"the workflow to copy the table again")


def convert_columns(table: Table, columns: list[list]) -> list[pa.Array]:
    """Text values (None for NULL) of each of the table's columns -> the arrays of `arrow_schema(table)`
    (`_sg_special` included): a value its column cannot hold is NULL there and its text in `_sg_special`."""
    rows = len(columns[0]) if columns else 0
    special = has_special(table)
    extra: list[list | None] = [None] * rows
    arrays = []
    for column, texts in zip(table.columns, columns):
        arrays.append(_convert_one(table, column, texts, extra, special))
    if special:
        arrays.append(pa.array(extra, type=SPECIAL_TYPE))
    return arrays


def convert_text_arrays(table: Table, texts: list[pa.Array]) -> list[pa.Array]:
    """`convert_columns` of string arrays: a column whose every value Arrow's cast reads exactly as the
    per-value converter does (`_vectorized`) by Arrow compute, any other column (or one with a value Arrow's
    cast refuses: NaN in a numeric, a BC date, infinity) value by value, as convert_columns does."""
    rows = len(texts[0]) if texts else 0
    special = has_special(table)
    extra: list[list | None] | None = None
    arrays = []
    for column, text in zip(table.columns, texts):
        dtype = arrow_type(column, table.type_tree)
        array = _vectorized(dtype, text)
        if array is None:
            if extra is None:
                extra = [None] * rows
            array = _convert_one(table, column, text.to_pylist(), extra, special)
        arrays.append(array)
    if special:
        arrays.append(pa.nulls(rows, SPECIAL_TYPE) if extra is None else pa.array(extra, type=SPECIAL_TYPE))
    return arrays


def _vectorized(dtype: pa.DataType, text: pa.Array) -> pa.Array | None:
    """The column's string array as `dtype` by Arrow compute, or None where that could differ from the
    per-value converter. Arrow's casts read PostgreSQL's output of these types as the converters do: integers;
    floats ('NaN', 'Infinity', '-0' too; float4 through float64, as Python's float() and pa.array round);
    numeric(p,s) (its text has exactly s decimals; NaN and infinities are refused, so go value by value);
    dates and timestamps of years 1-9999 AD (ISO, ' ' separator, '+00' under TimeZone UTC; BC, 5-digit years
    and infinities are refused). Any refusal: the whole column value by value (rare values, same result)."""
    if pa.types.is_string(dtype):
        return text
    if pa.types.is_boolean(dtype):  # _bool: 't' or 'true'
        return pc.or_(pc.equal(text, "t"), pc.equal(text, "true"))
    if not (pa.types.is_integer(dtype) or pa.types.is_floating(dtype) or pa.types.is_decimal(dtype)
            or pa.types.is_date32(dtype) or pa.types.is_timestamp(dtype)):
        return None  # bytea (hex), structures, intervals: value by value
    try:
        if pa.types.is_float32(dtype):
            return pc.cast(pc.cast(text, pa.float64()), dtype)
        return pc.cast(text, dtype)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None


def _convert_one(table: Table, column: Column, texts: list, extra: list, special: bool) -> pa.Array:
    """One column of convert_columns: a value its type cannot hold goes to `extra` (the row's special entries)."""
    fn = converter(column, table.type_tree)
    dtype = arrow_type(column, table.type_tree)
    values = []
    for r, text in enumerate(texts):
        if text is None:
            values.append(None)
            continue
        try:
            values.append(fn(text))
        except (ValueError, ArithmeticError, IndexError, KeyError) as exc:
            if not special or column.name in table.key:
                raise _terminal(table, column, dtype, exc) from None
            values.append(None)
            extra[r] = (extra[r] or []) + [(column.name, text)]
    try:
        return pa.array(values, type=dtype)
    except (pa.ArrowInvalid, OverflowError) as exc:
        raise _terminal(table, column, dtype, exc) from None


def convert_column(column: Column, texts: list, types: dict | None = None) -> pa.Array:
    """Text values (None for NULL) as one Arrow array of the column's type (no `_sg_special` fallback)."""
    table = Table("", "", (column,), (), type_tree=types)
    fn = converter(column, types)
    dtype = arrow_type(column, types)
    try:
        return pa.array([None if v is None else fn(v) for v in texts], type=dtype)
    except (ValueError, ArithmeticError, pa.ArrowInvalid) as exc:
        raise _terminal(table, column, dtype, exc) from None


def record_batch(table: Table, rows: list[tuple]) -> pa.RecordBatch:
    """Rows of text values in the table's column order -> a batch of the Delta table's schema."""
    columns = [list(v) for v in zip(*rows)] if rows else [[] for _ in table.columns]
    return pa.RecordBatch.from_arrays(convert_columns(table, columns), schema=arrow_schema(table))


def _sql_type(dtype: pa.DataType) -> str:
    """The type's name in delta-rs's (DataFusion's) SQL."""
    if pa.types.is_decimal(dtype):
        return f"DECIMAL({dtype.precision},{dtype.scale})"
    return {pa.int16(): "SMALLINT", pa.int32(): "INT", pa.int64(): "BIGINT", pa.float32(): "FLOAT",
            pa.float64(): "DOUBLE"}[dtype]


def sql_literal(column: Column, text: str | None, types: dict | None = None) -> str:
    """PostgreSQL's text of a value of `column` as a delta-rs SQL expression of the column's Arrow type (the
    same value `converter` gives), for MERGE clauses."""
    if text is None:
        return "NULL"
    dtype = arrow_type(column, types)
    try:
        value = converter(column, types)(text)
    except (ValueError, ArithmeticError) as exc:
        raise _terminal(Table("", "", (column,), ()), column, dtype, exc) from None
    if pa.types.is_boolean(dtype):
        return "TRUE" if value else "FALSE"
    if pa.types.is_binary(dtype):
        return f"decode('{value.hex()}', 'hex')"
    if pa.types.is_string(dtype):
        return "'" + value.replace("'", "''") + "'"
    if pa.types.is_date(dtype):
        return f"arrow_cast(CAST({value} AS INT), 'Date32')"
    if pa.types.is_timestamp(dtype):
        zone = ', Some("UTC")' if dtype.tz else ", None"
        return f"arrow_cast(CAST({value} AS BIGINT), 'Timestamp(Microsecond{zone})')"
    if pa.types.is_floating(dtype):
        if math.isnan(value):
            shown = "NaN"
        elif math.isinf(value):
            shown = "Infinity" if value > 0 else "-Infinity"
        else:
            shown = repr(value)
    elif pa.types.is_decimal(dtype):
        shown = format(value, "f")
    elif pa.types.is_integer(dtype):
        shown = str(value)
    else:
        raise TerminalError(f"column {column.name} ({column.type_sql}) was added with a default for older rows; "
                            f"a Delta target fills such columns of scalar types only: re-create the workflow")
    return f"CAST('{shown}' AS {_sql_type(dtype)})"

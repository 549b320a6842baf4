"""PostgreSQL columns as Arrow (Delta) columns, and PostgreSQL's text form of a value as the Arrow value.

One conversion path for the copy and the stream: the copy reads every column as text (`col::text`) and the
stream's pgoutput values are text, both with Sluicegate's session settings (ISO dates, UTC, hex bytea). What
Arrow has no faithful type for (unbounded numeric, json, arrays, enums, intervals, ranges, ...) is kept as
PostgreSQL's text, which loses nothing; so is `time` (Delta has no time-of-day type).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import date, datetime
from decimal import Decimal

import pyarrow as pa

from ..postgres.catalog import Column, Table

BOOL, BYTEA, INT8, INT2, INT4, TEXT, OID = 16, 17, 20, 21, 23, 25, 26
FLOAT4, FLOAT8 = 700, 701
BPCHAR, VARCHAR, NAME = 1042, 1043, 19
DATE, TIMESTAMP, TIMESTAMPTZ = 1082, 1114, 1184
NUMERIC, UUID = 1700, 2950
MAX_DECIMAL128 = 38


def numeric_precision(typmod: int | None) -> tuple[int, int] | None:
    """numeric(p,s)'s (p, s) from its atttypmod; None for an unbounded numeric."""
    if typmod is None or typmod < 4:
        return None
    mod = typmod - 4
    return (mod >> 16) & 0xFFFF, mod & 0xFFFF


def arrow_type(column: Column) -> pa.DataType:
    oid = column.type_oid
    if oid == BOOL:
        return pa.bool_()
    if oid == INT2:
        return pa.int16()
    if oid in (INT4, OID):
        return pa.int32() if oid == INT4 else pa.int64()
    if oid == INT8:
        return pa.int64()
    if oid == FLOAT4:
        return pa.float32()
    if oid == FLOAT8:
        return pa.float64()
    if oid == NUMERIC:
        ps = numeric_precision(column.typmod)
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
    # text, varchar, char, name, uuid, json, jsonb, arrays, enums, interval, inet, ...: PostgreSQL's text
    return pa.string()


def arrow_schema(table: Table) -> pa.Schema:
    """The Delta table's schema: the key columns are not nullable."""
    return pa.schema([pa.field(c.name, arrow_type(c), nullable=c.name not in table.key) for c in table.columns])


def _bool(text: str) -> bool:
    return text in ("t", "true")


def _bytea(text: str) -> bytes:
    if text.startswith("\\x"):
        return bytes.fromhex(text[2:])
    raise ValueError(f"bytea value not in hex form: {text[:20]!r}")


def _timestamp(text: str) -> datetime:
    # ISO output: '2024-01-02 03:04:05.123456' (no zone) or '…+00' (timestamptz under TimeZone=UTC)
    if text.endswith(("+00", "-00")):
        text += ":00"
    return datetime.fromisoformat(text)


def _decimal(dtype: pa.Decimal128Type) -> Callable[[str], Decimal]:
    def convert(text: str) -> Decimal:
        value = Decimal(text)
        if not value.is_finite():
            raise ValueError(f"numeric value {text} has no decimal128 form")
        return value

    return convert


def converter(column: Column) -> Callable[[str], object]:
    """PostgreSQL's text of a non-null value -> the Python value Arrow stores for `arrow_type(column)`."""
    dtype = arrow_type(column)
    if pa.types.is_boolean(dtype):
        return _bool
    if pa.types.is_integer(dtype):
        return int
    if pa.types.is_floating(dtype):
        return float  # 'NaN', 'Infinity', '-Infinity' read as Python's
    if pa.types.is_decimal(dtype):
        return _decimal(dtype)
    if pa.types.is_binary(dtype):
        return _bytea
    if pa.types.is_date(dtype):
        return date.fromisoformat
    if pa.types.is_timestamp(dtype):
        return _timestamp
    return str


def convert_column(column: Column, texts: list) -> pa.Array:
    """Text values (None for NULL) as one Arrow array of the column's type."""
    fn = converter(column)
    dtype = arrow_type(column)
    try:
        return pa.array([None if v is None else fn(v) for v in texts], type=dtype)
    except (ValueError, ArithmeticError, pa.ArrowInvalid) as exc:
        from ..errors import TerminalError

        raise TerminalError(f"column {column.name} ({column.type_sql}): a value has no {dtype} form ({exc}); "
                            f"a Delta target cannot hold it") from None


def record_batch(table: Table, rows: list[tuple]) -> pa.RecordBatch:
    """Rows of text values in the table's column order -> a batch of the Delta table's schema."""
    schema = arrow_schema(table)
    columns = list(zip(*rows)) if rows else [() for _ in table.columns]
    return pa.RecordBatch.from_arrays([convert_column(c, list(v)) for c, v in zip(table.columns, columns)],
                                      schema=schema)


def _sql_type(dtype: pa.DataType) -> str:
    """The type's name in delta-rs's (DataFusion's) SQL."""
    if pa.types.is_decimal(dtype):
        return f"DECIMAL({dtype.precision},{dtype.scale})"
    if pa.types.is_timestamp(dtype):
        return "TIMESTAMP WITH TIME ZONE" if dtype.tz else "TIMESTAMP"
    return {pa.int16(): "SMALLINT", pa.int32(): "INT", pa.int64(): "BIGINT", pa.float32(): "FLOAT",
            pa.float64(): "DOUBLE", pa.date32(): "DATE"}[dtype]


def sql_literal(column: Column, text: str | None) -> str:
    """PostgreSQL's text of a value of `column` as a delta-rs SQL expression of the column's Arrow type (the
    same value `converter` gives), for MERGE clauses."""
    if text is None:
        return "NULL"
    value = convert_column(column, [text])[0].as_py()
    dtype = arrow_type(column)
    if pa.types.is_boolean(dtype):
        return "TRUE" if value else "FALSE"
    if pa.types.is_binary(dtype):
        return f"decode('{value.hex()}', 'hex')"
    if pa.types.is_string(dtype):
        return "'" + value.replace("'", "''") + "'"
    if pa.types.is_floating(dtype):
        if math.isnan(value):
            shown = "NaN"
        elif math.isinf(value):
            shown = "Infinity" if value > 0 else "-Infinity"
        else:
            shown = repr(value)
    elif pa.types.is_decimal(dtype):
        shown = format(value, "f")
    elif pa.types.is_timestamp(dtype) or pa.types.is_date(dtype):
        shown = value.isoformat()
    else:
        shown = str(value)
    return f"CAST('{shown}' AS {_sql_type(dtype)})"

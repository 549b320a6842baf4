"""Types between PostgreSQL text and Spark SQL (pure).

Rows reach Spark as PostgreSQL's text form of each value (from COPY or pgoutput alike, so copy and replicate
see the same input) and a rule sees them typed by the casts below. Columns a rule passes through unchanged
never round-trip through Spark: the target gets the source's own text. Computed columns come back as Arrow
values and are written as text PostgreSQL parses back exactly.
"""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.compute as pc

from ..postgres.catalog import Column

NUMERIC = re.compile(r"numeric\((\d+),(\d+)\)")
_EXACT = {  # PostgreSQL type -> Spark type, for casts that cannot fail on PostgreSQL's text
    "smallint": "SMALLINT", "integer": "INT", "bigint": "BIGINT", "real": "FLOAT", "double precision": "DOUBLE",
    "boolean": "BOOLEAN", "text": "STRING",
}
_TIME = {"date": "DATE", "timestamp without time zone": "TIMESTAMP_NTZ", "timestamp with time zone": "TIMESTAMP"}


def spark_expr(column: Column, raw: str) -> str:
    """Spark SQL for the typed value of `column` from its text in column `raw`.

    numeric without a declared precision stays STRING (no Spark DECIMAL holds every value: CAST it in the
    rule); dates and times PostgreSQL can hold and Spark cannot ('infinity', BC) become NULL; types with no
    Spark twin (json, uuid, enums, arrays, intervals…) are their PostgreSQL text.
    """
    t = column.type_sql
    if t in _EXACT:
        return f"CAST({raw} AS {_EXACT[t]})"
    m = NUMERIC.fullmatch(t)
    if m and int(m.group(1)) <= 38:
        return f"CAST({raw} AS DECIMAL({m.group(1)},{m.group(2)}))"
    base = re.sub(r"\(\d+\)", "", t)  # timestamp(3) without time zone -> timestamp without time zone
    if base in _TIME:
        return f"try_cast({raw} AS {_TIME[base]})"
    if t == "bytea":
        return f"unhex(substr({raw}, 3))"  # '\x0102' (bytea_output=hex)
    return raw


_SPARK_TO_PG = {
    "tinyint": "smallint", "smallint": "smallint", "int": "integer", "bigint": "bigint", "float": "real",
    "double": "double precision", "boolean": "boolean", "string": "text", "date": "date",
    "timestamp": "timestamp with time zone", "timestamp_ntz": "timestamp without time zone", "binary": "bytea",
}


def pg_type(spark_type: str) -> str | None:
    """The PostgreSQL type for a computed column of this Spark type (simpleString), or None if none fits."""
    m = re.fullmatch(r"decimal\((\d+),(\d+)\)", spark_type)
    if m:
        return f"numeric({m.group(1)},{m.group(2)})"
    return _SPARK_TO_PG.get(spark_type)


def pg_text(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Arrow values as PostgreSQL input text (NULL stays null): '1.50', 'true', '2024-01-01 12:00:00.000000Z'."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type):
        return pa.array([None if v is None else "\\x" + v.hex() for v in values.to_pylist()], pa.string())
    if pa.types.is_string(values.type):
        return values
    return pc.cast(values, pa.string())


# -- does a rule's output fit a target column? -------------------------------------------------------------
_INT_DIGITS = {"tinyint": 3, "smallint": 5, "int": 10, "bigint": 19}
_PG_INT_DIGITS = {"smallint": 5, "integer": 10, "bigint": 19}
_PG_TO_SPARK = {**_EXACT, **_TIME, "bytea": "BINARY"}


def fits(spark_type: str, pg: str) -> bool | None:
    """Whether every value of Spark type `spark_type` (simpleString) is held exactly by a PostgreSQL column of
    type `pg`: True (the same or wider: int into bigint, decimal(10,2) into numeric), False (a lossy cast:
    decimal into bigint, double into integer, bigint into smallint), None (not a pair this knows)."""
    if pg_type(spark_type) == pg:
        return True
    if pg == "text":
        return True  # every value has a text form PostgreSQL keeps as it is
    dec = re.fullmatch(r"decimal\((\d+),(\d+)\)", spark_type)
    num = re.fullmatch(r"numeric(?:\((\d+),(\d+)\))?", pg)
    if spark_type in _INT_DIGITS:
        digits = _INT_DIGITS[spark_type]
        if pg in _PG_INT_DIGITS:
            return _PG_INT_DIGITS[pg] >= digits
        if num:
            return num.group(1) is None or int(num.group(1)) - int(num.group(2)) >= digits
        if pg in ("real", "double precision"):
            return digits <= (6 if pg == "real" else 15)
        return None
    if dec:
        p, s = int(dec.group(1)), int(dec.group(2))
        if num:
            return num.group(1) is None or (int(num.group(2)) >= s and int(num.group(1)) - int(num.group(2)) >= p - s)
        if pg in _PG_INT_DIGITS:
            return s == 0 and _PG_INT_DIGITS[pg] > p
        if pg in ("real", "double precision"):
            return False
        return None
    if spark_type in ("float", "double"):
        if pg == "double precision":
            return True
        if pg == "real" or pg in _PG_INT_DIGITS or num:
            return False
        return None
    return None


def spark_cast_type(pg: str) -> str | None:
    """The Spark type to CAST a rule's column to for a PostgreSQL column of type `pg` (None: no twin)."""
    if pg in _PG_TO_SPARK:
        return _PG_TO_SPARK[pg]
    num = re.fullmatch(r"numeric(?:\((\d+),(\d+)\))?", pg)
    if num:
        return f"DECIMAL({num.group(1)},{num.group(2)})" if num.group(1) else "DECIMAL(38,10)"
    return None


def spark_type_of(pg: str) -> str | None:
    """The Spark type (simpleString) a computed column of PostgreSQL type `pg` came from (pg_type's inverse)."""
    m = re.fullmatch(r"numeric\((\d+),(\d+)\)", pg)
    if m:
        return f"decimal({m.group(1)},{m.group(2)})"
    return next((k for k, v in _SPARK_TO_PG.items() if v == pg and k != "tinyint"), None)

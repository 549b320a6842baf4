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

_NUMERIC = re.compile(r"numeric\((\d+),(\d+)\)")
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
    m = _NUMERIC.fullmatch(t)
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

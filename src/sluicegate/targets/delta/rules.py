"""Rules into a Delta target: the Delta table a compiled rule writes, and its rows from the rule's output.

rules/ compiles a rule (Spark's analyzer) and evaluates it; its output is the target's columns as PostgreSQL
text, with the PostgreSQL type each computed column gets (rules/types.pg_type). The Delta table is described
as a PostgreSQL table of those types, so the one text -> Arrow conversion of the copy and the stream
(types.py) makes its rows too: a Spark type reaches Arrow through the PostgreSQL type it maps to.
"""

from __future__ import annotations

from dataclasses import replace

import pyarrow as pa

from ...errors import UsageError
from ...postgres.catalog import Column, Table
from ...rules.compile import CompiledRule
from ...rules.evaluate import target_columns
from ...rules.types import NUMERIC
from . import types

# A computed column's PostgreSQL type (one of rules/types.pg_type's) -> its type oid, for types.arrow_type.
_OIDS = {
    "smallint": types.INT2, "integer": types.INT4, "bigint": types.INT8, "real": types.FLOAT4,
    "double precision": types.FLOAT8, "boolean": types.BOOL, "text": types.TEXT, "date": types.DATE,
    "timestamp with time zone": types.TIMESTAMPTZ, "timestamp without time zone": types.TIMESTAMP,
    "bytea": types.BYTEA,
}


def computed_column(label: str, column: Column) -> Column:
    """A rule's computed column as a Delta column: its type oid and typmod from its PostgreSQL type, or a
    UsageError naming the rule, the column and the way out (a CAST)."""
    m = NUMERIC.fullmatch(column.type_sql)
    if m:  # numeric(p,s): atttypmod is ((p << 16) | s) + 4
        p, s = int(m.group(1)), int(m.group(2))
        return replace(column, type_oid=types.NUMERIC, typmod=((p << 16) | s) + 4)
    oid = _OIDS.get(column.type_sql)
    if oid is None:
        raise UsageError(f"rule {label}: column {column.name!r} is {column.type_sql}, which has no Delta column "
                         f"type here: CAST it in the rule (to STRING, say)")
    return replace(column, type_oid=oid, typmod=-1)


def label(rule: CompiledRule) -> str:
    return repr(rule.rule.split(":", 1)[0].strip())


def lake_table(rule: CompiledRule) -> Table:
    """The Delta table `rule` writes: columns passed through keep their source column's type (renamed),
    computed ones get theirs from the rule (computed_column); keyed by the rule's target key."""
    columns = []
    for (kind, ref), out in zip(rule.outputs, rule.target.columns):
        if kind == "raw":
            columns.append(replace(rule.source.columns[ref], name=out.name, not_null=out.not_null))
        else:
            columns.append(computed_column(label(rule), out))
    return replace(rule.target, columns=tuple(columns), enums=(), types=(), extensions=(), existing_types=(),
                   type_tree=rule.source.type_tree)


def check_keyed(rule: CompiledRule) -> None:
    """A Delta target merges changes by key: a rule's target must have one."""
    if not rule.target.key:
        raise UsageError(f"rule {label(rule)}: source table {rule.source.qualified} has no primary key (nor a "
                         f"non-null unique replica identity), so the rule's target {rule.target.qualified} has no "
                         f"key; a Delta target merges changes by key: add a primary key on the source, or "
                         f"materialize into a PostgreSQL target")


def target_batch(rule: CompiledRule, lake: Table, result: pa.Table | pa.RecordBatch) -> pa.RecordBatch:
    """A rule's output (`RuleRunner.transform`'s, or raw rows for a rule that only moves columns) as a batch
    of the Delta table's schema."""
    texts = [pa.array(c, pa.string()) if not isinstance(c, pa.Array) else c.cast(pa.string())
             for c in target_columns(rule, result)]
    return pa.RecordBatch.from_arrays(types.convert_text_arrays(lake, texts), schema=types.arrow_schema(lake))


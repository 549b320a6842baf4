"""Running a compiled rule: the same Spark SQL over a bulk copy's DataFrame or over a batch of changes.

Input rows are the source's text of each column (`__sg_raw_i`); a typed view over them carries the rule's
FROM name, and the rule's SELECT runs with the raw columns put first. Output: the target's columns as
PostgreSQL text — the source's own text for columns passed through, Spark's values for computed ones.
"""

from __future__ import annotations

import pyarrow as pa

from .compile import RAW, CompiledRule, quote, raw_schema, rule_session
from .types import pg_text

RAW_VIEW = "__sg_raw"  # the rows as the source's text, under the typed view the rule reads


class RuleRunner:
    """One rule on the driver's Spark: `transform` a DataFrame (copy) or `apply` to Arrow rows (replicate)."""

    def __init__(self, spark, rule: CompiledRule):
        self.rule = rule
        self.session = rule_session(spark, dict(rule.udfs))
        self.schema = raw_schema(rule.source)

    def transform(self, raw_df):
        """The rule over a DataFrame of raw text columns: raw columns first, then the rule's."""
        raw_df.createOrReplaceTempView(RAW_VIEW)
        self.session.sql(self.rule.typed_view_sql(RAW_VIEW)).createOrReplaceTempView(quote(self.rule.view))
        return self.session.sql(self.rule.runtime_select)

    def apply(self, raw: pa.Table) -> pa.Table:
        """The rule over a small batch of rows (all string columns, named like `raw_schema`)."""
        if raw.num_rows == 0:
            return raw
        if self.rule.moves_only:  # e.g. a Reshard stream's own rule: no Spark job per batch
            return raw if self.rule.keyrange is None else raw.filter(pa.array(self._in_range(raw)))
        return self.transform(self.session.createDataFrame(raw, schema=self.schema)).toArrow()

    def _in_range(self, raw: pa.Table) -> list[bool]:
        from ..sharding.keyrange import KeyRange, keyspace_id

        column, lo, hi = self.rule.keyrange
        r = KeyRange(lo, hi)
        return [v is not None and r.contains(keyspace_id(v)) for v in raw.column(column).to_pylist()]


def target_columns(rule: CompiledRule, result: pa.Table | pa.RecordBatch) -> list[pa.Array]:
    """The target table's columns, in order, as PostgreSQL text, from a `transform`/`apply` result."""
    n = len(rule.source.columns)
    names = result.schema.names
    by_name = {name: i for i, name in enumerate(names) if i >= n and not name.startswith("__sg_")}
    out = []
    for kind, ref in rule.outputs:
        col = result.column(ref) if kind == "raw" else result.column(by_name[ref])
        out.append(_combine(col) if kind == "raw" else pg_text(col))
    return out


def raw_table(rule: CompiledRule, rows: list[tuple]) -> pa.Table:
    """Rows of source text values (None for NULL) as the Arrow input `apply` takes."""
    n = len(rule.source.columns)
    return pa.table({RAW.format(i): pa.array([r[i] for r in rows], pa.string()) for i in range(n)})


def _combine(col):
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col

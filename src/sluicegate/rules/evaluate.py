"""Running a compiled rule: the same Spark SQL over a bulk copy's DataFrame or over a batch of changes.

Input rows are the source's text of each column (`__sg_raw_i`); a typed view over them carries the rule's
FROM name, and the rule's SELECT runs with the raw columns put first. Output: the target's columns as
PostgreSQL text — the source's own text for columns passed through, Spark's values for computed ones.
"""

from __future__ import annotations

import pyarrow as pa

from ..sharding.keyrange import KeyRange, keyspace_id
from .compile import OUT, RAW, CompiledRule, quote, raw_schema, rule_session, split_where
from .spec import wrap_select
from .types import pg_text

RAW_VIEW = "__sg_raw"  # the rows as the source's text, under the typed view the rule reads
KEEP = "__sg_keep"  # replicate: whether the rule keeps the row (its WHERE and key range), as a column


class RuleRunner:
    """One rule, planned on the driver's Spark: `transform` a DataFrame of a copy's rows, or
    `transform_changes` a DataFrame of replicated changes. Either way the rows stay in the executors."""

    def __init__(self, spark, rule: CompiledRule):
        self.rule = rule
        self.session = rule_session(spark, dict(rule.udfs))
        self.schema = raw_schema(rule.source)
        self._split = None

    def transform(self, raw_df):
        """The rule over a DataFrame of raw text columns: raw columns first, then the rule's."""
        raw_df.createOrReplaceTempView(RAW_VIEW)
        self.session.sql(self.rule.typed_view_sql(RAW_VIEW)).createOrReplaceTempView(quote(self.rule.view))
        return self.session.sql(self.rule.runtime_select)

    def transform_changes(self, raw_df, extra: list[str]):
        """The rule over changes (raw text columns and the `extra` columns of each change): one output row per
        input row, the rule's columns first as `transform` gives them, then `extra`, then KEEP. Rows the rule
        drops (its WHERE, a shard's key range) come out with KEEP false and their typed columns NULL, so the
        rule's expressions see them as the copy never would: only as NULLs."""
        from pyspark.sql import functions as F

        rule = self.rule
        if self._split is None:
            self._split = split_where(self.session, rule.select)
        raw_df.createOrReplaceTempView(RAW_VIEW)
        typed = self.session.sql(rule.typed_view_sql(RAW_VIEW, extra, in_range=False))
        typed.createOrReplaceTempView(quote(rule.view))
        in_range = None
        if rule.keyrange is not None:
            column, lo, hi = rule.keyrange
            in_range = KeyRange(lo, hi).spark_filter(RAW.format(column))
        keep = self.session.sql(self._split.keep_sql(in_range or ""))
        names = [c.name for c in rule.source.columns]
        keep.select(*[F.when(F.col(KEEP), F.col(quote(n))).alias(n) for n in names],
                    *[F.col(c) for c in keep.columns[len(names):]]).createOrReplaceTempView(quote(rule.view))
        outs = [f"{RAW.format(i)} AS {OUT.format(i)}" for i in range(len(names))]
        return self.session.sql(wrap_select(self._split.unfiltered, outs + [f"{e} AS {e}_" for e in extra]
                                            + [f"{KEEP} AS {KEEP}_"]))


class MovesOnly:
    """A rule that only passes columns through (maybe renamed or dropped) and may keep a shard's key range:
    nothing for Spark to compute, so it runs where the changes are (a play task), in Python."""

    def __init__(self, rule: CompiledRule):
        assert rule.moves_only
        self.rule = rule

    def apply(self, raw: pa.Table) -> pa.Table:
        if raw.num_rows == 0 or self.rule.keyrange is None:
            return raw

        column, lo, hi = self.rule.keyrange
        r = KeyRange(lo, hi)
        return raw.filter(pa.array([v is not None and r.contains(keyspace_id(v))
                                    for v in raw.column(column).to_pylist()]))


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

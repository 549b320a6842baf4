"""Comparing a table written through a rule: the source's rows go through the same rule in Spark, then
each key range's output is joined row by row to the target's rows of that range, in the target snapshot.

No summary shortcut here: the rule's output exists only after Spark computed it, so the comparison reads
it whole (as the copy does). The source side is the copy's own reader and the rule's own SELECT, so what
is compared is what the copy and the stream write; the join uses PostgreSQL's equality per column type.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from functools import partial

from ..faults import fault_point
from ..postgres.catalog import Table
from ..postgres.connect import connect
from ..rules.compile import CompiledRule
from ..rules.evaluate import RuleRunner, target_columns
from ..workflow.rule_copy import RuleRead, read_ranges
from . import store
from .compare import _import_snapshot, join_compare, new_stage


@dataclass(frozen=True)
class RuleRanges:
    """One (stream, table) of a vdiff: its ranges, to compare in one Spark job (one task per range)."""

    source_url: str
    target_url: str
    vdiff_id: int
    name: str  # the vdiff's name for this table (the source table; with its shard in a Reshard)
    rule: dict  # CompiledRule.to_json()
    source: dict  # the source Table
    generation: int
    ranges: list  # numbered from 0 in their generation
    source_snapshot: str
    target_snapshot: str
    text_columns: tuple[str, ...]
    sample_size: int


def compare_rule_ranges(spark, job: RuleRanges) -> None:
    runner = RuleRunner(spark, CompiledRule.from_json(job.rule, Table.from_json(job.source)))
    read = RuleRead(job.source_url, job.source, job.source_snapshot, job.ranges)
    ids = runner.session.range(0, len(job.ranges), 1, numPartitions=len(job.ranges))
    raw = ids.mapInArrow(partial(read_ranges, read), runner.schema)
    schema = "compared long, missing long, extra long, mismatched long"
    runner.transform(raw).mapInArrow(partial(compare_partition, job), schema).collect()


def compare_partition(job: RuleRanges, batches):
    """Runs in a Spark task: the rule's output for one key range against the target, recorded on the target."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    from psycopg import sql
    from pyspark import TaskContext

    i = TaskContext.get().partitionId()  # partition i is range i all the way: read, rule, here (no shuffle)
    lo, hi = job.ranges[i]
    rule = CompiledRule.from_json(job.rule, Table.from_json(job.source))
    target = rule.target
    names = [c.name for c in target.columns]
    options = pacsv.WriteOptions(include_header=False, quoting_style="all_valid")
    with connect(job.target_url, role="target") as dst:
        _import_snapshot(dst, job.target_snapshot, read_only=False)
        stage = new_stage(dst, target)
        cols = sql.SQL(", ").join(map(sql.Identifier, names))
        with dst.cursor() as cur, cur.copy(sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(stage, cols)) as copy:
            for batch in batches:
                if batch.num_rows:
                    buf = io.BytesIO()
                    pacsv.write_csv(pa.table(target_columns(rule, batch), names=names), buf, options)
                    copy.write(buf.getvalue())
        counts, samples = join_compare(dst, target, stage, lo, hi, job.text_columns, job.sample_size,
                                       rule.target_keyrange())
        dst.rollback()
        fault_point(f"vdiff.range.{i}")
        store.finish_range(dst, job.vdiff_id, job.name, job.generation, i, counts, samples)
        dst.commit()
    yield pa.RecordBatch.from_pydict({k: [counts[k]] for k in ("compared", "missing", "extra", "mismatched")})

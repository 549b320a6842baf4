"""The source side of a Delta vdiff for a table written through a rule: the rule applied to the snapshot.

What is compared must be what the copy and the stream write, so each piece is theirs:
- a rule that computes (copy.copy_cycle_through_rule): the key ranges read as text in the snapshot by
  workflow/rule_copy.py's `read_ranges` (one Spark partition each), the rule's SELECT over them in Spark
  (`RuleRunner.transform`), each partition's output made the Delta table's rows by rules.py `target_batch`;
- a rule that only moves columns (copy.copy_range) is not read here: vdiff.read_range reads its columns under
  its names, converted straight into the Delta table's schema.
The frame has the Delta table's schema (rules.py `lake_table`), so vdiff.compare joins it with the Delta table
on the rule's target key as it joins a table moved as it is.
"""

from __future__ import annotations

from functools import partial

from ...postgres.catalog import Table


def lake_rows(rule_json: dict, source_json: dict, batches):
    """Runs in a Spark task: the rule's output (CompiledRule.to_json(), its source Table.to_json()) for one
    partition as batches of the Delta table's schema."""
    from ...rules.compile import CompiledRule
    from .rules import lake_table, target_batch

    rule = CompiledRule.from_json(rule_json, Table.from_json(source_json))
    lake = lake_table(rule)
    for batch in batches:
        if batch.num_rows:
            yield target_batch(rule, lake, batch)


def source_frame(runner, source_url: str, rule, snapshot: str, ranges: list):
    """A rule that computes: its output over the source's `ranges` (vdiff's plan) in the exported `snapshot`,
    as a DataFrame of the Delta table's schema. The rule runs in a session of its own (rules.compile's
    rule_session); its frame joins the Delta side's all the same (one SparkContext)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    from ...rules.evaluate import RuleRunner
    from ...workflow.rule_copy import RuleRead, read_ranges
    from .rules import lake_table
    from .types import arrow_schema

    schema = from_arrow_schema(arrow_schema(lake_table(rule)))
    rules = RuleRunner(runner.spark, rule)
    read = RuleRead(source_url, rule.source.to_json(), snapshot, ranges)
    raw = rules.session.range(0, len(ranges), 1, numPartitions=len(ranges)).mapInArrow(
        partial(read_ranges, read), rules.schema)
    return rules.transform(raw).mapInArrow(partial(lake_rows, rule.to_json(), rule.source.to_json()), schema)

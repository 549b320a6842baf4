"""The copy into Delta: cycles of key ranges above lastpk, each cycle inside one exported snapshot.

The cycle is planned as for a PostgreSQL target (workflow/copier.plan_cycle). Each Spark task imports the
snapshot, reads its range as text (one COPY in CSV: each column as its output function writes it, the same
text the stream carries; targets/delta/types.py converts both) and writes Parquet files into the table's
directory (through the pyarrow filesystem of its URI, rebuilt in the task from the URI and the environment),
not committing anything. The driver then adds every file of the cycle in ONE Delta commit, which carries the
copy's app transaction (version = the table's cycle number) and the cycle's outcome in its commit metadata.
So a killed cycle leaves no rows in the table (only files no log entry references, which `lake vacuum`
removes), and a cycle committed just before a kill is found again by its app transaction and its state taken
from that commit: never copied twice.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from functools import partial

import psycopg2.errors
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql

from ...faults import fault_point
from ...postgres import passthrough
from ...postgres.catalog import Table
from ...postgres.connect import describe_conn
from ...rules.compile import CompiledRule
from ...rules.evaluate import RuleRunner
from ...spark import errors as spark_errors
from ...workflow.copier import CopyRange, task_where
from ...workflow.copy_task import snapshot_gone
from ...workflow.live import source_label
from ...workflow.rule_copy import RuleRead, read_ranges, rule_failure
from . import csvblock, durable
from .location import filesystem
from .rules import lake_table, target_batch
from .types import arrow_schema, convert_text_arrays

CYCLE_KEY = "sluicegate.copy_cycle"
# The COPY text a copy or vdiff task parses at once (~80k pgbench rows): memory stays bounded by it, the
# Parquet writer's row group and one file's key bounds, whatever the range's size.
BLOCK_BYTES = 8 << 20
# Rows per Parquet file a copy task writes. A MERGE rewrites every file that holds a row it changes, whole: a
# batch that touches a key range then rewrites the files that range spans, not a task's whole share.
FILE_ROWS = 250_000


@dataclass(frozen=True)
class LakeCopyTask:
    source_url: str
    table: dict
    snapshot: str
    lo: list | None
    hi: list | None
    pages: tuple | None
    directory: str  # the Delta table's directory or URI
    cycle: int
    label: str = ""  # the source session shows it and the rows read so far (workflow/live.py)
    rule: dict | None = None  # a rule that only moves columns (CompiledRule.to_json()): its columns are read


def tasks_for(plan, source_url: str, table: Table, snapshot: str, directory: str, cycle: int,
              rule: dict | None = None) -> list[LakeCopyTask]:
    return [LakeCopyTask(source_url, r.table, snapshot, r.lo, r.hi, r.pages, directory, cycle, rule=rule)
            for r in plan.tasks(source_url, "", table, snapshot)]


def snapshot_batches(source_url: str, snapshot: str, table: Table, where: sql.Composable, label: str = "",
                     columns=None, into: Table | None = None):
    """The table's rows matching `where`, read in the exported `snapshot` as text (the stream's form) and
    converted to Arrow batches of the Delta table's schema: what a copy task and a vdiff task read. `label`: the
    session's application_name while it reads (live.py: its COPY's rows are counted by the server), until the
    last batch. `columns` (of `table`, in the Delta table's order) and `into` (the Delta table): a rule's that
    only moves columns.

    One `COPY (SELECT …) TO STDOUT (FORMAT csv)`, its rows gathered into blocks of about BLOCK_BYTES
    (passthrough.copy_blocks), each parsed by Arrow's CSV reader (csvblock.py) and converted column by column
    (types.convert_text_arrays): no Python object per value where Arrow reads the type exactly as the
    per-value converter does."""
    into = into or table
    read = columns or table.columns
    # bare columns: COPY writes each with its type's output function, the stream's text (char(n) padded, inet
    # as inet's output, booleans as 't'/'f'), without a cast per value (`::text` differs for char(n) and inet)
    cols = sql.SQL(", ").join(sql.Identifier(c.name) for c in read)
    copy = sql.SQL("COPY (SELECT {} FROM {} WHERE {}) TO STDOUT (FORMAT csv)").format(cols, table.scan, where)
    schema = arrow_schema(into)
    src = passthrough.connect(source_url, "source")  # psycopg2: the COPY's loop runs in C (copy_blocks)
    try:
        src.set_session(isolation_level="REPEATABLE READ", readonly=True)
        try:
            src.cursor().execute("SET TRANSACTION SNAPSHOT %s", (snapshot,))
        except psycopg2.errors.InvalidParameterValue:
            raise snapshot_gone(snapshot, describe_conn(src)) from None
        if label:  # no statement can run during the COPY: the server counts its rows (pg_stat_progress_copy)
            src.cursor().execute("SELECT set_config('application_name', %s, false)", (source_label(label, 0),))
        def ended(rows: int) -> None:
            # The server counts a COPY's rows while it runs; the blocks read ahead are written after it ended, and
            # the session's name says their rows until then.
            src.cursor().execute("SELECT set_config('application_name', %s, false)", (source_label(label, rows),))

        for block in passthrough.copy_blocks(src, copy.as_string(None), BLOCK_BYTES, ended if label else None):
            yield _batch(into, schema, len(read), block)
        if label:  # before the task's result adds its rows to the cycle's counter: never counted twice
            src.cursor().execute("SELECT set_config('application_name', 'sluicegate', false)")
        src.rollback()
    finally:
        src.close()


def _batch(into: Table, schema, columns: int, block: bytes):
    texts = csvblock.string_arrays(columns, block)
    return pa.RecordBatch.from_arrays(convert_text_arrays(into, texts), schema=schema)


def copy_range(task: LakeCopyTask) -> list[dict]:
    """Runs in a Spark task: the range's rows as Parquet files in the table's directory; their add actions
    (as dicts) for the driver to commit."""
    table = Table.from_json(task.table)
    where = task_where(table, CopyRange(task.source_url, "", task.table, task.snapshot, task.lo, task.hi,
                                        task.pages))
    lake, columns = table, None
    if task.rule is not None:  # a rule that only moves columns: read its columns, under its names
        rule = CompiledRule.from_json(task.rule, table)
        lake, columns = lake_table(rule), [table.columns[ref] for _, ref in rule.outputs]
    return _written(task.directory, lake, task.cycle,
                    snapshot_batches(task.source_url, task.snapshot, table, where, task.label, columns, lake))


def _written(directory: str, lake: Table, cycle: int, batches) -> list[dict]:
    """`batches` as the cycle's Parquet files (FileWriter), nothing committed; their add actions."""
    files = FileWriter(directory, arrow_schema(lake), lake.key, cycle)
    try:
        for batch in batches:
            files.write(batch)
    except BaseException:
        files.abandon()
        raise
    files.finish()
    fault_point("lake.copy.task_written")
    return files.files


class FileWriter:
    """A copy task's Parquet files in the table's directory (or URI), of up to FILE_ROWS rows each; `files`:
    their add actions (as dicts) for the driver to commit."""

    def __init__(self, directory: str, schema, key, cycle: int):
        self.fs, self.directory = filesystem(directory)
        self.schema, self.cycle, self.local = schema, cycle, "://" not in directory
        self.files: list[dict] = []
        self.writer, self.path, self.name, self.rows = None, "", "", 0
        self.bounds = KeyBounds(schema, key)

    def write(self, batch) -> None:
        import pyarrow.parquet as pq

        if self.writer is None:
            self.name = f"part-c{self.cycle:05d}-{uuid.uuid4().hex}.parquet"
            self.path = f"{self.directory.rstrip('/')}/{self.name}"
            self.writer, self.rows = pq.ParquetWriter(self.path, self.schema, filesystem=self.fs), 0
        self.writer.write_batch(batch)
        self.bounds.add(batch)
        self.rows += batch.num_rows
        if self.rows >= FILE_ROWS:
            self.finish()

    def finish(self) -> None:
        """The file being written closed, synced and listed."""
        if self.writer is None:
            return
        self.writer.close()
        self.writer = None
        if self.local:  # on disk before the driver's commit names it
            durable.sync_file(self.path)
        info = self.fs.get_file_info(self.path)
        mtime = info.mtime.timestamp() if info.mtime is not None else time.time()
        self.files.append({"path": self.name, "size": info.size, "mtime": int(mtime * 1000), "rows": self.rows,
                           **self.bounds.take()})

    def abandon(self) -> None:
        """After a failure mid-file: the file is no part of any commit."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class KeyBounds:
    """The least and greatest value of each integer key column of the file being written: the add action's
    statistics, by which a MERGE skips files without reading them. Integers only: their order is the same
    for PostgreSQL, Arrow and delta-rs (text orders by collation in PostgreSQL, by bytes in delta-rs)."""

    def __init__(self, schema, key: list[str]):
        self.columns = [c for c in key if pa.types.is_integer(schema.field(c).type)]
        self.low: dict = {}
        self.high: dict = {}

    def add(self, batch) -> None:
        for c in self.columns:
            mm = pc.min_max(batch.column(c)).as_py()
            if mm["min"] is None:
                continue
            self.low[c] = mm["min"] if c not in self.low else min(self.low[c], mm["min"])
            self.high[c] = mm["max"] if c not in self.high else max(self.high[c], mm["max"])

    def take(self) -> dict:
        """The finished file's bounds (for its add action), and a fresh start for the next file."""
        out = {"min": self.low, "max": self.high} if self.low else {}
        self.low, self.high = {}, {}
        return out


def rows_written(files: list[dict]) -> int:
    """The rows of a copy task's files (what `copy_range` returns)."""
    return sum(f["rows"] for f in files)


def committed_cycle(dt, workflow_copy_app: str, cycle: int) -> dict | None:
    """The outcome of cycle `cycle` if the table already has its commit (a kill came before the state said so)."""
    done = dt.transaction_version(workflow_copy_app)
    if done is None or done < cycle:
        return None
    for entry in dt.history():
        raw = entry.get(CYCLE_KEY)
        if raw:
            outcome = json.loads(raw)
            if outcome.get("cycle") == cycle:
                return outcome
    return None


def _stats(f: dict) -> dict:
    """A copy file's add-action statistics: its rows, and its integer key columns' bounds (no NULLs: keys)."""
    out = {"numRecords": f["rows"]}
    if f.get("min"):
        out |= {"minValues": f["min"], "maxValues": f["max"], "nullCount": {c: 0 for c in f["min"]}}
    return out


def commit_cycle(dt, table: Table, files: list[dict], copy_app: str, outcome: dict,
                 mode: str = "append") -> None:
    """Every file of the cycle in one commit, with the copy's app transaction and the cycle's outcome;
    `mode` "overwrite" removes the table's other files in that commit."""
    from deltalake import CommitProperties, Transaction
    from deltalake.transaction import AddAction

    actions = [AddAction(f["path"], f["size"], {}, f["mtime"], True, json.dumps(_stats(f))) for f in files]
    props = CommitProperties(app_transactions=[Transaction(copy_app, outcome["cycle"])],
                             custom_metadata={CYCLE_KEY: json.dumps(outcome)})
    before = dt.version()
    dt.create_write_transaction(actions, mode, arrow_schema(table), commit_properties=props)
    durable.sync_versions(dt.table_uri, before, dt.version())  # (the files were synced by their tasks too)


# -- the copy through a rule that computes: a Spark job over the cycle's key ranges ------------------------
@dataclass(frozen=True)
class RuleFiles:
    """What each writing task needs: the rule, and where the cycle's files go."""

    rule: dict  # CompiledRule.to_json()
    source: dict  # its source Table.to_json()
    directory: str  # the Delta table's directory or URI
    cycle: int


def copy_cycle_through_rule(runner, tag: str, source_url: str, snapshot: str, rule, ranges: list,
                            directory: str, cycle: int) -> list[dict]:
    """The cycle's key ranges read as text (one Spark partition each: the PostgreSQL copy's reader,
    workflow/copier.py), the rule's SELECT over them in Spark, each partition's output written as Parquet files
    into the table's directory; their add actions, for the driver's one commit (copy.commit_cycle)."""
    if not ranges:
        return []
    rules = RuleRunner(runner.spark, rule)
    read = RuleRead(source_url, rule.source.to_json(), snapshot, ranges)
    write = RuleFiles(rule.to_json(), rule.source.to_json(), directory, cycle)
    raw = rules.session.range(0, len(ranges), 1, numPartitions=len(ranges)).mapInArrow(
        partial(read_ranges, read), rules.schema)
    out = rules.transform(raw).mapInArrow(partial(write_files, write), "file string")
    sc = runner.sc
    sc.setJobDescription(f"copy {rule.source.qualified} through its rule")
    sc.addJobTag(tag)
    try:
        rows = out.collect()
    except Exception as exc:
        if not spark_errors.is_data_error(exc):
            raise  # a lost worker, a cancelled job: classified by the engine
        raise rule_failure(rule, exc, None) from None
    finally:
        sc.removeJobTag(tag)
    return [json.loads(r[0]) for r in rows]


def write_files(task: RuleFiles, batches):
    """Runs in a Spark task: the rule's output for one partition as Parquet files (copy.FileWriter), nothing
    committed; one row per file (its add action as JSON)."""
    rule = CompiledRule.from_json(task.rule, Table.from_json(task.source))
    lake = lake_table(rule)
    files = _written(task.directory, lake, task.cycle,
                     (target_batch(rule, lake, b) for b in batches if b.num_rows))
    yield pa.RecordBatch.from_pydict({"file": [json.dumps(f) for f in files]},
                                     schema=pa.schema([pa.field("file", pa.string())]))

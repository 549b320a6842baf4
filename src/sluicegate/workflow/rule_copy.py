"""The copy of a table through a Spark SQL rule: a Spark DataFrame job per cycle.

Read tasks read the cycle's key ranges from the exported snapshot as text columns (one Spark partition each),
the rule's SELECT runs over them in Spark, and write tasks COPY each partition's output into the target. A row
the rule fails on stops the stream naming its key (found by halving the cycle's ranges). vdiff's rule
comparison and the Delta target's rule copy read through `read_ranges` too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ..errors import TerminalError, from_exception, pack, unpack
from ..faults import fault_point
from ..postgres import keyrange
from ..postgres.catalog import Table
from ..postgres.connect import connect, describe_conn
from .copy_task import snapshot_gone


@dataclass(frozen=True)
class RuleRead:
    """What each read task needs: the cycle's ranges (by index), in the snapshot."""

    source_url: str
    table: dict
    snapshot: str
    ranges: list[tuple[list[str] | None, list[str]]]


@dataclass(frozen=True)
class RuleWrite:
    target_url: str
    rule: dict  # CompiledRule.to_json()
    source: dict
    label: str = ""  # the target session's application_name (live.py)
    counter: Any = None  # each task adds the rows it committed (a Spark accumulator: live.py)


def copy_cycle_with_rule(runner, source_url: str, target_url: str, snapshot: str, ranges: list,
                         snapshot_conn: psycopg.Connection | None = None, label: str = "", counter=None) -> int:
    """Read the cycle's key ranges as text columns (one Spark partition each), run the rule's SELECT over
    them in Spark, write each partition's output with COPY into the target. Returns rows written. A row the
    rule fails on (Spark's data error) is a TerminalError naming the table, the row's key (found with
    `snapshot_conn`, find_failing_row) and the value; an error of a writing task comes back classified."""
    from functools import partial

    from ..spark import errors as spark_errors

    rule = runner.rule
    read = RuleRead(source_url, rule.source.to_json(), snapshot, ranges)
    write = RuleWrite(target_url, rule.to_json(), rule.source.to_json(), label, counter)
    ids = runner.session.range(0, len(ranges), 1, numPartitions=len(ranges))
    raw = ids.mapInArrow(partial(read_ranges, read), runner.schema)
    out = runner.transform(raw).mapInArrow(partial(write_rows, write), "rows long, error string")
    try:
        results = out.collect()
    except Exception as exc:
        if not spark_errors.is_data_error(exc):
            raise  # a lost worker, a cancelled job: classified by the engine
        key = None
        if snapshot_conn is not None:
            try:
                key = find_failing_row(runner, snapshot_conn, source_url, snapshot, ranges)
            except Exception:  # noqa: BLE001 - the search is a courtesy: report what is known
                key = None
        raise rule_failure(rule, exc, key) from None
    errors = [unpack(r[1]) for r in results if r[1]]
    if errors:
        raise next((e for e in errors if not e.retryable), errors[0])
    return sum(r[0] for r in results)


def rule_failure(rule, exc: BaseException, key: list[str] | None) -> TerminalError:
    """The one-line Error of a rule that fails on a row: the table, the key, the value, and the way out."""
    from ..spark import errors as spark_errors

    label = rule.rule.split(":", 1)[0]
    source = rule.source
    where = f"{source.qualified} row ({', '.join(source.key)})=({', '.join(key)})" if key else \
        f"a row of {source.qualified} (its key could not be found)"
    value = spark_errors.value(exc)
    what = spark_errors.message(exc)
    shown = f" on the value {value}" if value else ""
    return TerminalError(f"rule {label!r} fails{shown} of {where}: {what} Nothing past the copy's last committed "
                         f"key was applied to {rule.target.qualified}. Fix the rule (e.g. try_cast(... AS type), "
                         f"or CAST the input to a type that holds it), then re-create the workflow")


MAX_PROBES = 40


def find_failing_row(runner, conn: psycopg.Connection, source_url: str, snapshot: str,
                     ranges: list) -> list[str] | None:
    """The key of the first row of the cycle the rule fails on, by halving key ranges: each half one small
    Spark job over the snapshot (`conn` is in it: it splits a range at its middle key). An error path: the
    stream stops in Error, so the reads this takes (about twice the failing range) are spent once."""
    from functools import partial

    from ..spark import errors as spark_errors

    table = runner.rule.source

    def fails(lo, hi) -> bool:
        read = RuleRead(source_url, table.to_json(), snapshot, [(lo, hi)])
        raw = runner.session.range(0, 1, 1, numPartitions=1).mapInArrow(partial(read_ranges, read), runner.schema)
        try:
            runner.transform(raw).mapInArrow(count_rows, "n long").collect()
            return False
        except Exception as exc:
            if spark_errors.is_data_error(exc):
                return True
            raise

    def key_at(lo, hi, offset: int) -> list[str] | None:
        row = conn.execute(sql.SQL("SELECT {} FROM {} WHERE {} ORDER BY {} OFFSET %s LIMIT 1").format(
            keyrange.key_texts(table), table.scan, keyrange.in_range(table, lo, hi), keyrange.key_order(table)),
            (offset,)).fetchone()
        return list(row) if row else None

    probes = 0
    for lo, hi in ranges:
        probes += 1
        if not fails(lo, hi):
            continue
        while probes < MAX_PROBES:
            n = conn.execute(sql.SQL("SELECT count(*) FROM {} WHERE {}").format(
                table.scan, keyrange.in_range(table, lo, hi))).fetchone()[0]
            if n <= 1:
                return key_at(lo, hi, 0)
            mid = key_at(lo, hi, n // 2 - 1)
            probes += 1
            lo, hi = (lo, mid) if fails(lo, mid) else (mid, hi)
        return None
    return None


def count_rows(batches):
    """Every column of every row reaches Python, so Spark evaluates each of the rule's expressions."""
    import pyarrow as pa

    n = sum(b.num_rows for b in batches)
    yield pa.RecordBatch.from_arrays([pa.array([n], pa.int64())], names=["n"])


def read_ranges(task: RuleRead, batches):
    """Runs in a Spark task: each range index it is given, read in the snapshot as CSV, as string columns."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from ..rules.compile import RAW

    table = Table.from_json(task.table)
    names = [RAW.format(i) for i in range(len(table.columns))]
    convert = pacsv.ConvertOptions(column_types={n: pa.string() for n in names}, strings_can_be_null=True,
                                   quoted_strings_can_be_null=False, null_values=[""])
    parse = pacsv.ParseOptions(newlines_in_values=True)
    with connect(task.source_url, role="source") as src:
        src.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        src.read_only = True
        try:
            src.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(task.snapshot)))
        except psycopg.errors.InvalidParameterValue:
            raise snapshot_gone(task.snapshot, describe_conn(src)) from None
        cols = _rule_columns(src, table)
        for batch in batches:
            for idx in batch.column(0).to_pylist():
                lo, hi = task.ranges[idx]
                select = sql.SQL("COPY (SELECT {} FROM {} WHERE {}) TO STDOUT (FORMAT csv)").format(
                    cols, table.scan, keyrange.in_range(table, lo, hi))
                with src.cursor() as cur, cur.copy(select) as copy:
                    source = _CopyStream(copy)
                    if not source.peek():
                        continue  # no rows in this range (pyarrow refuses an empty CSV)
                    stream = pa.PythonFile(source, mode="r")
                    reader = pacsv.open_csv(stream, read_options=pacsv.ReadOptions(column_names=names,
                                                                                    block_size=4 << 20),
                                            parse_options=parse, convert_options=convert)
                    yield from reader
        src.rollback()


def _rule_columns(src: psycopg.Connection, table: Table) -> sql.Composable:
    """The rule's source columns as the source has them now: a column dropped, renamed or retyped since the rule
    was made reads NULL, as in the stream (schema_changes.rule_input; the stream stops if the rule reads it)."""
    now = dict(src.execute("SELECT attname, atttypid::int FROM pg_attribute WHERE attrelid = %s::regclass "
                           "AND attnum > 0 AND NOT attisdropped", (table.ident.as_string(src),)).fetchall())
    return sql.SQL(", ").join(sql.Identifier(c.name) if now.get(c.name) == c.type_oid else sql.SQL("NULL")
                              for c in table.columns)


def write_rows(task: RuleWrite, batches):
    """Runs in a Spark task: the rule's output for one partition, as CSV into the target, one transaction.
    An error of the target (a constraint, a type, a connection) comes back as a row, classified where it
    happened (errors.from_exception): Spark would report it only as a Python exception."""
    import io

    import pyarrow as pa
    import pyarrow.csv as pacsv

    from ..rules.compile import CompiledRule
    from ..rules.evaluate import target_columns

    rule = CompiledRule.from_json(task.rule, Table.from_json(task.source))
    target = rule.target
    names = [c.name for c in target.columns]
    cols = sql.SQL(", ").join(map(sql.Identifier, names))
    options = pacsv.WriteOptions(include_header=False, quoting_style="all_valid")
    rows = 0
    try:
        with connect(task.target_url, role="target", application_name=task.label or "sluicegate") as dst:
            with dst.cursor() as cur, cur.copy(sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
                    target.ident, cols)) as copy:
                for batch in _target_batches(batches):
                    buf = io.BytesIO()
                    pacsv.write_csv(pa.table(target_columns(rule, batch), names=names), buf, options)
                    copy.write(buf.getvalue())
                    rows += batch.num_rows
            fault_point("copy.before_commit")
            dst.commit()
        if task.counter is not None:
            task.counter.add(rows)
    except _SparkInput:
        raise  # the rule failed on a row: Spark's own error, with its class, reaches the driver
    except Exception as exc:  # noqa: BLE001 - classified here, raised on the driver
        err = from_exception(exc)
        err = type(err)(f"writing {target.qualified}: {err}", err.sqlstate)
        yield pa.RecordBatch.from_pydict({"rows": [0], "error": [pack(err)]})
        return
    yield pa.RecordBatch.from_pydict({"rows": [rows], "error": [None]})


class _SparkInput(Exception):
    """An error of the task's input (the rule's evaluation in the JVM), not of the target."""


def _target_batches(batches):
    """The non-empty input batches; a failure to produce one (the rule failed in Spark) as _SparkInput."""
    it = iter(batches)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except Exception as exc:
            raise _SparkInput(str(exc)) from exc
        if batch.num_rows:
            yield batch


class _CopyStream:
    """A psycopg COPY TO STDOUT as a readable file, for pyarrow's streaming CSV reader."""

    def __init__(self, copy):
        self._chunks = iter(copy)
        self._buf = b""
        self.closed = False

    def peek(self) -> bool:
        """Is there anything to read?"""
        while not self._buf:
            try:
                self._buf = bytes(next(self._chunks))
            except StopIteration:
                return False
        return True

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        parts, have = [self._buf], len(self._buf)
        while size < 0 or have < size:
            try:
                chunk = bytes(next(self._chunks))
            except StopIteration:
                break
            parts.append(chunk)
            have += len(chunk)
        data = b"".join(parts)
        if size < 0 or len(data) <= size:
            self._buf = b""
            return data
        self._buf = data[size:]
        return data[:size]

    def close(self) -> None:
        self.closed = True

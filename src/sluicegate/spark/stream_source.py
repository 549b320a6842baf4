"""`spark.readStream.format("sluicegate")`: PostgreSQL row changes as a Spark stream; offsets are positions.

Batches. A micro-batch [start, end) holds the row changes of every transaction whose commit record *begins*
at or after `start` and before `end` (Begin.final_lsn); a transaction is never split. Offsets may be any
WAL position, so the driver plans a batch from positions alone and never decodes a row: `end` is the WAL
flushed now, or `start` plus the batch's WAL bound (below), whichever is less. read(), in an executor, is
the only place a batch is decoded, once: one peek at the slot with upto_lsn = end, keeping the transactions
with start <= final_lsn < end. PostgreSQL's own rules make this exact:

- pg_logical_slot_peek_binary_changes(slot, upto) decodes WAL records up to the first whose end
  (EndRecPtr) reaches `upto` (pg_logical_slot_get_changes_guts), when `upto` was flushed before the call
  (`end` was flushed when it was planned); so every commit record that begins before `upto` is decoded,
  and a later one only when `upto` falls in the page header before it: read() drops that by its final_lsn.
- A slot confirmed at L skips the transactions whose commit record begins before L
  (SnapBuildXactNeedsSkip(buf->origptr) against start_decoding_at, which is the slot's confirmed_flush_lsn),
  and pg_replication_slot_advance(slot, L) confirms exactly L. So commit(end) releases exactly the batches
  up to `end`, and a later peek still sees every transaction of the batches after it.

Both sides only *peek* (replayable), so a batch read again after a crash gives the same rows, in the same
order; the slot moves only in `commit(end)`, which Spark calls once the batch is durably handled
(guarantee 7). A slot dropped, invalidated or consumed past an offset is a terminal error naming the way out.

Checkpoints written before (offsets were commit ends, a batch (start, end] held the transactions whose commit
*ends* in it) go on unchanged. Those offsets were never strictly inside the commit record of a transaction
with rows: commit ends, the slot's creation point (a record boundary), or a flushed position past which the
planning scan had seen every commit (a commit record straddling it ended the batch instead). For a position
P outside a commit record [b, e), "e <= P" is "b < P", so (start, end] by commit end is [start, end) by
commit start: a batch planned by the old code and replayed by this one gives the same rows, and the next
batch starts where it ended. Nothing is lost or read twice at the switch.

Admission control bounds a batch's WAL, not its rows (counting rows would mean decoding them):
`maxBytesPerBatch` (default 64 MiB) caps end - start; `maxChangesPerBatch` n still works and means a cap of
n * BYTES_PER_CHANGE, the least WAL a row change of a table with a key takes, so such a batch holds about n
changes or fewer (rows COPYed into a table without indexes take less WAL: then more). A batch may hold more:
the transactions whose commit begins in it come whole, with changes written before `start`. Spark's
ReadAllAvailable (Trigger.Once) reads everything flushed. WAL without such commits (unpublished tables,
other databases, a big transaction still being written) makes empty batches: they move the offset, so the
slot lets that WAL go, but each is a micro-batch and a peek that decodes from the slot's restart_lsn.

DDL: with the source's DDL capture installed (`sluicegate ddl install`), a DDL statement on a table of the
publication comes as a row per such table with op 'ddl', at its place among its transaction's rows (before it
the old shape, after it the new): `after` holds the statement (`statement`, its command tag `tag`, the
`search_path` it ran under), `before` and `key` are null. A CREATE TABLE touches no published table yet: not
sent. Which tables are published is read when a batch is read.

Where it runs: initialOffset/latestOffset/partitions/commit in one long-lived Python process on the driver
(its control connection is named `sluicegate stream planner` in pg_stat_activity); read() in executor
workers (each opens its own connection, `sluicegate stream reader`). Errors: a psycopg error becomes a
RetryableError or TerminalError (by is_retryable) whose one-line message carries its SQLSTATE. Retryable
ones are retried in place for up to RETRY_SECONDS (read() resumes after the rows it already handed to
Spark: a batch's rows come in the same order every time); terminal ones are raised at once. Spark shows
`sluicegate.errors.TerminalError: <message>` in the query's exception; `query_error()` gives the error back.
"""

from __future__ import annotations

import pickle
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psycopg
from psycopg import sql
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadMaxBytes,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import ArrayType, LongType, MapType, StringType, StructField, StructType, TimestampType

from .. import errors
from ..ddl.message import PREFIX, BadDdlMessage, parse
from ..errors import RetryableError, SluicegateError, TerminalError, UsageError, did_you_mean, is_retryable
from ..faults import fault_point
from ..position import format_lsn, parse_lsn
from ..postgres import capture, catalog, peek
from ..postgres.assembler import Change, assemble
from ..postgres.connect import connect, first_line
from ..postgres.pgoutput import UNCHANGED, Begin, Commit, DecodeError, LogicalMessage

NAME = "sluicegate"
DEFAULT_MAX_BYTES = 64 << 20
# The least WAL one row change takes (a DELETE's record; an INSERT into a table with a key takes two records),
# to turn maxChangesPerBatch into a WAL bound that seldom lets more changes in
BYTES_PER_CHANGE = 64
ROWS_PER_ARROW_BATCH = 8192
ARROW_BATCH_BYTES = 16 << 20  # ... or fewer rows, once they came from this many pgoutput bytes
# pgoutput bytes of one transaction held in memory (as Python rows, ~10x that); the rest waits in a temporary
# file for the commit, whose end every row carries
TXN_BUFFER_BYTES = 8 << 20
RETRY_SECONDS = 60.0  # how long a retryable error (connection lost, slot busy) is retried in place
PLANNER, READER = "sluicegate stream planner", "sluicegate stream reader"  # application_name of each side

_S = StringType()
SCHEMA = StructType([
    StructField("lsn", _S),  # the change's position
    StructField("commit_lsn", _S),  # end of its transaction's commit record
    StructField("xid", LongType()),
    StructField("commit_time", TimestampType()),
    StructField("op", _S),  # insert | update | delete | truncate | ddl
    StructField("schema", _S),
    StructField("table", _S),
    StructField("key", ArrayType(_S)),  # replica identity columns (the primary key by default)
    StructField("before", MapType(_S, _S)),
    StructField("after", MapType(_S, _S)),  # ddl: tag, statement, search_path
])

# Option names as documented; Spark hands them over lower-cased.
OPTIONS = ("source", "slot", "publication", "tables", "maxBytesPerBatch", "maxChangesPerBatch")
_REQUIRED = ("source", "slot")

_OPS = {"I": "insert", "U": "update", "D": "delete"}


def register(spark) -> None:
    """Make `spark.readStream.format("sluicegate")` available in this session."""
    spark.dataSource.register(ChangeSource)


def query_error(exc: BaseException | None) -> SluicegateError | None:
    """The Sluicegate error a streaming query failed with (Spark carries it as the text of a Python
    traceback), rebuilt with its type and message; None if it failed otherwise."""
    found = re.findall(r"^sluicegate\.errors\.(\w+): (.*)$", str(exc or ""), re.MULTILINE)
    for name, message in reversed(found):
        cls = getattr(errors, name, None)
        if isinstance(cls, type) and issubclass(cls, SluicegateError):
            return cls(message)
    return None


@dataclass(frozen=True)
class Settings:
    source: str
    slot: str
    publication: str
    tables: tuple[str, ...]  # empty: every table of schema public
    max_bytes: int  # WAL bytes a batch spans at most

    @classmethod
    def parse(cls, options) -> Settings:
        given = {k.lower(): v for k, v in options.items()}
        known = {o.lower(): o for o in OPTIONS}
        for key in given:
            if key not in known:
                hint = did_you_mean(key, list(OPTIONS)) or f"; its options: {', '.join(OPTIONS)}"
                raise UsageError(f"unknown option {key!r} of format {NAME!r}{hint}")
        for name in _REQUIRED:
            if not (given.get(name) or "").strip():
                raise UsageError(f"format {NAME!r} needs option {name!r}: .option({name!r}, ...)")
        slot = given["slot"].strip()
        bounds = []
        if "maxbytesperbatch" in given:
            bounds.append(_positive_size(given["maxbytesperbatch"]))
        if "maxchangesperbatch" in given:
            raw = given["maxchangesperbatch"]
            try:
                max_changes = int(raw)
                if max_changes < 1:
                    raise ValueError
            except ValueError:
                raise UsageError(f"option 'maxChangesPerBatch' must be a positive whole number, not {raw!r}"
                                 ) from None
            bounds.append(max_changes * BYTES_PER_CHANGE)
        tables = tuple(t.strip() for t in (given.get("tables") or "").split(",") if t.strip())
        publication = (given.get("publication") or "").strip() or slot
        return cls(given["source"], slot, publication, tables, min(bounds, default=DEFAULT_MAX_BYTES))


def _positive_size(raw) -> int:
    from ..changes.translog import parse_size

    try:
        size = parse_size(str(raw))
    except UsageError:
        size = 0
    if size < 1:
        raise UsageError(f"option 'maxBytesPerBatch' must be a positive size (WAL bytes, or like 16MiB), "
                         f"not {raw!r}")
    return size


class ChangeSource(DataSource):
    """The data source Spark looks up by name: options checked at load(), the reader made per query."""

    def __init__(self, options):
        super().__init__(options)
        self.settings = Settings.parse(options)

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        """Called once, at load(): a source that cannot serve a stream fails here, not at the first batch."""

        with connect(self.settings.source, role="source") as conn:
            capture.check_source(conn)
        return SCHEMA

    def streamReader(self, schema: StructType) -> ChangeReader:
        return ChangeReader(self.settings)


class LsnRange(InputPartition):
    """One micro-batch: transactions whose commit record begins in [start, end)."""

    def __init__(self, start: int, end: int):
        super().__init__((start, end))
        self.start, self.end = start, end


class ChangeReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, settings: Settings):
        self.settings = settings
        self._conn = None  # driver only: the control connection (never pickled to executors)
        self._ceiling: int | None = None  # Trigger.AvailableNow: read nothing committed after this

    def __getstate__(self):
        return {**self.__dict__, "_conn": None}

    # -- driver: positions only, never a peek ----------------------------------------------------------------

    def initialOffset(self) -> dict:
        """A new query starts where the slot stands (created now, after its publication, if missing)."""
        s = self.settings

        def start():
            conn = self._control()
            exists = conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (s.publication,))
            if not exists.fetchone():
                tables = catalog.resolve_tables(conn, list(s.tables) or None)
                capture.ensure_publication(conn, s.publication, tables)
            elif s.tables:
                self._check_publication_tables(conn)
            return _offset(capture.ensure_slot(conn, s.slot))

        return self._driver_call("starting the query", start)

    def getDefaultReadLimit(self):
        return ReadMaxBytes(self.settings.max_bytes)

    def prepareForTriggerAvailableNow(self) -> None:
        self._ceiling = self._driver_call("reading the flushed WAL position",
                                          lambda: capture.wal_flush_position(self._control())[0])

    def latestOffset(self, start: dict, limit) -> dict:
        """The next batch's end: the WAL flushed now (or at the AvailableNow start), at most the read limit's
        WAL past `start`. Nothing is decoded here."""
        start_lsn = _lsn(start)

        def plan():
            conn = self._control()
            _check_slot(conn, self.settings.slot, start_lsn)
            return self._ceiling if self._ceiling is not None else capture.wal_flush_position(conn)[0]

        upto = self._driver_call("planning a batch", plan)
        if upto <= start_lsn:
            return start
        if isinstance(limit, ReadAllAvailable):
            bound = None
        elif isinstance(limit, ReadMaxBytes):
            bound = limit.max_bytes
        elif isinstance(limit, ReadMaxRows):
            bound = limit.max_rows * BYTES_PER_CHANGE
        else:
            bound = self.settings.max_bytes
        return _offset(upto if bound is None else min(upto, start_lsn + max(1, bound)))

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        """Also for a batch Spark replays after a restart: a slot that can no longer supply it fails the query
        here, on the driver, before any task starts."""
        start_lsn, end_lsn = _lsn(start), _lsn(end)
        if end_lsn <= start_lsn:
            return []
        self._driver_call("checking the slot",
                          lambda: _check_slot(self._control(), self.settings.slot, start_lsn))
        return [LsnRange(start_lsn, end_lsn)]

    def commit(self, end: dict) -> None:
        """Spark durably handled everything before `end`: only now may the slot move."""
        self._driver_call(f"confirming up to {end.get('lsn')}",
                          lambda: capture.advance_slot(self._control(), self.settings.slot, _lsn(end)))

    def stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _control(self):
        if self._conn is None or self._conn.closed or self._conn.broken:
            conn = _connect(self.settings.source, PLANNER)
            try:
                capture.check_source(conn)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _driver_call(self, doing: str, fn: Callable):
        # (after a failure: a fresh connection for the next try)
        return _retrying(f"{doing} on slot {self.settings.slot}", fn, self.stop)

    def _check_publication_tables(self, conn) -> None:
        s = self.settings
        wanted = {(t.schema, t.name) for t in catalog.resolve_tables(conn, list(s.tables))}
        have = set(conn.execute("SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s",
                                (s.publication,)).fetchall())
        if not wanted <= have:
            missing = ", ".join(sorted(f"{a}.{b}" for a, b in wanted - have))
            raise UsageError(f"publication {s.publication} exists without {missing}: drop the 'tables' "
                             f"option, or add them with ALTER PUBLICATION {s.publication} ADD TABLE ...")

    # -- executors -----------------------------------------------------------------------------------------

    def read(self, partition: LsnRange):
        fault_point("stream_source.read")  # kill -9 tests: a batch planned, none of it handed to Spark
        yield from _read_retrying(self.settings, partition.start, partition.end)


# -- errors and retries --------------------------------------------------------------------------------------


def _as_error(exc: BaseException, doing: str) -> SluicegateError | None:
    """`exc` as one of our errors: itself, or a psycopg error as a RetryableError or TerminalError (by
    is_retryable) with the server's SQLSTATE; None for anything else (a bug: it goes up as it is)."""
    if isinstance(exc, SluicegateError):
        return exc
    if isinstance(exc, psycopg.Error):
        state = f" (SQLSTATE {exc.sqlstate})" if exc.sqlstate else ""
        kind = RetryableError if is_retryable(exc) else TerminalError
        return kind(f"{doing} failed: {first_line(exc)}{state}")
    if isinstance(exc, DecodeError):
        return TerminalError(f"{doing} failed: {first_line(exc)}")
    return None


class _Backoff:
    """Waits between the tries of a run of retryable failures; the run gives up RETRY_SECONDS after its first
    failure. An error leaves as ours (_as_error): a terminal one at once, a retryable one at the deadline."""

    def __init__(self, doing: str):
        self.doing = doing
        self.deadline: float | None = None
        self.delay = 0.1

    def failed(self, exc: Exception) -> None:
        """Wait before the next try, or raise."""
        err = _as_error(exc, self.doing)
        if err is None:
            raise exc
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + RETRY_SECONDS
        if not err.retryable or now + self.delay > self.deadline:
            raise err from None
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, 5.0)

    def progressed(self) -> None:
        self.deadline, self.delay = None, 0.1


def _retrying(doing: str, fn: Callable, again: Callable | None = None):
    """fn(), tried again (after again()) while it fails with a retryable error."""
    backoff = _Backoff(doing)
    while True:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - sorted by _Backoff: ours, psycopg's, or raised as it is
            backoff.failed(exc)
        if again is not None:
            again()


def _read_retrying(settings: Settings, start: int, end: int) -> Iterator:
    """_read_batches, read again after a retryable error; the rows Spark already has are skipped (a peek of
    the same batch gives the same rows in the same order)."""
    backoff = _Backoff(f"reading changes [{format_lsn(start)}, {format_lsn(end)}) of slot {settings.slot}")
    handed = 0
    while True:
        skip = handed
        try:
            for batch in _read_batches(settings, start, end):
                if skip >= batch.num_rows:
                    skip -= batch.num_rows
                    continue
                if skip:
                    batch, skip = batch.slice(skip), 0
                handed += batch.num_rows
                backoff.progressed()
                yield batch
            return
        except Exception as exc:  # noqa: BLE001 - sorted by _Backoff
            backoff.failed(exc)


# -- peeking at the slot (executors) -------------------------------------------------------------------------


def _connect(url: str, application_name: str):
    """A source session (autocommit) that pg_stat_activity and the server log name by its side."""
    conn = connect(url, role="source", autocommit=True)
    try:
        conn.execute(sql.SQL("SET application_name = {}").format(sql.Literal(application_name)))
    except BaseException:
        conn.close()
        raise
    return conn


def _check_slot(conn, slot: str, start: int) -> None:
    """The slot can still supply every transaction of a batch from `start`, or a terminal error with the way
    out."""
    capture.check_slot(conn, slot, start, consumer="this query's offset", way_out=(
        f"the query cannot go on without losing changes: start it again with a new checkpoint location (it "
        f"then reads from where slot {slot} stands)"))


def _read_batches(settings: Settings, start: int, end: int) -> Iterator:
    """The batch's rows as Arrow record batches, in commit order, in bounded memory: one peek up to `end`."""

    builder = _ArrowBuilder()
    conn = _connect(settings.source, READER)
    try:
        _check_slot(conn, settings.slot, start)  # a peek starts at the slot: it must not be past the batch
        conn.autocommit = False  # (the peek reads through a named cursor: in a transaction, rolled back after)
        published = {tuple(r) for r in conn.execute(
            "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s",
            (settings.publication,))}
        rows = peek.peek(conn, settings.slot, settings.publication, end, messages=True)
        txn: _TxnRows | None = None
        begin: Begin | None = None
        for event in assemble(peek.in_range(rows, start, end), messages=PREFIX):
            if isinstance(event, Change):
                txn.add(_change_row(event, begin), event.size)
            elif isinstance(event, LogicalMessage):
                for row in _ddl_rows(event, begin, published):
                    txn.add(row, len(event.content))
            elif isinstance(event, Begin):
                begin, txn = event, _TxnRows()
            elif isinstance(event, Commit):
                commit_lsn = format_lsn(event.end_lsn)
                for rows_, nbytes in txn.drain():
                    yield from builder.extend(rows_, nbytes, commit_lsn)
                txn = None
            else:  # TruncateChange: a row per table
                for row in _truncate_rows(event, begin):
                    txn.add(row, 0)
        yield from builder.flush()
    finally:
        conn.close()


def _change_row(change, begin) -> tuple:
    """An output row without commit_lsn (known only at the commit)."""
    rel = change.relation
    names, key = _names(rel)
    before = None
    if change.old is not None:
        if rel.replica_identity == "f":
            before = _values(names, change.old)
        else:  # key-only old row: the other columns were not sent (they are not NULL)
            before = {names[i]: _text(change.old[i]) for i in rel.key_columns}
    after = _values(names, change.new) if change.new is not None else None
    return (format_lsn(change.lsn), begin.xid, begin.commit_time, _OPS[change.kind], rel.schema, rel.name,
            key, before, after)


def _truncate_rows(truncate, begin) -> list[tuple]:
    lsn = format_lsn(truncate.lsn)
    return [(lsn, begin.xid, begin.commit_time, "truncate", rel.schema, rel.name, _names(rel)[1], None, None)
            for rel in truncate.relations]


def _ddl_rows(message, begin, published: set) -> list[tuple]:
    """A captured DDL statement: a row per published table it touches (changes/ddl.py decides which)."""
    from ..changes.ddl import touched

    try:
        ddl = parse(message.content, message.lsn)
    except BadDdlMessage as exc:
        raise TerminalError(f"{exc}; or remove the capture on the source (`sluicegate ddl remove`)") from None
    after = {"tag": ddl.tag, "statement": ddl.statement, "search_path": ddl.search_path}
    lsn = format_lsn(ddl.lsn)
    return [(lsn, begin.xid, begin.commit_time, "ddl", schema, table, None, None, after)
            for schema, table in touched(ddl, lambda s, n: (s, n) in published)]


_NAMES: dict[int, tuple] = {}


def _names(rel) -> tuple[tuple[str, ...], list[str]]:
    cached = _NAMES.get(rel.oid)
    if cached is None or cached[0] is not rel:
        names = tuple(c.name for c in rel.columns)
        cached = _NAMES[rel.oid] = (rel, names, [names[i] for i in rel.key_columns])
    return cached[1], cached[2]


def _values(names: tuple[str, ...], values: tuple) -> dict:
    return {n: _text(v) for n, v in zip(names, values) if v is not UNCHANGED}


def _text(value):
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):  # binary-format value: its bytea text form
        return "\\x" + value.hex()
    return str(value)


class _TxnRows:
    """A transaction's rows until its commit end is known; past TXN_BUFFER_BYTES they wait on disk."""

    def __init__(self):
        self.rows: list[tuple] = []
        self.bytes = 0
        self.spill = None

    def add(self, row: tuple, size: int) -> None:
        self.rows.append(row)
        self.bytes += size
        if self.bytes > TXN_BUFFER_BYTES:
            if self.spill is None:
                spill = tempfile.TemporaryFile(prefix="sluicegate-txn-")  # noqa: SIM115 - drain() closes it
                self.spill = spill
            pickle.dump((self.rows, self.bytes), self.spill, protocol=pickle.HIGHEST_PROTOCOL)
            self.rows, self.bytes = [], 0

    def drain(self) -> Iterator[tuple[list[tuple], int]]:
        """(rows, their pgoutput bytes), chunk by chunk, in order."""
        if self.spill is not None:
            self.spill.seek(0)
            try:
                while True:
                    try:
                        yield pickle.load(self.spill)
                    except EOFError:
                        break
            finally:
                self.spill.close()
        yield self.rows, self.bytes
        self.rows, self.bytes = [], 0


class _ArrowBuilder:
    """Rows into Arrow record batches with exactly the schema Spark expects of a Python data source."""

    def __init__(self):
        from pyspark.sql.pandas.types import to_arrow_schema

        self.schema = to_arrow_schema(SCHEMA, timezone="UTC")
        self.rows: list[tuple] = []
        self.commits: list[str] = []
        self.bytes = 0

    def extend(self, rows: list[tuple], nbytes: int, commit_lsn: str) -> Iterator:
        self.rows += rows
        self.commits += [commit_lsn] * len(rows)
        self.bytes += nbytes
        if self.bytes >= ARROW_BATCH_BYTES:  # wide rows: hand over everything now
            yield from self.flush()
        while len(self.rows) >= ROWS_PER_ARROW_BATCH:
            yield self._batch(ROWS_PER_ARROW_BATCH)

    def flush(self) -> Iterator:
        while self.rows:
            yield self._batch(min(len(self.rows), ROWS_PER_ARROW_BATCH))
        self.bytes = 0

    def _batch(self, n: int):
        import pyarrow as pa

        rows, commits = self.rows[:n], self.commits[:n]
        del self.rows[:n], self.commits[:n]
        lsn, xid, ts, op, schema, table, key, before, after = zip(*rows)
        columns = (lsn, commits, xid, ts, op, schema, table, key, before, after)
        arrays = [pa.array(col, type=field.type) for col, field in zip(columns, self.schema)]
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


# -- small helpers -------------------------------------------------------------------------------------------


def _offset(lsn: int) -> dict:
    return {"lsn": format_lsn(lsn)}


def _lsn(offset: dict) -> int:
    try:
        return parse_lsn(offset["lsn"])
    except (KeyError, TypeError, ValueError):
        raise TerminalError(f"offset {offset!r} is not a {NAME} position (like {{'lsn': '0/16B3748'}}): "
                            f"was the checkpoint written by another source?") from None

"""`spark.readStream.format("sluicegate")`: PostgreSQL row changes as a Spark stream; offsets are positions.

A micro-batch (start, end] holds the row changes of every transaction whose commit ends (Commit.end_lsn) after
`start` and at or before `end`; transactions are never split. Both sides only *peek* at the logical slot
(pg_logical_slot_peek_binary_changes is replayable), so a batch read again after a crash gives the same rows;
the slot moves only in `commit(end)`, which Spark calls once the batch is durably handled (guarantee 7).

Where it runs: initialOffset/latestOffset/partitions/commit in one long-lived Python process on the driver
(it keeps a control connection); read() in executor workers (each opens its own connection).

Offsets are never inside a commit record (they are commit ends, the slot's start, or a flushed position
past which the scan saw every commit), so "commits after start" is the same as "its commit record begins at
or after start" -- PostgreSQL's own rule for where a slot starts. read() therefore decides at Begin
(Begin.final_lsn is where the commit record begins) and never decodes a skipped transaction's rows.
"""

from __future__ import annotations

import pickle
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import ArrayType, LongType, MapType, StringType, StructField, StructType, TimestampType

from ..errors import TerminalError, UsageError, did_you_mean
from ..position import format_lsn, parse_lsn

NAME = "sluicegate"
DEFAULT_MAX_CHANGES = 100_000
# With nothing published to read, an offset still moves past this much WAL (one empty batch), so the slot
# can release WAL that only other tables (or other databases) wrote.
IDLE_ADVANCE_BYTES = 16 << 20
ROWS_PER_ARROW_BATCH = 8192
ARROW_BATCH_BYTES = 16 << 20  # ... or fewer rows, once they came from this many pgoutput bytes
# pgoutput bytes of one transaction held in memory (as Python rows, ~10x that); the rest waits in a temporary
# file for the commit, whose end every row carries
TXN_BUFFER_BYTES = 8 << 20
FETCH_ROWS = 5000  # rows per round trip of the server-side cursor
SLOT_BUSY_TIMEOUT = 30.0  # seconds to wait for a slot another peek or advance holds

_S = StringType()
SCHEMA = StructType([
    StructField("lsn", _S),  # the change's position
    StructField("commit_lsn", _S),  # end of its transaction's commit record: the offset it belongs to
    StructField("xid", LongType()),
    StructField("commit_time", TimestampType()),
    StructField("op", _S),  # insert | update | delete | truncate
    StructField("schema", _S),
    StructField("table", _S),
    StructField("key", ArrayType(_S)),  # replica identity columns (the primary key by default)
    StructField("before", MapType(_S, _S)),
    StructField("after", MapType(_S, _S)),
])

# Option names as documented; Spark hands them over lower-cased.
OPTIONS = ("source", "slot", "publication", "tables", "maxChangesPerBatch")
_REQUIRED = ("source", "slot")

_BEGIN, _COMMIT, _INSERT, _UPDATE, _DELETE, _TRUNCATE, _RELATION, _TYPE = b"BCIUDTRY"
_OPS = {"I": "insert", "U": "update", "D": "delete"}


def register(spark) -> None:
    """Make `spark.readStream.format("sluicegate")` available in this session."""
    spark.dataSource.register(ChangeSource)


@dataclass(frozen=True)
class Settings:
    source: str
    slot: str
    publication: str
    tables: tuple[str, ...]  # empty: every table of schema public
    max_changes: int

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
        raw_max = given.get("maxchangesperbatch", str(DEFAULT_MAX_CHANGES))
        try:
            max_changes = int(raw_max)
            if max_changes < 1:
                raise ValueError
        except ValueError:
            raise UsageError(f"option 'maxChangesPerBatch' must be a positive whole number, not {raw_max!r}"
                             ) from None
        tables = tuple(t.strip() for t in (given.get("tables") or "").split(",") if t.strip())
        publication = (given.get("publication") or "").strip() or slot
        return cls(given["source"], slot, publication, tables, max_changes)


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
        from ..postgres import capture
        from ..postgres.connect import connect

        with connect(self.settings.source, role="source") as conn:
            capture.check_source(conn)
        return SCHEMA

    def streamReader(self, schema: StructType) -> ChangeReader:
        return ChangeReader(self.settings)


class LsnRange(InputPartition):
    """One micro-batch: transactions whose commit ends in (start, end]."""

    def __init__(self, start: int, end: int):
        super().__init__((start, end))
        self.start, self.end = start, end


@dataclass
class _Scan:
    rows: int = 0  # rows the peek returned (all message kinds)
    rows_before: int = 0  # ... of transactions before start (already in an earlier batch)
    changes: int = 0  # row changes of the transactions taken
    last_end: int | None = None  # commit end of the last transaction taken
    cut: bool = False  # stopped at the read limit (the next transaction would pass it)


class ChangeReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, settings: Settings):
        self.settings = settings
        self._conn = None  # driver only: the control connection (never pickled to executors)
        self._ceiling: int | None = None  # Trigger.AvailableNow: read nothing committed after this
        self._last: tuple[int, int, float] | None = None  # (end, rows of its batch, rows per change)

    def __getstate__(self):
        return {**self.__dict__, "_conn": None}

    # -- driver ------------------------------------------------------------------------------------------

    def initialOffset(self) -> dict:
        """A new query starts where the slot stands (created now, after its publication, if missing)."""
        from ..postgres import capture, catalog

        s = self.settings
        conn = self._control()
        if not conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (s.publication,)).fetchone():
            tables = catalog.resolve_tables(conn, list(s.tables) or None)
            capture.ensure_publication(conn, s.publication, tables)
        elif s.tables:
            self._check_publication_tables(conn)
        return _offset(capture.ensure_slot(conn, s.slot))

    def getDefaultReadLimit(self):
        return ReadMaxRows(self.settings.max_changes)

    def prepareForTriggerAvailableNow(self) -> None:
        from ..postgres import capture

        self._ceiling = capture.wal_flush_position(self._control())[0]

    def latestOffset(self, start: dict, limit) -> dict:
        from ..postgres import capture

        start_lsn = _lsn(start)
        conn = self._control()
        _check_slot(conn, self.settings.slot, start_lsn)
        upto = self._ceiling if self._ceiling is not None else capture.wal_flush_position(conn)[0]
        if upto <= start_lsn:
            return start
        max_changes = limit.max_rows if isinstance(limit, ReadMaxRows) else None  # else ReadAllAvailable
        if max_changes is not None:
            behind, per_change = 0, 3.0
            if self._last is not None and self._last[0] == start_lsn:
                behind, per_change = self._last[1], self._last[2]
            cap = behind + int(max_changes * per_change) + 64
        else:
            cap = None
        while True:
            scan = _scan(conn, self.settings, start_lsn, upto, cap, max_changes)
            if scan.cut or cap is None or scan.rows < cap:
                break
            cap *= 2  # stopped at the row cap before the read limit: look further
        if scan.cut:
            end = scan.last_end
        elif scan.changes:
            # Everything committed before `upto` was seen; a commit record straddling it ends the batch.
            end = max(scan.last_end, upto)
        elif upto - start_lsn >= IDLE_ADVANCE_BYTES:
            end = upto
        else:
            return start
        if scan.changes:
            taken_rows = scan.rows - scan.rows_before
            self._last = (end, taken_rows, max(1.0, min(4.0, taken_rows / scan.changes)))
        return _offset(end)

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        start_lsn, end_lsn = _lsn(start), _lsn(end)
        return [LsnRange(start_lsn, end_lsn)] if end_lsn > start_lsn else []

    def commit(self, end: dict) -> None:
        """Spark durably handled everything up to `end`: only now may the slot move."""
        from ..postgres import capture

        _with_slot(lambda: capture.advance_slot(self._control(), self.settings.slot, _lsn(end)),
                   self.settings.slot)

    def stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _control(self):
        if self._conn is None or self._conn.closed or self._conn.broken:
            from ..postgres import capture
            from ..postgres.connect import connect

            conn = connect(self.settings.source, role="source", autocommit=True)
            try:
                capture.check_source(conn)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _check_publication_tables(self, conn) -> None:
        from ..postgres import catalog

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
        from ..workflow.faults import fault_point

        fault_point("stream_source.read")  # kill -9 tests: a batch planned, none of it handed to Spark
        yield from _read_batches(self.settings, partition.start, partition.end)


# -- peeking at the slot -------------------------------------------------------------------------------------


def _check_slot(conn, slot: str, start: int) -> None:
    """The slot can still supply every change after `start`, or a terminal error with the way out."""
    from ..postgres import capture

    capture.check_slot(conn, slot, start, consumer="this query's offset", way_out=(
        f"the query cannot go on without losing changes: start it again with a new checkpoint location (it "
        f"then reads from where slot {slot} stands)"))


def _peek(conn, settings: Settings, upto: int, nchanges: int | None):
    """A server-side cursor over the slot's changes from its confirmed position up to `upto`: (lsn, bytes).
    The server stops after the first transaction that brings its row count to `nchanges`. `conn` must be
    inside a transaction."""
    cur = conn.cursor(name="sluicegate_peek", binary=True)
    cur.itersize = FETCH_ROWS
    cur.execute(
        "SELECT (lsn - '0/0'::pg_lsn)::int8, data FROM pg_logical_slot_peek_binary_changes("
        "%s, %s::pg_lsn, %s, 'proto_version', '1', 'publication_names', %s)",
        (settings.slot, format_lsn(upto), nchanges, _quote_ident(settings.publication)),
    )
    return cur


def _scan(conn, settings: Settings, start: int, upto: int, cap: int | None, max_changes: int | None) -> _Scan:
    """Where the next batch after `start` ends, from message kinds and commit ends alone (no row decoding)."""
    from ..postgres import pgoutput

    def run() -> _Scan:
        scan = _Scan()
        taking, txn = False, 0
        with conn.transaction():
            cur = _peek(conn, settings, upto, cap)
            try:
                for _, data in cur:
                    scan.rows += 1
                    kind = data[0]
                    if kind == _BEGIN:  # the commit record's start decides, as in read()
                        taking, txn = int.from_bytes(data[1:9], "big") >= start, 0
                    if not taking:
                        scan.rows_before += 1
                    elif kind in (_INSERT, _UPDATE, _DELETE):
                        txn += 1
                    elif kind == _TRUNCATE:
                        txn += len(pgoutput.decode(bytes(data)).relation_oids)
                    elif kind == _COMMIT:
                        taking = False
                        if max_changes is not None and scan.changes and scan.changes + txn > max_changes:
                            scan.cut = True
                            break
                        scan.changes += txn
                        scan.last_end = int.from_bytes(data[10:18], "big")
            finally:
                cur.close()
        return scan

    return _with_slot(run, settings.slot)


def _read_batches(settings: Settings, start: int, end: int) -> Iterator:
    """The batch's rows as Arrow record batches, in commit order, in bounded memory."""
    from ..postgres.assembler import Change, assemble
    from ..postgres.connect import connect
    from ..postgres.pgoutput import Begin, Commit, DecodeError

    builder = _ArrowBuilder()
    conn = connect(settings.source, role="source")
    try:
        _check_slot(conn, settings.slot, start)  # a peek starts at the slot: it must not be past the batch
        cur, first = _open_peek(conn, settings, end)
        rows = _chain(first, cur)
        txn: _TxnRows | None = None
        begin: Begin | None = None
        for event in assemble(_wanted(rows, start, end)):
            if isinstance(event, Change):
                txn.add(_change_row(event, begin), event.size)
            elif isinstance(event, Begin):
                begin, txn = event, _TxnRows()
            elif isinstance(event, Commit):
                if not start < event.end_lsn <= end:
                    raise DecodeError(f"transaction {begin.xid} commits at {format_lsn(event.end_lsn)}, "
                                      f"outside the batch ({format_lsn(start)}, {format_lsn(end)}]")
                commit_lsn = format_lsn(event.end_lsn)
                for rows_, nbytes in txn.drain():
                    yield from builder.extend(rows_, nbytes, commit_lsn)
                txn = None
            else:  # TruncateChange: a row per table
                for row in _truncate_rows(event, begin):
                    txn.add(row, 0)
        yield from builder.flush()
        cur.close()
        conn.rollback()
    finally:
        conn.close()


def _open_peek(conn, settings: Settings, end: int):
    """The peek cursor and its first rows: the server decodes at the first fetch, holding the slot; if another
    peek or an advance holds it, try again."""
    import psycopg

    def open_peek():
        try:
            cur = _peek(conn, settings, end, None)
            return cur, cur.fetchmany(FETCH_ROWS)
        except psycopg.errors.ObjectInUse:
            conn.rollback()  # the failed transaction, before the next try
            raise

    return _with_slot(open_peek, settings.slot)


def _chain(first: list, rest) -> Iterator:
    yield from first
    yield from rest


def _wanted(rows, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """Drop the messages of transactions outside the batch before they are decoded; keep Relation and Type
    messages (they describe tables for every later transaction of this decoding session)."""
    keep = False
    for lsn, data in rows:
        kind = data[0]
        if kind == _BEGIN:
            final = int.from_bytes(data[1:9], "big")
            keep = start <= final < end
        elif kind in (_RELATION, _TYPE):
            yield lsn, data
            continue
        if keep:
            yield lsn, data
        if kind == _COMMIT:
            keep = False


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


_NAMES: dict[int, tuple] = {}


def _names(rel) -> tuple[tuple[str, ...], list[str]]:
    cached = _NAMES.get(rel.oid)
    if cached is None or cached[0] is not rel:
        names = tuple(c.name for c in rel.columns)
        cached = _NAMES[rel.oid] = (rel, names, [names[i] for i in rel.key_columns])
    return cached[1], cached[2]


def _values(names: tuple[str, ...], values: tuple) -> dict:
    from ..postgres.pgoutput import UNCHANGED

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
                self.spill = tempfile.TemporaryFile(prefix="sluicegate-txn-")  # noqa: SIM115 - closed by drain()
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


def _quote_ident(name: str) -> str:
    """pgoutput splits publication_names like identifiers (lower-casing unquoted ones): always quote."""
    return '"' + name.replace('"', '""') + '"'


def _with_slot(fn, slot: str):
    """fn() (a peek or an advance, which take the slot for their length), again while another holds it."""
    import psycopg

    deadline = time.monotonic() + SLOT_BUSY_TIMEOUT
    while True:
        try:
            return fn()
        except psycopg.errors.ObjectInUse:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)

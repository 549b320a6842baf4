"""Assembled pgoutput events -> Transaction messages, segmented at `transaction_message_threshold` bytes.

Pure: events in, messages out, in bounded memory (one message under construction per open transaction).
A statement is a run of changes of one type to one table by one (sub)transaction. When adding a row would
take the message past the threshold, the message goes out (`end_segment` false) and the next one carries on
with the same transaction id and the next `segment_id`; a statement cut that way continues there with the
same `statement_id` and its own next `segment_id`. A message always holds at least one row, so a single row
larger than the threshold still travels (alone).

DDL statements (the source's DDL capture, ddl/capture.py: logical messages the assembler hands over when asked)
become DDL statements at their place among the rows, when they touch a table the reader streams (changes/ddl.py);
a transaction with nothing else still goes out for one.

Protocol 2 streaming: at each Stream Stop the transaction's pending statements go out before its commit.
A Stream Abort of the whole transaction becomes a ROLLBACK statement if anything was sent (else nothing is
sent at all); the abort of a subtransaction (ROLLBACK TO SAVEPOINT) drops its unsent statements and, if some
were sent, becomes a ROLLBACK_STATEMENT naming it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ..ddl.message import PREFIX as DDL_PREFIX
from ..ddl.message import BadDdlMessage, parse
from ..ddl.touched import renames
from ..errors import TerminalError
from ..postgres.assembler import Change, Event, StreamedMessage, TruncateChange
from ..postgres.pgoutput import (
    Begin,
    Commit,
    LogicalMessage,
    Relation,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
)
from . import ddl as ddl_statements
from . import model as m

DEFAULT_THRESHOLD = 1 << 20  # bytes; Drizzle's default transaction_message_threshold is 1 MiB
MIN_THRESHOLD = 1024

_FIXED = 64  # bound on a Transaction's own fields and a Statement's fields beside its header and rows


def _framed(n: int) -> int:
    """Bytes a length-delimited field of n bytes takes: tag, varint length, body."""
    return 1 + (n.bit_length() + 6) // 7 + n if n else 2


@dataclass
class _Statement:
    msg: m.Statement
    key: tuple  # (kind, relation oid, subtransaction): a change with another key starts a new statement


@dataclass
class _Open:
    """A transaction being turned into messages."""

    xid: int
    streamed: bool
    start_time_us: int = 0
    segment_id: int = 0  # of the last message sent
    msg: m.Transaction = field(default_factory=m.Transaction)  # the message under construction
    size: int = 0
    current: _Statement | None = None
    next_statement: int = 1
    sent_subxids: set = field(default_factory=set)  # subtransactions with statements already sent


class Segmenter:
    """Feed assembled events (in order) to :meth:`feed`; it yields the Transaction messages they complete.

    `position` is the resume point: the end of the last commit whose transaction went out whole.
    `tables`, if given, is the set of (schema, name) to keep (the rest is left out). `published`: without
    `tables`, the tables the reader streams (its publication's), which DDL statements must touch to go out
    (a CREATE TABLE: be in one of their schemas); tables met in the rows join it. None: every DDL statement.
    """

    def __init__(self, source_id: str = "", threshold: int = DEFAULT_THRESHOLD, position: int = 0,
                 tables: set[tuple[str, str]] | None = None, published: set[tuple[str, str]] | None = None):
        if threshold < MIN_THRESHOLD:
            raise ValueError(f"transaction_message_threshold must be at least {MIN_THRESHOLD} bytes, got {threshold}")
        self.source_id, self.threshold, self.position, self.tables = source_id, threshold, position, tables
        self.published = published
        # A message's own fields before any statement: the context (source id, six numbers of at most 10
        # bytes each, a flag) and the segment fields. Every message starts its size count there.
        self._base = _framed(len(source_id.encode()) + 2 + 6 * 11 + 2) + 12
        self._open: dict[int, _Open] = {}
        self._block: _Open | None = None  # the streamed transaction whose block is open
        self._plain: _Open | None = None  # the Begin…Commit transaction being read
        self._headers: dict[int, tuple[Relation, m.TableHeader, int]] = {}

    # -- events -------------------------------------------------------------------------------------
    def feed(self, ev: Event) -> Iterator[m.Transaction]:
        if isinstance(ev, Change):
            txn = self._current()
            if self._keep(ev.relation):
                yield from self._row(txn, ev)
        elif isinstance(ev, TruncateChange):
            txn = self._current()
            kept = [r for r in ev.relations if self._keep(r)]
            if kept:
                yield from self._truncate(txn, ev, kept)
        elif isinstance(ev, LogicalMessage):
            txn = self._current()
            yield from self._ddl(txn, ev, txn.xid)
        elif isinstance(ev, StreamedMessage):
            txn = self._current()
            yield from self._ddl(txn, ev.message, ev.xid or txn.xid)
        elif isinstance(ev, Begin):
            self._plain = self._new(ev.xid, False, m.micros(ev.commit_time))
        elif isinstance(ev, Commit):
            txn, self._plain = self._plain, None
            yield from self._commit(txn, ev.commit_lsn, ev.end_lsn, ev.commit_time)
        elif isinstance(ev, StreamStart):
            txn = self._open.get(ev.xid)
            if txn is None:
                txn = self._open[ev.xid] = self._new(ev.xid, True)
            self._block = txn
        elif isinstance(ev, StreamStop):
            txn, self._block = self._block, None
            if txn is not None and txn.msg.statements:
                self._close_statement(txn)
                yield self._message(txn, end=False)
        elif isinstance(ev, StreamCommit):
            txn = self._open.pop(ev.xid, None) or self._new(ev.xid, True)
            yield from self._commit(txn, ev.commit_lsn, ev.end_lsn, ev.commit_time)
        elif isinstance(ev, StreamAbort):
            yield from self._abort(ev)

    def _new(self, xid: int, streamed: bool, start_time_us: int = 0) -> _Open:
        return _Open(xid, streamed, start_time_us, size=self._base)

    def _current(self) -> _Open:
        txn = self._block or self._plain
        if txn is None:
            raise ValueError("a change outside any transaction")
        return txn

    def _keep(self, rel: Relation) -> bool:
        return self.tables is None or (rel.schema, rel.name) in self.tables

    def _streams(self, schema: str, name: str) -> bool:
        if self.tables is not None:
            return (schema, name) in self.tables
        return self.published is None or (schema, name) in self.published

    def _header(self, rel: Relation) -> tuple[m.TableHeader, int]:
        known = self._headers.get(rel.oid)
        if known is None or known[0] is not rel:
            if self.published is not None:
                self.published.add((rel.schema, rel.name))  # e.g. added to the publication since the start
            h = m.header(rel)
            known = self._headers[rel.oid] = (rel, h, h.ByteSize())
        return known[1], known[2]

    # -- building -----------------------------------------------------------------------------------
    def _schema_change(self, txn: _Open, rel: Relation, sub: int) -> None:
        """A table's columns changed since its last change here (a new Relation message): say so first."""
        known = self._headers.get(rel.oid)
        if known is None or known[0] is rel:
            return
        if known[0].columns == rel.columns:
            if (known[0].schema, known[0].name, known[0].replica_identity) == (
                    rel.schema, rel.name, rel.replica_identity):
                self._headers[rel.oid] = (rel, known[1], known[2])
            else:  # renamed (or another replica identity): the same columns, a new header from here on
                self._close_statement(txn)
                del self._headers[rel.oid]
            return
        self._close_statement(txn)
        h, hsize = self._header(rel)
        st = txn.msg.statements.add(type=m.SCHEMA_CHANGE, statement_id=txn.next_statement, segment_id=1,
                                    end_segment=True, subtransaction_id=sub)
        st.table.CopyFrom(h)
        txn.next_statement += 1
        txn.size += _FIXED + hsize

    def _row(self, txn: _Open, ch: Change) -> Iterator[m.Transaction]:
        sub = ch.xid or txn.xid
        self._schema_change(txn, ch.relation, sub)
        key = (ch.kind, ch.relation.oid, sub)
        if txn.current is not None and txn.current.key != key:
            self._close_statement(txn)
        if txn.current is None:
            self._start_statement(txn, ch, key, sub)
        # Built in place (no copies); moved to the next message in the rare case it does not fit.
        rows = txn.current.msg.rows
        row = rows.add()
        if ch.old is not None:
            m.fill(row.before, ch.old)
        if ch.new is not None:
            m.fill(row.after, ch.new)
        cost = _framed(row.ByteSize())
        if txn.size + cost > self.threshold and (len(rows) > 1 or len(txn.msg.statements) > 1):
            del rows[-1]
            if not rows:  # the statement has no row in this message: start it in the next one
                del txn.msg.statements[-1]
                txn.next_statement -= 1
                txn.current = None
                yield self._message(txn, end=False)
                self._start_statement(txn, ch, key, sub)
            else:  # it goes on in the next message, as its next segment
                cur = txn.current.msg
                yield self._message(txn, end=False)
                st = txn.msg.statements.add(type=cur.type, statement_id=cur.statement_id,
                                            segment_id=cur.segment_id + 1, subtransaction_id=sub,
                                            start_position=cur.start_position)
                st.table.CopyFrom(cur.table)
                txn.current = _Statement(st, key)
                txn.size += _FIXED + _framed(st.table.ByteSize())
            row = txn.current.msg.rows.add()
            if ch.old is not None:
                m.fill(row.before, ch.old)
            if ch.new is not None:
                m.fill(row.after, ch.new)
        txn.size += cost

    def _start_statement(self, txn: _Open, ch: Change, key: tuple, sub: int) -> None:
        h, hsize = self._header(ch.relation)
        st = txn.msg.statements.add(type=m.ROW_TYPES[ch.kind], statement_id=txn.next_statement, segment_id=1,
                                    subtransaction_id=sub, start_position=ch.lsn)
        st.table.CopyFrom(h)
        txn.next_statement += 1
        txn.current = _Statement(st, key)
        txn.size += _FIXED + hsize

    def _truncate(self, txn: _Open, ev: TruncateChange, rels: list[Relation]) -> Iterator[m.Transaction]:
        for r in rels:
            self._schema_change(txn, r, ev.xid or txn.xid)
        self._close_statement(txn)
        st = m.Statement(type=m.TRUNCATE, statement_id=txn.next_statement, segment_id=1, end_segment=True,
                         subtransaction_id=ev.xid or txn.xid, start_position=ev.lsn,
                         cascade=bool(ev.options & 1), restart_identity=bool(ev.options & 2))
        st.truncated.extend(self._header(r)[0] for r in rels)
        txn.next_statement += 1
        size = _FIXED + st.ByteSize()
        if txn.msg.statements and txn.size + size > self.threshold:
            yield self._message(txn, end=False)
        txn.msg.statements.append(st)
        txn.size += size

    def _ddl(self, txn: _Open, msg: LogicalMessage, sub: int) -> Iterator[m.Transaction]:
        if msg.prefix != DDL_PREFIX:
            return
        try:
            ddl = parse(msg.content, msg.lsn)
        except BadDdlMessage as exc:
            raise TerminalError(f"{exc}; or remove the capture on the source (`sluicegate ddl remove`)") from None
        # CREATE TABLE: only for a reader of a whole publication, in the schemas of what it streams.
        schemas = {s for s, _ in self.published} if self.tables is None and self.published is not None else set()
        touched = ddl_statements.touched(ddl, self._streams, schemas)
        if not touched:
            return
        renamed = renames(ddl)
        if renamed is not None:  # the table goes on under its new name
            for kept in (self.tables, self.published):
                if kept is not None and renamed[0] in kept:
                    kept.add(renamed[1])
        self._close_statement(txn)
        st = ddl_statements.statement(ddl, touched, txn.next_statement, sub)
        txn.next_statement += 1
        size = _FIXED + st.ByteSize()
        if txn.msg.statements and txn.size + size > self.threshold:
            yield self._message(txn, end=False)
        txn.msg.statements.append(st)
        txn.size += size

    def _close_statement(self, txn: _Open) -> None:
        if txn.current is not None:
            txn.current.msg.end_segment = True
            txn.current = None

    def _message(self, txn: _Open, end: bool, commit_lsn: int = 0, end_lsn: int = 0,
                 end_time_us: int = 0) -> m.Transaction:
        txn.segment_id += 1
        msg, txn.msg, txn.size = txn.msg, m.Transaction(), self._base
        ctx = msg.context
        ctx.source_id, ctx.transaction_id, ctx.position = self.source_id, txn.xid, end_lsn or self.position
        ctx.commit_position, ctx.start_time_us, ctx.end_time_us = commit_lsn, txn.start_time_us, end_time_us
        ctx.streamed = txn.streamed
        msg.segment_id, msg.end_segment = txn.segment_id, end
        txn.sent_subxids.update(st.subtransaction_id for st in msg.statements)
        return msg

    def _commit(self, txn: _Open | None, commit_lsn: int, end_lsn: int, when) -> Iterator[m.Transaction]:
        if txn is None:
            raise ValueError(f"a commit at {commit_lsn} with no transaction open")
        self._close_statement(txn)
        if txn.msg.statements or txn.segment_id:
            if not txn.start_time_us:
                txn.start_time_us = m.micros(when)
            yield self._message(txn, end=True, commit_lsn=commit_lsn, end_lsn=end_lsn, end_time_us=m.micros(when))
        self.position = max(self.position, end_lsn)

    def _abort(self, ev: StreamAbort) -> Iterator[m.Transaction]:
        txn = self._open.get(ev.xid)
        if txn is None:
            return
        if ev.subxid == ev.xid or ev.subxid == 0:
            del self._open[ev.xid]
            if txn.segment_id:  # something went out: tell the reader to drop it all
                txn.msg, txn.current = m.Transaction(), None
                txn.msg.statements.add(type=m.ROLLBACK, statement_id=txn.next_statement, segment_id=1,
                                       end_segment=True, subtransaction_id=ev.xid)
                yield self._message(txn, end=True)
            return
        # ROLLBACK TO SAVEPOINT: what was not sent is simply dropped; what was sent is undone by the reader.
        if txn.current is not None and txn.current.key[2] == ev.subxid:
            txn.current = None
        kept = [st for st in txn.msg.statements if st.subtransaction_id != ev.subxid]
        if len(kept) != len(txn.msg.statements):
            txn.msg = m.Transaction(statements=kept)
            txn.size = self._base + sum(_FIXED + st.ByteSize() for st in kept)
        if ev.subxid in txn.sent_subxids:
            txn.sent_subxids.discard(ev.subxid)
            txn.msg.statements.add(type=m.ROLLBACK_STATEMENT, statement_id=txn.next_statement, segment_id=1,
                                   end_segment=True, subtransaction_id=ev.subxid)
            txn.next_statement += 1
            txn.size += _FIXED
            # Sent at once: the reader learns of the abort before any later change of the transaction.
            yield self._message(txn, end=False)

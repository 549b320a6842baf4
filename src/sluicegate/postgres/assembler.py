"""Transaction assembly over decoded pgoutput messages (pure: messages in, events out).

Resolves each row change to its relation, checks the Begin/Commit framing, and yields a flat, streaming
sequence (Begin, Change…, Truncate…, Commit), so a transaction of any size passes in bounded memory.

With protocol 2 streaming, a large transaction also comes before its commit, in blocks: StreamStart,
Change… (each with the xid of the (sub)transaction that made it), StreamStop, and finally StreamCommit or
StreamAbort (of the whole transaction, or of one subtransaction: ROLLBACK TO SAVEPOINT). Blocks of
different transactions may interleave with each other and with ordinary Begin…Commit transactions.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from . import pgoutput
from .pgoutput import (
    ROW_CHANGES,
    Begin,
    Commit,
    DecodeError,
    Delete,
    Insert,
    LogicalMessage,
    Origin,
    Relation,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
    Truncate,
    Update,
)


class Change(NamedTuple):
    """One row change: a named tuple, not a frozen dataclass, as one is made per replicated row."""

    kind: str  # 'I', 'U' or 'D'
    relation: Relation
    old: tuple | None  # key-only ('K') or full ('O') old row: deletes, and updates that change the key
    new: tuple | None
    lsn: int
    size: int = 0  # bytes of the pgoutput message: what the applier counts to bound a chunk's memory
    xid: int = 0  # in a stream block: the (sub)transaction that made the change; 0 otherwise


@dataclass(frozen=True, slots=True)
class TruncateChange:
    relations: tuple[Relation, ...]
    lsn: int
    options: int = 0  # bit 1 CASCADE, bit 2 RESTART IDENTITY
    xid: int = 0


@dataclass(frozen=True, slots=True)
class StreamedMessage:
    """A transactional logical message inside a stream block, with the (sub)transaction that emitted it."""

    message: LogicalMessage
    xid: int


Event = (Begin | Commit | Origin | LogicalMessage | Change | TruncateChange | StreamStart | StreamStop | StreamCommit
         | StreamAbort | StreamedMessage)


class Framing:
    """What a reader carries between calls of :func:`assemble`: the Relation messages seen (a decoding session
    sends each once) and, with protocol 2 streaming, the open stream block (a batch may end between blocks)."""

    def __init__(self, streaming: bool = False) -> None:
        self.streaming = streaming
        self.relations: dict[int, Relation] = {}
        self.block: int = 0  # xid of the open stream block, 0 outside one


def assemble(raw: Iterable[tuple[int, bytes]], framing: Framing | None = None, rows=None,
             origins: bool = False, messages: str | None = None) -> Iterator[Event]:
    """(lsn, pgoutput bytes) -> events; `framing` carries what a reader learnt across calls. `rows`: a fast
    lane for the row changes of ordinary transactions (PostgresApplier.row_sink): each is offered to it
    first, and one it takes (stages in the applier) is not yielded. `origins`: yield the Origin message of a
    transaction (right after its Begin, before its rows) that a replication origin wrote. `messages`: yield the
    transactional logical messages with this prefix, at their place among their transaction's rows (the DDL
    capture's, ddl/capture.py; inside a stream block as StreamedMessage); others, and those outside a
    transaction, carry nothing for an applier."""
    framing = framing if framing is not None else Framing()
    rels = framing.relations
    begin: Begin | None = None
    # The hot path, once per replicated row: names bound here, and the Change made by tuple.__new__ (the
    # named tuple's own __new__ is a Python function).
    row_changes, decode_row, new_tuple, change = ROW_CHANGES, pgoutput.decode_row, tuple.__new__, Change
    take = rows.take if rows is not None else None
    for lsn, data in raw:
        if data[0] in row_changes and not framing.block:  # a row of an ordinary transaction
            if begin is None:
                raise DecodeError(f"row change at {lsn} outside a transaction")
            if take is not None and take(data):
                continue
            kind, relid, old, new = decode_row(data)
            rel = rels.get(relid)
            if rel is None:
                rel = _relation(rels, relid, lsn)
            yield new_tuple(change, (kind, rel, old, new, lsn, len(data), 0))
            continue
        xid = 0
        if framing.block:
            xid, msg = pgoutput.decode_streamed(data)
        else:
            msg = pgoutput.decode(data)
        if isinstance(msg, (StreamStart, StreamStop, StreamCommit, StreamAbort)):
            if not framing.streaming:
                raise DecodeError(f"stream message at {lsn} on a protocol-1 reader")
            if begin is not None:
                raise DecodeError(f"stream message at {lsn} inside transaction {begin.xid}")
            if isinstance(msg, StreamStart):
                if framing.block:
                    raise DecodeError(f"Stream Start at {lsn} inside the block of {framing.block}")
                framing.block = msg.xid
            elif isinstance(msg, StreamStop):
                if not framing.block:
                    raise DecodeError(f"Stream Stop at {lsn} outside a stream block")
                framing.block = 0
            elif framing.block:
                raise DecodeError(f"stream commit/abort at {lsn} inside the block of {framing.block}")
            yield msg
            continue
        if framing.block:
            # Inside a block: changes belong to the streamed transaction (xid names the subtransaction).
            if isinstance(msg, Relation):
                rels[msg.oid] = msg
            elif isinstance(msg, (Insert, Update, Delete)):
                yield _change(msg, _relation(rels, msg.relation_oid, lsn), lsn, len(data), xid)
            elif isinstance(msg, Truncate):
                yield TruncateChange(tuple(_relation(rels, oid, lsn) for oid in msg.relation_oids), lsn,
                                     msg.options, xid)
            elif isinstance(msg, LogicalMessage) and msg.flags & 1 and msg.prefix == messages:
                yield StreamedMessage(msg, xid)
            elif isinstance(msg, (Begin, Commit)):
                raise DecodeError(f"Begin/Commit at {lsn} inside the stream block of {framing.block}")
            continue
        if isinstance(msg, Relation):
            rels[msg.oid] = msg
        elif isinstance(msg, Begin):
            if begin is not None:
                raise DecodeError(f"Begin of xid {msg.xid} at {lsn} inside transaction {begin.xid}")
            begin = msg
            yield msg
        elif isinstance(msg, Commit):
            if begin is None or msg.commit_lsn != begin.final_lsn:
                raise DecodeError(f"Commit at {lsn} does not close the open transaction")
            begin = None
            yield msg
        elif isinstance(msg, Truncate):  # (rows of an ordinary transaction took the fast path above)
            if begin is None:
                raise DecodeError(f"truncate at {lsn} outside a transaction")
            yield TruncateChange(tuple(_relation(rels, oid, lsn) for oid in msg.relation_oids), lsn, msg.options)
        elif begin is not None and ((isinstance(msg, Origin) and origins) or (
                isinstance(msg, LogicalMessage) and msg.flags & 1 and msg.prefix == messages)):
            yield msg
        # Origin and logical messages unless asked for, and Type messages, carry nothing a table applier needs.
    if begin is not None:
        raise DecodeError(f"transaction {begin.xid} was cut off before its Commit")


def _change(msg: Insert | Update | Delete, rel: Relation, lsn: int, size: int, xid: int) -> Change:
    if isinstance(msg, Insert):
        return Change("I", rel, None, msg.new, lsn, size, xid)
    if isinstance(msg, Update):
        return Change("U", rel, msg.old, msg.new, lsn, size, xid)
    return Change("D", rel, msg.old, None, lsn, size, xid)


def _relation(rels: dict[int, Relation], oid: int, lsn: int) -> Relation:
    try:
        return rels[oid]
    except KeyError:
        raise DecodeError(f"change at {lsn} for relation {oid} before its Relation message") from None

"""Transaction assembly over decoded pgoutput messages (pure: messages in, events out).

Resolves each row change to its relation, checks the Begin/Commit framing, and yields a flat, streaming
sequence (Begin, Change…, Truncate…, Commit), so a transaction of any size passes in bounded memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from . import pgoutput
from .pgoutput import Begin, Commit, DecodeError, Delete, Insert, Relation, Truncate, Update


@dataclass(frozen=True, slots=True)
class Change:
    kind: str  # 'I', 'U' or 'D'
    relation: Relation
    old: tuple | None  # key-only ('K') or full ('O') old row: deletes, and updates that change the key
    new: tuple | None
    lsn: int
    size: int = 0  # bytes of the pgoutput message: what the applier counts to bound a chunk's memory


@dataclass(frozen=True, slots=True)
class TruncateChange:
    relations: tuple[Relation, ...]
    lsn: int


Event = Begin | Commit | Change | TruncateChange


def assemble(raw: Iterable[tuple[int, bytes]], relations: dict[int, Relation] | None = None) -> Iterator[Event]:
    """(lsn, pgoutput bytes) -> events. `relations` caches Relation messages across calls."""
    rels = relations if relations is not None else {}
    begin: Begin | None = None
    for lsn, data in raw:
        msg = pgoutput.decode(data)
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
        elif isinstance(msg, (Insert, Update, Delete)):
            if begin is None:
                raise DecodeError(f"row change at {lsn} outside a transaction")
            rel = _relation(rels, msg.relation_oid, lsn)
            if isinstance(msg, Insert):
                yield Change("I", rel, None, msg.new, lsn, len(data))
            elif isinstance(msg, Update):
                yield Change("U", rel, msg.old, msg.new, lsn, len(data))
            else:
                yield Change("D", rel, msg.old, None, lsn, len(data))
        elif isinstance(msg, Truncate):
            if begin is None:
                raise DecodeError(f"truncate at {lsn} outside a transaction")
            yield TruncateChange(tuple(_relation(rels, oid, lsn) for oid in msg.relation_oids), lsn)
        # Origin, Type and logical messages carry nothing a table applier needs.
    if begin is not None:
        raise DecodeError(f"transaction {begin.xid} was cut off before its Commit")


def _relation(rels: dict[int, Relation], oid: int, lsn: int) -> Relation:
    try:
        return rels[oid]
    except KeyError:
        raise DecodeError(f"change at {lsn} for relation {oid} before its Relation message") from None

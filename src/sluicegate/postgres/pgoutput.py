"""Sans-IO decoder for PostgreSQL's ``pgoutput`` logical replication messages (protocol version 1).

:func:`decode` turns the ``data`` bytes of one row of ``pg_logical_slot_{peek,get}_binary_changes``
(or one walsender XLogData payload) into a frozen dataclass.  Layouts follow PostgreSQL's
``src/backend/replication/logical/proto.c``: big-endian ints, LSNs uint64, timestamps int64 µs since
2000-01-01 UTC, NUL-terminated strings.  Every decoder checks it consumed the message exactly, so
truncated or misaligned input raises :class:`DecodeError` rather than yielding plausible garbage.

Protocol notes worth knowing (all observed on PostgreSQL 15):
* Relation ('R') is sent before the first change of a relation in each decoding session and again
  after any relcache invalidation (ALTER TABLE, TRUNCATE, ...); it lists only live, non-generated
  columns, and tuples have exactly those columns in that order.
* A 'K' old tuple has the full column count; non-key columns are sent as NULL ('n').
* Type ('Y') is sent only for non-built-in column types; for a domain it carries the *domain's*
  OID but the *base type's* schema and name.
* The schema is sent as an empty string for pg_catalog; we restore the name, as PostgreSQL's own
  reader (logicalrep_read_namespace) does.
* Text values are in the server encoding; we assume UTF-8 (anything else raises DecodeError).
* In protocol >= 2, messages inside a stream block (between Stream Start and Stream Stop) carry the xid of
  the (sub)transaction that made them right after the type byte: :func:`decode_streamed` reads it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone


class DecodeError(ValueError):
    """The bytes are not a (complete) pgoutput protocol-1 message."""


class _Unchanged:
    """Marker for a TOASTed value the server did not send because the row change left it alone."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNCHANGED"

    def __reduce__(self) -> str:
        # Pickle/copy by reference to the module global, so identity checks (`is UNCHANGED`)
        # keep working after a round trip (e.g. shipping rows to Spark workers).
        return "UNCHANGED"


UNCHANGED = _Unchanged()

_PG_EPOCH = datetime(2000, 1, 1, tzinfo=timezone.utc)


def _ts(us: int) -> datetime:
    return _PG_EPOCH + timedelta(microseconds=us)


# ---------------------------------------------------------------------------------------------
# Message types
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int  # LSN of the commit record; equals the matching Commit.commit_lsn
    commit_time: datetime
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    flags: int  # always 0 in protocol 1
    commit_lsn: int
    end_lsn: int  # end of the commit record: the position to confirm/advance the slot to
    commit_time: datetime


@dataclass(frozen=True, slots=True)
class Origin:
    lsn: int  # commit LSN on the origin server
    name: str


@dataclass(frozen=True, slots=True)
class Column:
    flags: int  # bit 1: part of the replica identity (all columns under REPLICA IDENTITY FULL)
    name: str
    type_oid: int
    typmod: int


@dataclass(frozen=True, slots=True)
class Relation:
    oid: int
    schema: str
    name: str
    replica_identity: str  # 'd' default (pkey), 'n' nothing, 'f' full, 'i' index
    columns: tuple[Column, ...]

    @property
    def key_columns(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.columns) if c.flags & 1)


@dataclass(frozen=True, slots=True)
class TypeMsg:
    oid: int
    schema: str
    name: str


@dataclass(frozen=True, slots=True)
class Insert:
    relation_oid: int
    new: tuple


@dataclass(frozen=True, slots=True)
class Update:
    relation_oid: int
    old: tuple | None  # present if the key changed ('K') or under REPLICA IDENTITY FULL ('O')
    old_kind: str | None
    new: tuple


@dataclass(frozen=True, slots=True)
class Delete:
    relation_oid: int
    old: tuple
    old_kind: str  # 'K' (key columns set, the rest None) or 'O' (full old row)


@dataclass(frozen=True, slots=True)
class Truncate:
    options: int  # bit 1 CASCADE, bit 2 RESTART IDENTITY
    relation_oids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    flags: int  # bit 1: transactional (then it sits between Begin and Commit)
    lsn: int
    prefix: str
    content: bytes


@dataclass(frozen=True, slots=True)
class StreamStart:
    xid: int
    first_segment: bool


@dataclass(frozen=True, slots=True)
class StreamStop:
    pass


@dataclass(frozen=True, slots=True)
class StreamCommit:
    xid: int
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: datetime


@dataclass(frozen=True, slots=True)
class StreamAbort:
    xid: int
    subxid: int  # equals xid when the whole top-level transaction aborted


Message = Begin | Commit | Origin | Relation | TypeMsg | Insert | Update | Delete | Truncate | LogicalMessage
StreamMessage = StreamStart | StreamStop | StreamCommit | StreamAbort

# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------

_U16 = struct.Struct(">H").unpack_from
_U32 = struct.Struct(">I").unpack_from
_BEGIN = struct.Struct(">QqI").unpack_from
_COMMIT = struct.Struct(">BQQq").unpack_from
_ORIGIN = struct.Struct(">Q").unpack_from
_COLUMN = struct.Struct(">Ii").unpack_from  # type oid (unsigned), typmod (signed, -1 = none)
_MESSAGE = struct.Struct(">BQ").unpack_from
_TRUNCATE = struct.Struct(">IB").unpack_from
_STREAM_COMMIT = struct.Struct(">IBQQq").unpack_from
_STREAM_ABORT = struct.Struct(">II").unpack_from

_N, _K, _O, _T, _NULL, _U, _B = b"NKOtnub"  # tuple markers and value kinds, as ints
_INSERT, _UPDATE, _DELETE = b"IUD"


def _end(buf: bytes, off: int) -> None:
    if off != len(buf):
        what = "truncated" if off > len(buf) else f"{len(buf) - off} trailing byte(s) in"
        raise DecodeError(f"{what} pgoutput {chr(buf[0])!r} message ({len(buf)} bytes)")


def _cstr(buf: bytes, off: int) -> tuple[str, int]:
    end = buf.find(0, off)
    if end < 0:
        raise DecodeError(f"unterminated string in pgoutput {chr(buf[0])!r} message")
    return buf[off:end].decode(), end + 1


def _tuple(buf: bytes, off: int) -> tuple[tuple, int]:
    """TupleData at ``off``: Int16 count, then per column a kind byte and, for 't'/'b', Int32 len + bytes."""
    (n,) = _U16(buf, off)
    off += 2
    vals = []
    append = vals.append
    for _ in range(n):
        kind = buf[off]
        if kind == _T:
            start = off + 5
            off = start + _U32(buf, off + 1)[0]
            append(buf[start:off].decode())
        elif kind == _NULL:
            off += 1
            append(None)
        elif kind == _U:
            off += 1
            append(UNCHANGED)
        elif kind == _B:
            start = off + 5
            off = start + _U32(buf, off + 1)[0]
            append(buf[start:off])
        else:
            raise DecodeError(f"unknown tuple value kind {chr(kind)!r} in pgoutput {chr(buf[0])!r} message")
    # A length running past the end shows up here (slices clip silently) or at the caller's _end().
    if off > len(buf):
        _end(buf, off)
    return tuple(vals), off


# A message's first byte (as ints), for readers that pass messages over before decoding them (peek.in_range)
BEGIN, COMMIT, RELATION, TYPE = b"BCRY"


def begin_final_lsn(buf: bytes) -> int:
    """A Begin message's final_lsn (where its transaction's commit record starts), without decoding the rest."""
    return _BEGIN(buf, 1)[0]


def _begin(buf: bytes) -> Begin:
    _end(buf, 21)
    final_lsn, ts, xid = _BEGIN(buf, 1)
    return Begin(final_lsn, _ts(ts), xid)


def _commit(buf: bytes) -> Commit:
    _end(buf, 26)
    flags, commit_lsn, end_lsn, ts = _COMMIT(buf, 1)
    return Commit(flags, commit_lsn, end_lsn, _ts(ts))


def _origin(buf: bytes) -> Origin:
    (lsn,) = _ORIGIN(buf, 1)
    name, off = _cstr(buf, 9)
    _end(buf, off)
    return Origin(lsn, name)


def _relation(buf: bytes) -> Relation:
    (oid,) = _U32(buf, 1)
    schema, off = _cstr(buf, 5)
    name, off = _cstr(buf, off)
    ident = chr(buf[off])
    (n,) = _U16(buf, off + 1)
    off += 3
    cols = []
    for _ in range(n):
        flags = buf[off]
        cname, off = _cstr(buf, off + 1)
        type_oid, typmod = _COLUMN(buf, off)
        off += 8
        cols.append(Column(flags, cname, type_oid, typmod))
    _end(buf, off)
    return Relation(oid, schema or "pg_catalog", name, ident, tuple(cols))


def _type(buf: bytes) -> TypeMsg:
    (oid,) = _U32(buf, 1)
    schema, off = _cstr(buf, 5)
    name, off = _cstr(buf, off)
    _end(buf, off)
    return TypeMsg(oid, schema or "pg_catalog", name)


# Row changes share one decoder with the replay's hot path (decode_row): the message objects wrap its tuple.
def _insert(buf: bytes) -> Insert:
    _, relid, _, new = _decode_row_py(buf)
    return Insert(relid, new)


def _update(buf: bytes) -> Update:
    _, relid, old, new = _decode_row_py(buf)
    return Update(relid, old, None if old is None else "K" if buf[5] == _K else "O", new)


def _delete(buf: bytes) -> Delete:
    _, relid, old, _ = _decode_row_py(buf)
    return Delete(relid, old, "K" if buf[5] == _K else "O")


def _truncate(buf: bytes) -> Truncate:
    n, options = _TRUNCATE(buf, 1)
    _end(buf, 6 + 4 * n)
    return Truncate(options, struct.unpack_from(f">{n}I", buf, 6))


def _message(buf: bytes) -> LogicalMessage:
    flags, lsn = _MESSAGE(buf, 1)
    prefix, off = _cstr(buf, 10)
    (n,) = _U32(buf, off)
    off += 4 + n
    _end(buf, off)
    return LogicalMessage(flags, lsn, prefix, buf[off - n:off])


def _stream_start(buf: bytes) -> StreamStart:
    _end(buf, 6)
    return StreamStart(_U32(buf, 1)[0], buf[5] == 1)


def _stream_stop(buf: bytes) -> StreamStop:
    _end(buf, 1)
    return StreamStop()


def _stream_commit(buf: bytes) -> StreamCommit:
    _end(buf, 30)
    xid, flags, commit_lsn, end_lsn, ts = _STREAM_COMMIT(buf, 1)
    return StreamCommit(xid, flags, commit_lsn, end_lsn, _ts(ts))


def _stream_abort(buf: bytes) -> StreamAbort:
    if len(buf) != 25:  # protocol 4 (parallel apply) appends abort_lsn and abort_time; ignored
        _end(buf, 9)
    return StreamAbort(*_STREAM_ABORT(buf, 1))


_DECODERS = {
    ord("B"): _begin, ord("C"): _commit, ord("O"): _origin, ord("R"): _relation, ord("Y"): _type,
    ord("I"): _insert, ord("U"): _update, ord("D"): _delete, ord("T"): _truncate, ord("M"): _message,
    ord("S"): _stream_start, ord("E"): _stream_stop, ord("c"): _stream_commit, ord("A"): _stream_abort,
}


_IN_STREAM = frozenset(b"RYIUDTM")  # message types that carry an xid inside a stream block
ROW_CHANGES = frozenset(b"IUD")


try:  # the C twin of _decode_row_py (built with the package when a compiler is at hand)
    from ._pgoutput_rows import decode_row as _decode_row_c
except ImportError:  # pragma: no cover - no compiler where it was installed: the Python one does it all
    _decode_row_c = None


def decode_row(data: bytes) -> tuple[str, int, tuple | None, tuple | None]:
    """The hot path of a replay: an Insert, Update or Delete message as (kind 'I'/'U'/'D', relation oid, old,
    new), without building a message object; the same checks and errors as :func:`decode`. The C decoder
    takes well-formed messages; for anything else it answers None and the Python one says what is wrong."""
    if type(data) is not bytes:
        data = bytes(data)
    if _decode_row_c is not None:
        row = _decode_row_c(data, UNCHANGED)
        if row is not None:
            return row
    return _decode_row_py(data)


def _decode_row_py(data: bytes) -> tuple[str, int, tuple | None, tuple | None]:
    try:
        kind = data[0]
        (relid,) = _U32(data, 1)
        marker = data[5]
        if kind == _UPDATE:
            if marker == _N:
                new, off = _tuple(data, 6)
                _end(data, off)
                return "U", relid, None, new
            if marker != _K and marker != _O:
                raise DecodeError(f"expected 'K', 'O' or 'N' in pgoutput update, got {data[5:6]!r}")
            old, off = _tuple(data, 6)
            if data[off] != _N:
                raise DecodeError(f"expected 'N' in pgoutput update, got {data[off:off + 1]!r}")
            new, off = _tuple(data, off + 1)
            _end(data, off)
            return "U", relid, old, new
        if kind == _INSERT:
            if marker != _N:
                raise DecodeError(f"expected 'N' in pgoutput insert, got {data[5:6]!r}")
            new, off = _tuple(data, 6)
            _end(data, off)
            return "I", relid, None, new
        if kind == _DELETE:
            if marker != _K and marker != _O:
                raise DecodeError(f"expected 'K' or 'O' in pgoutput delete, got {data[5:6]!r}")
            old, off = _tuple(data, 6)
            _end(data, off)
            return "D", relid, old, None
    except (struct.error, IndexError) as e:
        raise DecodeError(f"truncated pgoutput {chr(data[0])!r} message ({len(data)} bytes): {e}") from None
    except UnicodeDecodeError as e:
        raise DecodeError(f"pgoutput {chr(data[0])!r} message has non-UTF-8 text: {e}") from None
    raise DecodeError(f"not a row change: pgoutput message type {data[:1]!r}")


def decode_streamed(data: bytes) -> tuple[int, Message | StreamMessage]:
    """Decode one message of a stream block: (xid of the (sub)transaction, message); control messages
    (Stream Start/Stop/Commit/Abort) have no prefix and come back with xid 0."""
    if type(data) is not bytes:
        data = bytes(data)
    if data and data[0] in _IN_STREAM:
        if len(data) < 5:
            raise DecodeError(f"truncated streamed pgoutput {chr(data[0])!r} message ({len(data)} bytes)")
        return _U32(data, 1)[0], decode(data[:1] + data[5:])
    return 0, decode(data)


def decode(data: bytes) -> Message | StreamMessage:
    """Decode one pgoutput message; raises DecodeError on unknown, short or malformed input."""
    if type(data) is not bytes:  # bytearray/memoryview from a driver: one copy, then fast slicing
        data = bytes(data)
    if not data:
        raise DecodeError("empty pgoutput message")
    fn = _DECODERS.get(data[0])
    if fn is None:
        raise DecodeError(f"unknown pgoutput message type {data[:1]!r} (protocol 1 decoder)")
    try:
        return fn(data)
    except (struct.error, IndexError) as e:
        raise DecodeError(f"truncated pgoutput {chr(data[0])!r} message ({len(data)} bytes): {e}") from None
    except UnicodeDecodeError as e:
        raise DecodeError(f"pgoutput {chr(data[0])!r} message has non-UTF-8 text: {e}") from None

"""The one module that touches the replication socket: a pgoutput stream from a logical slot.

START_REPLICATION keeps one walsender decoding forward for the life of a play task, instead of
re-decoding from the slot's restart_lsn at every batch as `pg_logical_slot_peek_binary_changes` must.
psycopg 3 has no replication API (PLATFORM.md); its libpq layer (`psycopg.pq`) carries the copy stream,
and the protocol's messages are read and written by `walsender` (pure). Everything yielded is plain
(lsn, pgoutput bytes), decoded elsewhere by the pure decoder.

Positions: the server's `wal_end` (from keepalives) means every transaction that committed before it has
been sent; `confirm()` reports the position the target has durably committed (guarantee 7), and only that:
the streaming twin of capture.advance_slot.
"""

from __future__ import annotations

import select
import struct
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import psycopg
from psycopg import pq, sql
from psycopg.conninfo import make_conninfo

from ..errors import RetryableError, UsageError
from ..position import format_lsn
from . import walsender
from .connect import (
    connect_failure,
    connect_hint,
    describe,
    primary_only,
    redact,
    session_options,
)

if TYPE_CHECKING:
    from typing import Self

BEGIN, COMMIT = ord("B"), ord("C")
STREAM_START, STREAM_STOP, STREAM_COMMIT = ord("S"), ord("E"), ord("c")
_FRAMING = frozenset((BEGIN, COMMIT, STREAM_START, STREAM_STOP, STREAM_COMMIT))  # a row's message is none
_END_LSN = struct.Struct(">Q")
_OBJECT_IN_USE = b"55006"  # the slot is active for another process
_END_WAIT = 5.0  # seconds a closing stream waits for the walsender to end the copy too
_XLOG_DATA, _XLOG_HEADER, _DATA_START = walsender.XLOG_DATA, walsender.XLOG_HEADER, walsender.START.unpack_from


class ChangeStream:
    """pgoutput messages of `slot` for `publication`, from `start` on. Use as a context manager."""

    def __init__(self, url: str, slot: str, publication: str, start: int, streaming: bool = False,
                 decoding_work_mem: str | None = None, skip_origins: bool = False, messages: bool = False):
        """`streaming`: pgoutput protocol 2 with in-progress transactions sent before their commit, in
        blocks (Stream Start … Stream Stop) closed by Stream Commit or Stream Abort; read them with an
        assembler Framing. A transaction is streamed once the walsender holds more than
        `decoding_work_mem` (logical_decoding_work_mem, e.g. '64kB'; default: the server's) of changes.
        `skip_origins`: the server leaves out transactions that a replication origin wrote (pgoutput's
        `origin 'none'`, PostgreSQL 16+; on 14/15 the reader skips them by their Origin message).
        `messages`: pgoutput also sends logical messages (pg_logical_emit_message; the DDL capture's)."""
        self.url, self.slot, self.publication = url, slot, publication
        self.confirmed = start
        self.in_transaction = False
        self.ended_by = ""
        self.boundary = start
        self.wal_end = 0  # the newest keepalive's
        # The walsender formats pgoutput's text values with its session settings: the same ones as every
        # other Sluicegate session (ISO dates, UTC), whatever the server's defaults.
        self.pg = _open(url, session_options(url, f"-c logical_decoding_work_mem={decoding_work_mem}"
                                             if decoding_work_mem else ""))
        # Of a URL that lists several hosts, the one libpq chose: the primary now (status shows it).
        self.where = f"{_text(self.pg.host)}:{_text(self.pg.port)}/{_text(self.pg.db)}"
        origin = {"origin": "none"} if skip_origins and self.pg.server_version >= 160000 else {}
        options = {"proto_version": "2" if streaming else "1", "publication_names": publication,
                   **({"streaming": "on"} if streaming else {}), **origin, **({"messages": "true"} if messages else {})}
        command = sql.SQL("START_REPLICATION SLOT {} LOGICAL {} ({})").format(
            sql.Identifier(slot), sql.SQL(format_lsn(start)),
            sql.SQL(", ").join(sql.SQL("{} {}").format(sql.Identifier(k), sql.Literal(v)) for k, v in options.items()))
        try:
            res = self.pg.exec_(command.as_bytes(None))
        except psycopg.OperationalError as exc:
            self.close()
            raise RetryableError(f"cannot stream from replication slot {slot}: {redact(str(exc))}") from None
        except BaseException:
            self.close()
            raise
        if res.status != pq.ExecStatus.COPY_BOTH:
            self.close()
            if res.error_field(pq.DiagnosticField.SQLSTATE) == _OBJECT_IN_USE:
                raise RetryableError(f"replication slot {slot} is still in use by an earlier reader; will retry")
            # e.g. the slot was dropped or invalidated: the caller checks the slot
            text = " ".join(_text(res.error_message).split())
            raise RetryableError(f"cannot stream from replication slot {slot}: {redact(text)}")

    def messages(self, nchanges: int, idle: float, max_seconds: float, until: int = 0) -> Iterator[tuple[int, bytes]]:
        """Messages as they come, ending at a transaction boundary: once everything committed before `until`
        was read ("reached"), after `nchanges` messages ("count"), after `max_seconds` ("time"), or when none
        came for `idle` seconds ("idle"); `self.ended_by` says which. A transaction is never cut: a big one
        streams through whole (the applier stages it)."""
        start = last = time.monotonic()
        count = 0
        received = False  # since `last`: its time is taken when the next read finds nothing (not per row)
        read = self._read
        self.ended_by = ""
        while True:
            if not self.in_transaction and until and self.sent_upto >= until and (
                    count or time.monotonic() - start >= idle):  # nothing new yet: wait `idle` for it
                self.ended_by = "reached"
                return
            if not self.in_transaction and count:
                if count >= nchanges:
                    self.ended_by = "count"
                    return
                if time.monotonic() - start >= max_seconds:
                    self.ended_by = "time"
                    return
            msg = read()
            if msg is not None:
                start_lsn, payload = msg
                kind = payload[0]
                if kind not in _FRAMING:
                    pass  # a row, most of the time
                elif kind == BEGIN:
                    self.in_transaction = True
                elif kind == COMMIT:
                    self.in_transaction = False
                    # Commit: flags, commit_lsn, end_lsn, time. Everything committing before end_lsn is read.
                    self.boundary = max(self.boundary, _END_LSN.unpack_from(payload, 10)[0])
                elif kind == STREAM_START:  # a block is not cut either (its changes carry no framing of their own)
                    self.in_transaction = True
                elif kind == STREAM_STOP:
                    self.in_transaction = False
                elif kind == STREAM_COMMIT:  # xid, flags, commit_lsn, end_lsn, time
                    self.boundary = max(self.boundary, _END_LSN.unpack_from(payload, 14)[0])
                count += 1
                received = True
                yield start_lsn, payload
                continue
            if received:
                last, received = time.monotonic(), False
            wait = idle - (time.monotonic() - last)
            if wait <= 0 and not self.in_transaction:
                self.ended_by = "idle"
                return
            select.select([self.pg.socket], [], [], max(wait, 0.01))

    def _read(self) -> tuple[int, bytes] | None:
        """The next XLogData message's (data start, pgoutput bytes), or None when none has arrived yet. A
        keepalive moves `wal_end`, and is answered when the server asks (before wal_sender_timeout ends the
        session) with the confirmed position: never with the keepalive's own."""
        pg, consumed, start = self.pg, False, _DATA_START
        try:
            while True:
                n, data = pg.get_copy_data(1)
                if n == 0:
                    if consumed:
                        return None
                    # Read the socket only once the buffer is empty: a busy server cannot grow it without bound.
                    pg.consume_input()
                    consumed = True
                    continue
                if n < 0:  # the server ended the stream: its last result says why
                    res = pg.get_result()
                    raise psycopg.OperationalError(_text(res.error_message) if res is not None else "closed")
                kind = data[0]
                if kind == _XLOG_DATA:  # most messages: no call more than needed
                    return start(data, 1)[0], data.tobytes()[_XLOG_HEADER:]
                if kind == walsender.KEEPALIVE:
                    wal_end, reply = walsender.keepalive(data)
                    self.wal_end = max(self.wal_end, wal_end)
                    if reply:
                        self._send(self.confirmed)
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from None

    def _send(self, position: int) -> None:
        try:
            self.pg.put_copy_data(walsender.standby_status(position))
            self.pg.flush()
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from None

    def _lost(self, exc: Exception) -> RetryableError:
        text = str(exc).strip()
        return RetryableError(f"replication connection to {self.where} lost: "
                              f"{redact(text.splitlines()[0] if text else 'closed')}")

    @property
    def sent_upto(self) -> int:
        """Every transaction committing before this position has been read: the end of the last commit read,
        or the server's keepalive wal_end when it says more."""
        if self.in_transaction:
            return 0
        return max(self.boundary, self.wal_end)

    def confirm(self, position: int) -> None:
        """Tell the server the target has durably applied everything before `position`: the slot moves to
        exactly there (a fast-forward stops at an exact position), never further."""
        if position > self.confirmed:
            self._send(position)
            self.confirmed = position

    def close(self) -> None:
        """End the stream so that the walsender reads what was sent to it last (the newest confirmation), then
        close. Closing with the server's data still unread makes the kernel reset the connection, and the
        walsender's unread input (that confirmation) goes with it: the slot would stay at the one before."""
        try:
            if self.pg.status == pq.ConnStatus.OK and self.pg.transaction_status == pq.TransactionStatus.ACTIVE:
                self.pg.put_copy_end()
                self.pg.flush()
                self._drain(time.monotonic() + _END_WAIT)
        except psycopg.OperationalError:
            pass  # a broken connection: nothing more to tell
        finally:
            self.pg.finish()

    def _drain(self, deadline: float) -> None:
        """Read and drop what the server still sends until it ends the copy too (its replies to us are read in
        order before our end), or until `deadline`."""
        pg = self.pg
        while (wait := deadline - time.monotonic()) > 0:  # (a server still sending is also bounded by it)
            n, _ = pg.get_copy_data(1)
            if n < 0:  # its end: it had read ours, and what came before it
                return
            if n == 0:
                select.select([pg.socket], [], [], wait)
                pg.consume_input()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_replication_access(url: str) -> None:
    """A replication connection works (pg_hba.conf entry, REPLICATION role, max_wal_senders), or say how."""
    _open(url, {}).finish()


def _open(url: str, options: dict) -> pq.PGconn:
    """A replication connection (`replication=database`) to the primary `url` names."""
    info = make_conninfo(url, replication="database", connect_timeout=10, application_name="sluicegate",
                         **primary_only(url), **options)
    pg = pq.PGconn.connect(info.encode())
    if pg.status != pq.ConnStatus.OK:
        text = _text(pg.error_message)
        pg.finish()
        raise _connect_error(url, text)
    return pg


def _text(value: bytes | None) -> str:
    return (value or b"").decode("utf-8", "replace")


def _connect_error(url: str, text: str) -> Exception:
    text = redact(" ".join(text.split()))
    where = describe(url)
    if "no password supplied" in text:
        return connect_failure("source", url, text)
    if "pg_hba.conf" in text and "replication" in text:
        tls = ("; if it admits TLS connections only (hostssl), add sslmode=verify-full&sslrootcert=CA-FILE to the "
               "source URL" if "no encryption" in text else "")
        return UsageError(
            f"source {where} refuses replication connections: add a `host replication <user> <client address> "
            f"scram-sha-256` line to pg_hba.conf and reload{tls} ({text})"
        )
    if "must be superuser or replication role" in text or "permission denied to start WAL sender" in text:
        return UsageError(f"source {where}: the user needs the REPLICATION attribute: ALTER ROLE <user> REPLICATION")
    if "number of requested standby connections exceeds max_wal_senders" in text or "max_wal_senders" in text:
        return UsageError(f"source {where}: max_wal_senders is exhausted: raise it and restart the server ({text})")
    return RetryableError(f"cannot open a replication connection to {where}: {text}{connect_hint('source', text)}")

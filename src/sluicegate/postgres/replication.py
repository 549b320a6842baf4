"""The one module that touches the replication socket: a pgoutput stream from a logical slot.

START_REPLICATION keeps one walsender decoding forward for the life of a play task, instead of
re-decoding from the slot's restart_lsn at every batch as `pg_logical_slot_peek_binary_changes` must.
psycopg 3 has no replication protocol (PLATFORM.md), so this uses psycopg2's LogicalReplicationConnection;
everything it yields is plain (lsn, pgoutput bytes), decoded elsewhere by the pure decoder.

Positions: the server's `wal_end` (from keepalives) means every transaction that committed before it has
been sent; `confirm()` reports the position the target has durably committed (guarantee 7) — the
streaming twin of capture.advance_slot.
"""

from __future__ import annotations

import select
import struct
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import psycopg2
import psycopg2.errors
import psycopg2.extras

from ..errors import RetryableError, UsageError
from ..position import format_lsn
from .connect import (
    connect_failure,
    connect_hint,
    describe,
    describe_conn,
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
NO_STATUS_FEEDBACK = 24 * 3600  # seconds: psycopg2 would otherwise send feedback of its own every 10 s


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
        self.last_start = 0  # WAL position of the last commit read: at most psycopg2's last_msg_data_start
        try:
            # The walsender formats pgoutput's text values with its session settings: the same ones as
            # every other Sluicegate session (ISO dates, UTC), whatever the server's defaults.
            self.conn = psycopg2.connect(url, connection_factory=psycopg2.extras.LogicalReplicationConnection,
                                         connect_timeout=10, application_name="sluicegate", **primary_only(url),
                                         **session_options(url, f"-c logical_decoding_work_mem={decoding_work_mem}"
                                                           if decoding_work_mem else ""))
        except psycopg2.OperationalError as exc:
            raise _connect_error(url, exc) from None
        # Of a URL that lists several hosts, the one libpq chose: the primary now (status shows it).
        self.where = describe_conn(self.conn)
        try:
            self.cur = self.conn.cursor()
            origin = {"origin": "none"} if skip_origins and self.conn.server_version >= 160000 else {}
            # No feedback of psycopg2's own (see confirm()): only positions the target has committed are sent.
            # The server asks for a reply only after wal_sender_timeout/2 without one; confirm() answers sooner.
            self.cur.start_replication(
                slot_name=slot, decode=False, start_lsn=format_lsn(start), status_interval=NO_STATUS_FEEDBACK,
                options={"proto_version": "2" if streaming else "1", "publication_names": publication,
                         **({"streaming": "on"} if streaming else {}), **origin,
                         **({"messages": "true"} if messages else {})},
            )
        except psycopg2.errors.ObjectInUse:
            self.close()
            raise RetryableError(f"replication slot {slot} is still in use by an earlier reader; will retry") from None
        except psycopg2.Error as exc:  # e.g. the slot was dropped or invalidated: the caller checks the slot
            self.close()
            text = " ".join(str(exc).split())
            raise RetryableError(f"cannot stream from replication slot {slot}: {redact(text)}") from None
        except BaseException:
            self.close()
            raise

    def messages(self, nchanges: int, idle: float, max_seconds: float, until: int = 0) -> Iterator[tuple[int, bytes]]:
        """Messages as they come, ending at a transaction boundary: once everything committed before `until`
        was read ("reached"), after `nchanges` messages ("count"), after `max_seconds` ("time"), or when none
        came for `idle` seconds ("idle"); `self.ended_by` says which. A transaction is never cut: a big one
        streams through whole (the applier stages it)."""
        start = last = time.monotonic()
        count = 0
        received = False  # since `last`: its time is taken when the next read finds nothing (not per row)
        read = self.cur.read_message
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
            try:
                msg = read()
            except psycopg2.Error as exc:
                text = str(exc).strip()
                raise RetryableError(f"replication connection to {self.where} lost: "
                                     f"{redact(text.splitlines()[0] if text else 'closed')}") from None
            if msg is not None:
                payload = msg.payload  # bytes: the stream was started with decode=False
                kind = payload[0]
                if kind not in _FRAMING:
                    pass  # a row, most of the time
                elif kind == BEGIN:
                    self.in_transaction = True
                elif kind == COMMIT:
                    self.in_transaction = False
                    # Kept at commits only (rows are most messages): never past psycopg2's last message start,
                    # so confirm() trusting it is only ever more careful.
                    self.last_start = msg.data_start
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
                yield msg.data_start, payload
                continue
            if received:
                last, received = time.monotonic(), False
            wait = idle - (time.monotonic() - last)
            if wait <= 0 and not self.in_transaction:
                self.ended_by = "idle"
                return
            select.select([self.conn], [], [], max(wait, 0.01))

    @property
    def sent_upto(self) -> int:
        """Every transaction committing before this position has been read: the end of the last commit read,
        or the server's keepalive wal_end when it says more (psycopg2 also sets wal_end from data messages,
        to their start, which never passes the last commit's end)."""
        if self.in_transaction:
            return 0
        return max(self.boundary, int(self.cur.wal_end or 0))

    def confirm(self, position: int, exact: bool = True) -> bool:
        """Tell the server the target has durably applied everything before `position`.

        psycopg2 moves its flush position to a keepalive's WAL end on its own once every message received was
        confirmed, and sends that with the next feedback (ours or its periodic one, which start() turns off).
        Harmless for data (the server had sent nothing before it), but the slot would pass the target's
        position, and a fast-forward stops at an exact one: while the server has said it is past `position`,
        send nothing and keep the slot where it is — unless a message read after `position` is still unconfirmed
        (an older position a target's standbys have just flushed: postgres/standby_flush.py), which keeps
        psycopg2 from forwarding. `exact=False` (a VStream client's acknowledgement) lets it pass: psycopg2
        forwards only once every message received was confirmed, so nothing unread is passed. False: not sent,
        for that reason (a later confirm of it, or of a later position, may be).
        """
        if exact and int(self.cur.wal_end or 0) > position and position >= self.last_start:
            return False
        if position > self.confirmed:
            self.cur.send_feedback(write_lsn=position, flush_lsn=position, force=True)
            self.confirmed = position
        return True

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001, S110 - closing a broken connection: nothing to tell
            pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_replication_access(url: str) -> None:
    """A replication connection works (pg_hba.conf entry, REPLICATION role, max_wal_senders), or say how."""
    try:
        conn = psycopg2.connect(url, connection_factory=psycopg2.extras.LogicalReplicationConnection,
                                connect_timeout=10, **primary_only(url))
    except psycopg2.OperationalError as exc:
        raise _connect_error(url, exc) from None
    conn.close()


def _connect_error(url: str, exc: psycopg2.OperationalError) -> Exception:
    text = redact(" ".join(str(exc).split()))
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

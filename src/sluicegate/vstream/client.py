"""A VStream client: Transaction messages and heartbeats from a VStream server, or straight from the source.

:func:`stream` gives an iterator that survives lost connections: it reconnects (with backoff) from the last
complete position it handed out — the ``context.position`` of the last message with ``end_segment``, or of
the last heartbeat — and asks for that position, which tells the server everything before it is handled
(the slot is confirmed up to it): asking for more acknowledges what was handed out.

Acknowledging, so that a new process with the same client id resumes where this one stopped: call
``events.ack()`` once the last event handed out is durably handled (written, flushed, committed), or
``events.ack(position)`` with an earlier resume point. The slot on the source keeps the acknowledged
position (see source.py); a later stream from position 0 starts right after it. Acks reach the server at
most every `ack_interval` seconds, and once more when the stream is closed (``close()``, ``cancel()`` then
the end of the iteration), so after a clean stop nothing comes again; after a crash (kill -9) the
transactions handled in the last `ack_interval` seconds or so come again, each whole (at least once).
Reading the source directly, an ack goes to the slot through the replication connection at the next read.

A transaction cut by the lost connection (some segments handed out, not its ``end_segment``) comes again
whole, from segment 1. So that a reader never has to guess, the iterator first hands out a ROLLBACK message
for it (Drizzle's "undo the whole transaction: its earlier segments were already sent"), made up here with
the transaction's id, the next segment_id and the resume position. A reader that keeps whole transactions
only (drops those whose end_segment it did not see) can simply ignore it.

Errors that reconnecting cannot fix end the iteration with an exception: UsageError (a bad request),
TerminalError (the changes asked for are gone, or another connection with this client id took over).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator

import grpc

from ..changes import change_pb2 as pb
from ..changes import change_pb2_grpc as pb_grpc
from ..changes import model as m
from ..changes.segmenter import DEFAULT_THRESHOLD
from ..errors import SluicegateError, TerminalError, UsageError
from ..position import format_lsn
from ..postgres.connect import redact
from . import source
from .security import ClientSecurity

log = logging.getLogger(__name__)
Heartbeat = pb.Heartbeat
Event = m.Transaction | Heartbeat

# Worth another try: the server or the network went away, or the server is restarting.
_RETRY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
          grpc.StatusCode.INTERNAL}
ACK_INTERVAL = 1.0  # seconds: at most one Ack call per interval; bounds what a crash makes come again
ACK_TIMEOUT = 10.0
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", -1),  # a single row bigger than the threshold travels alone
    ("grpc.keepalive_time_ms", 20_000),  # notice a server that vanished without closing the connection
    ("grpc.keepalive_timeout_ms", 10_000),
]


def is_source_url(text: str) -> bool:
    """A libpq URL or keyword string (read the source directly) rather than HOST:PORT (a VStream server)."""
    return text.startswith(("postgres://", "postgresql://")) or "=" in text


def stream(server_or_source: str, client_id: str, position: int = 0, tables: Iterable[str] | None = None,
           threshold: int = 0, streaming: bool = True, heartbeat_seconds: float = 1.0,
           decoding_work_mem: str | None = None, max_backoff: float = 30.0,
           ack_interval: float = ACK_INTERVAL, security: ClientSecurity | None = None) -> Stream:
    """Transaction messages and heartbeats for `client_id` from `position` (0: where its slot stands: after
    the client id's last acknowledgement; see the module docstring for `ack()`).

    `server_or_source`: HOST:PORT of a VStream server, or a libpq URL to read the source in this process (the
    same stream, without a server). `tables`: keep only these (the publication is made for them on the
    client's first request). `threshold`: transaction_message_threshold in bytes (0: the server's). The
    `heartbeat_seconds` and `decoding_work_mem` options apply when reading the source directly. `security`:
    TLS and the client's credentials for a server that wants them.
    """
    return Stream(server_or_source, client_id, position, list(tables or []), threshold, streaming,
                  heartbeat_seconds, decoding_work_mem, max_backoff, ack_interval, security)


class Stream:
    """Iterate it for events; `position` is where a new stream would resume; `ack()` acknowledges; `acked` is
    the last acknowledgement sent; `cancel()` (from any thread) ends the iteration."""

    def __init__(self, target: str, client_id: str, position: int, tables: list[str], threshold: int,
                 streaming: bool, heartbeat_seconds: float, decoding_work_mem: str | None,
                 max_backoff: float, ack_interval: float = ACK_INTERVAL, security: ClientSecurity | None = None):
        if not client_id:
            raise UsageError("a VStream client needs a client id (--client-id): it names its slot")
        self.target, self.client_id, self.position = target, client_id, position
        self.tables, self.threshold, self.streaming = tables, threshold, streaming
        self.heartbeat_seconds, self.decoding_work_mem = heartbeat_seconds, decoding_work_mem
        self.max_backoff, self.ack_interval = max_backoff, ack_interval
        self.reconnects = 0
        # The last acknowledgement handed to the server (or to the reader of the slot): the request's position
        # is one (the server confirms the slot up to it).
        self.acked = position
        self.ack_error = ""  # why the last one did not get there
        self._to_ack = position
        self._ack_sent_at = 0.0
        self._acks: source.Acks | None = None  # reading the source directly: the current stream's
        self._reading = None  # reading the source directly: the current stream (a generator)
        self._stop = threading.Event()
        self._call = None
        self._open: dict[int, tuple[int, str]] = {}  # transaction id -> (last segment_id, source_id): cut off
        self._direct = is_source_url(target)
        security = security or ClientSecurity()
        self._metadata = security.metadata
        self._channel = None if self._direct else security.channel(target, CHANNEL_OPTIONS)

    # -- iteration ----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Event]:
        backoff = 0.5
        try:
            while not self._stop.is_set():
                try:
                    for ev in self._connect():
                        backoff = 0.5  # the connection works
                        self._track(ev)
                        yield ev
                    if self._stop.is_set():
                        return
                    why = "the server ended the stream"
                except grpc.RpcError as exc:
                    if self._stop.is_set():
                        return
                    if exc.code() not in _RETRY:
                        raise _error(self.target, self.client_id, exc) from None
                    why = f"{exc.code().name}: {exc.details()}"
                except SluicegateError as exc:  # reading the source directly
                    if not exc.retryable:
                        raise
                    why = str(exc)
                yield from self._cut_off()
                self.reconnects += 1
                log.warning("vstream client %s: %s; reconnecting in %.1fs from position %s", self.client_id,
                            redact(why), backoff, format_lsn(self.position))
                if self._stop.wait(backoff):
                    return
                backoff = min(backoff * 2, self.max_backoff)
        finally:
            self.close()

    def _connect(self) -> Iterator[Event]:
        if self._direct:
            self._acks = source.Acks()
            self._reading = source.transactions(
                self.target, self.client_id, self.position, self.tables, self.threshold or DEFAULT_THRESHOLD,
                self.streaming, self.heartbeat_seconds, self.decoding_work_mem, stop=self._stop,
                acks=self._acks)
            yield from self._reading
            return
        request = pb.VStreamRequest(client_id=self.client_id, position=self.position, tables=self.tables,
                                    threshold=self.threshold, streaming=self.streaming)
        self._call = pb_grpc.VStreamStub(self._channel).Stream(request, metadata=self._metadata)
        if self._stop.is_set():  # cancel() came before the call existed
            self._call.cancel()
        for resp in self._call:
            yield resp.transaction if resp.WhichOneof("event") == "transaction" else resp.heartbeat

    def _track(self, ev: Event) -> None:
        if isinstance(ev, Heartbeat):
            self.position = max(self.position, ev.position)
            return
        xid = ev.context.transaction_id
        if ev.end_segment:
            self._open.pop(xid, None)
            self.position = max(self.position, ev.context.position)
        else:
            self._open[xid] = (ev.segment_id, ev.context.source_id)

    def _cut_off(self) -> Iterator[m.Transaction]:
        """A ROLLBACK for each transaction the lost connection cut: it comes again whole, from segment 1."""
        for xid, (segment_id, source_id) in self._open.items():
            rollback = m.Statement(type=m.ROLLBACK, statement_id=1, segment_id=1, end_segment=True,
                                   subtransaction_id=xid)
            yield m.Transaction(context=m.TransactionContext(source_id=source_id, transaction_id=xid,
                                                             position=self.position),
                                statements=[rollback], segment_id=segment_id + 1, end_segment=True)
        self._open.clear()

    # -- acknowledging ----------------------------------------------------------------------------
    def ack(self, position: int | None = None) -> None:
        """Everything before `position` (default: `self.position`, the last resume point handed out) is
        durably handled: a new stream of this client id from position 0 resumes after it. Call it from the
        thread that iterates. Raises UsageError for a position past what was handed out."""
        at = self.position if position is None else position
        if at > self.position:
            raise UsageError(f"VStream client {self.client_id} cannot acknowledge {format_lsn(at)}: it was "
                             f"handed out only up to {format_lsn(self.position)}")
        if at <= self._to_ack:
            return
        self._to_ack = at
        # Direct: a cheap hand-over to the reader. Through a server: one call per interval (the rest waits for
        # the next ack or close()).
        if self._direct or time.monotonic() - self._ack_sent_at >= self.ack_interval:
            self._send_ack()

    def _send_ack(self) -> None:
        at = self._to_ack
        if at <= self.acked:
            return
        self._ack_sent_at = time.monotonic()
        try:
            if self._direct:
                if self._acks is None or not self._acks.offer(at):  # no stream holds the slot
                    source.acknowledge(self.target, self.client_id, at)
            elif self._channel is None:
                raise UsageError(f"VStream client {self.client_id} is closed: acknowledge before close()")
            else:
                pb_grpc.VStreamStub(self._channel).Ack(pb.VStreamRequest(client_id=self.client_id, position=at),
                                                       timeout=ACK_TIMEOUT, metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise UsageError(exc.details() or "") from None
            why = ("the server does not keep acknowledgements (an older Sluicegate)"
                   if exc.code() == grpc.StatusCode.UNIMPLEMENTED else f"{exc.code().name}: {exc.details()}")
            self._ack_failed(at, why)
            return
        except SluicegateError as exc:
            if not exc.retryable:
                raise
            self._ack_failed(at, str(exc))
            return
        self.acked, self.ack_error = at, ""

    def _ack_failed(self, at: int, why: str) -> None:
        """A later ack (or the reconnect's request) carries it again; until then a restart repeats a little."""
        if why != self.ack_error:
            log.warning("vstream client %s: cannot acknowledge position %s yet: %s", self.client_id,
                        format_lsn(at), redact(why))
        self.ack_error = why

    # -- ending -------------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop (from any thread, e.g. a signal handler's helper): the iteration ends without an error."""
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()

    def close(self) -> None:
        """End the stream and send the last acknowledgement (a clean stop leaves nothing to come again)."""
        self.cancel()
        if self._reading is not None:  # ends the read of the slot, confirming what was acknowledged
            try:
                self._reading.close()
            except ValueError:  # running in the iterating thread: it ends by itself (`_stop`)
                pass
        if self._direct or self._channel is not None:  # not closed yet
            try:
                self._send_ack()
            except SluicegateError as exc:
                self._ack_failed(self._to_ack, str(exc))
        if self._channel is not None:
            self._channel.close()
            self._channel = None


def _error(target: str, client_id: str, exc: grpc.RpcError) -> SluicegateError:
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return UsageError(details)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return UsageError(f"VStream server {target} refused client {client_id}: {code.name}: {details}")
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED):
        return TerminalError(details)
    return TerminalError(f"VStream server {target} ended the stream of client {client_id}: "
                         f"{code.name}: {details}")


__all__ = ["Heartbeat", "Stream", "is_source_url", "stream"]

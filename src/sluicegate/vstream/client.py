"""A VStream client: Transaction messages and heartbeats from a VStream server, or straight from the source.

:func:`stream` gives an iterator that survives lost connections: it reconnects (with backoff) from the last
complete position it handed out — the ``context.position`` of the last message with ``end_segment``, or of
the last heartbeat — and asks for that position, which tells the server everything before it is handled
(the slot is confirmed up to it; nothing else moves it).

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

log = logging.getLogger(__name__)
Heartbeat = pb.Heartbeat
Event = m.Transaction | Heartbeat

# Worth another try: the server or the network went away, or the server is restarting.
_RETRY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
          grpc.StatusCode.INTERNAL}
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
           decoding_work_mem: str | None = None, max_backoff: float = 30.0) -> Stream:
    """Transaction messages and heartbeats for `client_id` from `position` (0: where its slot stands).

    `server_or_source`: HOST:PORT of a VStream server, or a libpq URL to read the source in this process (the
    same stream, without a server). `tables`: keep only these (the publication is made for them on the
    client's first request). `threshold`: transaction_message_threshold in bytes (0: the server's). The
    `heartbeat_seconds` and `decoding_work_mem` options apply when reading the source directly.
    """
    return Stream(server_or_source, client_id, position, list(tables or []), threshold, streaming,
                  heartbeat_seconds, decoding_work_mem, max_backoff)


class Stream:
    """Iterate it for events; `position` is where a new stream would resume; `cancel()` (from any thread)
    ends the iteration."""

    def __init__(self, target: str, client_id: str, position: int, tables: list[str], threshold: int,
                 streaming: bool, heartbeat_seconds: float, decoding_work_mem: str | None,
                 max_backoff: float):
        if not client_id:
            raise UsageError("a VStream client needs a client id (--client-id): it names its slot")
        self.target, self.client_id, self.position = target, client_id, position
        self.tables, self.threshold, self.streaming = tables, threshold, streaming
        self.heartbeat_seconds, self.decoding_work_mem = heartbeat_seconds, decoding_work_mem
        self.max_backoff = max_backoff
        self.reconnects = 0
        self._stop = threading.Event()
        self._call = None
        self._open: dict[int, tuple[int, str]] = {}  # transaction id -> (last segment_id, source_id): cut off
        self._direct = is_source_url(target)
        self._channel = None if self._direct else grpc.insecure_channel(target, options=CHANNEL_OPTIONS)

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
            yield from source.transactions(
                self.target, self.client_id, self.position, self.tables, self.threshold or DEFAULT_THRESHOLD,
                self.streaming, self.heartbeat_seconds, self.decoding_work_mem, stop=self._stop)
            return
        request = pb.VStreamRequest(client_id=self.client_id, position=self.position, tables=self.tables,
                                    threshold=self.threshold, streaming=self.streaming)
        self._call = pb_grpc.VStreamStub(self._channel).Stream(request)
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

    # -- ending -------------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop (from any thread, e.g. a signal handler's helper): the iteration ends without an error."""
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()

    def close(self) -> None:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        if self._channel is not None:
            self._channel.close()
            self._channel = None


def _error(target: str, client_id: str, exc: grpc.RpcError) -> SluicegateError:
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return UsageError(details)
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED):
        return TerminalError(details)
    return TerminalError(f"VStream server {target} ended the stream of client {client_id}: "
                         f"{code.name}: {details}")


__all__ = ["Heartbeat", "Stream", "is_source_url", "stream"]

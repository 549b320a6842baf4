"""The VStream gRPC service: each client's Transaction messages from the source, as it reads them.

`Stream` is a generator over :func:`source.transactions`. A synchronous gRPC server pulls a response generator
only when the previous message was handed to the transport, and HTTP/2 flow control holds that back while the
client is not reading: a slow client therefore slows the reading of the source (the target pulls), and the
server holds at most one message under construction per stream plus the transport's windows.

Client ids: each has its own slot; clients with different ids stream at the same time. A second connection
with an id already streaming takes over: the older stream ends with ABORTED (its walsender is ended too, so
the slot is free), because the usual reason is a client that restarted while its old connection lingers.
The client library treats ABORTED as final, so two live processes with one id do not fight forever.

Errors end a stream with a status a client can act on: INVALID_ARGUMENT (bad request: fix it),
FAILED_PRECONDITION (the changes asked for are gone: re-bootstrap), UNAVAILABLE (a passing fault, the source
restarting, this server stopping: reconnect from the last position), ABORTED (taken over), UNKNOWN (a bug).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from ..changes import change_pb2 as pb
from ..changes import change_pb2_grpc as pb_grpc
from ..changes.segmenter import DEFAULT_THRESHOLD, MIN_THRESHOLD
from ..errors import SluicegateError, TerminalError, UsageError
from ..position import format_lsn
from ..postgres.connect import describe, redact
from . import source

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger(__name__)
MAX_STREAMS = 64  # worker threads: one per open stream
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    # Clients ping every 20 s (client.CHANNEL_OPTIONS), also while a paused reader leaves the stream quiet.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


@dataclass(eq=False)
class _Active:
    client_id: str
    stop: threading.Event = field(default_factory=threading.Event)
    why: str = ""  # why it was stopped from outside: "taken over", "server stopping"


class VStreamService(pb_grpc.VStreamServicer):
    def __init__(self, source_url: str, threshold: int = DEFAULT_THRESHOLD, tables: list[str] | None = None,
                 heartbeat_seconds: float = 1.0, decoding_work_mem: str | None = None):
        self.source_url, self.threshold, self.tables = source_url, threshold, list(tables or [])
        self.heartbeat_seconds, self.decoding_work_mem = heartbeat_seconds, decoding_work_mem
        self._lock = threading.Lock()
        self._active: dict[str, _Active] = {}

    def Stream(self, request: pb.VStreamRequest, context: grpc.ServicerContext):
        if not request.client_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "client_id is required: it names the slot")
        threshold = request.threshold or self.threshold
        if threshold < MIN_THRESHOLD:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"threshold {threshold} is below the minimum of {MIN_THRESHOLD} bytes")
        me = self._register(request.client_id)
        context.add_callback(me.stop.set)  # the client went away (cancelled, connection lost)
        peer = context.peer()
        log.info("client %s (%s) streams from %s", request.client_id, peer, format_lsn(request.position))
        try:
            events = source.transactions(
                self.source_url, request.client_id, request.position, list(request.tables) or self.tables,
                threshold, request.streaming, self.heartbeat_seconds, self.decoding_work_mem, stop=me.stop)
            for ev in events:
                if isinstance(ev, pb.Transaction):
                    yield pb.VStreamResponse(transaction=ev)
                else:
                    yield pb.VStreamResponse(heartbeat=ev)
            if me.why:  # stopped from outside (not by the client, which is gone and hears nothing)
                context.abort(*_stopped_status(me))
        except SluicegateError as exc:
            if me.why:  # the takeover ended our walsender: that is the error we see
                context.abort(*_stopped_status(me))
            code = (grpc.StatusCode.INVALID_ARGUMENT if isinstance(exc, UsageError)
                    else grpc.StatusCode.FAILED_PRECONDITION if isinstance(exc, TerminalError)
                    else grpc.StatusCode.UNAVAILABLE if exc.retryable else grpc.StatusCode.UNKNOWN)
            log.warning("client %s: %s", request.client_id, exc)
            context.abort(code, redact(str(exc)))
        finally:
            self._unregister(me)
            log.info("client %s (%s) stream ended", request.client_id, peer)

    def _register(self, client_id: str) -> _Active:
        me = _Active(client_id)
        with self._lock:
            old = self._active.get(client_id)
            if old is not None:
                old.why = "taken over"
                old.stop.set()
            self._active[client_id] = me
        return me

    def _unregister(self, me: _Active) -> None:
        with self._lock:
            if self._active.get(me.client_id) is me:
                del self._active[me.client_id]

    def stop_all(self) -> None:
        """End every stream with UNAVAILABLE (its client reconnects, to this server once it is back)."""
        with self._lock:
            for active in self._active.values():
                active.why = "server stopping"
                active.stop.set()


def _stopped_status(me: _Active) -> tuple[grpc.StatusCode, str]:
    if me.why == "taken over":
        return (grpc.StatusCode.ABORTED,
                f"client {me.client_id} connected again: this older stream was taken over by the new one")
    return grpc.StatusCode.UNAVAILABLE, "the VStream server is stopping; reconnect from the last position"


class VStreamServer:
    """A gRPC server with the VStream service for one source. `port` 0 picks a free one (see `.port`)."""

    def __init__(self, source_url: str, port: int = 0, host: str = "127.0.0.1", **service_options):
        self.service = VStreamService(source_url, **service_options)
        self.source_url = source_url
        self.grpc = grpc.server(ThreadPoolExecutor(max_workers=MAX_STREAMS, thread_name_prefix="vstream"),
                                maximum_concurrent_rpcs=MAX_STREAMS,
                                options=SERVER_OPTIONS)
        pb_grpc.add_VStreamServicer_to_server(self.service, self.grpc)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self.grpc.add_insecure_port(address)
        except RuntimeError as exc:
            raise UsageError(f"cannot listen on {address}: {exc} (is the port in use?)") from None
        if not self.port:
            raise UsageError(f"cannot listen on {address} (is the port in use?)")
        self.host = host

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> VStreamServer:
        self.grpc.start()
        log.info("VStream of %s on %s", describe(self.source_url), self.address)
        return self

    def stop(self, grace: float = 5.0) -> None:
        self.service.stop_all()
        self.grpc.stop(grace).wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

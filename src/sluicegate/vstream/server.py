"""The VStream gRPC service: each client's Transaction messages from the source, as it reads them.

`Stream` is a generator over :func:`source.transactions`. A synchronous gRPC server pulls a response generator
only when the previous message was handed to the transport, and HTTP/2 flow control holds that back while the
client is not reading: a slow client therefore slows the reading of the source (the target pulls), and the
server holds at most one message under construction per stream plus the transport's windows.

Client ids: each has its own slot; clients with different ids stream at the same time. A second connection
with an id already streaming takes over: the older stream ends with ABORTED (its walsender is ended too, so
the slot is free), because the usual reason is a client that restarted while its old connection lingers.
The client library treats ABORTED as final, so two live processes with one id do not fight forever.

Acknowledgements: `Ack` (a unary call: VStreamRequest with client_id and position, answered by a Heartbeat
with the position the slot now stands at) says the client has durably handled everything before that
resume point. The client's slot on the source keeps it (see source.py: the stream holding the slot confirms
it, else SQL does), so a client that reconnects with position 0 resumes right after it, whatever restarted
meanwhile. A client of another language calls it from change.proto like Stream.

Errors end a stream with a status a client can act on: INVALID_ARGUMENT (bad request: fix it),
FAILED_PRECONDITION (the changes asked for are gone: re-bootstrap), UNAVAILABLE (a passing fault, the source
restarting, this server stopping: reconnect from the last position), ABORTED (taken over), UNKNOWN (a bug).
"""

from __future__ import annotations

import logging
import threading
import time
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
from .security import ServerSecurity

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger(__name__)
MAX_STREAMS = 64  # worker threads: one per open stream
TAKEOVER_WAIT = 5.0  # seconds a new stream waits for the one it takes over to end (and confirm its acks)
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
    acks: source.Acks = field(default_factory=source.Acks)
    sent: int = 0  # the last resume point sent: a client cannot have handled more
    done: threading.Event = field(default_factory=threading.Event)


class VStreamService(pb_grpc.VStreamServicer):
    def __init__(self, source_url: str, threshold: int = DEFAULT_THRESHOLD, tables: list[str] | None = None,
                 heartbeat_seconds: float = 1.0, decoding_work_mem: str | None = None):
        self.source_url, self.threshold, self.tables = source_url, threshold, list(tables or [])
        self.heartbeat_seconds, self.decoding_work_mem = heartbeat_seconds, decoding_work_mem
        self._lock = threading.Lock()
        self._active: dict[str, _Active] = {}
        # Acks a stream accepted, until that client's next stream starts: one that came as the stream ended may
        # not have reached the slot before its walsender was gone (see Stream).
        self._acked: dict[str, int] = {}

    def Stream(self, request: pb.VStreamRequest, context: grpc.ServicerContext):
        if not request.client_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "client_id is required: it names the slot")
        threshold = request.threshold or self.threshold
        if threshold < MIN_THRESHOLD:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"threshold {threshold} is below the minimum of {MIN_THRESHOLD} bytes")
        me = self._register(request.client_id, request.position)
        context.add_callback(me.stop.set)  # the client went away (cancelled, connection lost)
        peer = context.peer()
        log.info("client %s (%s) streams from %s", request.client_id, peer, format_lsn(request.position))
        try:
            with self._lock:  # an explicit position overrides what the client acknowledged before
                acked = self._acked.pop(request.client_id, 0) if not request.position else 0
            events = source.transactions(
                self.source_url, request.client_id, request.position, list(request.tables) or self.tables,
                threshold, request.streaming, self.heartbeat_seconds, self.decoding_work_mem, stop=me.stop,
                acks=me.acks, acked=acked)
            for ev in events:
                if isinstance(ev, pb.Transaction):
                    if ev.end_segment:
                        me.sent = max(me.sent, ev.context.position)
                    yield pb.VStreamResponse(transaction=ev)
                else:
                    me.sent = max(me.sent, ev.position)
                    yield pb.VStreamResponse(heartbeat=ev)
            if me.why:  # stopped from outside (not by the client, which is gone and hears nothing)
                context.abort(*_stopped_status(me))
        except SluicegateError as exc:
            if me.why:  # the takeover ended our walsender: that is the error we see
                context.abort(*_stopped_status(me))
            log.warning("client %s: %s", request.client_id, exc)
            context.abort(*_error_status(exc))
        finally:
            self._unregister(me)
            log.info("client %s (%s) stream ended", request.client_id, peer)

    def Ack(self, request: pb.VStreamRequest, context: grpc.ServicerContext) -> pb.Heartbeat:
        """The client has durably handled everything before `request.position` (a resume point it received):
        its slot is confirmed up to it. The answer's position: where the slot stands (or will, within a poll,
        when the client's stream holds the slot: that stream confirms it, at the latest as it ends)."""
        client_id, position = request.client_id, request.position
        if not client_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "client_id is required: it names the slot")
        if not position:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "position is required: the last resume point the client has handled")
        with self._lock:
            active = self._active.get(client_id)
        known = max(active.sent, active.acks.start) if active is not None else 0
        if known and position > known:  # (0: the stream is still starting)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"client {client_id} acknowledged {format_lsn(position)}, past the last position "
                          f"sent to it ({format_lsn(known)})")
        if active is not None and active.acks.offer(position):
            with self._lock:
                self._acked[client_id] = max(self._acked.get(client_id, 0), position)
            return pb.Heartbeat(position=position, time_us=time.time_ns() // 1000)
        try:  # no stream of this client here holds the slot
            confirmed = source.acknowledge(self.source_url, client_id, position)
        except SluicegateError as exc:
            log.warning("client %s: %s", client_id, exc)
            context.abort(*_error_status(exc))
        return pb.Heartbeat(position=confirmed, time_us=time.time_ns() // 1000)

    def _register(self, client_id: str, position: int) -> _Active:
        me = _Active(client_id, sent=position)
        with self._lock:
            old = self._active.get(client_id)
            if old is not None:
                old.why = "taken over"
                old.stop.set()
            self._active[client_id] = me
        if old is not None:  # let it confirm what its client acknowledged before the slot changes hands
            old.done.wait(TAKEOVER_WAIT)
        return me

    def _unregister(self, me: _Active) -> None:
        with self._lock:
            if self._active.get(me.client_id) is me:
                del self._active[me.client_id]
        me.done.set()

    def stop_all(self) -> None:
        """End every stream with UNAVAILABLE (its client reconnects, to this server once it is back)."""
        with self._lock:
            for active in self._active.values():
                active.why = "server stopping"
                active.stop.set()


def _error_status(exc: SluicegateError) -> tuple[grpc.StatusCode, str]:
    code = (grpc.StatusCode.INVALID_ARGUMENT if isinstance(exc, UsageError)
            else grpc.StatusCode.FAILED_PRECONDITION if isinstance(exc, TerminalError)
            else grpc.StatusCode.UNAVAILABLE if exc.retryable else grpc.StatusCode.UNKNOWN)
    return code, redact(str(exc))


def _stopped_status(me: _Active) -> tuple[grpc.StatusCode, str]:
    if me.why == "taken over":
        return (grpc.StatusCode.ABORTED,
                f"client {me.client_id} connected again: this older stream was taken over by the new one")
    return grpc.StatusCode.UNAVAILABLE, "the VStream server is stopping; reconnect from the last position"


class VStreamServer:
    """A gRPC server with the VStream service for one source. `port` 0 picks a free one (see `.port`)."""

    def __init__(self, source_url: str, port: int = 0, host: str = "127.0.0.1",
                 security: ServerSecurity | None = None, **service_options):
        """`security`: TLS and client authentication; required (or its `insecure`) off loopback."""
        security = security or ServerSecurity()
        security.check(host)
        credentials = security.credentials()
        self.service = VStreamService(source_url, **service_options)
        self.source_url = source_url
        self.grpc = grpc.server(ThreadPoolExecutor(max_workers=MAX_STREAMS, thread_name_prefix="vstream"),
                                maximum_concurrent_rpcs=MAX_STREAMS, interceptors=security.interceptors(),
                                options=SERVER_OPTIONS)
        pb_grpc.add_VStreamServicer_to_server(self.service, self.grpc)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = (self.grpc.add_secure_port(address, credentials) if credentials
                         else self.grpc.add_insecure_port(address))
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

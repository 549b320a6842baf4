"""One VStream client's changes read from the source: Transaction messages and heartbeats, from a position.

Each client id has its own logical slot (pgoutput) and publication on the source, both named
``sg_vstream_<client id>`` (see :func:`capture_name`). They are made on the client's first request: the
publication for the tables it names (default: every table of schema public at that time), then the slot at
the source's current position. A table is added later on the source with
``ALTER PUBLICATION sg_vstream_<id> ADD TABLE t`` (its changes from then on are sent); asking for a table
that is not in the publication is refused with that advice, never silently answered with nothing.

Resume semantics (Drizzle's, over a position):

* A resume point is the position on a message with ``end_segment`` (its ``context.position``: the end of
  that transaction's commit) or on a heartbeat. Only the client moves its slot, by acknowledging a resume
  point it has durably handled: with a request's position (``capture.advance_slot``), or with
  :class:`Acks` while it streams (the reader sends it as a standby status update between reads, and once
  more before it lets go of the slot), or with :func:`acknowledge` when no stream holds the slot. The slot
  is durable state on the source, so the acknowledged position outlives the client, the server and their
  restarts; the server never confirms on its own.
* The stream starts there: every transaction whose commit ends at or before the position is skipped (the
  walsender does so, and so does :func:`_skip_done`, as workflow/player.py does), and every later one is sent
  in full. A transaction the client had only partly received before its connection broke comes again from
  segment 1, so a client drops the segments of a transaction whose ``end_segment`` it did not see.
* Position 0 means the slot's confirmed position: where the client's last acknowledgement put it. A
  position before it is refused: the changes between were consumed and are gone, and the client has to
  re-bootstrap (copy again, or use a new client id).

DDL: with the source's DDL capture installed (`sluicegate ddl install`), each DDL statement on a table the
client streams comes as a DDL statement at its place in its transaction (changes/ddl.py); others are passed
over. Without the capture there are none, and nothing else changes.

Heartbeats: when nothing was sent for ``heartbeat_seconds``, a Heartbeat whose position is a resume point
too: everything that committed before it has been sent (transactions of tables outside the publication or
the filter included, so an idle client's position keeps moving). It is never taken inside a transaction the
walsender is still sending; a streamed transaction still open then simply comes again whole after a resume.

Memory is bounded: one Transaction message under construction per open transaction, and nothing is read
from the replication connection until the consumer asks for the next event (a generator all the way down).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Iterable, Iterator

import psycopg

from ..changes import change_pb2 as pb
from ..changes import model as m
from ..changes.segmenter import DEFAULT_THRESHOLD, Segmenter
from ..ddl.message import PREFIX as DDL_PREFIX
from ..errors import RetryableError, UsageError
from ..position import format_lsn
from ..postgres import capture
from ..postgres.assembler import Event, Framing, assemble
from ..postgres.catalog import Table, list_tables, resolve_name
from ..postgres.connect import connect
from ..postgres.pgoutput import Begin, Commit, DecodeError
from ..postgres.replication import ChangeStream

log = logging.getLogger(__name__)
Heartbeat = pb.Heartbeat
PREFIX = "sg_vstream_"
_NAME_MAX = 63  # NAMEDATALEN - 1
_POLL = 0.2  # seconds: how often an idle stream looks at `stop` and the heartbeat clock
_MANY = 1 << 40  # no count limit on one read of the replication connection


def capture_name(client_id: str) -> str:
    """The slot and publication name of a client id: ``sg_vstream_<id>``, lowercased, with characters a slot
    name cannot hold replaced; a short hash of the id is added when that changed it, so ids stay distinct."""
    if not client_id:
        raise UsageError("a VStream client needs a client id (it names the client's replication slot)")
    clean = re.sub(r"[^a-z0-9_]", "_", client_id.lower())
    if clean != client_id or len(PREFIX) + len(clean) > _NAME_MAX:
        digest = hashlib.sha1(client_id.encode()).hexdigest()[:8]
        clean = f"{clean[:_NAME_MAX - len(PREFIX) - 9]}_{digest}"
    return PREFIX + clean


class Acks:
    """A client's acknowledgements to the stream that holds its slot (any thread may `offer`).

    While a walsender holds the slot, SQL cannot move it (pg_replication_slot_advance: "slot is active"),
    so the reader confirms the latest acknowledgement through its own replication connection. `close()` is
    the reader's last look before it lets go of the slot; after it `offer` says no and the caller confirms
    with :func:`acknowledge` instead, so no acknowledgement falls between the two."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest = 0
        self._closed = False
        self.start = 0  # where the stream started: everything before it is acknowledged already

    def offer(self, position: int) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._latest = max(self._latest, position)
            return True

    def latest(self) -> int:
        with self._lock:
            return self._latest

    def close(self) -> int:
        with self._lock:
            self._closed = True
            return self._latest


def transactions(source_url: str, client_id: str, position: int = 0, tables: Iterable[str] | None = None,
                 threshold: int = DEFAULT_THRESHOLD, streaming: bool = True, heartbeat_seconds: float = 1.0,
                 decoding_work_mem: str | None = None, stop=None, acks: Acks | None = None,
                 acked: int = 0) -> Iterator[m.Transaction | Heartbeat]:
    """The client's Transaction messages (and heartbeats) from `position` on; see the module docstring.

    `tables`: names (``t`` or ``schema.t``) the publication is made for on the first request and that every
    request keeps (the Segmenter's table filter); None or empty: the whole publication. `stop` (anything with
    ``is_set()``) ends the generator within a fraction of a second, also while the source is idle. `acks`:
    where the client's acknowledgements arrive while this stream holds the slot. `acked`: with position 0, an
    acknowledgement the slot may have missed (a server's memory of one that came as a stream ended).
    Raises UsageError (bad request), TerminalError (the changes asked for are gone) or RetryableError.
    """
    stop = stop or threading.Event()  # never set
    acks = acks or Acks()
    names = [t for t in (tables or []) if t.strip()]
    name = capture_name(client_id)
    try:
        with connect(source_url, role="source", autocommit=True) as ctl:
            capture.check_source(ctl)
            keep, published = _ensure_publication(ctl, name, names)
            start = acks.start = _take_slot(ctl, name, client_id, position, acked)
            source_id = _source_id(ctl)
            # Logical messages: the DDL capture's, asked for whether or not it is installed (yet).
            stream = ChangeStream(source_url, name, name, start, streaming=streaming,
                                  decoding_work_mem=decoding_work_mem, messages=True)
    except BaseException:
        acks.close()
        raise
    with stream:
        try:
            yield from _read(stream, Segmenter(source_id, threshold, start, keep, published), start,
                             heartbeat_seconds, stop, acks)
        except RetryableError:
            with connect(source_url, role="source", autocommit=True) as ctl:
                _check_slot(ctl, name, client_id, start)  # a lost slot is terminal: say so, never skip ahead
            raise
        finally:
            _confirm(stream, acks.close())


def _confirm(stream: ChangeStream, position: int) -> None:
    """Confirm the slot up to an acknowledged position. A connection already broken cannot: the slot stays at
    the previous acknowledgement, and the client gets those transactions again (whole) when it resumes."""
    try:
        stream.confirm(position)  # (sends only a position past the confirmed one)
    except Exception as exc:  # noqa: BLE001 - see above: at least once, never lost
        log.info("slot %s not confirmed up to %s: %s", stream.slot, format_lsn(position), exc)


def _read(stream: ChangeStream, seg: Segmenter, start: int, heartbeat_seconds: float,
          stop, acks: Acks) -> Iterator[m.Transaction | Heartbeat]:
    framing = Framing(streaming=True)
    last_sent = time.monotonic()
    poll = min(_POLL, heartbeat_seconds) if heartbeat_seconds > 0 else _POLL
    while not stop.is_set():
        _confirm(stream, acks.latest())
        # Each read ends at a transaction boundary after `poll` seconds (busy) or `poll` idle seconds.
        raw = _until_stopped(stream.messages(_MANY, poll, poll), stop)
        try:
            for ev in _skip_done(assemble(raw, framing, messages=DDL_PREFIX), start):
                for txn in seg.feed(ev):
                    yield txn
                    last_sent = time.monotonic()
        except DecodeError:
            if stop.is_set():
                return  # stopped inside a transaction: nothing more is read, the cut is expected
            raise
        if stop.is_set():
            return
        quiet = time.monotonic() - last_sent
        if heartbeat_seconds > 0 and quiet >= heartbeat_seconds and not stream.in_transaction:
            seg.position = max(seg.position, stream.sent_upto)
            yield Heartbeat(position=seg.position, time_us=time.time_ns() // 1000)
            last_sent = time.monotonic()


def _until_stopped(raw: Iterator[tuple[int, bytes]], stop) -> Iterator[tuple[int, bytes]]:
    for item in raw:
        if stop.is_set():
            return  # ends the stream mid-transaction: the caller stops reading altogether
        yield item


def _skip_done(events: Iterator[Event], start: int) -> Iterator[Event]:
    """Leave out the Begin…Commit transactions whose commit record starts before `start` (they end at or
    before it: the client has them). The walsender already skips them; this keeps the promise whatever it
    sends. A streamed transaction cannot have committed before the start: it is only streamed past it."""
    skipping = False
    for ev in events:
        if isinstance(ev, Begin):
            skipping = ev.final_lsn < start
        if not skipping:
            yield ev
        elif isinstance(ev, Commit):
            skipping = False


# -- the client's capture on the source --------------------------------------------------------------

def _ensure_publication(ctl: psycopg.Connection, name: str, names: list[str]
                        ) -> tuple[set[tuple[str, str]] | None, set[tuple[str, str]]]:
    """Create the client's publication if missing; the (schema, table) set to keep, or None for all of it, and
    the tables it publishes."""
    existing = list_tables(ctl)
    wanted = [resolve_name(existing, n) for n in names]
    published = {(s, t) for s, t in ctl.execute(
        "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s", (name,)).fetchall()}
    exists = ctl.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,)).fetchone()
    if not exists:
        chosen = wanted or [t for t in existing if t[0] == "public"]
        if not chosen:
            raise UsageError("source has no tables in schema public: name the tables (--tables a,b)")
        capture.ensure_publication(ctl, name, [Table(s, t, (), ()) for s, t in dict.fromkeys(chosen)])
        return set(wanted) or None, set(chosen)
    missing = [f"{s}.{t}" for s, t in wanted if (s, t) not in published]
    if missing:
        adds = "; ".join(f"ALTER PUBLICATION {name} ADD TABLE {t}" for t in missing)
        has = ", ".join(sorted(f"{s}.{t}" for s, t in published)) or "no tables"
        raise UsageError(
            f"table {', '.join(missing)} is not in this client's publication {name} (it has {has}): add "
            f"it on the source with `{adds}` (changes from then on are sent), or use another client id")
    return set(wanted) or None, published


def _take_slot(ctl: psycopg.Connection, name: str, client_id: str, position: int, acked: int = 0) -> int:
    """Create the slot on the first request; end an earlier reader of it; confirm it up to `position`.
    The position to start from."""
    info = capture.slot_info(ctl, name)
    if info is None:
        capture.ensure_slot(ctl, name)  # at the current position
    info = _check_slot(ctl, name, client_id, position)
    capture.release_slot(ctl, name, info)  # a dead connection's walsender: the client is back
    confirmed = info.confirmed_flush or 0
    if not position and acked > confirmed:
        position = acked  # acknowledged as the previous stream ended, before its walsender confirmed it
    flushed = capture.wal_flush_position(ctl)[0]
    if position > flushed:  # skipping up to it would lose every change before it
        raise UsageError(f"VStream client {client_id} asked for position {format_lsn(position)}, ahead of "
                         f"the source's WAL ({format_lsn(flushed)}): a position of another source? Use 0 to "
                         f"start where the slot stands")
    if position > confirmed:
        capture.advance_slot(ctl, name, position)  # the client says it has everything before it
    return max(position, confirmed)


def _check_slot(ctl: psycopg.Connection, name: str, client_id: str, position: int) -> capture.SlotInfo:
    """The client's slot can still supply everything after `position` (0: wherever it stands)."""
    way_out = (f"the changes VStream client {client_id} still needs are gone: re-bootstrap: copy the tables "
               f"again and stream from a new client id (or drop the slot with SELECT "
               f"pg_drop_replication_slot('{name}') and start client {client_id} from position 0)")
    info = capture.slot_info(ctl, name)
    at = position or (info.confirmed_flush if info is not None and info.confirmed_flush is not None else 0)
    return capture.check_slot(ctl, name, at, way_out, consumer=f"the position client {client_id} asked for")


def acknowledge(source_url: str, client_id: str, position: int, wait: float = 5.0) -> int:
    """Confirm a client's slot up to `position` while no stream holds it; the slot's confirmed position.

    A walsender still on its way out (its client just stopped) is waited for, up to `wait` seconds; one that
    stays is a stream of this client id elsewhere (another server): a RetryableError, never ended from here.
    """
    name = capture_name(client_id)
    with connect(source_url, role="source", autocommit=True) as ctl:
        deadline = time.monotonic() + wait
        while True:
            info = _check_slot(ctl, name, client_id, 0)
            confirmed = info.confirmed_flush or 0
            if confirmed >= position:
                return confirmed
            if not info.active_pid:
                break
            if time.monotonic() > deadline:
                raise RetryableError(f"replication slot {name} is held by pid {info.active_pid} (a stream of "
                                     f"VStream client {client_id} elsewhere?): position {format_lsn(position)} "
                                     f"is acknowledged by that stream's client, or here once it ends")
            time.sleep(0.05)
        flushed = capture.wal_flush_position(ctl)[0]
        if position > flushed:
            raise UsageError(f"VStream client {client_id} acknowledged position {format_lsn(position)}, ahead "
                             f"of the source's WAL ({format_lsn(flushed)}): a position of another source?")
        try:
            capture.advance_slot(ctl, name, position)
        except psycopg.errors.ObjectInUse:
            raise RetryableError(f"replication slot {name} was taken by a new stream of VStream client "
                                 f"{client_id}: acknowledge position {format_lsn(position)} to it") from None
        return position


def _source_id(ctl: psycopg.Connection) -> str:
    """'<system identifier>/<database>': names the source in every message's context."""
    db = ctl.execute("SELECT current_database()").fetchone()[0]
    try:
        system = ctl.execute("SELECT system_identifier::text FROM pg_control_system()").fetchone()[0]
    except psycopg.errors.InsufficientPrivilege:
        return db
    return f"{system}/{db}"


def drop(source_url: str, client_id: str) -> list[str]:
    """Drop a client's slot and publication (what was dropped): the way to forget a client."""
    name = capture_name(client_id)
    with connect(source_url, role="source", autocommit=True) as ctl:
        return capture.drop_capture(ctl, name, name)


__all__ = ["DEFAULT_THRESHOLD", "Acks", "Heartbeat", "acknowledge", "capture_name", "drop", "transactions"]

"""What every player does with its slot, one way for every target: take it, open it, read a batch, end it.

- `take_slot`: before a reader starts at the position its target recorded: the slot can still supply it,
  a reader a killed task left attached is ended, and a slot not confirmed up to that position (the task died
  between its target's commit and the confirm) is confirmed now, through the caller's confirm (a PostgreSQL
  target may wait for its standbys first).
- `open_stream`: the replication socket from that position; a slot that cannot serve it says why.
- `BatchReader`: one batch of decoded events, no further than a stop position, and the position the batch
  ends at. A transaction is the batch's when its commit record starts at or after the batch's start: one
  before it was applied by an earlier batch.
- `wait_flushed`: decoding reads only flushed WAL: a play to a position waits until it is flushed.
- `PeekedSlot`: the slot of a stream read by peeks (a Spark job a batch, through rules), as a batch source.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import psycopg

from ..errors import RetryableError
from . import capture
from .pgoutput import Begin, Commit
from .replication import ChangeStream


def take_slot(conn: psycopg.Connection, slot: str, position: int, way_out: str,
              confirm: Callable[[int], None] | None = None) -> capture.SlotInfo:
    """Make the slot ready for a reader from `position`, the target's recorded one (`conn`: autocommit).
    `confirm(position)`: how the caller confirms a position it has committed (default: advance the slot)."""
    info = capture.check_slot(conn, slot, position, way_out)
    capture.release_slot(conn, slot, info)
    if info.confirmed_flush is not None and info.confirmed_flush < position:
        if confirm is None:
            capture.advance_slot(conn, slot, position)
        else:
            confirm(position)
    return info


def open_stream(conn: psycopg.Connection, url: str, slot: str, publication: str, position: int, way_out: str,
                **options) -> ChangeStream:
    """The slot's changes from `position` (ChangeStream's `options`); a slot gone or invalidated meanwhile is
    a TerminalError with the way out, never a retry that would skip it."""
    try:
        return ChangeStream(url, slot, publication, position, **options)
    except RetryableError:
        capture.check_slot(conn, slot, position, way_out)
        raise


@dataclass(frozen=True)
class BatchEnd:
    position: int  # where the next batch starts: every transaction committing before it is read
    limited: bool  # the batch ended early (size, time, a cut): more may be waiting


class BatchReader:
    """One batch's events from `stream` (the player's own handling of each), starting at `position` and
    reading no transaction whose commit record starts at or after `stop_at`."""

    def __init__(self, stream: ChangeStream, position: int, stop_at: int | None = None):
        self.stream, self.position, self.stop_at = stream, position, stop_at
        self.commit_lsn = 0  # where the commit record of the transaction being read starts
        self.last_end: int | None = None  # end of the last commit record read
        self.reached_stop = False

    @property
    def earlier(self) -> bool:
        """The transaction being read was applied by an earlier batch."""
        return self.commit_lsn < self.position

    def events(self, events: Iterable) -> Iterator:
        """`events` (assembled) up to the stop position: a Begin at or past it ends the batch unseen."""
        for ev in events:
            if isinstance(ev, Begin):
                if self.stop_at is not None and ev.final_lsn >= self.stop_at:
                    self.reached_stop = True
                    return
                self.commit_lsn = ev.final_lsn
            elif isinstance(ev, Commit):
                self.last_end = ev.end_lsn
            yield ev

    def end(self, cut: bool = False) -> BatchEnd:
        """The batch's end. `cut`: the player ended it after the last commit it read (a DDL statement
        changed the stream's tables): no further than that commit. Else the batch is caught up only when the
        server says it sent everything up to where the read was asked to end: a quiet socket may just mean
        the walsender is still decoding a big transaction."""
        position, stop_at, last_end = self.position, self.stop_at, self.last_end
        limited = cut or (not self.reached_stop and self.stream.ended_by != "reached")
        sent = self.stream.sent_upto  # every transaction committing before it has been read
        if cut:
            return BatchEnd(max(position, last_end or position), True)
        if self.reached_stop or (stop_at is not None and sent >= stop_at):
            return BatchEnd(stop_at, limited)
        if limited:
            return BatchEnd(max(position, last_end or position), True)
        return BatchEnd(max(position, last_end or 0, sent), False)


class PeekedSlot:
    """A slot read by peeks (each batch's job peeks it, consuming nothing): confirmed once the target has the
    batch; nothing to close."""

    def __init__(self, conn: psycopg.Connection, slot: str):
        self.conn, self.slot = conn, slot

    def confirm(self, position: int) -> None:
        capture.advance_slot(self.conn, self.slot, position)

    def close(self) -> None:
        pass


def wait_flushed(conn: psycopg.Connection, lsn: int, timeout: float = 30.0) -> None:
    """Until the source has flushed its WAL up to `lsn` (`conn`: autocommit)."""
    deadline = time.monotonic() + timeout
    nudged = False
    while capture.wal_flush_position(conn)[0] < lsn:
        if time.monotonic() > deadline:
            raise RetryableError("source WAL was not flushed up to the snapshot position in time; will retry")
        if not nudged:
            # An idle server may leave the last records unflushed for a while; a tiny committed
            # transaction (invisible to the publication) flushes them.
            conn.execute("SELECT pg_current_xact_id()")
            nudged = True
        time.sleep(0.01)

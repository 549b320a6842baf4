"""The replication socket on a real walsender: the slot moves to the position confirmed, never further
(guarantee 7), whatever the server's keepalives say and whenever it asks for a reply."""

from __future__ import annotations

import psycopg
from psycopg import sql

from sluicegate.position import format_lsn, parse_lsn
from sluicegate.postgres import capture
from sluicegate.postgres.replication import ChangeStream
from tests.conftest import wait_for


def _slot(src: psycopg.Connection, slot: str) -> int:
    return capture.slot_info(src, slot).confirmed_flush


def _flushed(src: psycopg.Connection, pid: int) -> int | None:
    """The flush position of the reader's last status update, as the server took it (None: none yet)."""
    (lsn,) = src.execute("SELECT flush_lsn::text FROM pg_stat_replication WHERE pid = %s", (pid,)).fetchone()
    return parse_lsn(lsn) if lsn else None


def test_keepalives_and_replies_leave_the_slot_at_the_confirmed_position(pair):
    slot = f"{pair.name}_slot"
    pair.src("CREATE TABLE items (id int PRIMARY KEY); CREATE TABLE other (id int); CREATE PUBLICATION pub FOR TABLE items")
    # The server asks for a reply after half of wal_sender_timeout without one: soon, in this database.
    pair.src(sql.SQL("ALTER ROLE CURRENT_USER IN DATABASE {} SET wal_sender_timeout = '2s'").format(
        sql.Identifier(pair.name)))
    with psycopg.connect(pair.source, autocommit=True) as src:
        start = capture.ensure_slot(src, slot)
        with ChangeStream(pair.source, slot, "pub", start) as stream:
            pid = capture.slot_info(src, slot).active_pid
            # WAL the publication does not cover: keepalives pass the slot's position, no data comes.
            src.execute("INSERT INTO other SELECT generate_series(1, 1000)")

            def keepalives_past_and_replied():
                assert list(stream.messages(100, idle=0.2, max_seconds=1)) == []
                return stream.wal_end > start and _flushed(src, pid) is not None

            wait_for(keepalives_past_and_replied, 30, what="a keepalive past the slot, and a reply to the server")
            assert stream.sent_upto > start
            # psycopg2 had answered with the keepalive's WAL end, and the slot went there
            assert _flushed(src, pid) == start and _slot(src, slot) == start

            src.execute("INSERT INTO items VALUES (1)")
            got = []
            wait_for(lambda: got.extend(stream.messages(100, idle=0.2, max_seconds=1)) or stream.boundary > start,
                     30, what="the published insert")
            assert [payload[:1] for _lsn, payload in got] == [b"B", b"R", b"I", b"C"]
            assert _slot(src, slot) == start
            stream.confirm(stream.boundary)
            wait_for(lambda: _slot(src, slot) == stream.boundary, 10, what="the slot at the commit's end")
            src.execute("INSERT INTO other VALUES (0)")
            wait_for(lambda: not list(stream.messages(100, idle=0.2, max_seconds=1)) and stream.wal_end > stream.boundary,
                     30, what="a keepalive past the commit")
            assert _slot(src, slot) == stream.boundary


def test_the_last_confirmation_reaches_the_slot_when_a_busy_stream_closes(pair):
    """Closing with the server's data unread resets the connection, and the walsender's unread input (the
    confirmation sent just before) goes with it: close ends the copy first, so the slot has it."""
    slot = f"{pair.name}_slot"
    pair.src("CREATE TABLE items (id int PRIMARY KEY, pad text); CREATE PUBLICATION pub FOR TABLE items")
    with psycopg.connect(pair.source, autocommit=True) as src:
        capture.ensure_slot(src, slot)
        # Many transactions, ~40 MB of changes: far more than the socket's buffers hold.
        for i in range(20):
            src.execute("INSERT INTO items SELECT g, repeat('x', 200) FROM generate_series(%s::int, %s::int) g",
                        (i * 10_000 + 1, (i + 1) * 10_000))
        for _round in range(5):  # the race is the kernel's: each round is a fresh chance to lose it
            with ChangeStream(pair.source, slot, "pub", _slot(src, slot)) as stream:
                before = stream.boundary
                for _ in stream.messages(10_001, idle=5, max_seconds=30):
                    pass  # ends at the first commit after 10,001 messages: one transaction
                assert stream.boundary > before
                # Wait until the walsender is blocked on a full socket: its input is then read only between
                # writes, the case a close used to lose.
                wait_for(lambda: src.execute(
                    "SELECT sent_lsn > %s::pg_lsn FROM pg_stat_replication WHERE application_name = 'sluicegate'",
                    (format_lsn(stream.boundary + 1_000_000),)).fetchone()[0], 30, what="the walsender far ahead")
                stream.confirm(stream.boundary)
            wait_for(lambda: capture.slot_info(src, slot).active_pid is None, 30, what="the walsender gone")
            assert _slot(src, slot) == stream.boundary

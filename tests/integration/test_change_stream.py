"""The replication socket on a real walsender: the slot moves to the position confirmed, never further
(guarantee 7), whatever the server's keepalives say and whenever it asks for a reply."""

from __future__ import annotations

import psycopg
from psycopg import sql

from sluicegate.position import parse_lsn
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

"""Transaction messages from a real source with in-progress streaming (pgoutput protocol 2), and the PostgreSQL
applier of those messages: streamed segments before the commit, ROLLBACK, ROLLBACK_STATEMENT, exactly once."""

from __future__ import annotations

import psycopg

from sluicegate.appliers.transactions import TransactionApplier
from sluicegate.changes import model as m
from sluicegate.changes.segmenter import Segmenter
from sluicegate.postgres import capture
from sluicegate.postgres.assembler import Framing, assemble
from sluicegate.postgres.replication import ChangeStream
from tests.conftest import wait_for

BODY = "x" * 100


class Reader:
    """Transaction messages of a slot, read as they come (the walsender streams past 64 kB of changes)."""

    def __init__(self, url: str, slot: str, publication: str, start: int, threshold: int):
        self.stream = ChangeStream(url, slot, publication, start, streaming=True, decoding_work_mem="64kB")
        self.framing = Framing(streaming=True)
        self.segmenter = Segmenter("test", threshold=threshold, position=start)
        self.messages: list[m.Transaction] = []

    def pump(self) -> list[m.Transaction]:
        new = []
        raw = self.stream.messages(50_000, 0.2, 1.0)
        for ev in assemble(raw, self.framing):
            new.extend(self.segmenter.feed(ev))
        self.messages.extend(new)
        return new

    def until(self, lsn: int) -> None:
        wait_for(lambda: self.pump() is not None and self.segmenter.position >= lsn and not self.framing.block,
                 timeout=60, what=f"messages up to {lsn}")


def _setup(pair):
    pair.src("CREATE TABLE items (id int PRIMARY KEY, body text); CREATE TABLE other (id int PRIMARY KEY)")
    pair.dst("CREATE TABLE items (id int PRIMARY KEY, body text); CREATE TABLE other (id int PRIMARY KEY)")
    with psycopg.connect(pair.source, autocommit=True) as c:
        capture.ensure_publication(c, "pub", [_t(c, "items"), _t(c, "other")])
        return capture.ensure_slot(c, "sg_test")


def _t(conn, name):
    from sluicegate.postgres.catalog import describe_table

    return describe_table(conn, "public", name)


def _ids(msgs, xid=None, kind=m.INSERT):
    return {int(m.values(r.after)[0]) for x in msgs for s in x.statements
            if s.type == kind and (xid is None or s.subtransaction_id == xid) for r in s.rows}


def test_streamed_savepoint_rollback_and_abort_reach_the_target_as_if_never_written(pair):
    start = _setup(pair)
    reader = Reader(pair.source, "sg_test", "pub", start, threshold=16 << 10)
    with reader.stream:
        a = psycopg.connect(pair.source)
        a.execute("INSERT INTO items SELECT g, %s FROM generate_series(1, 3000) g", (BODY,))
        xid_a = int(a.execute("SELECT pg_current_xact_id()::text").fetchone()[0])
        # Segments of the open transaction arrive before its commit.
        wait_for(lambda: reader.pump() is not None and any(x.context.transaction_id == xid_a for x in reader.messages),
                 timeout=30, what="a streamed segment of the open transaction")
        early = [x for x in reader.messages if x.context.transaction_id == xid_a]
        assert all(x.context.streamed and not x.end_segment for x in early)
        a.execute("SAVEPOINT s1")
        a.execute("INSERT INTO items SELECT g, %s FROM generate_series(10001, 13000) g", (BODY,))
        # The savepoint's changes stream under its own (sub)transaction id.
        subs = lambda: {s.subtransaction_id for x in reader.messages for s in x.statements
                        if x.context.transaction_id == xid_a and s.subtransaction_id != xid_a}
        wait_for(lambda: reader.pump() is not None and subs(), timeout=30,
                 what="the savepoint's rows streamed before its rollback")
        (sub,) = subs()
        a.execute("ROLLBACK TO SAVEPOINT s1")
        a.execute("INSERT INTO items SELECT g, %s FROM generate_series(20001, 21000) g", (BODY,))
        a.commit()

        b = psycopg.connect(pair.source)
        b.execute("INSERT INTO items SELECT g, %s FROM generate_series(30001, 33000) g", (BODY,))
        xid_b = int(b.execute("SELECT pg_current_xact_id()::text").fetchone()[0])
        wait_for(lambda: reader.pump() is not None and _ids(reader.messages, xid_b), timeout=30,
                 what="a streamed segment of the transaction about to abort")
        b.rollback()
        pair.src("BEGIN; INSERT INTO items VALUES (50001, 'never'); ROLLBACK")
        pair.src("BEGIN; INSERT INTO items VALUES (40001, 'small'); UPDATE items SET body = 'changed' WHERE id = 1; "
                 "DELETE FROM items WHERE id = 2; INSERT INTO other VALUES (7); COMMIT")
        a.close()
        b.close()
        with psycopg.connect(pair.source) as c:
            end = capture.wal_flush_position(c)[0]
        reader.until(end)
    msgs = reader.messages

    # A: many segments (16 kB threshold), a ROLLBACK_STATEMENT naming the savepoint, then its commit.
    of_a = [x for x in msgs if x.context.transaction_id == xid_a]
    assert [x.segment_id for x in of_a] == list(range(1, len(of_a) + 1)) and len(of_a) > 10
    assert [x.end_segment for x in of_a] == [False] * (len(of_a) - 1) + [True]
    rb = [s for x in of_a for s in x.statements if s.type == m.ROLLBACK_STATEMENT]
    assert [s.subtransaction_id for s in rb] == [sub]
    assert _ids(of_a, sub) <= set(range(10001, 13001)) and _ids(of_a, sub)
    assert of_a[-1].context.commit_position and of_a[-1].context.position > of_a[-1].context.commit_position
    # B: streamed, then a ROLLBACK; the small aborted transaction never appears at all.
    of_b = [x for x in msgs if x.context.transaction_id == xid_b]
    assert of_b[-1].end_segment and [m.type_name(s.type) for s in of_b[-1].statements] == ["ROLLBACK"]
    assert 50001 not in _ids(msgs)
    assert all(len(x.SerializeToString()) <= 16 << 10 for x in msgs)

    applier = TransactionApplier(pair.target, name="t1")
    try:
        for x in msgs:
            applier.apply(x)
        want = pair.src("SELECT id, body FROM items ORDER BY id")
        assert pair.dst("SELECT id, body FROM items ORDER BY id") == want
        assert pair.dst("SELECT id FROM other") == [(7,)]
        assert not pair.dst("SELECT 1 FROM items WHERE id BETWEEN 10001 AND 13000 OR id >= 30001 AND id < 40000")
        position = applier.position()
        assert position == max(x.context.position for x in msgs if x.end_segment)
        # Everything again (a reader resuming from too early): nothing is applied twice.
        applied = applier.applied_transactions
        pair.dst("UPDATE items SET body = 'target only' WHERE id = 3")
        for x in msgs:
            applier.apply(x)
        assert applier.applied_transactions == applied and applier.position() == position
        assert pair.dst("SELECT body FROM items WHERE id = 3") == [("target only",)]
    finally:
        applier.close()

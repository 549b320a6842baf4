"""Golden tests of the change model's segmentation (pure: assembled events in, Transaction messages out)."""

from __future__ import annotations

import os
from datetime import datetime, timezone

import pytest

from sluicegate.changes import model as m
from sluicegate.changes.segmenter import Segmenter
from sluicegate.postgres.assembler import Change, TruncateChange
from sluicegate.postgres.pgoutput import (
    UNCHANGED,
    Begin,
    Column,
    Commit,
    Relation,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
)

T = datetime(2026, 11, 22, 12, 0, tzinfo=timezone.utc)
ACCOUNTS = Relation(16401, "public", "accounts", "d",
                    (Column(1, "id", 23, -1), Column(0, "owner", 25, -1), Column(0, "balance", 1700, -1)))
NOTES = Relation(16402, "app", "notes", "f", (Column(1, "id", 23, -1), Column(1, "body", 25, -1)))


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def shape(msgs):
    """(segment_id, end_segment, [(statement_id, type, segment_id, end_segment, rows)]) per message."""
    return [(x.segment_id, x.end_segment,
             [(s.statement_id, m.type_name(s.type), s.segment_id, s.end_segment, len(s.rows)) for s in x.statements])
            for x in msgs]


def run(seg, events):
    return [msg for ev in events for msg in seg.feed(ev)]


def three_statements():
    evs = [Begin(9000, T, 42)]
    evs += [Change("I", ACCOUNTS, None, (str(i), f"owner-{i:03d}", "10.00"), 100 + i) for i in range(60)]
    evs += [Change("U", ACCOUNTS, None, (str(i), f"owner-{i:03d}", "20.00"), 200 + i) for i in range(60)]
    evs += [Change("D", ACCOUNTS, (str(i), None, None), None, 300 + i) for i in range(60)]
    return evs + [Commit(0, 9000, 9100, T)]


def test_three_statement_transaction_under_a_large_threshold_is_one_message():
    msgs = run(Segmenter("src", threshold=1 << 20, position=50), three_statements())
    assert shape(msgs) == [(1, True, [(1, "INSERT", 1, True, 60), (2, "UPDATE", 1, True, 60),
                                      (3, "DELETE", 1, True, 60)])]
    ctx = msgs[0].context
    assert (ctx.transaction_id, ctx.position, ctx.commit_position, ctx.source_id) == (42, 9100, 9000, "src")
    assert ctx.end_time_us == ctx.start_time_us == m.micros(T)


def test_three_statement_transaction_segmented_at_2kb():
    seg = Segmenter("src", threshold=2048, position=50)
    msgs = run(seg, three_statements())
    assert shape(msgs) == [
        (1, False, [(1, "INSERT", 1, True, 60), (2, "UPDATE", 1, False, 4)]),
        (2, False, [(2, "UPDATE", 2, True, 56), (3, "DELETE", 1, False, 13)]),
        (3, True, [(3, "DELETE", 2, True, 47)]),
    ]
    assert all(len(x.SerializeToString()) <= 2048 for x in msgs)
    assert {x.context.transaction_id for x in msgs} == {42}
    # Earlier segments carry the resume point before the transaction; the last one its commit's end.
    assert all(len(x.SerializeToString()) > 2048 - 200 for x in msgs[:-1])  # and not much less: full
    assert [x.context.position for x in msgs] == [50, 50, 9100]
    assert [x.context.commit_position for x in msgs] == [0, 0, 9000]
    assert seg.position == 9100
    rows = [m.values(r.after) for x in msgs for s in x.statements if s.type == m.INSERT for r in s.rows]
    assert rows == [(str(i), f"owner-{i:03d}", "10.00") for i in range(60)]
    deleted = [m.values(r.before) for x in msgs for s in x.statements if s.type == m.DELETE for r in s.rows]
    assert deleted[0] == ("0", None, None)


def test_values_round_trip_and_json_shape():
    evs = [Begin(500, T, 7), Change("U", NOTES, ("1", "old"), ("1", UNCHANGED), 400),
           Change("I", ACCOUNTS, None, ("2", None, "1.50"), 410), TruncateChange((ACCOUNTS, NOTES), 420, 1),
           Commit(0, 500, 520, T)]
    (msg,) = run(Segmenter(), evs)
    assert m.values(msg.statements[0].rows[0].after) == ("1", UNCHANGED)
    j = m.to_json(msg)
    assert (j["transaction_id"], j["position"], j["segment_id"], j["end_segment"]) == (7, "0/208", 1, True)
    upd, ins, trunc = j["statements"]
    assert upd == {"type": "UPDATE", "table": "app.notes", "statement_id": 1, "segment_id": 1, "end_segment": True,
                   "subtransaction_id": 7, "key": ["id", "body"],
                   "rows": [{"before": {"id": "1", "body": "old"}, "after": {"id": "1"}}]}  # unchanged: left out
    assert ins["rows"] == [{"before": None, "after": {"id": "2", "owner": None, "balance": "1.50"}}]
    assert (trunc["type"], trunc["tables"], trunc["cascade"], trunc["restart_identity"]) == (
        "TRUNCATE", ["public.accounts", "app.notes"], True, False)


def test_a_million_row_statement_in_bounded_memory():
    """UPDATE person SET is_active = 'N' over 1M rows (Drizzle's example): one statement in many segments."""
    threshold = 64 << 10
    seg = Segmenter("src", threshold=threshold)
    n = 1_000_000
    count = rows = 0
    last = None
    grown = 0
    rss = _rss()
    def events():
        yield Begin(10 ** 9, T, 4242)
        for i in range(n):
            yield Change("U", ACCOUNTS, None, (str(i), "Ada Lovelace", "N"), 1000 + i)
        yield Commit(0, 10 ** 9, 10 ** 9 + 64, T)

    for ev in events():
        for msg in seg.feed(ev):
            count += 1
            assert msg.segment_id == count and msg.end_segment == (msg.context.commit_position != 0)
            assert len(msg.SerializeToString()) <= threshold
            (st,) = msg.statements
            assert (st.statement_id, st.segment_id, st.type) == (1, count, m.UPDATE)
            assert st.end_segment == msg.end_segment
            first = int(st.rows[0].after.values[0])
            assert first == rows  # rows continue in order, none lost or repeated
            rows += len(st.rows)
            last = msg
            if count % 100 == 0:
                grown = max(grown, _rss() - rss)
    assert rows == n and count > 400 and last.end_segment and last.context.position == 10 ** 9 + 64
    # 1M rows are ~30 MB of messages: holding them would show; one message under construction does not.
    assert grown < 12 << 20, f"RSS grew by {grown} bytes: memory must not grow with the statement"


def test_streamed_transaction_goes_out_before_its_commit_and_interleaves():
    seg = Segmenter("src", threshold=1 << 20, position=10)
    out = run(seg, [StreamStart(77, True)] + [Change("I", ACCOUNTS, None, (str(i), "a", "1"), 100 + i, xid=77)
                                              for i in range(3)] + [StreamStop()])
    assert shape(out) == [(1, False, [(1, "INSERT", 1, True, 3)])]
    assert out[0].context.streamed and out[0].context.position == 10
    # A small transaction commits while 77 is still open: it goes out whole, and moves the resume point.
    out = run(seg, [Begin(300, T, 78), Change("D", ACCOUNTS, ("9", None, None), None, 290), Commit(0, 300, 310, T)])
    assert shape(out) == [(1, True, [(1, "DELETE", 1, True, 1)])] and out[0].context.position == 310
    out = run(seg, [StreamStart(77, False), Change("I", ACCOUNTS, None, ("3", "a", "1"), 400, xid=77), StreamStop(),
                    StreamCommit(77, 0, 500, 510, T)])
    assert shape(out) == [(2, False, [(2, "INSERT", 1, True, 1)]), (3, True, [])]
    assert out[-1].context.position == 510 and out[-1].context.commit_position == 500
    assert seg.position == 510


def test_streamed_then_aborted_transaction_yields_rollback():
    seg = Segmenter("src", position=10)
    out = run(seg, [StreamStart(90, True), Change("I", ACCOUNTS, None, ("1", "a", "1"), 100, xid=90), StreamStop()])
    assert len(out) == 1
    out = run(seg, [StreamAbort(90, 90)])
    assert shape(out) == [(2, True, [(2, "ROLLBACK", 1, True, 0)])]
    assert seg.position == 10  # an aborted transaction moves nothing


def test_savepoint_rollback_yields_rollback_statement_for_its_changes_only():
    seg = Segmenter("src", position=10)
    block1 = [StreamStart(90, True), Change("I", ACCOUNTS, None, ("1", "a", "1"), 100, xid=90),
              Change("I", ACCOUNTS, None, ("2", "b", "1"), 110, xid=91), StreamStop()]
    assert shape(run(seg, block1)) == [(1, False, [(1, "INSERT", 1, True, 1), (2, "INSERT", 1, True, 1)])]
    block2 = [StreamStart(90, False), Change("I", ACCOUNTS, None, ("3", "c", "1"), 120, xid=91),
              Change("I", ACCOUNTS, None, ("4", "d", "1"), 130, xid=92), StreamStop()]
    assert shape(run(seg, block2)) == [(2, False, [(3, "INSERT", 1, True, 1), (4, "INSERT", 1, True, 1)])]
    # ROLLBACK TO SAVEPOINT of 91 (after its changes went out): the reader is told to undo 91's statements only.
    out = run(seg, [StreamAbort(90, 91)])
    assert shape(out) == [(3, False, [(5, "ROLLBACK_STATEMENT", 1, True, 0)])]
    assert out[0].statements[0].subtransaction_id == 91
    out = run(seg, [StreamStart(90, False), Change("I", ACCOUNTS, None, ("5", "e", "1"), 140, xid=90), StreamStop(),
                    StreamCommit(90, 0, 600, 610, T)])
    assert shape(out) == [(4, False, [(6, "INSERT", 1, True, 1)]), (5, True, [])]
    assert out[-1].context.position == 610


def test_unsent_savepoint_rollback_leaves_no_trace_and_table_filter():
    seg = Segmenter("src", tables={("public", "accounts")})
    evs = [StreamStart(90, True), Change("I", NOTES, None, ("1", "x"), 90, xid=90),
           Change("I", ACCOUNTS, None, ("1", "a", "1"), 100, xid=91), StreamAbort(90, 91)]
    with pytest.raises(ValueError):  # an abort inside a block is a framing error of the caller, not ours
        run(seg, evs[:1] + [StreamStop(), StreamAbort(90, 91)] + [Change("I", ACCOUNTS, None, ("1", "a", "1"), 1)])
    seg = Segmenter("src", tables={("public", "accounts")})
    out = run(seg, evs[:3] + [StreamAbort(90, 91), StreamStop(), StreamCommit(90, 0, 200, 210, T)])
    assert out == []  # notes filtered out, 91's change dropped before it was sent: nothing to tell


def test_threshold_must_leave_room():
    with pytest.raises(ValueError, match="at least 1024"):
        Segmenter(threshold=100)


def test_changed_columns_yield_schema_change_before_the_rows():
    seg = Segmenter()
    run(seg, [Begin(100, T, 1), Change("I", ACCOUNTS, None, ("1", "a", "1"), 90), Commit(0, 100, 110, T)])
    same = Relation(ACCOUNTS.oid, "public", "accounts", "d", ACCOUNTS.columns)  # re-sent after a TRUNCATE
    (msg,) = run(seg, [Begin(200, T, 2), Change("I", same, None, ("2", "b", "1"), 190), Commit(0, 200, 210, T)])
    assert [m.type_name(s.type) for s in msg.statements] == ["INSERT"]
    wider = Relation(ACCOUNTS.oid, "public", "accounts", "d", ACCOUNTS.columns + (Column(0, "note", 25, -1),))
    (msg,) = run(seg, [Begin(300, T, 3), Change("I", wider, None, ("3", "c", "1", "x"), 290), Commit(0, 300, 310, T)])
    assert shape([msg]) == [(1, True, [(1, "SCHEMA_CHANGE", 1, True, 0), (2, "INSERT", 1, True, 1)])]
    assert [c.name for c in msg.statements[0].table.columns] == ["id", "owner", "balance", "note"]

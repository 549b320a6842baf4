"""The filter replicator (Drizzle's filtered replicator): tables, schemas, exclusions, columns, rollbacks."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from sluicegate.changes import model as m
from sluicegate.changes.plugins import load_replicator
from sluicegate.changes.replicators import FilterReplicator
from sluicegate.changes.segmenter import Segmenter
from sluicegate.errors import UsageError
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
USERS = Relation(1, "public", "users", "d",
                 (Column(1, "id", 23, -1), Column(0, "name", 25, -1), Column(0, "ssn", 25, -1)))
ORDERS = Relation(2, "public", "orders", "d", (Column(1, "id", 23, -1), Column(0, "total", 1700, -1)))
ORDER_LINES = Relation(3, "public", "order_lines", "d", (Column(1, "id", 23, -1), Column(0, "qty", 23, -1)))
NOTES = Relation(4, "app", "notes", "f", (Column(1, "id", 23, -1), Column(1, "body", 25, -1)))


def messages(events, threshold=1 << 20):
    seg = Segmenter("src", threshold=threshold, position=10)
    return [msg for ev in events for msg in seg.feed(ev)]


def mixed():
    """One transaction touching every table, including a key-changing update and a delete."""
    return messages([
        Begin(900, T, 42),
        Change("I", USERS, None, ("1", "ann", "111-11"), 100),
        Change("U", USERS, ("1", None, None), ("2", "ann", "222-22"), 110),  # the key changed: before is sent
        Change("I", ORDERS, None, ("7", "9.50"), 120),
        Change("I", ORDER_LINES, None, ("70", "3"), 130),
        Change("I", NOTES, None, ("5", "hi"), 140),
        Change("D", USERS, ("2", None, None), None, 150),
        TruncateChange((ORDERS, NOTES), 160, 1),
        Commit(0, 900, 910, T),
    ])


def tables_of(msg):
    return [(m.type_name(st.type), f"{st.table.schema}.{st.table.name}" if st.table.name else
             ",".join(f"{t.schema}.{t.name}" for t in st.truncated)) for st in msg.statements]


def test_tables_globs_schemas_and_exclusions():
    (msg,) = mixed()
    every = tables_of(msg)
    assert tables_of(FilterReplicator().replicate(msg)) == every
    assert tables_of(FilterReplicator(tables="public.users").replicate(msg)) == [
        ("INSERT", "public.users"), ("UPDATE", "public.users"), ("DELETE", "public.users")]
    # A bare name is schema public; globs match schema and name apart; TRUNCATE keeps the kept tables only.
    assert tables_of(FilterReplicator(tables="order*").replicate(msg)) == [
        ("INSERT", "public.orders"), ("INSERT", "public.order_lines"), ("TRUNCATE", "public.orders")]
    assert tables_of(FilterReplicator(tables="orders;*.notes").replicate(msg)) == [
        ("INSERT", "public.orders"), ("INSERT", "app.notes"), ("TRUNCATE", "public.orders,app.notes")]
    assert tables_of(FilterReplicator(schemas="app").replicate(msg)) == [
        ("INSERT", "app.notes"), ("TRUNCATE", "app.notes")]
    assert tables_of(FilterReplicator(schemas="app", tables="users").replicate(msg)) == [
        ("INSERT", "public.users"), ("UPDATE", "public.users"), ("INSERT", "app.notes"),
        ("DELETE", "public.users"), ("TRUNCATE", "app.notes")]
    assert tables_of(FilterReplicator(schemas="public", exclude_tables="users;order_*").replicate(msg)) == [
        ("INSERT", "public.orders"), ("TRUNCATE", "public.orders")]
    assert FilterReplicator(tables="nothing_here").replicate(msg) is None


def test_a_new_message_and_the_input_untouched():
    (msg,) = mixed()
    before = msg.SerializeToString()
    out = FilterReplicator(tables="users", columns="users.ssn").replicate(msg)
    assert msg.SerializeToString() == before
    assert out is not msg
    assert (out.context, out.segment_id, out.end_segment) == (msg.context, msg.segment_id, msg.end_segment)
    assert [st.statement_id for st in out.statements] == [1, 2, 6]


def test_columns_are_removed_from_header_and_every_record():
    (msg,) = mixed()
    out = FilterReplicator(columns="public.users.ssn;notes.nothing;*.order*.qty").replicate(msg)
    users = [st for st in out.statements if st.table.name == "users"]
    for st in users:
        assert [c.name for c in st.table.columns] == ["id", "name"]
    ins, upd, dele = users
    assert m.values(ins.rows[0].after) == ("1", "ann")
    assert m.values(upd.rows[0].before) == ("1", None) and m.values(upd.rows[0].after) == ("2", "ann")
    assert m.values(dele.rows[0].before) == ("2", None) and not dele.rows[0].HasField("after")
    lines = next(st for st in out.statements if st.table.name == "order_lines")
    assert [c.name for c in lines.table.columns] == ["id"] and m.values(lines.rows[0].after) == ("70",)
    orders = next(st for st in out.statements if st.table.name == "orders")
    assert m.values(orders.rows[0].after) == ("7", "9.50")  # a column pattern of another table leaves it alone
    assert m.to_json(out)["statements"][0]["rows"][0]["after"] == {"id": "1", "name": "ann"}


def test_removed_columns_renumber_nulls_unchanged_and_binary_values():
    wide = Relation(9, "public", "wide", "d", tuple(Column(int(n == "id"), n, 25, -1)
                                                    for n in ("id", "secret", "toasted", "raw", "empty")))
    (msg,) = messages([Begin(9, T, 7), Change("U", wide, None, ("1", "s", UNCHANGED, b"\x01\x02", None), 5),
                       Commit(0, 9, 10, T)])
    out = FilterReplicator(columns="wide.secret").replicate(msg)
    assert m.values(out.statements[0].rows[0].after) == ("1", UNCHANGED, b"\x01\x02", None)
    out = FilterReplicator(columns="wide.secret;wide.toasted;wide.empty").replicate(msg)
    assert [c.name for c in out.statements[0].table.columns] == ["id", "raw"]
    assert m.values(out.statements[0].rows[0].after) == ("1", b"\x01\x02")
    assert m.values(msg.statements[0].rows[0].after) == ("1", "s", UNCHANGED, b"\x01\x02", None)


def test_a_key_column_is_never_removed():
    (msg,) = mixed()
    with pytest.raises(UsageError, match=r"public\.users\.id is a key column of public\.users"):
        FilterReplicator(columns="users.id").replicate(msg)
    # Under REPLICA IDENTITY FULL every column is a key column.
    with pytest.raises(UsageError, match=r"app\.notes\.body is a key column"):
        FilterReplicator(columns="app.notes.body").replicate(msg)


def test_rollbacks_always_pass():
    out = messages([StreamStart(90, True), Change("I", USERS, None, ("1", "a", "x"), 100, xid=90),
                    Change("I", USERS, None, ("2", "b", "y"), 110, xid=91), StreamStop(),
                    StreamAbort(90, 91), StreamAbort(90, 90)])
    assert [[m.type_name(st.type) for st in x.statements] for x in out] == [
        ["INSERT", "INSERT"], ["ROLLBACK_STATEMENT"], ["ROLLBACK"]]
    f = FilterReplicator(tables="orders")
    got = [f.replicate(x) for x in out]
    assert got[0] is None
    assert [st.type for st in got[1].statements] == [m.ROLLBACK_STATEMENT]
    assert [st.type for st in got[2].statements] == [m.ROLLBACK] and got[2].end_segment


def test_empty_messages_are_dropped_unless_they_end_what_was_passed():
    f = FilterReplicator(tables="orders")
    # A transaction cut into segments: users, users, then orders, then users again at the end.
    events = [Begin(900, T, 50)]
    events += [Change("I", USERS, None, (str(i), "n" * 20, "s"), 100 + i) for i in range(40)]
    events += [Change("I", ORDERS, None, ("1", "1.00"), 200)]
    events += [Change("I", USERS, None, (str(i), "n" * 20, "s"), 300 + i) for i in range(40)]
    events.append(Commit(0, 900, 910, T))
    msgs = messages(events, threshold=1024)
    kinds = [sorted({st.table.name for st in x.statements}) for x in msgs]
    assert len(msgs) >= 4 and kinds[0] == ["users"] and kinds[-1] == ["users"]
    got = [f.replicate(x) for x in msgs]
    passed = [x for x in got if x is not None]
    # Only the segment with the order, and the transaction's (now empty) end the reader needs to close it.
    assert [tables_of(x) for x in passed] == [[("INSERT", "public.orders")], []]
    assert passed[-1].end_segment and passed[-1].context.position == 910
    # The same transaction without any order: nothing at all goes on, its end included.
    none = [f.replicate(x) for x in messages(events[:41] + events[-1:], threshold=1024)]
    assert none and all(x is None for x in none)
    # A single-message transaction left empty goes too.
    assert f.replicate(messages([Begin(5, T, 51), Change("I", USERS, None, ("1", "a", "b"), 1),
                                 Commit(0, 5, 6, T)])[0]) is None
    # A streamed transaction: blocks of other transactions between its segments do not confuse it.
    streamed = messages([StreamStart(60, True), Change("I", ORDERS, None, ("1", "1"), 10, xid=60), StreamStop(),
                         StreamStart(61, True), Change("I", USERS, None, ("1", "a", "b"), 11, xid=61), StreamStop(),
                         StreamCommit(61, 0, 20, 21, T), StreamCommit(60, 0, 30, 31, T)])
    got = [f.replicate(x) for x in streamed]
    assert [(x.context.transaction_id, x.end_segment) for x in got if x is not None] == [(60, False), (60, True)]


def test_spec_options_and_names():
    f = load_replicator("filter:tables=public.users;orders,columns=users.ssn")
    assert f.tables == [("public", "users"), ("public", "orders")] and f.columns == [("public", "users", "ssn")]
    with pytest.raises(UsageError, match="bad option 'orders'"):
        load_replicator("filter:tables=users,orders")  # ',' separates options: lists take ';'
    with pytest.raises(UsageError, match=r"'a\.b\.c' is not schema\.table or table"):
        FilterReplicator(tables="a.b.c")
    with pytest.raises(UsageError, match=r"'ssn' is not schema\.table\.column"):
        FilterReplicator(columns="ssn")
    with pytest.raises(UsageError, match="unknown replicator 'filtr': did you mean 'filter'"):
        load_replicator("filtr")
    with pytest.raises(UsageError, match="unexpected keyword argument 'table'"):
        load_replicator("filter:table=users")

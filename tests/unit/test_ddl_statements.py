"""Captured DDL in the change model (pure): DdlMessage -> DDL Statement, which streamed tables it touches, and
its place among the rows in the Segmenter's Transaction messages."""

from __future__ import annotations

import json
import struct
from datetime import datetime, timezone

import pytest

from sluicegate.changes import ddl
from sluicegate.changes import model as m
from sluicegate.changes.replicators import FilterReplicator
from sluicegate.changes.segmenter import Segmenter
from sluicegate.cli.log import statement_summary
from sluicegate.ddl.message import PREFIX, parse
from sluicegate.errors import TerminalError
from sluicegate.postgres.assembler import Change, Framing, StreamedMessage, assemble
from sluicegate.postgres.pgoutput import (
    Begin,
    Column,
    Commit,
    LogicalMessage,
    Relation,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
)

T = datetime(2026, 11, 27, 12, 0, tzinfo=timezone.utc)
ITEMS = Relation(16401, "public", "items", "d", (Column(1, "id", 23, -1), Column(0, "v", 25, -1)))
ITEMS2 = Relation(16401, "public", "items", "d",
                  (Column(1, "id", 23, -1), Column(0, "v", 25, -1), Column(0, "note", 25, -1)))
PATH = '"$user", public'


def _obj(object_type, identity, table, schema="public", name=None):
    return {"object_type": object_type, "schema": schema, "identity": identity, "table": table, "name": name}


def _content(tag, statement, objects, event="ddl_command_end") -> bytes:
    return json.dumps({"format": 1, "event": event, "tag": tag, "statement": statement, "search_path": PATH,
                       "objects": objects}).encode()


def message(tag, statement, objects, lsn=0x500, event="ddl_command_end") -> LogicalMessage:
    return LogicalMessage(1, lsn, PREFIX, _content(tag, statement, objects, event))


def add_column(table="items", lsn=0x500) -> LogicalMessage:
    return message("ALTER TABLE", f"ALTER TABLE {table} ADD COLUMN note text",
                   [_obj("table", f"public.{table}", ["public", table])], lsn)


def streams_items(schema, name):
    return (schema, name) == ("public", "items")


def test_statement_carries_text_tag_search_path_tables_and_place():
    msg = parse(add_column().content, 0x500)
    st = ddl.statement(msg, [("public", "items")], statement_id=3, subtransaction_id=42)
    assert (m.type_name(st.type), st.statement_id, st.segment_id, st.end_segment) == ("DDL", 3, 1, True)
    assert (st.subtransaction_id, st.start_position) == (42, 0x500)
    assert (st.ddl.tag, st.ddl.sql, st.ddl.search_path) == ("ALTER TABLE", "ALTER TABLE items ADD COLUMN note text",
                                                            PATH)
    assert [(t.schema, t.name) for t in st.ddl.tables] == [("public", "items")]
    assert not st.HasField("table") and not st.rows  # old readers see a statement with no table and no rows
    again = m.Statement.FromString(st.SerializeToString())
    assert again == st
    txn = m.Transaction(statements=[st], segment_id=1, end_segment=True)
    assert m.to_json(txn)["statements"][0] == {
        "type": "DDL", "table": None, "statement_id": 3, "segment_id": 1, "end_segment": True,
        "subtransaction_id": 42, "rows": [], "tables": ["public.items"], "tag": "ALTER TABLE",
        "sql": "ALTER TABLE items ADD COLUMN note text", "search_path": PATH}
    assert statement_summary(st) == "DDL ALTER TABLE public.items"


@pytest.mark.parametrize("tag,statement,objects,event,expected", [
    ("CREATE INDEX", "CREATE INDEX items_v ON items (v)",
     [_obj("index", "public.items_v", ["public", "items"])], "ddl_command_end", [("public", "items")]),
    ("ALTER TABLE", "ALTER TABLE other ADD x int", [_obj("table", "public.other", ["public", "other"])],
     "ddl_command_end", []),
    ("DROP TABLE", "DROP TABLE items, other", [_obj("table", "public.items", None, name="items"),
                                               _obj("table", "public.other", None, name="other")],
     "sql_drop", [("public", "items")]),
    ("DROP INDEX", "DROP INDEX items_v", [_obj("index", "public.items_v", None, name="items_v")], "sql_drop", []),
    ("ALTER TABLE", "ALTER TABLE items RENAME TO things", [_obj("table", "public.things", ["public", "things"])],
     "ddl_command_end", [("public", "items")]),
    ("CREATE TABLE", "CREATE TABLE fresh (id int)", [_obj("table", "public.fresh", ["public", "fresh"])],
     "ddl_command_end", []),
])
def test_touched_streamed_tables(tag, statement, objects, event, expected):
    msg = parse(_content(tag, statement, objects, event), 1)
    assert ddl.touched(msg, streams_items) == expected


def test_create_table_in_a_streamed_schema():
    msg = parse(_content("CREATE TABLE", "CREATE TABLE fresh (id int)",
                         [_obj("table", "public.fresh", ["public", "fresh"])]), 1)
    assert ddl.touched(msg, streams_items, {"public"}) == [("public", "fresh")]
    assert ddl.touched(msg, streams_items, {"app"}) == []


def shape(msgs):
    return [(x.segment_id, x.end_segment, [(s.statement_id, m.type_name(s.type), len(s.rows)) for s in x.statements])
            for x in msgs]


def run(seg, events):
    return [msg for ev in events for msg in seg.feed(ev)]


def test_ddl_between_rows_keeps_its_place():
    events = [Begin(0x900, T, 42),
              Change("I", ITEMS, None, ("1", "a"), 0x400),
              add_column(lsn=0x500),
              Change("I", ITEMS2, None, ("2", "b", "n"), 0x600),
              Commit(0, 0x900, 0x910, T)]
    msgs = run(Segmenter("src", position=0x100), events)
    assert shape(msgs) == [(1, True, [(1, "INSERT", 1), (2, "DDL", 0), (3, "SCHEMA_CHANGE", 0), (4, "INSERT", 1)])]
    sts = msgs[0].statements
    assert [c.name for c in sts[0].table.columns] == ["id", "v"]
    assert [c.name for c in sts[3].table.columns] == ["id", "v", "note"]
    assert sts[1].subtransaction_id == 42 and sts[1].start_position == 0x500


def test_a_transaction_of_ddl_only_is_sent_and_one_on_other_tables_is_not():
    seg = Segmenter("src", tables={("public", "items")})
    msgs = run(seg, [Begin(0x900, T, 42), add_column(), Commit(0, 0x900, 0x910, T),
                     Begin(0xA00, T, 43), add_column("other", 0x980), Commit(0, 0xA00, 0xA10, T)])
    assert shape(msgs) == [(1, True, [(1, "DDL", 0)])]
    assert msgs[0].context.position == 0x910 and seg.position == 0xA10


def test_a_reader_of_a_whole_publication():
    """Without a table list: the publication's tables (and those met in rows); CREATE TABLE in their schemas."""
    seg = Segmenter("src", published={("app", "notes")})
    notes = Relation(16402, "app", "notes", "d", (Column(1, "id", 23, -1),))
    create = message("CREATE TABLE", "CREATE TABLE app.fresh (id int)",
                     [_obj("table", "app.fresh", ["app", "fresh"], schema="app")])
    msgs = run(seg, [Begin(0x900, T, 42), add_column(), Change("I", ITEMS, None, ("1", "a"), 0x600),
                     add_column(lsn=0x700), create, Commit(0, 0x900, 0x910, T)])
    # items was not published at the start: its first ALTER is passed over; its rows make it streamed
    assert shape(msgs) == [(1, True, [(1, "INSERT", 1), (2, "DDL", 0), (3, "DDL", 0)])]
    assert [t.name for t in msgs[0].statements[2].ddl.tables] == ["fresh"]
    assert run(seg, [Begin(0xA00, T, 43), Change("I", notes, None, ("1",), 0x980), Commit(0, 0xA00, 0xA10, T)])


def test_a_renamed_table_streams_on_under_its_new_name():
    seg = Segmenter("src", tables={("public", "items")})
    rename = message("ALTER TABLE", "ALTER TABLE items RENAME TO things",
                     [_obj("table", "public.things", ["public", "things"])])
    things = Relation(16401, "public", "things", "d", ITEMS.columns)
    msgs = run(seg, [Begin(0x900, T, 42), rename, Change("I", things, None, ("1", "a"), 0x600),
                     Commit(0, 0x900, 0x910, T)])
    assert shape(msgs) == [(1, True, [(1, "DDL", 0), (2, "INSERT", 1)])]
    assert [(t.schema, t.name) for t in msgs[0].statements[0].ddl.tables] == [("public", "items")]
    assert msgs[0].statements[1].table.name == "things"


def test_ddl_in_a_streamed_transaction_follows_its_subtransaction():
    """Protocol 2: a DDL statement of a subtransaction rolled back (ROLLBACK TO SAVEPOINT) goes with it."""
    seg = Segmenter("src")
    msgs = run(seg, [StreamStart(42, True), StreamedMessage(add_column(lsn=0x500), 42),
                     StreamedMessage(add_column(lsn=0x600), 50), StreamAbort(42, 50),
                     StreamStop(), StreamCommit(42, 0, 0x900, 0x910, T)])
    assert shape(msgs) == [(1, False, [(1, "DDL", 0)]), (2, True, [])]
    assert msgs[0].statements[0].subtransaction_id == 42


def test_the_assembler_yields_messages_of_a_stream_block_with_their_xid():
    content = _content("ALTER TABLE", "ALTER TABLE items ADD x int", [])
    streamed = (b"M" + struct.pack(">IBQ", 50, 1, 0x500) + PREFIX.encode() + b"\0"
                + struct.pack(">I", len(content)) + content)
    raw = [(1, b"S" + struct.pack(">IB", 42, 1)), (2, streamed), (3, b"E")]
    events = list(assemble(raw, Framing(streaming=True), messages=PREFIX))
    found = [e for e in events if isinstance(e, StreamedMessage)]
    assert len(found) == 1 and found[0].xid == 50 and found[0].message.content == content
    assert not [e for e in assemble(raw, Framing(streaming=True)) if isinstance(e, StreamedMessage)]


def test_an_unreadable_ddl_message_stops_with_the_way_out():
    bad = LogicalMessage(1, 0x500, PREFIX, b'{"format": 99}')
    with pytest.raises(TerminalError, match="ddl install.*ddl remove"):
        run(Segmenter("src"), [Begin(0x900, T, 42), bad])


def test_filter_replicator_keeps_ddl_of_kept_tables():
    msg = parse(add_column().content, 0x500)
    keep = ddl.statement(msg, [("public", "items")], 1, 42)
    drop = ddl.statement(parse(add_column("other").content, 0x600), [("public", "other")], 2, 42)
    txn = m.Transaction(statements=[keep, drop], segment_id=1, end_segment=True)
    out = FilterReplicator(tables="public.items").replicate(txn)
    assert [s.ddl.tables[0].name for s in out.statements] == ["items"]
    assert FilterReplicator(tables="public.items").replicate(
        m.Transaction(statements=[keep], segment_id=1, end_segment=True)).statements[0] == keep


def test_rows_of_a_renamed_table_get_its_new_name_without_capture_too():
    things = Relation(16401, "public", "things", "d", ITEMS.columns)
    msgs = run(Segmenter("src"), [Begin(0x900, T, 42), Change("I", ITEMS, None, ("1", "a"), 0x400),
                                  Change("I", things, None, ("2", "b"), 0x600), Commit(0, 0x900, 0x910, T)])
    assert [(s.statement_id, s.table.name, len(s.rows)) for s in msgs[0].statements] == [(1, "items", 1),
                                                                                      (2, "things", 1)]

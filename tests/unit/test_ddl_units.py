"""The DDL capture's pure parts: the message's JSON, the statement's text (one statement? which command?),
and the assembler handing logical messages over in their place. No server."""

from __future__ import annotations

import json
import struct

import pytest

from sluicegate.ddl import both_ways
from sluicegate.ddl.message import BadDdlMessage, parse
from sluicegate.ddl.statement import NotReplayable, read, statements, without_concurrently
from sluicegate.postgres.assembler import assemble
from sluicegate.postgres.pgoutput import LogicalMessage


def _doc(**over):
    doc = {"format": 1, "event": "ddl_command_end", "tag": "ALTER TABLE", "statement": "ALTER TABLE t ADD x int",
           "search_path": '"$user", public',
           "objects": [{"object_type": "table", "schema": "public", "identity": "public.t", "table": ["public", "t"]}]}
    doc.update(over)
    return json.dumps(doc).encode()


def test_message_parses():
    m = parse(_doc(), 0x16B3748)
    assert m.tag == "ALTER TABLE" and m.tables() == {("public", "t")} and m.search_path == '"$user", public'


def test_message_of_another_format_or_broken_is_refused():
    with pytest.raises(BadDdlMessage, match="format 2"):
        parse(_doc(format=2), 1)
    with pytest.raises(BadDdlMessage, match="not JSON"):
        parse(b"{", 1)
    with pytest.raises(BadDdlMessage, match="lacks"):
        parse(json.dumps({"format": 1, "event": "x"}).encode(), 1)


def test_statements_split_only_at_top_level_semicolons():
    text = """ALTER TABLE t ADD c text DEFAULT 'a;b' ;  -- x; y
              /* c; /* nested; */ */ SELECT $$;$$, $q$ ; $q$, E'\\';', "we;ird" ;"""
    assert statements(text) == ["ALTER TABLE t ADD c text DEFAULT 'a;b'",
                                """SELECT $$;$$, $q$ ; $q$, E'\\';', "we;ird\""""]
    assert statements("ALTER TABLE t ADD x int;  -- done\n") == ["ALTER TABLE t ADD x int"]


def test_read_refuses_several_statements_and_wrapped_commands():
    with pytest.raises(NotReplayable, match="2 statements"):
        read("ALTER TABLE t ADD x int; UPDATE t SET x = 1", "ALTER TABLE")
    with pytest.raises(NotReplayable, match="inside a function"):
        read("DO $$ BEGIN EXECUTE 'ALTER TABLE t ADD x int'; END $$", "ALTER TABLE")
    with pytest.raises(NotReplayable, match="cannot be read"):
        read("ALTER TABLE t ADD c text DEFAULT 'open", "ALTER TABLE")


@pytest.mark.parametrize(("text", "adds"), [
    ("ALTER TABLE t ADD COLUMN a int DEFAULT 0", True),
    ("alter table only public.t add a numeric(10, 2), add column if not exists b text", True),
    ('ALTER TABLE "T" ADD "Col" int', True),
    ("ALTER TABLE t ADD CONSTRAINT c CHECK (a > 0)", False),
    ("ALTER TABLE t ADD UNIQUE (a)", False),
    ("ALTER TABLE t ADD a int, DROP COLUMN b", False),
    ("ALTER TABLE t RENAME COLUMN a TO b", False),
    ("ALTER TABLE t ALTER a TYPE bigint USING a::bigint", False),
])
def test_alter_table_that_only_adds_columns(text, adds):
    s = read(text, "ALTER TABLE")
    assert s.kind == "alter table" and s.adds_columns_only is adds


def test_index_statements_and_concurrently():
    s = read("create unique index concurrently if not exists i on t (a)", "CREATE INDEX")
    assert s.kind == "create index" and s.concurrently
    assert without_concurrently(s.text) == "create unique index if not exists i on t (a)"
    d = read("DROP INDEX CONCURRENTLY public.i", "DROP INDEX")
    assert d.kind == "drop index" and without_concurrently(d.text) == "DROP INDEX public.i"
    assert read("CREATE TYPE e AS ENUM ('a')", "CREATE TYPE").kind == "create type"
    assert read("ALTER TYPE e ADD VALUE IF NOT EXISTS 'b'", "ALTER TYPE").adds_value
    assert not read("ALTER TYPE e RENAME VALUE 'a' TO 'c'", "ALTER TYPE").adds_value
    assert read("CREATE SEQUENCE s", "CREATE SEQUENCE").kind == "create sequence"
    assert read("DROP TYPE e", "DROP TYPE").kind == "drop type"
    assert read("CREATE FUNCTION f() RETURNS int AS 'select 1' LANGUAGE sql", "CREATE FUNCTION").kind == "other"


def _begin(final_lsn: int, xid: int = 7) -> bytes:
    return b"B" + struct.pack(">QqI", final_lsn, 0, xid)


def _commit(lsn: int) -> bytes:
    return b"C" + struct.pack(">BQQq", 0, lsn, lsn + 8, 0)


def _message(prefix: str, content: bytes, transactional: bool = True) -> bytes:
    return b"M" + struct.pack(">BQ", int(transactional), 0x100) + prefix.encode() + b"\0" + \
        struct.pack(">I", len(content)) + content


def test_assembler_yields_the_prefix_messages_of_a_transaction_only_when_asked():
    raw = [(1, _message("sluicegate.ddl", b"{}", transactional=False)), (2, _begin(0x200)),
           (3, _message("other", b"x")), (4, _message("sluicegate.ddl", b"{}")), (5, _commit(0x200))]
    events = list(assemble(raw, messages="sluicegate.ddl"))
    found = [e for e in events if isinstance(e, LogicalMessage)]
    assert len(found) == 1 and found[0].prefix == "sluicegate.ddl" and found[0].content == b"{}"
    assert not [e for e in assemble(raw) if isinstance(e, LogicalMessage)]


@pytest.mark.parametrize("text,expected", [
    ("ALTER TABLE orders RENAME TO orders_old", (None, "orders", "orders_old")),
    ('ALTER TABLE IF EXISTS ONLY sales."Big Orders" RENAME TO "Old Orders"', ("sales", "Big Orders", "Old Orders")),
    ("alter table Public.Orders rename to Archive", ("public", "orders", "archive")),
    ("ALTER TABLE orders RENAME COLUMN a TO b", None),
    ("ALTER TABLE orders RENAME a TO b", None),
    ("ALTER TABLE orders RENAME CONSTRAINT c TO d", None),
    ("ALTER TABLE orders ADD COLUMN x int", None),
])
def test_table_rename_is_read_from_the_statement(text, expected):
    assert read(text, "ALTER TABLE").renames_table == expected


def test_create_and_drop_table_are_replayable_kinds():
    assert read("CREATE TABLE t (id int PRIMARY KEY)", "CREATE TABLE").kind == "create table"
    drop = read("DROP TABLE IF EXISTS a, b CASCADE", "DROP TABLE")
    assert drop.kind == "drop table" and drop.cascade
    assert not read("DROP TABLE a", "DROP TABLE").cascade
    with pytest.raises(NotReplayable):  # unlogged: its rows are not in the WAL; the tag differs anyway
        read("CREATE UNLOGGED TABLE t (id int)", "CREATE TABLE")


def test_whole_schemas_and_who_joins():
    from sluicegate.ddl.tables import EXCLUDED, SCHEMAS, joins, qualified_names, whole_schemas

    assert whole_schemas(None) == ["public"]
    assert whole_schemas(["sales.*", "public.items", '"Big".*']) == ["sales", "Big"]
    assert whole_schemas(["items"]) == []
    options = {SCHEMAS: ["public"], EXCLUDED: qualified_names(["audit"])}
    assert joins(options, "public", "fresh") and not joins(options, "public", "audit")
    assert not joins(options, "other", "fresh") and not joins({}, "public", "fresh")


@pytest.mark.parametrize("query,tag,replayed", [
    ("ALTER TABLE items ADD COLUMN note text DEFAULT 'x'", "ALTER TABLE", True),
    ("alter table items add n int, add m int not null default 0", "ALTER TABLE", True),
    ("alter table items add column n int not null", "ALTER TABLE", False),
    ("alter table items add column n int unique", "ALTER TABLE", False),
    ("alter table items add constraint c check (qty > 0)", "ALTER TABLE", False),
    ("alter table items alter column qty type bigint", "ALTER TABLE", False),
    ("alter table items alter qty set default 3, alter column qty drop not null", "ALTER TABLE", True),
    ("alter table items alter qty set not null", "ALTER TABLE", False),
    ("alter table items drop column qty", "ALTER TABLE", False),
    ("alter table items drop constraint c", "ALTER TABLE", True),
    ("alter table items rename column qty to q", "ALTER TABLE", False),
    ("alter table items rename to things", "ALTER TABLE", False),
    ("alter table items set (fillfactor = 80)", "ALTER TABLE", True),
    ("alter table items set schema other", "ALTER TABLE", False),
    ("create index i on items (qty)", "CREATE INDEX", True),
    ("create unique index concurrently i on items (qty)", "CREATE INDEX", False),
    ("drop index i", "DROP INDEX", True),
    ("drop table items", "DROP TABLE", False),
    ("create type mood as enum ('a')", "CREATE TYPE", True),
    ("alter type mood add value 'b' before 'a'", "ALTER TYPE", True),
    ("alter type mood rename value 'a' to 'z'", "ALTER TYPE", False),
    ("create sequence s", "CREATE SEQUENCE", False),
    ("alter sequence s restart", "ALTER SEQUENCE", False),
])
def test_what_active_active_replays(query, tag, replayed):
    why = both_ways.refusal(read(query, tag))
    assert (why is None) == replayed, why

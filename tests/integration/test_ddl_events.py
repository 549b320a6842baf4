"""DDL events with the source's DDL capture installed, on real PostgreSQL: through a real VStream server,
each DDL statement on a streamed table comes as a DDL statement at its place in its transaction, in commit
order, and one on a table the client does not stream is not sent; the Spark streaming source's reader gives
it as rows with op 'ddl' between the rows (its calls made as Spark makes them, without Spark)."""

from __future__ import annotations

import psycopg
import pytest

from sluicegate.changes import model as m
from sluicegate.ddl import capture
from sluicegate.position import format_lsn, parse_lsn
from sluicegate.spark import stream_source
from sluicegate.vstream import VStreamServer

from ..conftest import wait_for
from .test_vstream import Collector, complete, xid_of


@pytest.fixture
def server(pair):
    with VStreamServer(pair.source, heartbeat_seconds=0.2, decoding_work_mem="64kB") as srv:
        yield srv


def statements(msgs) -> list[m.Statement]:
    """A transaction's statements across its messages, one per run of row changes of one type to one table
    (a streamed transaction's stream blocks, and segments, cut them in several)."""
    out: list[m.Statement] = []
    for x in msgs:
        for st in x.statements:
            if (out and st.type in m.ROW_TYPES.values() and out[-1].type == st.type
                    and out[-1].table == st.table):
                out[-1].rows.extend(st.rows)
            else:
                out.append(m.Statement.FromString(st.SerializeToString()))
    return out


def kinds(msgs) -> list[str]:
    return [m.type_name(st.type) for st in statements(msgs)]


def ddl_of(msgs) -> list[tuple[str, str, list[str]]]:
    return [(st.ddl.tag, st.ddl.sql, [f"{t.schema}.{t.name}" for t in st.ddl.tables])
            for st in statements(msgs) if st.type == m.DDL]


def test_ddl_statements_in_commit_order(pair, server):
    pair.src("CREATE TABLE items (id int PRIMARY KEY, v text)")
    pair.src("CREATE TABLE other (id int PRIMARY KEY)")
    capture.run(pair.source, capture.install_statements(), "Install")
    with Collector(server.address, "ddl", tables=["items"]) as reader, psycopg.connect(pair.source) as c:
        x1 = xid_of(c)
        c.execute("INSERT INTO items VALUES (1, 'a')")
        c.commit()
        # One transaction: rows in the old shape, the ALTER, rows in the new one. Big enough (over the
        # server's 64kB decoding_work_mem) to be streamed before its commit.
        x2 = xid_of(c)
        c.execute("INSERT INTO items SELECT g, repeat('x', 100) FROM generate_series(100, 2099) g")
        c.execute("ALTER TABLE items ADD COLUMN note text")
        c.execute("INSERT INTO items VALUES (2, 'b', 'n2')")
        c.commit()
        x3 = xid_of(c)
        c.execute("ALTER TABLE items RENAME COLUMN v TO val")  # a transaction with nothing but DDL
        c.commit()
        x4 = xid_of(c)
        c.execute("CREATE INDEX items_note ON items (note)")
        c.commit()
        xo = xid_of(c)
        c.execute("ALTER TABLE other ADD COLUMN x int")  # not streamed: not sent
        c.execute("CREATE INDEX other_x ON other (x)")
        c.commit()
        x5 = xid_of(c)
        c.execute("INSERT INTO items VALUES (3, 'c', 'n3')")
        c.execute("ALTER TABLE items RENAME TO things")  # streamed on under its new name
        c.execute("INSERT INTO things VALUES (4, 'd', 'n4')")
        c.commit()
        wait_for(lambda: reader.finished(x5), timeout=60, what="the last transaction")
        got = dict(complete(reader.transactions()))

    assert list(got) == [x1, x2, x3, x4, x5]
    assert all(t.context.transaction_id != xo for t in reader.transactions())
    assert kinds(got[x1]) == ["INSERT"]
    assert any(x.context.streamed for x in got[x2])  # the streamed path (in-block messages) was taken
    assert kinds(got[x2]) == ["INSERT", "DDL", "SCHEMA_CHANGE", "INSERT"]
    first, _, _, last = statements(got[x2])
    assert len(first.rows) == 2000
    assert [c.name for c in first.table.columns] == ["id", "v"]
    assert [c.name for c in last.table.columns] == ["id", "v", "note"]
    assert [m.values(r.after) for r in last.rows] == [("2", "b", "n2")]
    assert ddl_of(got[x2]) == [("ALTER TABLE", "ALTER TABLE items ADD COLUMN note text", ["public.items"])]
    assert statements(got[x2])[1].ddl.search_path == '"$user", public'
    assert kinds(got[x3]) == ["DDL"]
    assert ddl_of(got[x3]) == [("ALTER TABLE", "ALTER TABLE items RENAME COLUMN v TO val", ["public.items"])]
    assert ddl_of(got[x4]) == [("CREATE INDEX", "CREATE INDEX items_note ON items (note)", ["public.items"])]
    assert kinds(got[x5]) == ["SCHEMA_CHANGE", "INSERT", "DDL", "INSERT"]  # renamed: same columns
    assert ddl_of(got[x5]) == [("ALTER TABLE", "ALTER TABLE items RENAME TO things", ["public.items"])]
    _, before, ddl, after = statements(got[x5])
    # where the source wrote them (a logical message's position is the end of its record)
    assert before.start_position < ddl.start_position <= after.start_position
    assert (after.table.name, [c.name for c in after.table.columns]) == ("things", ["id", "val", "note"])
    assert [m.values(r.after) for r in after.rows] == [("4", "d", "n4")]
    # Positions keep their order: each transaction resumes after the one before.
    ends = [got[x][-1].context.position for x in (x1, x2, x3, x4, x5)]
    assert ends == sorted(ends)


def test_a_client_of_the_whole_publication_gets_create_table_in_its_schema(pair, server):
    pair.src("CREATE TABLE items (id int PRIMARY KEY)")
    pair.src("CREATE SCHEMA side")
    pair.src("CREATE TABLE side.t (id int PRIMARY KEY)")
    capture.run(pair.source, capture.install_statements(), "Install")
    with Collector(server.address, "whole") as reader, psycopg.connect(pair.source) as c:  # schema public
        xs = xid_of(c)
        c.execute("ALTER TABLE side.t ADD COLUMN x int")  # not published: not sent
        c.execute("CREATE TABLE side.u (id int)")
        c.commit()
        x1 = xid_of(c)
        c.execute("CREATE TABLE fresh (id int PRIMARY KEY)")
        c.commit()
        x2 = xid_of(c)
        c.execute("INSERT INTO items VALUES (1)")
        c.commit()
        wait_for(lambda: reader.finished(x2), timeout=60, what="the last transaction")
        got = dict(complete(reader.transactions()))
    assert list(got) == [x1, x2] and xs not in got
    assert ddl_of(got[x1]) == [("CREATE TABLE", "CREATE TABLE fresh (id int PRIMARY KEY)", ["public.fresh"])]


def test_spark_stream_source_rows_with_op_ddl(pair):
    pair.src("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pair.src("CREATE TABLE other (id int PRIMARY KEY)")
    capture.run(pair.source, capture.install_statements(), "Install")
    reader = stream_source.ChangeSource({"source": pair.source, "slot": "ddl1", "tables": "t"}) \
        .streamReader(stream_source.SCHEMA)
    try:
        start = reader.initialOffset()
        with psycopg.connect(pair.source) as c:
            c.execute("INSERT INTO t VALUES (1, 'a')")
            c.execute("ALTER TABLE t ADD COLUMN note text")
            c.execute("INSERT INTO t VALUES (2, 'b', 'n')")
            c.commit()
            c.execute("ALTER TABLE other ADD COLUMN x int")  # not published: no row
            c.commit()
            c.execute("CREATE INDEX t_note ON t (note)")
            c.commit()
        end = parse_lsn(pair.src("SELECT pg_current_wal_flush_lsn()::text")[0][0])
        [part] = reader.partitions(start, {"lsn": format_lsn(end)})
        rows = [r for batch in reader.read(part) for r in batch.to_pylist()]
    finally:
        reader.stop()
    got = [(r["op"], r["schema"], r["table"], dict(r["after"]) if r["after"] else None) for r in rows]
    assert got == [
        ("insert", "public", "t", {"id": "1", "v": "a"}),
        ("ddl", "public", "t", {"tag": "ALTER TABLE", "statement": "ALTER TABLE t ADD COLUMN note text",
                                "search_path": '"$user", public'}),
        ("insert", "public", "t", {"id": "2", "v": "b", "note": "n"}),
        ("ddl", "public", "t", {"tag": "CREATE INDEX", "statement": "CREATE INDEX t_note ON t (note)",
                                "search_path": '"$user", public'})]
    assert rows[1]["key"] is None and rows[1]["before"] is None
    commits = [parse_lsn(r["commit_lsn"]) for r in rows]
    assert commits[0] == commits[1] == commits[2] < commits[3]

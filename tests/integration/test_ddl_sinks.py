"""Schema changes on Replicate sinks (`replicate create --on-ddl exec`): a migration run on the source under live
writes reaches every sink in its place among the rows, one consumer killed -9 in the middle of it; each sink ends
with the source's columns, indexes, constraints and rows, and vdiff finds nothing. Real PostgreSQL servers (a
source and two sinks), consumers run as `sluicegate workflow run` processes."""

from __future__ import annotations

import psycopg
import pytest

from sluicegate.targets.delta.read import arrow_tables_as_of
from sluicegate.targets.delta.state import Store
from sluicegate.targets.delta.types import SPECIAL

from ..conftest import wait_for
from .cluster_helpers import Consumer, assert_equal, caught_up, cli, create, run, stream
from .test_ddl_flow import ROWS, Writes, backfill, constraints, indexes
from .test_replicate_delta import assert_lake_equal, lake_caught_up
from .test_schema_changes import columns

pytestmark = pytest.mark.spark


def definition(url: str) -> tuple:
    """What `pg_dump -s` would say of items: its columns, indexes and constraints."""
    return columns(url), indexes(url), constraints(url)


def test_migration_reaches_every_sink_with_a_consumer_killed(rc, tmp_path):
    c = rc
    c.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int, name text, legacy text)")
    c.src("INSERT INTO items SELECT g, g %% 7, 'item ' || g, 'old' FROM generate_series(1, %s) g", (ROWS,))
    out = cli("ddl", "install", "--source", c.source)
    assert out.returncode == 0, out.stderr
    out = create(c, "--on-ddl", "exec")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "captures no DDL" not in out.stderr  # installed: no note
    consumers = [Consumer(c.workflow, s, tmp_path / f"run{i}.log").start() for i, s in enumerate(c.sinks)]
    writes = Writes(c.source, ROWS + 1)
    try:
        wait_for(lambda: all(caught_up(c, s) for s in c.sinks), 180, what="both sinks replicating")
        writes.start()
        wait_for(lambda: writes.commits > 10, what="writes")
        with psycopg.connect(c.source) as conn:  # rows before and after a statement in one transaction
            conn.execute("INSERT INTO items (id, qty) VALUES (100001, 1)")
            conn.execute("ALTER TABLE items ADD COLUMN status text DEFAULT 'new'")
            conn.execute("INSERT INTO items (id, qty, status) VALUES (100002, 2, 'first')")
        backfill(c.source)
        c.src("UPDATE items SET status = 'late' WHERE status IS NULL")
        c.src("ALTER TABLE items ALTER COLUMN status SET NOT NULL")
        c.src("CREATE INDEX CONCURRENTLY items_status ON items (status)")
        consumers[0].kill()  # -9 of its process group, in the middle of the migration
        c.src("ALTER TABLE items RENAME COLUMN name TO title")
        c.src("ALTER TABLE items ALTER COLUMN qty TYPE bigint USING qty::bigint * 10")
        c.src("ALTER TABLE items ADD CONSTRAINT qty_nonneg CHECK (qty >= 0)")
        c.src("ALTER TABLE items DROP COLUMN legacy")
        consumers[0].start()
        wait_for(lambda: writes.commits > 60, what="writes after the migration")
        writes.finish()
        for i, sink in enumerate(c.sinks):
            wait_for(lambda sink=sink: caught_up(c, sink), 180, what=f"sink {i} caught up",
                     describe=lambda sink=sink: stream(sink))
            assert definition(sink) == definition(c.source), f"sink {i}"
            assert assert_equal(c, sink, "public.items", ["id"]) > ROWS
            assert run(sink, "SELECT status FROM items WHERE id IN (100001, 100002) ORDER BY id") == \
                [("new",), ("first",)]
    finally:
        writes.stop_event.set()
        for consumer in consumers:
            consumer.kill()
    assert [col[0] for col in columns(c.source)] == ["id", "qty", "title", "status"]
    for sink in c.sinks:
        out = cli("vdiff", c.workflow, "--target", sink, "--spark-master", "local[1]")
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow  # ~32 s; the default set has Delta DDL in test_lake_ddl and two sinks above
def test_migration_reaches_a_postgres_and_a_delta_sink(rc, tmp_path):
    """The Delta sink follows the column changes as a MoveTables into Delta does (lake/ddl.py): added with a
    default, renamed, dropped, an integer widened; an index passed over."""
    c = rc
    c.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int, name text, legacy text)")
    c.src("INSERT INTO items SELECT g, g %% 7, 'item ' || g, 'old' FROM generate_series(1, %s) g", (ROWS,))
    assert cli("ddl", "install", "--source", c.source).returncode == 0
    root = tmp_path / "lake"
    lake = f"delta:{root}"
    out = create(c, "--on-ddl", "exec", sinks=[c.sinks[0], lake])
    assert out.returncode == 0, out.stdout + out.stderr
    consumers = [Consumer(c.workflow, c.sinks[0], tmp_path / "pg.log").start(),
                 Consumer(c.workflow, lake, tmp_path / "delta.log").start()]
    writes = Writes(c.source, ROWS + 1)
    try:
        wait_for(lambda: caught_up(c, c.sinks[0]) and lake_caught_up(c, root), 180, what="both sinks replicating",
                 describe=lambda: (tmp_path / "delta.log").read_text()[-2000:])
        writes.start()
        wait_for(lambda: writes.commits > 10, what="writes")
        c.src("ALTER TABLE items ADD COLUMN status text DEFAULT 'new'")
        c.src("UPDATE items SET status = 'n' || (id % 3) WHERE id <= 500")
        c.src("CREATE INDEX items_status ON items (status)")
        c.src("ALTER TABLE items RENAME COLUMN name TO title")
        c.src("ALTER TABLE items ALTER COLUMN qty TYPE bigint")
        c.src("ALTER TABLE items DROP COLUMN legacy")
        wait_for(lambda: writes.commits > 60, what="writes after the migration")
        writes.finish()
        wait_for(lambda: caught_up(c, c.sinks[0]) and lake_caught_up(c, root), 180, what="both sinks caught up",
                 describe=lambda: (stream(c.sinks[0]), Store(root).load(c.workflow).message))
        assert definition(c.sinks[0]) == definition(c.source)
        assert assert_equal(c, c.sinks[0], "public.items", ["id"]) > ROWS
        assert_lake_equal(c, root)
        got = arrow_tables_as_of(str(root), c.workflow)["public.items"]
        assert [n for n in got.column_names if n != SPECIAL] == ["id", "qty", "title", "status"]
    finally:
        writes.stop_event.set()
        for consumer in consumers:
            consumer.kill()

"""Deferred index builds (postgres/indexes.py): a target table's indexes are dropped for its first copy cycle
and built again, exactly as they were, when the cycle commits; a kill or a delete in between never leaves a
table without them; tables something else leans on keep theirs."""

from __future__ import annotations

import os
import signal

import psycopg
import pytest

from sluicegate.postgres import indexes
from sluicegate.postgres.catalog import describe_table
from sluicegate.workflow.create import create_movetables, delete_workflow

from ..conftest import EngineThread, wait_for
from .helpers import assert_same, reap_group, stream_row
from .test_kill_restart import start_driver

TARGET_DDL = """
CREATE TABLE items (id bigint PRIMARY KEY, code text NOT NULL, qty int, note text,
                    CONSTRAINT items_code_key UNIQUE (code) DEFERRABLE INITIALLY DEFERRED);
CREATE INDEX items_qty_positive ON items (qty) WHERE qty > 0;
CREATE INDEX items_lower_note ON items (lower(note)) WITH (fillfactor = 70);
"""


def index_shape(url: str, table: str = "items") -> tuple[set, set]:
    """Every index's definition and every constraint's, by name."""
    with psycopg.connect(url) as c:
        defs = set(c.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s", (table,)))
        cons = set(c.execute("SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
                             "WHERE conrelid = %s::regclass", (table,)))
    return defs, cons


def fill_source(pair, rows: int) -> None:
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, code text NOT NULL, qty int, note text)")
    pair.src("INSERT INTO items SELECT g, 'c' || g, g %% 5, md5(g::text) FROM generate_series(1, %s) g", (rows,))
    pair.src("ANALYZE items")


def test_defer_then_build_gives_back_the_same_indexes(pair):
    """Primary key, a deferrable unique constraint, a partial index and an expression index with storage
    options: dropped (the table then has none), built again identical, names included."""
    pair.dst(TARGET_DDL)
    before = index_shape(pair.target)
    assert len(before[0]) == 4
    with psycopg.connect(pair.target) as c:
        table = describe_table(c, "public", "items")
        deferred = indexes.defer(c, table)
        assert deferred[0]["name"] == "items_pkey"  # the key first
        assert len(deferred) == 4
        assert c.execute("SELECT count(*) FROM pg_indexes WHERE tablename = 'items'").fetchone()[0] == 0
    pair.dst("INSERT INTO items SELECT g, 'c' || g, g % 5, md5(g::text) FROM generate_series(1, 1000) g")
    with psycopg.connect(pair.target) as c:
        indexes.build(c, table, deferred)
    assert index_shape(pair.target) == before


@pytest.mark.parametrize("leaning", ["foreign key", "view", "replica identity"])
def test_tables_others_lean_on_keep_their_indexes(pair, leaning):
    pair.dst(TARGET_DDL)
    if leaning == "foreign key":
        pair.dst("CREATE TABLE notes (item bigint REFERENCES items, body text)")
    elif leaning == "view":  # the view's GROUP BY relies on the primary key: dropping it would fail
        pair.dst("CREATE VIEW item_notes AS SELECT i.id, i.note, count(*) FROM items i GROUP BY i.id")
    else:
        pair.dst("ALTER TABLE items REPLICA IDENTITY USING INDEX items_pkey")
    before = index_shape(pair.target)
    with psycopg.connect(pair.target) as c:
        table = describe_table(c, "public", "items")
        assert indexes.defer(c, table) == []
        assert c.execute("SELECT count(*) FROM items").fetchone()[0] == 0  # the transaction is still usable
    assert index_shape(pair.target) == before


@pytest.mark.spark
def test_copy_builds_the_indexes_after_the_first_cycle(pair, spark, caplog):
    """Through the engine: a target table made by the user, with four indexes, is copied without them in
    the first cycle (then cycles with them); the copy ends with the same indexes and every row."""
    caplog.set_level("INFO", logger="sluicegate")
    fill_source(pair, 3000)
    pair.dst(TARGET_DDL)
    before = index_shape(pair.target)
    create_movetables("defer", pair.source, pair.target, None, [], {"cycle_rows": 1000, "chunk_rows": 300})
    with EngineThread(spark, pair.target, "defer"):
        wait_for(lambda: stream_row(pair, "defer")["state"] == "Running", timeout=240, what="Running")
    assert index_shape(pair.target) == before
    built = [r.getMessage() for r in caplog.records if r.getMessage().startswith("building index")]
    assert len(built) == 4 and "items_pkey" in built[0], built  # once each, after the first cycle
    assert assert_same(pair, "public.items", ["id"]) == 3000
    assert pair.dst("SELECT deferred_indexes FROM sluicegate.copy_state") == [(None,)]


@pytest.mark.spark
def test_keep_indexes_option(pair, spark):
    fill_source(pair, 500)
    create_movetables("keep", pair.source, pair.target, None, [], {"defer_indexes": False})
    with EngineThread(spark, pair.target, "keep"):
        wait_for(lambda: stream_row(pair, "keep")["state"] == "Running", timeout=240, what="Running")
    assert assert_same(pair, "public.items", ["id"]) == 500
    assert pair.dst("SELECT indexname FROM pg_indexes WHERE tablename = 'items'") == [("items_pkey",)]


@pytest.mark.spark
def test_killed_mid_copy_then_deleted_gives_the_indexes_back(pair, tmp_path):
    """kill -9 while the first cycle's rows are committed and its indexes dropped (recorded in copy_state):
    `workflow delete` builds them again before it drops the state."""
    fill_source(pair, 2000)
    pair.dst(TARGET_DDL)
    before = index_shape(pair.target)
    create_movetables("kd", pair.source, pair.target, None, [], {})
    log = tmp_path / "driver.log"
    driver = start_driver(pair, "kd", log, fault="copy.before_progress", fault_dir=tmp_path)
    try:
        wait_for(lambda: (tmp_path / "copy.before_progress").exists() or driver.poll() is not None, timeout=240,
                 what="fault point", describe=lambda: log.read_text()[-2000:])
        assert driver.poll() is None, log.read_text()[-2000:]
        os.kill(driver.pid, signal.SIGKILL)
    finally:
        reap_group(driver)
    assert pair.dst("SELECT count(*) FROM pg_indexes WHERE tablename = 'items'") == [(0,)]
    recorded = pair.dst("SELECT deferred_indexes FROM sluicegate.copy_state")[0][0]
    assert sorted(d["name"] for d in recorded) == sorted(name for name, _ in before[0])
    assert pair.dst("SELECT count(*) FROM items") == [(2000,)]  # the tasks committed; the cycle did not
    delete_workflow("kd", pair.target)
    assert index_shape(pair.target) == before

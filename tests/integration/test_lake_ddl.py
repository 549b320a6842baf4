"""Schema changes captured on the source (`sluicegate ddl install`) flowing into a Delta target as the
workflow's --on-ddl says (lake/ddl.py), on real PostgreSQL and real local Spark: a migration under live writes
with exec (a column renamed between rows of one transaction, with a kill -9 between the table's rewrite and
the batch's MERGE; a column added with a default, one dropped, types widened) ends with the Delta table's
columns and rows equal to the source's; stop and exec-ignore do what the README says."""

from __future__ import annotations

import os
import signal

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from sluicegate.position import parse_lsn
from sluicegate.spark.runner import SparkRunner
from sluicegate.targets.delta import cli as lake
from sluicegate.targets.delta.ddl import ddl_app_id
from sluicegate.targets.delta.engine import LakeEngine
from sluicegate.targets.delta.read import arrow_tables_as_of
from sluicegate.targets.delta.state import Store
from sluicegate.targets.delta.types import SPECIAL

from ..conftest import wait_for
from .helpers import reap_group
from .test_ddl_flow import Writes, cli, install
from .test_lake_added_columns import under_writes
from .test_lake_movetables import by_key, source_rows, start_driver

pytestmark = pytest.mark.spark


def caught_up(pair, store: Store, engine: LakeEngine, workflow: str) -> None:
    """Copied, then everything the source flushed applied (the engine stepped in this process)."""
    flushed = parse_lsn(pair.src("SELECT pg_current_wal_flush_lsn()::text")[0][0])

    def done() -> bool:
        wf = store.load(workflow)
        return wf.state == "Running" and wf.first_point and wf.position >= flushed

    wait_for(lambda: done() or engine.step(store.load(workflow)), timeout=90, what="caught up",
             describe=lambda: store.load(workflow).message)


def logical(table) -> list[str]:
    return [n for n in table.column_names if n != SPECIAL]


def source_columns(pair, table: str) -> list[str]:
    return [r[0] for r in pair.src("SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
                                   "AND NOT attisdropped ORDER BY attnum", (table,))]


def test_migration_under_writes_reaches_delta_in_shape(pair, spark, tmp_path):
    install(pair)
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int, name text, legacy text, price real)")
    pair.src("INSERT INTO items SELECT g, g % 7, 'item ' || g, 'old', g / 3.0 FROM generate_series(1, 2000) g")
    root = tmp_path / "lake"
    target = f"delta:{root}"
    notes: list[str] = []
    lake.create("mig", pair.source, target, ["items"], None, [], {"on_ddl": "exec", "slice_seconds": 1,
                                                                      "stage_rows": 50}, notes)
    assert not notes, notes  # the capture is installed
    store = Store(root)
    log = tmp_path / "driver.log"
    writes = Writes(pair.source, 2001)
    driver = start_driver(target, "mig", log, fault="lake.replicate.rewritten", fault_dir=tmp_path)
    try:
        wait_for(lambda: store.load("mig").first_point or driver.poll() is not None, timeout=120,
                 what="the first consistent point", describe=lambda: log.read_text()[-2000:])
        writes.start()
        # Rows changed before and after the rename in one transaction: each in its own shape.
        under_writes(pair.source, "UPDATE items SET name = name || ' before' WHERE id <= 100",
                     "ALTER TABLE items RENAME COLUMN name TO title",
                     "UPDATE items SET title = title || ' after' WHERE id <= 50")
        wait_for(lambda: (tmp_path / "lake.replicate.rewritten").exists() or driver.poll() is not None,
                 timeout=120, what="the rewrite's fault point", describe=lambda: log.read_text()[-2000:])
        assert driver.poll() is None, log.read_text()[-2000:]
        os.kill(driver.pid, signal.SIGKILL)  # after the table's rewrite, before the batch's MERGE
    finally:
        reap_group(driver)
    dt = DeltaTable(str(root / "public" / "items"))
    names = [f.name for f in dt.schema().fields]
    assert "title" in names and "name" not in names  # rewritten in the new shape ...
    assert dt.transaction_version(ddl_app_id("mig")) > store.load("mig").position  # ... past the position

    engine = LakeEngine(target, "mig", SparkRunner(spark))
    try:
        # Rows before a drop and a widened real in their transactions outgrow stage_rows: staged, then
        # reshaped; the real's values as PostgreSQL's cast gives them.
        for statements in (("ALTER TABLE items ADD COLUMN tag text DEFAULT 'plain'",
                            "UPDATE items SET tag = 'hot' WHERE id % 11 = 0"),
                           ("UPDATE items SET qty = qty + 1 WHERE id <= 400", "ALTER TABLE items DROP COLUMN legacy",
                            "UPDATE items SET qty = qty + 1 WHERE id <= 10"),
                           ("ALTER TABLE items ALTER COLUMN qty TYPE bigint",),
                           ("UPDATE items SET price = price + 1 WHERE id <= 400",
                            "ALTER TABLE items ALTER COLUMN price TYPE double precision",
                            "UPDATE items SET price = price + 0.5 WHERE id <= 10"),
                           ("CREATE INDEX items_tag ON items (tag)",),
                           ("ALTER TABLE items ALTER COLUMN tag SET NOT NULL",)):
            under_writes(pair.source, *statements)
            engine.step(store.load("mig"))
        under_writes(pair.source, "UPDATE items SET title = title || '!', price = price * 2 WHERE id % 13 = 0")
        seen = writes.commits
        wait_for(lambda: writes.commits > seen + 20 or writes.error, what="writes after the migration")
    finally:
        writes.finish()
    caught_up(pair, store, engine, "mig")
    wf = store.load("mig")
    assert wf.state == "Running" and wf.message == "", wf.message

    got = arrow_tables_as_of(str(root), "mig")["public.items"]
    assert logical(got) == source_columns(pair, "items") == ["id", "qty", "title", "price", "tag"]
    assert got.schema.field("qty").type == pa.int64() and got.schema.field("price").type == pa.float64()
    rows, want = by_key(got.to_pylist()), by_key(source_rows(pair.source, "public.items"))
    assert rows == want, f"{len(rows)} rows in Delta, {len(want)} on the source"
    by_id = {r["id"]: r for r in rows}
    # The writes delete rows at random keys: the rows named here are checked where they are left.
    expected = {7: ("title", "item 7 before after"), 77: ("title", "item 77 before"), 11: ("tag", "hot"),
                 22: ("tag", "hot")}
    left = [i for i in expected if i in by_id]
    assert len(left) >= 2 and all(by_id[i][expected[i][0]] == expected[i][1] for i in left), left
    assert sum(r["tag"] == "plain" for r in rows) > 1000
    # What Sluicegate's Spark readers read (the files by name) has the logical columns too.
    df = spark.read.parquet(*DeltaTable(str(root / "public" / "items")).file_uris())
    assert [c for c in df.columns if c != SPECIAL] == ["id", "qty", "title", "price", "tag"]
    assert df.count() == len(want)


def test_stop_and_exec_ignore_on_a_delta_target(pair, spark, tmp_path):
    install(pair)
    pair.src("CREATE TABLE gadgets (id int PRIMARY KEY, a int, v int)")
    pair.src("INSERT INTO gadgets SELECT g, g, g FROM generate_series(1, 300) g")
    pair.src("CREATE TABLE extra (id int PRIMARY KEY)")
    pair.src("INSERT INTO extra SELECT generate_series(1, 10)")
    root = tmp_path / "lake"
    target = f"delta:{root}"
    lake.create("sx", pair.source, target, None, None, [], {"slice_seconds": 1})  # --on-ddl stop (default)
    store = Store(root)
    engine = LakeEngine(target, "sx", SparkRunner(spark))
    caught_up(pair, store, engine, "sx")
    gadgets = root / "public" / "gadgets"

    # stop: Error before the statement's transaction, naming it; what came before it applied, nothing of it
    pair.src("INSERT INTO gadgets VALUES (500, 500, 500)")
    before = parse_lsn(pair.src("SELECT pg_current_wal_insert_lsn()::text")[0][0])
    pair.src("ALTER TABLE gadgets RENAME COLUMN a TO b")
    pair.src("UPDATE gadgets SET b = b + 1000 WHERE id <= 5")
    assert LakeEngine(target, "sx", SparkRunner(spark)).run() == "Error"
    stopped = store.load("sx")
    assert "RENAME COLUMN a TO b" in stopped.message and "--on-ddl stop" in stopped.message, stopped.message
    assert "--on-ddl exec" in stopped.message  # the way out
    assert "a" in [f.name for f in DeltaTable(str(gadgets)).schema().fields]
    assert before <= stopped.position  # the insert's batch was applied ...
    assert by_key(arrow_tables_as_of(str(root), "sx")["public.gadgets"].to_pylist())[-1]["a"] == 500
    assert all(r["a"] < 1000 for r in arrow_tables_as_of(str(root), "sx")["public.gadgets"].to_pylist())

    # exec-ignore: the rename follows; a DROP TABLE a Delta target does not follow is passed over, noted
    out = cli("workflow", "set", "sx", "--on-ddl", "exec-ignore", "--target", target)
    assert out.returncode == 0, out.stderr
    lake.set_state("sx", target, "start")
    pair.src("DROP TABLE extra")
    pair.src("INSERT INTO gadgets VALUES (1000, 1, 1)")
    engine = LakeEngine(target, "sx", SparkRunner(spark))
    caught_up(pair, store, engine, "sx")
    wf = store.load("sx")
    assert wf.state == "Running", wf.message
    assert "exec-ignore: passed over DROP TABLE" in wf.message and "public.extra" in wf.message, wf.message
    got = arrow_tables_as_of(str(root), "sx")["public.gadgets"]
    assert logical(got) == ["id", "b", "v"]
    assert by_key(got.to_pylist()) == by_key(source_rows(pair.source, "public.gadgets"))

    # exec: a type a Delta column cannot widen to stops the stream, naming the column and the way out
    lake.configure("sx", target, "exec", {})
    pair.src("ALTER TABLE gadgets ALTER COLUMN v TYPE text")
    pair.src("UPDATE gadgets SET v = 'x' WHERE id = 1")
    assert LakeEngine(target, "sx", SparkRunner(spark)).run() == "Error"
    failed = store.load("sx")
    assert "column v changed type from integer to text" in failed.message, failed.message
    assert "re-create the workflow" in failed.message and "exec-ignore" in failed.message


def test_create_takes_on_ddl_for_a_delta_target(pair, tmp_path):
    pair.src("CREATE TABLE items (id int PRIMARY KEY, v text)")
    target = f"delta:{tmp_path / 'lake'}"
    out = cli("movetables", "create", "--workflow", "od", "--source", pair.source, "--target", target,
              "--on-ddl", "exec")
    assert out.returncode == 0, out.stderr
    assert "--on-ddl exec" in out.stderr and "ddl install" in out.stderr, out.stderr  # no capture yet
    store = Store(tmp_path / "lake")
    assert store.load("od").options["on_ddl"] == "exec"
    out = cli("workflow", "set", "od", "--on-ddl", "ignore", "--target", target)
    assert out.returncode == 0 and "on-ddl ignore" in out.stdout, out.stderr
    assert store.load("od").options["on_ddl"] == "ignore"

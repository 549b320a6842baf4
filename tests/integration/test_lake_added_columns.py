"""Columns added on the source of a Delta target: the Delta table's older rows hold what the source's older
rows hold (PostgreSQL's recorded "fast default", not NULL), through a kill -9 between the column's add and
the batch's MERGE, for a column added before the copy too; a volatile default stops the stream in Error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psycopg
import pytest

from sluicegate.position import parse_lsn
from sluicegate.spark.runner import SparkRunner
from sluicegate.targets.delta import cli as lake
from sluicegate.targets.delta.engine import LakeEngine
from sluicegate.targets.delta.read import arrow_tables_as_of
from sluicegate.targets.delta.state import Store, app_id

from ..conftest import wait_for
from .helpers import Writer, reap_group
from .test_lake_movetables import by_key, delta_rows, source_rows, start_driver

pytestmark = pytest.mark.spark

W = "ac"
TABLES = ("public.items", "public.early", "public.other")


def delta_columns(root, qualified: str) -> list[str]:
    from deltalake import DeltaTable

    schema, name = qualified.split(".")
    return [f.name for f in DeltaTable(str(root / schema / name)).schema().fields]


def under_writes(url: str, *statements: str) -> None:
    """One transaction of `statements` beside the Writer's: it gives way (lock_timeout, below the deadlock
    check's 1s) and is tried again, so the Writer is never the one a deadlock aborts."""
    for _ in range(100):
        try:
            with psycopg.connect(url) as c:
                c.execute("SET LOCAL lock_timeout = '200ms'")
                for s in statements:
                    c.execute(s)
            return
        except psycopg.errors.LockNotAvailable:
            continue
    raise AssertionError(f"could not run {statements} beside the writes")


def caught_up(pair, store: Store, engine: LakeEngine) -> None:
    flushed = parse_lsn(pair.src("SELECT pg_current_wal_flush_lsn()::text")[0][0])
    wait_for(lambda: store.load(W).position >= flushed or engine.step(store.load(W)), timeout=90,
             what="caught up", describe=lambda: store.describe(W))


@pytest.mark.slow  # the default suite keeps to its time
def test_added_columns_hold_the_sources_values(pair, spark, tmp_path):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("INSERT INTO items SELECT g, 0, md5(g::text) FROM generate_series(1, 2000) g")
    pair.src("CREATE TABLE early (id int PRIMARY KEY, v text)")
    pair.src("INSERT INTO early SELECT g, 'v' || g FROM generate_series(1, 200) g")
    pair.src("CREATE TABLE other (id int PRIMARY KEY, v text)")
    pair.src("INSERT INTO other SELECT g, 'o' FROM generate_series(1, 10) g")
    root = tmp_path / "lake"
    target = f"delta:{root}"
    # stage_rows: the batch that meets the first column stages rows of the old shape to files
    lake.create(W, pair.source, target, None, None, [], {"slice_seconds": 1, "stage_rows": 50})
    store = Store(root)
    # Added between `create` and the copy: the copy adopts it and reads its values.
    pair.src("ALTER TABLE early ADD COLUMN flag text DEFAULT 'x'")
    pair.src("INSERT INTO early SELECT g, 'w', 'given' || g FROM generate_series(201, 250) g")
    pair.src("UPDATE early SET flag = NULL WHERE id = 7")

    log = tmp_path / "driver.log"
    writer = Writer(pair.source, 2000, pause=0.005)
    driver = start_driver(target, W, log, fault="lake.replicate.columns_added", fault_dir=tmp_path)
    try:
        wait_for(lambda: store.load(W).first_point or driver.poll() is not None, timeout=120,
                 what="the first consistent point", describe=lambda: log.read_text()[-2000:])
        assert driver.poll() is None, log.read_text()[-2000:]
        writer.start()
        # Rows changed under the old shape in the same transaction (and batch) as the add: older than the
        # column on the source, so they hold its default too.
        under_writes(pair.source, "UPDATE items SET qty = qty + 100 WHERE id <= 300",
                     "ALTER TABLE items ADD COLUMN tag text NOT NULL DEFAULT 'plain'",
                     "UPDATE items SET tag = 'first' WHERE id = 3")
        # Killed after the column's own commit, before the batch's MERGE.
        wait_for(lambda: (tmp_path / "lake.replicate.columns_added").exists() or driver.poll() is not None,
                 timeout=120, what="the fault point", describe=lambda: log.read_text()[-2000:])
        assert driver.poll() is None, log.read_text()[-2000:]
        os.kill(driver.pid, signal.SIGKILL)
    finally:
        reap_group(driver)
    try:
        assert "tag" in delta_columns(root, "public.items")
        assert all(r.get("tag") is None for r in delta_rows(root, "public.items"))  # added, not filled
        under_writes(pair.source, "ALTER TABLE items ADD COLUMN n numeric(10,2) DEFAULT 1.5")
        under_writes(pair.source, "UPDATE items SET tag = 'hot', n = n + 1 WHERE id % 7 = 0")
        pair.src("INSERT INTO items (id, qty, note, tag) VALUES (100000, 1, 'given', 'explicit')")
        pair.src("INSERT INTO items (id, qty, note, n) VALUES (100001, 1, 'no n', NULL)")
        seen = writer.commits
        wait_for(lambda: writer.commits > seen + 30 or writer.error, what="writes after the columns were added")
    finally:
        writer.stop_event.set()
        writer.join()
    assert writer.error is None

    engine = LakeEngine(target, W, SparkRunner(spark))
    caught_up(pair, store, engine)
    wf = store.load(W)
    assert wf.state == "Running" and wf.message == ""
    tables = arrow_tables_as_of(str(root), W)
    for q in TABLES:
        got, want = by_key(tables[q].to_pylist()), by_key(source_rows(pair.source, q))
        assert got == want, f"{q}: {len(got)} rows in Delta, {len(want)} on the source"
    # Equal to the source, and not vacuously: most rows hold the defaults the source recorded.
    items = {r["id"]: r for r in tables["public.items"].to_pylist()}
    assert sum(r["tag"] == "plain" for r in items.values()) > 1000
    assert sum(str(r["n"]) == "1.50" for r in items.values()) > 1000
    assert {r["tag"] for r in items.values()} >= {"plain", "hot", "first", "explicit"}
    assert items[100000]["tag"] == "explicit" and items[100001]["n"] is None
    early = {r["id"]: r for r in tables["public.early"].to_pylist()}
    assert early[1]["flag"] == "x" and early[7]["flag"] is None and early[201]["flag"] == "given201"
    assert "flag" in delta_columns(root, "public.early")

    diff = subprocess.run([sys.executable, "-m", "sluicegate.cli.main", "vdiff", W, "--target", target,
                           "--spark-master", "local[2]"], capture_output=True, text=True, timeout=120, check=False)
    assert diff.returncode == 0, diff.stdout[-1000:] + diff.stderr[-2000:]

    # A volatile default: every older row got its own value, which the stream does not carry.
    before = {q: delta_rows(root, q) for q in ("public.items", "public.other")}
    wf = store.load(W)
    with psycopg.connect(pair.source) as c:
        c.execute("INSERT INTO other VALUES (11, 'same transaction')")
        c.execute("ALTER TABLE items ADD COLUMN r double precision DEFAULT random()")
        c.execute("UPDATE items SET qty = qty + 1 WHERE id > 0")
    after = parse_lsn(pair.src("SELECT pg_current_wal_flush_lsn()::text")[0][0])
    assert LakeEngine(target, W, SparkRunner(spark)).run() == "Error"
    stopped = store.load(W)
    assert stopped.state == "Error"
    assert "column r" in stopped.message and "public.items" in stopped.message, stopped.message
    assert "volatile default random()" in stopped.message and "workflow start" in stopped.message
    # Nothing of that batch applied, to either table; the stream did not move past what they have.
    from deltalake import DeltaTable

    for q in ("public.items", "public.other"):
        assert by_key(delta_rows(root, q)) == by_key(before[q]), q
        dt = DeltaTable(str(root / "public" / q.split(".")[1]))
        assert (dt.transaction_version(app_id(W)) or 0) <= stopped.position
    assert "r" not in delta_columns(root, "public.items")
    assert wf.position <= stopped.position < after


def test_a_column_added_before_the_copy_is_copied(pair, spark, tmp_path):
    """A column added between `create` and the copy joins the Delta table with its rows' values: the first
    cycle adopts it, and the cycle's commit keeps it (that commit once wrote the table's shape at create)."""
    pair.src("CREATE TABLE early (id int PRIMARY KEY, v text)")
    pair.src("INSERT INTO early SELECT g, 'v' || g FROM generate_series(1, 200) g")
    root = tmp_path / "lake"
    target = f"delta:{root}"
    lake.create(W, pair.source, target, None, None, [], {"slice_seconds": 1})
    pair.src("ALTER TABLE early ADD COLUMN flag text DEFAULT 'x'")
    pair.src("UPDATE early SET flag = NULL WHERE id = 7")
    store = Store(root)
    engine = LakeEngine(target, W, SparkRunner(spark))
    wait_for(lambda: store.load(W).first_point or engine.step(store.load(W)), timeout=90,
             what="the first consistent point", describe=lambda: store.describe(W))
    assert set(delta_columns(root, "public.early")) == {"id", "v", "flag", "_sg_special"}
    got = by_key(arrow_tables_as_of(str(root), W)["public.early"].to_pylist())
    assert got == by_key(source_rows(pair.source, "public.early"))
    flags = {r["id"]: r["flag"] for r in got}
    assert flags[7] is None and flags[8] == "x" and len(flags) == 200

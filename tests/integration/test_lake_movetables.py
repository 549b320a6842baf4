"""MoveTables into Delta tables under live writes, with `workflow run` killed -9 during the copy and during
replication: the Delta tables end equal to the source row for row, each change applied once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psycopg
import pyarrow.dataset as ds
import pytest
from psycopg import sql

from sluicegate.position import parse_lsn
from sluicegate.postgres.catalog import describe_table
from sluicegate.postgres.connect import connect
from sluicegate.targets.delta import cli as lake
from sluicegate.targets.delta.read import points
from sluicegate.targets.delta.state import Store, app_id
from sluicegate.targets.delta.types import record_batch

from ..conftest import wait_for
from .helpers import Writer, reap_group, slot_confirmed

pytestmark = pytest.mark.spark


def start_driver(target: str, workflow: str, log: Path, fault: str | None = None, fault_dir: Path | None = None):
    env = dict(os.environ)
    env.pop("SLUICEGATE_DRIVER_PID", None)
    if fault:
        env.update(SLUICEGATE_FAULT_PAUSE=fault, SLUICEGATE_FAULT_DIR=str(fault_dir))
    return subprocess.Popen(
        [sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", workflow, "--target", target,
         "--no-progress", "--spark-master", "local[2]"],
        env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
    )


def kill_at(target, workflow, log, point, tmp_path):
    driver = start_driver(target, workflow, log, fault=point, fault_dir=tmp_path)
    try:
        wait_for(lambda: (tmp_path / point).exists() or driver.poll() is not None, timeout=120,
                 what=f"fault point {point}", describe=lambda: log.read_text()[-2000:])
        assert driver.poll() is None, log.read_text()[-2000:]
        os.kill(driver.pid, signal.SIGKILL)
    finally:
        reap_group(driver)


def stop_caught_up(pair, store, driver, log: Path) -> None:
    """Once workflow lk has applied everything the source flushed: a clean stop of its driver (exit 0)."""
    flushed = parse_lsn(pair.src("SELECT pg_current_wal_flush_lsn()::text")[0][0])
    wait_for(lambda: store.load("lk").position >= flushed, timeout=60, what="caught up",
             describe=lambda: log.read_text()[-2000:])
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]


def delta_rows(root: Path, qualified: str) -> list[dict]:
    from deltalake import DeltaTable

    schema, name = qualified.split(".")
    files = DeltaTable(str(root / schema / name)).file_uris()
    return ds.dataset(files).to_table().to_pylist() if files else []


def source_rows(url: str, qualified: str) -> list[dict]:
    """The source's rows as the Delta table must hold them (the same text -> Arrow conversion)."""
    schema, name = qualified.split(".")
    with connect(url, role="source") as c:
        table = describe_table(c, schema, name)
        cols = sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(n)) for n in table.column_names)
        rows = c.execute(sql.SQL("SELECT {} FROM {}").format(cols, table.ident)).fetchall()
    return record_batch(table, rows).to_pylist()


def by_key(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: r["id"])


# The default set kills a Delta workflow in test_lake_rules (kill -9 twice, under writes); every Delta fault
# point is in the slow set below.
@pytest.mark.slow
def test_movetables_into_delta_survives_kill_9(pair, spark, tmp_path):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("INSERT INTO items SELECT g, 0, md5(g::text) FROM generate_series(1, 3000) g")
    pair.src("""CREATE TABLE prices (id int PRIMARY KEY, price numeric(10,2), at timestamptz, doc jsonb,
                raw bytea, tags text[], amount numeric, day date)""")
    pair.src("""INSERT INTO prices SELECT g, g / 7.0, '2024-01-01 00:00:00+00'::timestamptz + g * interval '1 hour',
                jsonb_build_object('g', g), decode(md5(g::text), 'hex'), ARRAY['a', g::text], g * 1.000001,
                DATE '2024-01-01' + g FROM generate_series(1, 400) g""")
    root = tmp_path / "lake"
    target = f"delta:{root}"
    moved, _ = lake.create("lk", pair.source, target, None, None, [], {"cycle_rows": 1000, "chunk_rows": 400})
    assert sorted(moved) == ["public.items", "public.prices"]
    store = Store(root)
    writer = Writer(pair.source, 3000, pause=0.005)
    writer.start()
    log = tmp_path / "driver.log"
    try:
        # During the copy: a cycle committed to Delta, the state not yet told.
        kill_at(target, "lk", log, "lake.copy.before_progress", tmp_path)
        wf = store.load("lk")
        assert wf.state == "Copying"
        # During replication: one table has the batch's merge, the points and the state do not.
        kill_at(target, "lk", log, "lake.replicate.between_tables", tmp_path)
        wf = store.load("lk")
        confirmed = slot_confirmed(pair, wf.slot)
        assert confirmed is None or confirmed <= wf.position

        driver = start_driver(target, "lk", log)
        try:
            wait_for(lambda: store.load("lk").first_point, timeout=120, what="the first consistent point",
                     describe=lambda: log.read_text()[-2000:])
            pair.src("ALTER TABLE items ADD COLUMN extra int")  # follows: a new Delta column
            pair.src("UPDATE items SET extra = id % 10 WHERE id % 3 = 0")
            pair.src("UPDATE prices SET price = price + 1, doc = doc || '{\"x\": 1}' WHERE id % 5 = 0")
            pair.src("DELETE FROM prices WHERE id > 390")
            writer.stop_event.set()
            writer.join()
            assert writer.error is None and writer.commits > 50
            stop_caught_up(pair, store, driver, log)
        finally:
            reap_group(driver)
    finally:
        writer.stop_event.set()

    wf = store.load("lk")
    assert wf.state == "Running" and wf.message == ""
    from deltalake import DeltaTable

    for qualified in ("public.items", "public.prices"):
        got, want = by_key(delta_rows(root, qualified)), by_key(source_rows(pair.source, qualified))
        keys = [r["id"] for r in got]
        assert len(keys) == len(set(keys)), f"{qualified}: duplicate keys"
        assert got == want, f"{qualified}: {len(got)} rows in Delta, {len(want)} on the source"
        t = wf.table(qualified)
        dt = DeltaTable(str(root / "public" / qualified.split(".")[1]))
        # Exactly once: the table's app transaction is the last batch the state says it applied.
        assert dt.transaction_version(app_id("lk")) == t.applied
        assert t.applied is not None and t.applied <= wf.position
    assert len(source_rows(pair.source, "public.items")) > 2500
    assert any(r["extra"] is not None for r in delta_rows(root, "public.items"))
    assert slot_confirmed(pair, wf.slot) <= wf.position

    # The points log: the last point names each table's current version.
    log_points = points(root, "lk")
    assert log_points and log_points[-1].position <= wf.position
    positions = [p.position for p in log_points]
    assert positions == sorted(set(positions))
    last = log_points[-1].versions
    assert last == {q: DeltaTable(str(root / "public" / q.split(".")[1])).version() for q in last}

    # An independent reader agrees: DuckDB's delta_scan.
    import duckdb
    import duckdb_extension_delta

    con = duckdb.connect()
    ext = next(Path(duckdb_extension_delta.__file__).parent.glob("extensions/*/delta.duckdb_extension"))
    con.execute(f"LOAD '{ext}'")
    count = con.execute(f"SELECT count(*), count(DISTINCT id) FROM delta_scan('{root / 'public' / 'items'}')").fetchone()
    assert count[0] == count[1] == len(source_rows(pair.source, "public.items"))

    # The consistent-read helper (lake/read.py) at the newest point, through Spark and through pyarrow: the
    # source's rows (nothing was written after the last batch, so the last point is the source's state).
    from sluicegate.targets.delta.read import arrow_tables_as_of, tables_as_of

    frames = tables_as_of(spark, str(root), "lk")
    arrows = arrow_tables_as_of(str(root), "lk")
    for qualified in ("public.items", "public.prices"):
        ids = sorted(r["id"] for r in source_rows(pair.source, qualified))
        assert sorted(r.id for r in frames[qualified].select("id").collect()) == ids, qualified
        assert sorted(arrows[qualified].column("id").to_pylist()) == ids, qualified

    status = lake.status("lk", target)
    assert status["state"] == "Running" and {t["table"] for t in status["tables"]} == set(moved)
    assert json.dumps(status)
    assert lake.delete("lk", target) == [f"replication slot {wf.slot}", f"publication {wf.publication}"]
    assert not store.exists("lk") and (root / "public" / "items").exists()


def sluicegate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluicegate.cli.main", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_no_point_before_the_stream_passes_every_copy(pair, tmp_path):
    """Tables are copied one after another, each at its own snapshot, and the replay starts at the first one's.
    Until the stream passes the last snapshot, a table copied later holds changes the others do not have yet:
    a point recorded meanwhile would show a two-table transaction on one table only. None is recorded."""
    pair.src("CREATE TABLE a (id int PRIMARY KEY, v int NOT NULL)")
    pair.src("CREATE TABLE b (id int PRIMARY KEY, v int NOT NULL)")
    pair.src("INSERT INTO a SELECT g, 0 FROM generate_series(1, 300) g")
    pair.src("INSERT INTO b SELECT g, 0 FROM generate_series(1, 300) g")
    root = tmp_path / "lake"
    target = f"delta:{root}"
    lake.create("pt", pair.source, target, None, None, [], {"batch_changes": 20})
    log = tmp_path / "driver.log"
    # a's copy is committed at its snapshot; b is copied only when the driver runs again
    kill_at(target, "pt", log, "lake.copy.before_progress", tmp_path)
    with psycopg.connect(pair.source, autocommit=True) as c:
        with c.transaction():  # on both tables: b's copy will have it, a gets it from the replay
            c.execute("UPDATE a SET v = 1 WHERE id = 1")
            c.execute("UPDATE b SET v = 1 WHERE id = 1")
        for i in range(2, 300):  # then many small batches (batch_changes 20) that touch a only
            c.execute("UPDATE a SET v = 2 WHERE id = %s", (i,))
    flushed = parse_lsn(pair.src("SELECT pg_current_wal_flush_lsn()::text")[0][0])
    store = Store(root)
    driver = start_driver(target, "pt", log)
    try:
        wait_for(lambda: store.load("pt").position >= flushed and store.load("pt").first_point, timeout=120,
                 what="caught up", describe=lambda: log.read_text()[-2000:])
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]
    finally:
        reap_group(driver)
    wf = store.load("pt")
    a, b = wf.table("public.a"), wf.table("public.b")
    # b was copied after every write above, so a's replay covers them all at positions below b's snapshot
    # (past `flushed` when anything else wrote WAL meanwhile: the server's, autovacuum's)
    assert a.copied_to < b.copied_to and b.copied_to >= flushed, (a.copied_to, b.copied_to, flushed)
    assert wf.position >= b.copied_to and a.applied > a.copied_to
    recorded = points(root, "pt")
    assert recorded and all(p.position >= b.copied_to for p in recorded), \
        [(p.position, b.copied_to) for p in recorded[:3]]
    for qualified in ("public.a", "public.b"):
        assert by_key(delta_rows(root, qualified)) == by_key(source_rows(pair.source, qualified)), qualified


def test_lake_cli_create_status_stop_start_delete(pair, tmp_path):
    """The commands a `--target delta:PATH` reaches, without running the workflow."""
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, note text)")
    pair.src("CREATE TABLE nokey (v int)")
    target = f"delta:{tmp_path / 'lake'}"
    bad = sluicegate("movetables", "create", "--workflow", "c1", "--source", pair.source, "--target", target,
                     "--tables", "items,nokey")
    assert bad.returncode == 1 and "nokey has no primary key" in bad.stderr
    assert not (tmp_path / "lake" / "public" / "items").exists()  # nothing made when a check fails
    made = sluicegate("movetables", "create", "--workflow", "c1", "--source", pair.source, "--target", target,
                      "--tables", "items")
    assert made.returncode == 0, made.stderr
    assert "public/items" in made.stdout
    again = sluicegate("movetables", "create", "--workflow", "c1", "--source", pair.source, "--target", target,
                       "--tables", "items")
    assert again.returncode == 1 and "already exists" in again.stderr
    status = sluicegate("workflow", "status", "c1", "--target", target, "--json")
    assert status.returncode == 0, status.stderr
    s = json.loads(status.stdout)
    assert s["state"] == "Init" and s["tables"][0]["delta_version"] == 0 and not s["running"]
    assert sluicegate("workflow", "stop", "c1", "--target", target).returncode == 0
    assert Store(tmp_path / "lake").load("c1").state == "Stopped"
    assert sluicegate("workflow", "start", "c1", "--target", target).returncode == 0
    assert Store(tmp_path / "lake").load("c1").state == "Init"
    text = sluicegate("workflow", "status", "c1", "--target", target)
    assert "public.items: 0 rows copied (copying), Delta version 0" in text.stdout
    gone = sluicegate("workflow", "delete", "c1", "--target", target, "--drop-tables")
    assert gone.returncode == 0, gone.stderr
    assert not (tmp_path / "lake" / "public" / "items").exists()
    assert sluicegate("workflow", "status", "c1", "--target", target).returncode == 1


def test_a_table_added_while_the_copy_ends_is_copied(pair, tmp_path):
    """The engine read the state with every table copied and is about to set Running when `replicate
    add-tables` appends one (forced by pausing it there): it must not set Running over a table never copied,
    whose rows would then never reach the Delta sink."""
    pair.src("CREATE TABLE a (id int PRIMARY KEY, v int NOT NULL)")
    pair.src("CREATE TABLE b (id int PRIMARY KEY, v int NOT NULL)")
    pair.src("INSERT INTO a SELECT g, 0 FROM generate_series(1, 100) g")
    pair.src("INSERT INTO b SELECT g, 0 FROM generate_series(1, 100) g")
    root = tmp_path / "lake"
    target = f"delta:{root}"
    made = sluicegate("replicate", "create", "--workflow", "ad", "--source", pair.source, "--sink", target,
                      "--tables", "a")
    assert made.returncode == 0, made.stderr
    log = tmp_path / "driver.log"
    point = "lake.copy.before_running"
    driver = start_driver(target, "ad", log, fault=point, fault_dir=tmp_path)
    store = Store(root)
    try:
        wait_for(lambda: (tmp_path / point).exists() or driver.poll() is not None, timeout=120,
                 what=f"fault point {point}", describe=lambda: log.read_text()[-2000:])
        added = sluicegate("replicate", "add-tables", "ad", "--tables", "b", "--target", target)
        assert added.returncode == 0, added.stderr
        (tmp_path / point).unlink()  # the engine goes on, with the state it read before b joined
        # It copies b and comes back here to set Running again (the point still pauses it): let it go on
        wait_for(lambda: (tmp_path / point).exists() or driver.poll() is not None, timeout=90,
                 what="the copy of b ending", describe=lambda: log.read_text()[-2000:])
        assert store.load("ad").table("public.b").done
        (tmp_path / point).unlink()
        wait_for(lambda: store.load("ad").state == "Running" and store.load("ad").table("public.b").done,
                 timeout=90, what="b copied", describe=lambda: log.read_text()[-2000:])
        pair.src("UPDATE b SET v = 1 WHERE id <= 10")
        flushed = parse_lsn(pair.src("SELECT pg_current_wal_flush_lsn()::text")[0][0])
        wait_for(lambda: store.load("ad").position >= flushed, timeout=90, what="caught up",
                 describe=lambda: log.read_text()[-2000:])
        assert driver.poll() is None, log.read_text()[-2000:]
    finally:
        reap_group(driver)
    for qualified in ("public.a", "public.b"):
        assert by_key(delta_rows(root, qualified)) == by_key(source_rows(pair.source, qualified)), qualified


# Every fault point of the Delta target (the default set kills at two of them, above).
LAKE_POINTS = ["lake.copy.task_written", "lake.copy.before_progress", "lake.copy.before_running",
               "lake.slice.mid_batch", "lake.replicate.columns_added", "lake.replicate.between_tables",
               "lake.replicate.before_state"]


@pytest.mark.slow
@pytest.mark.parametrize("point", LAKE_POINTS)
def test_killed_at_each_fault_point_the_lake_ends_equal(pair, tmp_path, point):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("INSERT INTO items SELECT g, 0, md5(g::text) FROM generate_series(1, 2000) g")
    pair.src("CREATE TABLE other (id int PRIMARY KEY, v text)")
    pair.src("INSERT INTO other SELECT g, md5(g::text) FROM generate_series(1, 300) g")
    root = tmp_path / "lake"
    target = f"delta:{root}"
    lake.create("lk", pair.source, target, None, None, [], {"cycle_rows": 500, "chunk_rows": 250})
    store = Store(root)
    log = tmp_path / "driver.log"
    writer = Writer(pair.source, 2000, pause=0.005)
    writer.start()
    try:
        if not point.startswith("lake.copy."):  # to Running first, then a change of shape and rows to replay
            driver = start_driver(target, "lk", log)
            try:
                wait_for(lambda: store.load("lk").first_point, timeout=120, what="the first consistent point",
                         describe=lambda: log.read_text()[-2000:])
                driver.send_signal(signal.SIGTERM)
                assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]
            finally:
                reap_group(driver)
            pair.src("ALTER TABLE items ADD COLUMN extra int")
            pair.src("UPDATE items SET extra = id % 10 WHERE id % 3 = 0")
            pair.src("UPDATE other SET v = v || 'x' WHERE id % 2 = 0")
        kill_at(target, "lk", log, point, tmp_path)
        wf = store.load("lk")
        held = wf.position  # the lake holds every change before it; once every table is copied, also
        if all(t.done for t in wf.tables):  # before the earliest copy snapshot (where the replay starts)
            held = max(held, min(t.copy_from for t in wf.tables))
        confirmed = slot_confirmed(pair, wf.slot)
        assert confirmed is None or confirmed <= held  # never past what the lake holds

        driver = start_driver(target, "lk", log)
        try:
            wait_for(lambda: store.load("lk").first_point, timeout=120, what="the first consistent point",
                     describe=lambda: log.read_text()[-2000:])
            writer.stop_event.set()
            writer.join()
            assert writer.error is None
            stop_caught_up(pair, store, driver, log)
        finally:
            reap_group(driver)
    finally:
        writer.stop_event.set()

    from deltalake import DeltaTable

    wf = store.load("lk")
    assert wf.state == "Running" and wf.message == ""
    for qualified in ("public.items", "public.other"):
        got, want = by_key(delta_rows(root, qualified)), by_key(source_rows(pair.source, qualified))
        assert got == want, f"{qualified}: {len(got)} rows in Delta, {len(want)} on the source"
        applied = wf.table(qualified).applied
        if applied is not None:  # exactly once: the table's app transaction is the batch the state names
            assert DeltaTable(str(root / "public" / qualified.split(".")[1])).transaction_version(
                app_id("lk")) == applied

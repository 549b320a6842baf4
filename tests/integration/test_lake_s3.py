"""MoveTables into a Delta target on S3 (moto's S3 server on 127.0.0.1, started and stopped here): the state, the
copy files, the points and the readers live in the bucket; `workflow run` killed -9 resumes from what the bucket
holds; two drivers started at once: one runs, the other exits with one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pyarrow.dataset as ds
import pytest

from sluicegate.position import parse_lsn
from sluicegate.targets.delta import cli as lake
from sluicegate.targets.delta.location import filesystem_paths
from sluicegate.targets.delta.state import DeltaStore, app_id, open_store

from ..conftest import wait_for
from .helpers import Writer, reap_group, slot_confirmed
from .test_lake_movetables import by_key, kill_at, sluicegate, source_rows, start_driver

pytestmark = pytest.mark.spark

BUCKET = "lake"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server on 127.0.0.1, its address and fake credentials in the environment (which the drivers
    started here inherit), one bucket."""
    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=log.open("ab"), stderr=subprocess.STDOUT)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true",
           "AWS_CONDITIONAL_PUT": "etag"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1")
        wait_for(lambda: client.create_bucket(Bucket=BUCKET), timeout=60, what="moto's S3 server",
                 describe=lambda: log.read_text()[-1000:])
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.terminate()
        server.wait(timeout=30)


def s3_rows(uri: str) -> list[dict]:
    from deltalake import DeltaTable

    fs, paths = filesystem_paths(DeltaTable(uri).file_uris())
    return ds.dataset(paths, filesystem=fs, format="parquet").to_table().to_pylist() if paths else []


def make_source(pair, rows: int = 2000) -> None:
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src(f"INSERT INTO items SELECT g, 0, md5(g::text) FROM generate_series(1, {rows}) g")
    pair.src("CREATE TABLE prices (id int PRIMARY KEY, price numeric(10,2), at timestamptz)")
    pair.src("INSERT INTO prices SELECT g, g / 7.0, '2024-01-01 00:00:00+00'::timestamptz + g * interval '1 hour' "
             "FROM generate_series(1, 300) g")


def assert_equal(pair, root: str, wf) -> None:
    from deltalake import DeltaTable

    for qualified in ("public.items", "public.prices"):
        uri = f"{root}/public/{qualified.split('.')[1]}"
        got, want = by_key(s3_rows(uri)), by_key(source_rows(pair.source, qualified))
        assert len({r["id"] for r in got}) == len(got), f"{qualified}: duplicate keys"
        assert got == want, f"{qualified}: {len(got)} rows in Delta, {len(want)} on the source"
        t = wf.table(qualified)
        assert DeltaTable(uri).transaction_version(app_id(wf.name)) == t.applied


def caught_up(pair, store, name: str, log) -> None:
    flushed = parse_lsn(pair.src("SELECT pg_current_wal_flush_lsn()::text")[0][0])
    wait_for(lambda: store.load(name).position >= flushed, timeout=90, what="caught up",
             describe=lambda: log.read_text()[-2000:])


@pytest.mark.slow
def test_movetables_into_s3_survives_kill_9(s3, pair, spark, tmp_path):
    make_source(pair, 3000)
    root = f"s3://{BUCKET}/k9{os.getpid()}"
    target = f"delta:{root}"
    # stage_rows: batches stage their net effect (in the task's local temporary directory for a URI lake)
    lake.create("s3k", pair.source, target, None, None, [], {"cycle_rows": 1000, "chunk_rows": 400,
                                                              "stage_rows": 40})
    store = open_store(target)
    assert isinstance(store, DeltaStore)
    writer = Writer(pair.source, 3000, pause=0.005)
    writer.start()
    log = tmp_path / "driver.log"
    try:
        kill_at(target, "s3k", log, "lake.copy.before_progress", tmp_path)
        assert store.load("s3k").state == "Copying"
        kill_at(target, "s3k", log, "lake.replicate.between_tables", tmp_path)
        wf = store.load("s3k")
        confirmed = slot_confirmed(pair, wf.slot)
        assert confirmed is None or confirmed <= wf.position
        driver = start_driver(target, "s3k", log)  # at once: the killed driver's lease binds no more
        try:
            wait_for(lambda: store.load("s3k").first_point, timeout=120, what="the first consistent point",
                     describe=lambda: log.read_text()[-2000:])
            writer.stop_event.set()
            writer.join()
            assert writer.error is None and writer.commits > 50
            caught_up(pair, store, "s3k", log)
            driver.send_signal(signal.SIGTERM)
            assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]
        finally:
            reap_group(driver)
    finally:
        writer.stop_event.set()
    wf = store.load("s3k")
    assert wf.state == "Running" and not store.is_running("s3k")
    assert_equal(pair, root, wf)
    assert slot_confirmed(pair, wf.slot) <= wf.position

    # vdiff plays the stream to its own point on S3 (writes since the driver stopped) and compares there.
    pair.src("UPDATE items SET qty = qty + 100 WHERE id % 11 = 0")
    diff = subprocess.run([sys.executable, "-m", "sluicegate.cli.main", "vdiff", "s3k", "--target", target,
                           "--spark-master", "local[2]", "--json"], capture_output=True, text=True, timeout=180,
                          check=False)
    assert diff.returncode == 0, diff.stderr[-2000:]
    report = json.loads(diff.stdout)
    assert report["equal"] and report["tables"]["public.items"]["rows_compared"] > 2000


@pytest.mark.slow  # the default set replicates into S3 (test_replicate_into_an_s3_sink)
def test_s3_target_commands_two_drivers_and_readers(s3, pair, spark, tmp_path):
    """create, two drivers at once (one runs), status/stop/start, optimize/vacuum, the readers; on S3."""
    make_source(pair)
    root = f"s3://{BUCKET}/cmd{os.getpid()}"
    target = f"delta:{root}"
    made = sluicegate("movetables", "create", "--workflow", "s3c", "--source", pair.source, "--target", target)
    assert made.returncode == 0, made.stderr
    assert f"{root}/_sluicegate/workflows/s3c" in made.stdout and "AWS" not in made.stdout
    store = open_store(target)
    pair.src("UPDATE items SET qty = 5 WHERE id % 7 = 0")
    logs = [tmp_path / "d1.log", tmp_path / "d2.log"]
    drivers = [start_driver(target, "s3c", log) for log in logs]
    try:
        wait_for(lambda: any(d.poll() is not None for d in drivers), timeout=120, what="one driver to give up",
                 describe=lambda: [log.read_text()[-1000:] for log in logs])
        lost = next(i for i, d in enumerate(drivers) if d.poll() is not None)
        ran = drivers[1 - lost]
        assert drivers[lost].returncode == 1
        said = [ln for ln in logs[lost].read_text().splitlines() if "already being run" in ln]
        assert len(said) == 1 and "Traceback" not in logs[lost].read_text(), logs[lost].read_text()[-2000:]
        assert ran.poll() is None and store.is_running("s3c")
        wait_for(lambda: store.load("s3c").first_point, timeout=120, what="the first consistent point",
                 describe=lambda: logs[1 - lost].read_text()[-2000:])
        pair.src("DELETE FROM prices WHERE id > 290")
        pair.src("INSERT INTO items SELECT g, 1, 'late' FROM generate_series(2001, 2100) g")
        caught_up(pair, store, "s3c", logs[1 - lost])
        status = sluicegate("workflow", "status", "s3c", "--target", target, "--json")
        assert status.returncode == 0, status.stderr
        s = json.loads(status.stdout)
        assert s["running"] and s["state"] == "Running" and s["target"] == target
        assert {t["table"] for t in s["tables"]} == {"public.items", "public.prices"}
        stop = sluicegate("workflow", "stop", "s3c", "--target", target)
        assert stop.returncode == 0, stop.stderr
        assert ran.wait(timeout=90) == 0, logs[1 - lost].read_text()[-2000:]
    finally:
        for d in drivers:
            reap_group(d)
    assert store.load("s3c").state == "Stopped" and not store.is_running("s3c")
    assert sluicegate("workflow", "start", "s3c", "--target", target).returncode == 0
    wf = store.load("s3c")
    assert wf.state == "Running"
    assert_equal(pair, root, wf)

    opt = sluicegate("lake", "optimize", "s3c", "--target", target, "--json")
    assert opt.returncode == 0, opt.stderr
    assert {t["table"] for t in json.loads(opt.stdout)["tables"]} >= {"public.items", "public.prices"}
    vac = sluicegate("lake", "vacuum", "s3c", "--target", target, "--retention", "0h", "--allow-short-retention",
                     "--json")
    assert vac.returncode == 0, vac.stderr
    assert sum(t["files_removed"] for t in json.loads(vac.stdout)["tables"]) > 0
    assert_equal(pair, root, store.load("s3c"))

    from sluicegate.targets.delta.read import arrow_tables_as_of, tables_as_of

    arrows = arrow_tables_as_of(target, "s3c")
    spark.sparkContext.environment.update(s3)  # the executors' credentials (spark.executorEnv.* on a cluster)
    frames = tables_as_of(spark, target, "s3c")
    for qualified in ("public.items", "public.prices"):
        want = by_key(source_rows(pair.source, qualified))
        assert by_key(arrows[qualified].to_pylist()) == want, qualified
        assert sorted(r.id for r in frames[qualified].select("id").collect()) == [r["id"] for r in want]

    gone = sluicegate("workflow", "delete", "s3c", "--target", target, "--drop-tables")
    assert gone.returncode == 0, gone.stderr
    assert not store.exists("s3c") and "Delta table" in gone.stdout


def test_replicate_into_an_s3_sink(s3, pair, spark, tmp_path):
    """A Replicate workflow whose sink is a Delta target on S3: its decision at create, its consumer, add-tables
    and bootstrap --tables beside the running consumer (the state a Delta table that both commit to), safe
    time and slot in status, delete."""
    make_source(pair)
    root = f"s3://{BUCKET}/rep{os.getpid()}"
    target = f"delta:{root}"
    made = sluicegate("replicate", "create", "--workflow", "rs3", "--source", pair.source, "--sink", target,
                      "--tables", "items")
    assert made.returncode == 0, made.stderr
    assert f"sink s1 ({target}), table public.items: copy — new setup, Delta table created" in made.stdout
    store = open_store(target)
    assert isinstance(store, DeltaStore) and store.load("rs3").kind == "Replicate"
    log = tmp_path / "rep.log"
    driver = start_driver(target, "rs3", log)
    try:
        wait_for(lambda: store.load("rs3").first_point, timeout=120, what="the first consistent point",
                 describe=lambda: log.read_text()[-2000:])
        pair.src("UPDATE prices SET price = 1 WHERE id % 3 = 0")  # before add-tables: in prices' copy
        added = sluicegate("replicate", "add-tables", "rs3", "--tables", "prices", "--target", target)
        assert added.returncode == 0, added.stderr
        assert "table public.prices: copy — new setup, Delta table created" in added.stdout, added.stdout
        pair.src("UPDATE prices SET price = 2 WHERE id % 4 = 0")  # after: replayed
        cycles = store.load("rs3").table("public.items").cycles
        wait_for(lambda: store.load("rs3").state == "Running" and store.load("rs3").table("public.prices").done,
                 timeout=120, what="prices copied", describe=lambda: log.read_text()[-2000:])
        again = sluicegate("replicate", "bootstrap", "rs3", "--sink", target, "--tables", "items")
        assert again.returncode == 0, again.stderr
        pair.src("UPDATE items SET qty = 9 WHERE id % 5 = 0")
        pair.src("DELETE FROM prices WHERE id < 10")
        wait_for(lambda: store.load("rs3").state == "Running" and store.load("rs3").table("public.items").cycles
                 > cycles, timeout=120, what="items copied again", describe=lambda: log.read_text()[-2000:])
        caught_up(pair, store, "rs3", log)
        assert driver.poll() is None, log.read_text()[-2000:]  # one consumer run throughout
        assert "sink s1: new setup: bootstrap by a copy of 1 table(s)" in log.read_text()
        s = json.loads(sluicegate("workflow", "status", "rs3", "--target", target, "--json").stdout)
        assert s["kind"] == "Replicate" and s["sink"] == "s1" and s["safe_time"].endswith("Z")
        assert [(h["sink"], h["exists"]) for h in s["sinks"]] == [("s1", True)]
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]
    finally:
        reap_group(driver)
    assert_equal(pair, root, store.load("rs3"))
    slot = store.load("rs3").slot
    gone = sluicegate("workflow", "delete", "rs3", "--target", target, "--drop-tables")
    assert gone.returncode == 0, gone.stderr
    assert not store.exists("rs3")
    assert not pair.src("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,))

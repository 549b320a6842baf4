"""A Delta target under a big source transaction (atomic across tables through the consistent-read helper,
staged in bounded memory), under many small ones (then `lake optimize`), and with housekeeping on a schedule."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pyarrow.dataset as ds
import pytest

from sluicegate.position import parse_lsn
from sluicegate.targets.delta import cli as lake
from sluicegate.targets.delta import read
from sluicegate.targets.delta.state import Store, app_id

from ..conftest import wait_for
from .helpers import Writer, reap_group
from .test_lake_movetables import by_key, delta_rows, sluicegate, source_rows, start_driver

pytestmark = pytest.mark.spark


def tree_peak_rss(root_pid: int) -> dict[str, int]:
    """Peak resident memory (VmHWM, bytes) of each live process descending from `root_pid`, by kind (python,
    java). By parentage, not process group: PySpark's daemon puts itself and its workers in a group of their own."""
    parent: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        parent[int(pid)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        children = [p for p, pp in parent.items() if pp in frontier and p not in tree]
        tree.update(children)
        frontier = children
    out: dict[str, int] = {}
    for pid in tree:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        hwm = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM")), 0)
        out[f"{'java' if cmd.endswith('java') else 'python'}:{pid}"] = hwm
    return out


def start_verbose_driver(target: str, workflow: str, log: Path) -> subprocess.Popen:
    """`workflow run -v`: the driver logs its housekeeping."""
    env = dict(os.environ)
    env.pop("SLUICEGATE_DRIVER_PID", None)
    return subprocess.Popen(
        [sys.executable, "-m", "sluicegate.cli.main", "-v", "workflow", "run", workflow, "--target", target,
         "--no-progress", "--spark-master", "local[2]"],
        env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def counts_at_newest_point(root: Path, workflow: str, tables: list[str]) -> dict[str, int]:
    """Row counts of each table at the workflow's newest consistent point (Parquet metadata only)."""
    from deltalake import DeltaTable

    point = read.point_for(str(root), workflow)
    out = {}
    for q in tables:
        files = DeltaTable(read.table_uri(str(root), q), version=point.versions[q]).file_uris()
        out[q] = ds.dataset(files).count_rows() if files else 0
    return out


def caught_up(store: Store, workflow: str, url: str) -> callable:
    with psycopg.connect(url, autocommit=True) as c:
        flushed = parse_lsn(c.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])
    return lambda: store.load(workflow).position >= flushed


def big_transaction(pair, tmp_path, rows: int, stage_rows: int, note_bytes: int = 32, options=None) -> dict:
    """`rows` rows inserted into each of two tables in one transaction, each with a text of `note_bytes` (the
    source stores it compressed; the stream sends it whole)."""
    pair.src("CREATE TABLE a (id bigint PRIMARY KEY, v int NOT NULL, note text)")
    pair.src("CREATE TABLE b (id bigint PRIMARY KEY, v int NOT NULL, note text)")
    pair.src("INSERT INTO a SELECT g, 0, 'before' FROM generate_series(1, 1000) g")
    pair.src("INSERT INTO b SELECT g, 0, 'before' FROM generate_series(1, 1000) g")
    root = tmp_path / "lake"
    target = f"delta:{root}"
    lake.create("big", pair.source, target, None, None, [], {"stage_rows": stage_rows, **(options or {})})
    store = Store(root)
    tables = ["public.a", "public.b"]
    log = tmp_path / "driver.log"
    driver = start_driver(target, "big", log)
    seen: set[tuple[int, int]] = set()
    errors: list[str] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                c = counts_at_newest_point(root, "big", tables)
            except Exception as exc:  # noqa: BLE001 - the assertion below says what
                errors.append(repr(exc))
                return
            seen.add((c["public.a"], c["public.b"]))

    peaks: dict[str, int] = {}
    try:
        wait_for(lambda: store.load("big").first_point, timeout=120, what="the first consistent point",
                 describe=lambda: log.read_text()[-2000:])
        reader = threading.Thread(target=poll, daemon=True)
        reader.start()
        # One source transaction: `rows` inserted into each table, and every copied row updated.
        with psycopg.connect(pair.source) as c:
            for t in ("a", "b"):
                c.execute(f"INSERT INTO {t} SELECT g, 1, repeat(md5(g::text), {max(1, note_bytes // 32)}) "
                          f"FROM generate_series(1001, {1000 + rows}) g")
                c.execute(f"UPDATE {t} SET v = 2 WHERE id <= 1000")
        whole = 1000 + rows

        def applied():
            peaks.update({k: max(v, peaks.get(k, 0)) for k, v in tree_peak_rss(driver.pid).items()})
            return counts_at_newest_point(root, "big", tables) == {"public.a": whole, "public.b": whole}

        wait_for(applied, timeout=600, interval=0.5, what="the big transaction applied",
                 describe=lambda: log.read_text()[-2000:])
        done.set()
        reader.join(timeout=60)
        peaks.update({k: max(v, peaks.get(k, 0)) for k, v in tree_peak_rss(driver.pid).items()})
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]
    finally:
        done.set()
        reap_group(driver)
    assert not errors, errors
    # Never one table with the transaction and the other without it, and never part of it.
    assert seen <= {(1000, 1000), (whole, whole)} and (whole, whole) in seen, sorted(seen)
    frames = read.arrow_tables_as_of(str(root), "big", tables)
    for q in tables:
        assert frames[q].num_rows == whole
        assert sorted(set(frames[q].column("v").to_pylist())) == [1, 2]
        assert by_key(delta_rows(root, q)) == by_key(source_rows(pair.source, q))
    from deltalake import DeltaTable

    wf = store.load("big")
    for q in tables:
        assert DeltaTable(str(root / "public" / q[7:])).transaction_version(app_id("big")) == wf.table(q).applied
    assert not any((root / "_sluicegate" / "staging").rglob("*"))  # the batch's files are gone
    python = max(v for k, v in peaks.items() if k.startswith("python"))
    print(f"\nbig transaction {2 * rows} rows, stage_rows {stage_rows}: peak RSS python {python >> 20} MiB, "
          f"per process {json.dumps({k: v >> 20 for k, v in peaks.items()})}")
    return {"python_peak": python, "log": log.read_text()}


def test_big_transaction_is_atomic_across_tables(pair, spark, tmp_path):
    """A 2 x 60k-row transaction, staged in 10k-row generations."""
    big_transaction(pair, tmp_path, 60_000, 10_000)


@pytest.mark.slow
def test_million_row_transaction_is_atomic_in_bounded_memory(pair, spark, tmp_path):
    result = big_transaction(pair, tmp_path, 500_000, 50_000)
    assert result["python_peak"] < 1024 << 20


@pytest.mark.slow  # ~20 s; test_big_transaction_is_atomic_across_tables stages in the default set
def test_wide_rows_are_staged_by_their_bytes(pair, spark, tmp_path):
    """2 x 20,000 rows of 16 kB in one transaction (640 MB as the stream sends it), fewer changes than
    stage_rows: staged by their bytes (stage_bytes, 64 MB). Held in memory whole, the play task's peak was
    2.6 GB; staged, 1.35 GB, most of it delta-rs's MERGE (bench/README.md, "staging by bytes")."""
    result = big_transaction(pair, tmp_path, 20_000, 50_000, note_bytes=16 << 10)
    assert result["python_peak"] < 2 << 30


@pytest.mark.slow  # the default set optimizes on a schedule (test_housekeeping_on_a_schedule)
def test_small_transactions_then_optimize(pair, spark, tmp_path):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("CREATE TABLE events (id bigint PRIMARY KEY, item bigint, at timestamptz DEFAULT now())")
    pair.src("INSERT INTO items SELECT g, 0, 'n' FROM generate_series(1, 500) g")
    root = tmp_path / "lake"
    target = f"delta:{root}"
    made = sluicegate("movetables", "create", "--workflow", "small", "--source", pair.source, "--target", target,
                      "--optimize-every", "0", "--vacuum-every", "0")
    assert made.returncode == 0, made.stderr
    store = Store(root)
    log = tmp_path / "driver.log"
    driver = start_driver(target, "small", log)
    try:
        wait_for(lambda: store.load("small").first_point, timeout=120, what="the first consistent point",
                 describe=lambda: log.read_text()[-2000:])
        with psycopg.connect(pair.source, autocommit=True) as c:
            for i in range(10_000):  # 10,000 source transactions
                if i % 2:
                    c.execute("UPDATE items SET qty = qty + 1 WHERE id = %s", (i % 500 + 1,))
                else:
                    c.execute("INSERT INTO events (id, item) VALUES (%s, %s)", (i, i % 500 + 1))
        wait_for(caught_up(store, "small", pair.source), timeout=180, what="caught up",
                 describe=lambda: log.read_text()[-2000:])
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]
    finally:
        reap_group(driver)
    assert "optimize small" not in log.read_text()  # --optimize-every 0: never on its own
    from deltalake import DeltaTable

    before = {}
    for q in ("public.items", "public.events"):
        dt = DeltaTable(str(root / "public" / q[7:]))
        before[q] = (len(dt.file_uris()), dt.transaction_version(app_id("small")), dt.version())
        assert before[q][2] < 2000, f"{q}: {before[q][2]} commits for 10,000 transactions"
    done = sluicegate("lake", "optimize", "small", "--target", target, "--json")
    assert done.returncode == 0, done.stderr
    report = {t["table"]: t for t in json.loads(done.stdout)["tables"]}
    print(f"\n10,000 transactions: {json.dumps(before)}; optimize: {json.dumps(report)}")
    for q in ("public.items", "public.events"):
        dt = DeltaTable(str(root / "public" / q[7:]))
        # An update MERGE rewrites the file it touches; inserts add one file per batch: those compact.
        assert len(dt.file_uris()) <= before[q][0] and report[q]["files_after"] == len(dt.file_uris())
        assert dt.transaction_version(app_id("small")) == before[q][1] == store.load("small").table(q).applied
        assert by_key(delta_rows(root, q)) == by_key(source_rows(pair.source, q))
    assert report["public.events"]["files_after"] < before["public.events"][0]
    assert len(source_rows(pair.source, "public.events")) == 5000


@pytest.mark.slow  # ~16 s; test_lake_read runs optimize and vacuum in the default set
def test_housekeeping_on_a_schedule(pair, spark, tmp_path):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("INSERT INTO items SELECT g, 0, md5(g::text) FROM generate_series(1, 2000) g")
    root = tmp_path / "lake"
    target = f"delta:{root}"
    bad = sluicegate("movetables", "create", "--workflow", "hk", "--source", pair.source, "--target", target,
                     "--vacuum-every", "soon")
    assert bad.returncode == 1 and "--vacuum-every" in bad.stderr
    # Made with a schedule under which nothing would run during the test (optimize hourly, vacuum never); the
    # test changes it with `lake schedule` while the driver runs, whose play task then ends and replans.
    made = sluicegate("movetables", "create", "--workflow", "hk", "--source", pair.source, "--target", target,
                      "--optimize-every", "1h", "--vacuum-every", "0", "--vacuum-retention", "0s")
    assert made.returncode == 0, made.stderr
    store = Store(root)
    schedule_keys = ("optimize_every", "vacuum_every", "vacuum_retention")
    assert {k: store.load("hk").options[k] for k in schedule_keys} == {
        "optimize_every": 3600.0, "vacuum_every": 0.0, "vacuum_retention": 0.0}
    shown = sluicegate("lake", "schedule", "hk", "--target", target)
    assert shown.returncode == 0 and "optimize-every: 1:00:00" in shown.stdout and "vacuum-every: never" in \
        shown.stdout, shown.stdout + shown.stderr
    bad = sluicegate("lake", "schedule", "hk", "--target", target, "--optimize-every", "often")
    assert bad.returncode == 1 and "--optimize-every" in bad.stderr and "Traceback" not in bad.stderr
    log = tmp_path / "driver.log"
    writer = Writer(pair.source, 2000, pause=0.01)
    driver = start_verbose_driver(target, "hk", log)
    try:
        wait_for(lambda: store.load("hk").first_point, timeout=120, what="the first consistent point",
                 describe=lambda: log.read_text()[-2000:])
        writer.start()
        started = time.time()
        changed = sluicegate("lake", "schedule", "hk", "--target", target, "--optimize-every", "2s",
                             "--vacuum-every", "3s", "--json")
        assert changed.returncode == 0, changed.stderr
        assert json.loads(changed.stdout) == {"optimize_every": 2.0, "vacuum_every": 3.0, "vacuum_retention": 0.0,
                                              "commit_every": 30.0}

        def ran_twice():
            text = log.read_text()
            return text.count("optimize hk:") >= 2 and text.count("vacuum hk") >= 2

        wait_for(ran_twice, timeout=120, what="optimize and vacuum run on their schedule",
                 describe=lambda: log.read_text()[-2000:])
        writer.stop_event.set()
        writer.join()
        assert writer.error is None and writer.commits > 20
        wait_for(caught_up(store, "hk", pair.source), timeout=60, what="caught up",
                 describe=lambda: log.read_text()[-2000:])
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]
    finally:
        writer.stop_event.set()
        reap_group(driver)
    text = log.read_text()
    assert "failed, will try again" not in text, text[-3000:]
    wf = store.load("hk")
    assert wf.housekeeping["optimize"] > started and wf.housekeeping["vacuum"] > started
    assert by_key(delta_rows(root, "public.items")) == by_key(source_rows(pair.source, "public.items"))
    frames = read.arrow_tables_as_of(str(root), "hk")
    assert sorted(frames["public.items"].column("id").to_pylist()) == sorted(
        r["id"] for r in source_rows(pair.source, "public.items"))
    # Vacuum with retention 0 drops every point but the newest, and the files only older versions had.
    dropped = [int(n) for n in re.findall(r"vacuum hk \(retention [^)]*\): (\d+) points dropped", text)]
    removed = [int(n) for n in re.findall(r"public\.items (\d+) files removed", text)]
    assert sum(dropped) > 0 and sum(removed) > 0, text[-3000:]
    status = json.loads(sluicegate("workflow", "status", "hk", "--target", target, "--json").stdout)
    assert status["housekeeping"]["optimize_every"] == 2.0 and "last_vacuum" in status["housekeeping"]

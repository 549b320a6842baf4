"""A rule's replicate path runs in Spark jobs, not on the driver: memory, errors across the executor boundary."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from sluicegate.workflow.create import create_materialize

from ..conftest import EngineThread, wait_for
from .helpers import Writer, caught_up, reap_group, stream_row
from .test_kill_restart import start_driver

pytestmark = pytest.mark.spark


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class _Sampler(threading.Thread):
    """The driver process's RSS every 0.1 s, until stopped."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.samples, self.stop_event = pid, [], threading.Event()

    def run(self):
        while not self.stop_event.wait(0.1):
            self.samples.append(_rss_bytes(self.pid))


@pytest.mark.slow  # a soak of memory: bench/ measures it; CI's default suite keeps the kill test below
def test_driver_memory_stays_flat_while_a_1m_row_transaction_passes_through_a_rule(pair, tmp_path):
    pair.src("CREATE TABLE big (id bigint PRIMARY KEY, v int, pad text)")
    pair.src("INSERT INTO big SELECT g, g, 'row ' || g FROM generate_series(1, 1000) g")
    create_materialize("mem", pair.source, pair.target,
                       ["big_odd: SELECT id, v * 2 AS v2, upper(pad) AS pad FROM big WHERE v % 2 = 1"], {}, {})
    log = (tmp_path / "run.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", "mem",
                             "--target", pair.target], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_for(lambda: caught_up(pair, "mem"), timeout=180, what="the copy done and caught up",
                 describe=lambda: stream_row(pair, "mem"))
        # warm the replicate path (its first Spark job, the Python workers), then take the baseline
        pair.src("INSERT INTO big SELECT g, g, 'row ' || g FROM generate_series(1001, 21000) g")
        wait_for(lambda: caught_up(pair, "mem"), timeout=180, what="caught up after 20k rows",
                 describe=lambda: stream_row(pair, "mem"))
        baseline = max(_rss_bytes(proc.pid) for _ in range(3))
        sampler = _Sampler(proc.pid)
        sampler.start()
        pair.src("INSERT INTO big SELECT g, g, 'row ' || g FROM generate_series(21001, 1021000) g")  # one transaction
        wait_for(lambda: caught_up(pair, "mem"), timeout=600, interval=0.5, what="1M rows replicated",
                 describe=lambda: stream_row(pair, "mem"))
        sampler.stop_event.set()
        sampler.join()
        assert proc.poll() is None, (tmp_path / "run.log").read_text()[-2000:]
        assert len(sampler.samples) > 10
        growth = max(sampler.samples) - baseline
        print(f"driver RSS {baseline >> 20} MB, peak {max(sampler.samples) >> 20} MB during the 1M-row transaction")
        assert growth < 50 << 20, f"driver RSS grew {growth >> 20} MB (baseline {baseline >> 20} MB)"
        assert pair.dst("SELECT count(*), sum(v2) FROM big_odd") == \
            pair.src("SELECT count(*), sum(v * 2) FROM big WHERE v % 2 = 1")
    finally:
        reap_group(proc)
        log.close()


def test_a_rule_that_fails_at_run_time_stops_the_stream_naming_the_table_and_the_key(pair, spark):
    pair.src("CREATE TABLE codes (id int PRIMARY KEY, code text)")
    pair.src("INSERT INTO codes SELECT g, g::text FROM generate_series(1, 500) g")
    create_materialize("bad", pair.source, pair.target,
                       ["codes_n: SELECT id, CAST(code AS INT) AS n FROM codes"], {}, {})
    with EngineThread(spark, pair.target, "bad") as run:
        wait_for(lambda: caught_up(pair, "bad"), what="caught up", describe=lambda: stream_row(pair, "bad"))
        pair.src("INSERT INTO codes SELECT g, g::text FROM generate_series(501, 600) g")
        wait_for(lambda: caught_up(pair, "bad"), what="caught up again", describe=lambda: stream_row(pair, "bad"))
        pair.src("INSERT INTO codes VALUES (777, 'not a number')")
        wait_for(lambda: stream_row(pair, "bad")["state"] == "Error", what="Error",
                 describe=lambda: stream_row(pair, "bad"))
        run.thread.join(timeout=60)
    message = stream_row(pair, "bad")["message"]
    assert "public.codes" in message and "777" in message and "not a number" in message, message
    # nothing of the failed batch was applied; what came before it was
    assert pair.dst("SELECT count(*), max(id) FROM codes_n") == [(600, 600)]


@pytest.mark.parametrize("point", [
    pytest.param("replicate.before_commit", marks=pytest.mark.slow),  # data and position written, not committed
    pytest.param("rule_batch.mid_read", marks=pytest.mark.slow),  # a table's peek half read
    pytest.param("rule_batch.before_advance", marks=pytest.mark.slow),  # committed, the slot not confirmed
])
def test_kill_9_while_replicating_through_a_rule_then_resume(pair, tmp_path, point):
    """Reading (a task's peek), applying (the task's transaction) and confirming the slot (the driver)."""
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("INSERT INTO items SELECT g, g % 4, md5(g::text) FROM generate_series(1, 2000) g")
    rule = "busy: SELECT id, qty * 10 AS qty10, upper(note) AS note FROM items WHERE qty % 2 = 0"
    expected = "SELECT id, qty * 10, upper(note) FROM items WHERE qty % 2 = 0 ORDER BY id"
    create_materialize("k9r", pair.source, pair.target, [rule], {}, {})
    log = tmp_path / "driver.log"
    driver = start_driver(pair, "k9r", log)
    writer = Writer(pair.source, 2000, pause=0.005)
    try:
        wait_for(lambda: stream_row(pair, "k9r")["state"] == "Running", timeout=180, what="Running",
                 describe=lambda: log.read_text()[-2000:])
        reap_group(driver)
        writer.start()
        driver = start_driver(pair, "k9r", log, fault=point, fault_dir=tmp_path)
        wait_for(lambda: (tmp_path / point).exists() or driver.poll() is not None, timeout=240,
                 what=f"fault point {point}", describe=lambda: log.read_text()[-2000:])
        assert driver.poll() is None, log.read_text()[-2000:]
        os.kill(driver.pid, signal.SIGKILL)
        reap_group(driver)
        writer.stop_event.set()
        writer.join()
        assert writer.error is None
        driver = start_driver(pair, "k9r", log)
        wait_for(lambda: caught_up(pair, "k9r"), timeout=240, what="caught up after the kill",
                 describe=lambda: (stream_row(pair, "k9r"), log.read_text()[-2000:]))
        assert pair.dst("SELECT id, qty10, note FROM busy ORDER BY id") == pair.src(expected)
    finally:
        writer.stop_event.set()
        reap_group(driver)

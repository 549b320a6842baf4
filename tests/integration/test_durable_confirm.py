"""Guarantee 7 on a target that commits asynchronously: the slot is confirmed only past what the target has
flushed, so crashing that target (`-m immediate`: commits still in its WAL buffers are gone) never leaves a
stream that needs a re-bootstrap.

The target runs with `synchronous_commit = off` (a wide window of commits that only memory holds) and fsync
on, as a production server would; the source writes throughout; a MoveTables and
a Replicate sink apply into it; it is crashed three times.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import psycopg
import pytest

from sluicegate.cluster.create import create_replicate
from sluicegate.localpg import LocalPostgres
from sluicegate.workflow.create import create_movetables

from ..conftest import Pair, wait_for
from .helpers import assert_same, caught_up, reap_group, stream_row

pytestmark = pytest.mark.spark


@pytest.fixture
def async_target(tmp_path):
    # Commits only memory holds, for seconds: the WAL writer wakes every 10 s, and the background writer
    # (which flushes WAL before writing a dirty page) writes nothing.
    server = LocalPostgres(tmp_path / "async", settings={
        "synchronous_commit": "off", "wal_writer_delay": "10s", "wal_buffers": "64MB", "bgwriter_lru_maxpages": 0,
        "fsync": "on"}).init().start()
    yield server
    server.stop()


class Writes(threading.Thread):
    """Inserts and updates on both tables, one small transaction after another, until stopped."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop_event, self.n, self.error = url, threading.Event(), 0, None

    def run(self):
        try:
            with psycopg.connect(self.url, autocommit=True) as c:
                while not self.stop_event.is_set():
                    self.n += 1
                    for t in ("a", "b"):
                        c.execute(f"INSERT INTO {t} VALUES (%s, 0)", (1000 + self.n,))
                        c.execute(f"UPDATE {t} SET v = v + 1 WHERE id = %s", (self.n % 100 + 1,))
                    self.stop_event.wait(0.005)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            self.error = exc


def _driver(target: str, workflow: str, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("SLUICEGATE_TARGET", "SLUICEGATE_DRIVER_PID")}
    return subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", workflow, "--target",
                             target, "--no-progress"], env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def test_crashing_an_asynchronous_target_needs_no_rebootstrap(source_server, async_target, tmp_path):
    p = Pair(source_server, async_target, f"dur{os.getpid()}")
    try:
        for t in ("a", "b"):
            p.src(f"CREATE TABLE {t} (id int PRIMARY KEY, v int NOT NULL)")
            p.src(f"INSERT INTO {t} SELECT g, 0 FROM generate_series(1, 100) g")
        create_movetables("mt", p.source, p.target, ["a"], [], {})
        create_replicate("rp", p.source, [p.target], ["b"], None, {})
        logs = {w: tmp_path / f"{w}.log" for w in ("mt", "rp")}
        drivers = [_driver(p.target, w, log) for w, log in logs.items()]
        writes = Writes(p.source)
        tail = lambda: "\n".join(f"{w}: {x.read_text()[-1500:]}" for w, x in logs.items())
        try:
            writes.start()
            for crash in range(3):
                done = writes.n
                # both streams applying: commits the target has not flushed yet are in its WAL buffers
                wait_for(lambda done=done: all(stream_row(p, w)["state"] == "Running" for w in logs)
                         and writes.n > done + 50,
                         timeout=180, what=f"both streams running before crash {crash + 1}", describe=tail)
                async_target.stop("immediate")
                async_target.start()
            writes.stop_event.set()
            writes.join(timeout=30)
            assert writes.error is None, writes.error
            for w in logs:
                wait_for(lambda w=w: caught_up(p, w), timeout=120, what=f"{w} caught up after the crashes",
                         describe=lambda: (stream_row(p, "mt"), stream_row(p, "rp"), tail()))
            assert assert_same(p, "a", ["id"]) == 100 + writes.n
            assert assert_same(p, "b", ["id"]) == 100 + writes.n
            for w, log in logs.items():
                text = log.read_text()
                assert "re-bootstrap" not in text and "stopped in Error" not in text, (w, text[-3000:])
        finally:
            writes.stop_event.set()
            for d in drivers:
                reap_group(d)
    finally:
        p.cleanup()

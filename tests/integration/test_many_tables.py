"""A MoveTables of many small tables (issue 37): copy cycles of many tables each, a kill -9 between a cycle's
tasks committing and its progress being recorded, and a resume to equal data with every row once."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading

import psycopg
import pytest

from sluicegate.workflow.create import create_movetables

from ..conftest import wait_for
from .helpers import caught_up, reap_group, stream_row
from .test_kill_restart import kill_at, start_driver
from .test_vdiff import vdiff

pytestmark = pytest.mark.spark

SCHEMAS, PER_SCHEMA, ROWS = 5, 20, 30
WRITTEN = [f"s{i}.t{j:02d}" for i in range(2) for j in range(3)]  # the tables the application writes meanwhile


class Writes(threading.Thread):
    """Inserts, updates and deletes in a few of the tables, committed continuously while the copy runs."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.rng, self.next_id = url, random.Random(5), 1000
        self.stop_event, self.commits, self.error = threading.Event(), 0, None

    def run(self):
        try:
            with psycopg.connect(self.url) as c:
                while not self.stop_event.is_set():
                    table = self.rng.choice(WRITTEN)
                    k = self.rng.randint(1, ROWS)
                    c.execute(f"UPDATE {table} SET note = md5(random()::text) WHERE id = %s", (k,))
                    c.execute(f"INSERT INTO {table} VALUES (%s, 'new', now())", (self.next_id,))
                    c.execute(f"DELETE FROM {table} WHERE id = %s", (self.rng.randint(1, ROWS),))
                    self.next_id += 1
                    c.commit()
                    self.commits += 1
                    self.stop_event.wait(0.02)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def load(pair) -> list[str]:
    names = []
    for i in range(SCHEMAS):
        pair.src(f"CREATE SCHEMA s{i}")
        for j in range(PER_SCHEMA):
            name = f"s{i}.t{j:02d}"
            pair.src(f"CREATE TABLE {name} (id bigint PRIMARY KEY, note text, at timestamptz NOT NULL)")
            pair.src(f"INSERT INTO {name} SELECT g, md5(g::text), now() FROM generate_series(1, {ROWS}) g")
            names.append(name)
    pair.src("ANALYZE")
    return names


def counts(url: str, names: list[str]) -> dict[str, int]:
    union = " UNION ALL ".join(f"SELECT '{n}', count(*) FROM {n}" for n in names)
    with psycopg.connect(url) as c:
        return dict(c.execute(union).fetchall())


@pytest.mark.parametrize(("point", "committed"), [
    ("copy.before_progress", 33),  # the first cycle's tasks committed its 33 tables (30 rows each, 1000 a cycle)
    # its tasks sent their COPYs, not committed (a worker may outlive the kill by a moment and commit: either way)
    pytest.param("copy.before_commit", None, marks=pytest.mark.slow),
])
def test_many_small_tables_kill_9_mid_copy_then_resume(pair, tmp_path, point, committed):
    names = load(pair)
    # chunk_rows 1000: a table of 30 rows is small (<= 250), a cycle takes up to 1000 rows: 33 tables a cycle
    create_movetables("many", pair.source, pair.target, [f"s{i}.*" for i in range(SCHEMAS)], [],
                      {"chunk_rows": 1000})
    writes = Writes(pair.source)
    writes.start()
    log = tmp_path / "driver.log"
    try:
        kill_at(pair, "many", point, tmp_path, log)
        pending = pair.dst("SELECT count(*) FROM sluicegate.copy_state WHERE NOT done")[0][0]
        assert pending == len(names)  # the first cycle is not recorded ...
        if committed is not None:  # ... though its tasks committed their tables
            assert sum(1 for n in counts(pair.target, names).values() if n) == committed
        driver = start_driver(pair, "many", log)
        try:
            wait_for(lambda: stream_row(pair, "many")["state"] == "Running", timeout=240, what="Running",
                     describe=lambda: log.read_text()[-2000:])
            writes.stop_event.set()
            writes.join()
            assert writes.error is None and writes.commits > 0
            wait_for(lambda: caught_up(pair, "many"), what="caught up", describe=lambda: log.read_text()[-2000:])
            out = vdiff(pair.target, "many")  # served by the running driver
            assert out.returncode == 0, out.stdout + out.stderr
            status = subprocess.run([sys.executable, "-m", "sluicegate.cli.main", "workflow", "status", "many",
                                     "--target", pair.target], capture_output=True, text=True, timeout=60, check=False)
            assert f"tables: {len(names)} copied, 0 copying, 0 pending of {len(names)}" in status.stdout, status
            assert "s4.t19" not in status.stdout  # the summary, not a line a table
            driver.send_signal(signal.SIGTERM)
            assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]
        finally:
            reap_group(driver)
    finally:
        writes.stop_event.set()
    assert counts(pair.target, names) == counts(pair.source, names)
    # Every row once: the copy of the tables nobody wrote is recorded once, whatever the killed cycle committed.
    recorded = dict(pair.dst("SELECT table_name, rows_copied FROM sluicegate.copy_state"))
    assert all(recorded[n] == ROWS for n in names if n not in WRITTEN), recorded
    assert all(done for (done,) in pair.dst("SELECT done FROM sluicegate.copy_state"))

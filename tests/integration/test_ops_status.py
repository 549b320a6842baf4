"""Status that tells the truth: whether a driver runs (its heartbeat), the WAL each stream's slot holds on
the source, `workflow list`; and the small things: --exclude-tables, -v after the subcommand, names checked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from ..conftest import wait_for
from .helpers import reap_group, stream_row

pytestmark = pytest.mark.spark


def sg(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluicegate.cli.main", *args], capture_output=True, text=True,
                          timeout=180, stdin=subprocess.DEVNULL, check=False)


def status(pair, *extra: str) -> dict:
    out = sg("workflow", "status", "st", "--target", pair.target, "--json", *extra)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow  # the default suite keeps to its time
def test_status_after_kill_9_and_the_wal_a_stopped_workflow_holds(pair, tmp_path):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("INSERT INTO items SELECT g, 0, md5(g::text) FROM generate_series(1, 2000) g")
    pair.src("CREATE TABLE skipped (id bigint PRIMARY KEY)")
    bad = sg("movetables", "create", "--workflow", "st; rm -rf /", "--source", pair.source, "--target", pair.target)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1, bad.stderr
    assert "workflow name 'st; rm -rf /' is not allowed" in bad.stderr
    created = sg("movetables", "create", "--workflow", "st", "--source", pair.source, "--target", pair.target,
                 "--exclude-tables", "skipped")
    assert created.returncode == 0, created.stderr
    assert pair.dst("SELECT table_name FROM sluicegate.copy_state") == [("public.items",)]
    assert not pair.dst("SELECT 1 FROM pg_tables WHERE tablename = 'skipped'")

    # State made before the heartbeat existed: read as it is, upgraded by the first run.
    pair.dst("ALTER TABLE sluicegate.workflows DROP COLUMN driver_seen_at, DROP COLUMN driver_pid, "
             "DROP COLUMN driver_host")
    pair.dst("ALTER TABLE sluicegate.streams DROP COLUMN source_identity")
    before = status(pair)
    assert before["driver"] == {"running": False, "last_seen_seconds": None, "pid": None, "host": None}
    assert before["warnings"][0].startswith("no driver running (never seen)")

    log = tmp_path / "driver.log"
    driver = subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", "st", "--target",
                               pair.target, "--no-progress", "-v"],  # -v after the subcommand
                              stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: stream_row(pair, "st")["state"] == "Running", timeout=240, what="Running",
                 describe=lambda: log.read_text()[-2000:])
        running = status(pair)
        assert running["driver"]["running"] is True and running["driver"]["pid"] == driver.pid
        assert running["warnings"] == []
        assert "copying public.items" in log.read_text()  # -v: the engine's info lines
        os.kill(driver.pid, signal.SIGKILL)
    finally:
        reap_group(driver)

    # kill -9: the stream still says Running, but status knows nobody runs it
    dead = wait_for(lambda: (s := status(pair))["driver"]["running"] is False and s, timeout=60,
                    what="the driver seen as gone")
    assert dead["state"] == "Running" and dead["driver"]["last_seen_seconds"] >= 10
    assert dead["warnings"][0].startswith(f"no driver running (last seen {dead['driver']['last_seen_seconds']:.0f}")
    listed = json.loads(sg("workflow", "list", "--target", pair.target, "--json").stdout)["workflows"]
    assert [(w["workflow"], w["kind"], w["state"], w["driver"]["running"]) for w in listed] == \
        [("st", "MoveTables", "Running", False)]
    text = sg("workflow", "list", "--target", pair.target)
    assert "no driver running (last seen" in text.stdout, text.stdout

    # Stopped: the slot holds the WAL of every source write since, and status shows it growing.
    assert sg("workflow", "stop", "st", "--target", pair.target).returncode == 0
    held = status(pair)["streams"][0]
    assert held["wal_status"] == "reserved" and held["retained_wal_bytes"] > 0
    pair.src("INSERT INTO items SELECT g, 1, repeat('x', 200) FROM generate_series(10001, 30000) g")
    grown = status(pair)["streams"][0]
    assert grown["retained_wal_bytes"] > held["retained_wal_bytes"] + 4_000_000, (held, grown)

    # Over the threshold: a warning; text output unwrapped when not on a terminal (here a pipe)
    warned = status(pair, "--wal-warning", "1MB")
    assert any("replication slot" in w and "holds" in w for w in warned["warnings"]), warned["warnings"]
    text = sg("workflow", "status", "st", "--target", pair.target, "--wal-warning", "1MB")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert "driver: no driver running (last seen" in text.stdout
    slot_warning = [line for line in lines if line.startswith("warning:") and "replication slot" in line]
    assert len(slot_warning) == 1 and slot_warning[0].endswith("(max_slot_wal_keep_size caps it)"), lines
    assert any(line.startswith("stream ") and " of WAL (reserved)" in line for line in lines), lines

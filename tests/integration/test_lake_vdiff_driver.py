"""`sluicegate vdiff W --target delta:PATH` while `workflow run` drives W: the driver stops one batch at
the vdiff's snapshot position (the stream's durable stop position, lake/control.py), records a point there and
plays on once the vdiff released it; the vdiff compares at that point. Under live writes (the driver racing ahead) and with no write in flight (the driver idle
at the position), with the driver's vacuum running every second with no retention meanwhile; then, the driver
stopped, the vdiff that plays the stream itself."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sluicegate.position import parse_lsn
from sluicegate.targets.delta import cli as lake
from sluicegate.targets.delta import read
from sluicegate.targets.delta.state import Store

from ..conftest import wait_for
from .helpers import Writer, reap_group

pytestmark = pytest.mark.spark


def start_vdiff(target: str, log: Path, **env_vars: str) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("SLUICEGATE_DRIVER_PID", None)
    env.update(env_vars)
    return subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "-v", "vdiff", "vd", "--target", target,
                             "--spark-master", "local[1]", "--json"],
                            env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def vdiff(target: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluicegate.cli.main", "-v", "vdiff", "vd", "--target",
                           target, "--spark-master", "local[2]", "--json", *args], capture_output=True,
                          text=True, timeout=180, check=False)


def start_driver(target: str, log: Path, **env_vars: str) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("SLUICEGATE_DRIVER_PID", None)
    env.update(env_vars)
    return subprocess.Popen(
        [sys.executable, "-m", "sluicegate.cli.main", "-v", "workflow", "run", "vd", "--target", target,
         "--no-progress", "--spark-master", "local[2]"],
        env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def no_control(wf) -> bool:
    return (wf.stop_position, wf.stop_reason, wf.pins) == (None, "", {})


@pytest.mark.slow  # ~1 min; the default suite keeps to its time
def test_vdiff_beside_a_running_driver(pair, tmp_path):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("INSERT INTO items SELECT g, 0, md5(g::text) FROM generate_series(1, 2000) g")
    pair.src("CREATE TABLE prices (id int PRIMARY KEY, price numeric(10,2), doc jsonb)")
    pair.src("INSERT INTO prices SELECT g, g / 7.0, jsonb_build_object('g', g) "
             "FROM generate_series(1, 500) g")
    root = tmp_path / "lake"
    target = f"delta:{root}"
    # Vacuum every second keeping nothing old: only the newest point and the vdiff's pinned one survive it.
    lake.create("vd", pair.source, target, None, None, [],
                {"slice_seconds": 1, "vacuum_every": 1.0, "vacuum_retention": 0.0})
    store = Store(root)
    log = tmp_path / "driver.log"
    driver = start_driver(target, log)
    writer = Writer(pair.source, 2000, pause=0.005)
    try:
        wait_for(lambda: store.load("vd").first_point or driver.poll() is not None, timeout=120,
                 what="the copy and the first consistent point", describe=lambda: log.read_text()[-2000:])
        assert driver.poll() is None, log.read_text()[-2000:]

        # Live writes: the driver is ahead of any position the vdiff could pick unless it holds for it.
        writer.start()
        wait_for(lambda: writer.commits > 20, what="writes before the vdiff")
        commits, vacuums = writer.commits, log.read_text().count("vacuum vd")
        equal = vdiff(target)
        assert writer.error is None and writer.commits > commits  # the source took writes during it
        assert equal.returncode == 0, equal.stderr[-2000:]
        report = json.loads(equal.stdout)
        position = parse_lsn(report["source_position"])
        assert report["equal"] and report["tables"]["public.items"]["rows_compared"] > 1500
        assert report["tables"]["public.prices"]["rows_compared"] == 500
        held = re.search(r"from the running driver \(held at (\S+)\)", equal.stderr)
        assert held and parse_lsn(held.group(1)) <= position, equal.stderr[-2000:]
        wf = store.load("vd")
        assert driver.poll() is None and wf.state == "Running"
        assert wf.position > position  # it played on past the vdiff's point during the comparison
        assert no_control(wf)  # the vdiff released the stream and took its pin away
        assert log.read_text().count("vacuum vd") > vacuums  # and vacuum ran meanwhile, sparing the point
        writer.stop_event.set()
        writer.join()

        # No write in flight: the driver sits at the stream's end; an injected difference is found.
        from deltalake import DeltaTable

        prices_dt = DeltaTable(str(root / "public" / "prices"))
        prices_dt.update(predicate="id = 7", new_values={"doc": '{"g": 700}'})
        differs = vdiff(target)
        assert differs.returncode == 1, differs.stderr[-2000:]
        report = json.loads(differs.stdout)
        prices, items = report["tables"]["public.prices"], report["tables"]["public.items"]
        assert (prices["mismatched"], prices["missing"], prices["extra"]) == (1, 0, 0), prices
        assert [(s["kind"], s["key"]) for s in prices["samples"]] == [("mismatched", ["7"])]
        assert (items["mismatched"], items["missing"], items["extra"]) == (0, 0, 0), items
        idle_at = parse_lsn(report["source_position"])
        assert idle_at in [p.position for p in read.points(str(root), "vd")]  # the newest: vacuum keeps it
        assert driver.poll() is None and no_control(store.load("vd"))

        # No driver: the vdiff plays the stream to its own point (the path test_lake_vdiff.py runs whole).
        os.kill(driver.pid, signal.SIGTERM)
        assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]
        pair.src("UPDATE items SET qty = qty + 1 WHERE id % 9 = 0")  # for the vdiff's own play to apply
        prices_dt = DeltaTable(str(root / "public" / "prices"))
        prices_dt.delete(predicate="id = 11")
        alone = vdiff(target)
        assert alone.returncode == 1, alone.stderr[-2000:]
        assert "from the running driver" not in alone.stderr
        report = json.loads(alone.stdout)
        prices, items = report["tables"]["public.prices"], report["tables"]["public.items"]
        assert (prices["mismatched"], prices["missing"], prices["extra"]) == (1, 1, 0), prices
        assert sorted((s["kind"], s["key"]) for s in prices["samples"]) == [("mismatched", ["7"]),
                                                                           ("missing", ["11"])]
        assert (items["mismatched"], items["missing"], items["extra"]) == (0, 0, 0), items
        assert store.load("vd").state == "Running" and not store.is_running("vd") and no_control(store.load("vd"))
        # Again at once, after one more direct write: the stream may stand at the new snapshot's position
        # already (no source write since), and the write must count all the same.
        prices_dt.delete(predicate="id = 12")
        again = json.loads(vdiff(target).stdout)["tables"]["public.prices"]
        assert (again["mismatched"], again["missing"], again["extra"]) == (1, 2, 0), again
    finally:
        writer.stop_event.set()
        if writer.is_alive():
            writer.join()
        if driver.poll() is None:
            os.kill(driver.pid, signal.SIGTERM)
            try:
                driver.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        reap_group(driver)
    assert "Traceback" not in log.read_text()


def test_a_killed_vdiff_does_not_leave_the_stream_stopped(pair, tmp_path):
    """kill -9 of a vdiff between "the stream stopped at its point" and its release: the driver waits for the
    release (it does not exit), then, the hold lapse passed (3 s here), releases the stream itself and plays on."""
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL)")
    pair.src("INSERT INTO items SELECT g, 0 FROM generate_series(1, 200) g")
    root = tmp_path / "lake"
    target = f"delta:{root}"
    lake.create("vd", pair.source, target, None, None, [], {"commit_every": 0.0})
    store = Store(root)
    log, vlog = tmp_path / "driver.log", tmp_path / "vdiff.log"
    point = "lake.vdiff.stopped_at_point"
    driver = start_driver(target, log, SLUICEGATE_STREAM_HOLD_SECONDS="3")
    checker = None
    try:
        wait_for(lambda: store.load("vd").first_point or driver.poll() is not None, timeout=120,
                 what="the copy and the first consistent point", describe=lambda: log.read_text()[-2000:])
        pair.src("INSERT INTO items SELECT g, 1 FROM generate_series(201, 210) g")
        checker = start_vdiff(target, vlog, SLUICEGATE_FAULT_PAUSE=point, SLUICEGATE_FAULT_DIR=str(tmp_path))
        wait_for(lambda: (tmp_path / point).exists() or checker.poll() is not None, timeout=120,
                 what=f"fault point {point}", describe=lambda: vlog.read_text()[-2000:])
        assert checker.poll() is None, vlog.read_text()[-2000:]
        held = store.load("vd")
        assert held.state == "Stopped" and held.stop_reason.startswith("vdiff ") and held.pins
        assert held.stop_position == held.position and held.message.startswith("stopped at ")
        os.kill(checker.pid, signal.SIGKILL)
        reap_group(checker)
        pair.src("INSERT INTO items SELECT g, 2 FROM generate_series(211, 220) g")  # for the driver to play
        wait_for(lambda: store.load("vd").state == "Running" or driver.poll() is not None, timeout=60,
                 what="the driver's release of the killed vdiff's stop", describe=lambda: log.read_text()[-2000:])
        assert driver.poll() is None, log.read_text()[-2000:]  # it waited, it did not exit
        wf = store.load("vd")
        assert (wf.stop_position, wf.stop_reason) == (None, "")
        assert "not released within 3s" in log.read_text()
        wait_for(lambda: store.load("vd").position > held.position, timeout=60, what="replication going on",
                 describe=lambda: log.read_text()[-2000:])
        # The killed vdiff's pin stays until it expires (pins.PIN_SECONDS): a vacuum must not need it gone.
        assert set(store.load("vd").pins) == set(held.pins)
    finally:
        if checker is not None and checker.poll() is None:
            reap_group(checker)
        if driver.poll() is None:
            os.kill(driver.pid, signal.SIGTERM)
            try:
                driver.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        reap_group(driver)
    assert "Traceback" not in log.read_text()

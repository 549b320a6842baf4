"""kill -9 of `sluicegate workflow run` at exact points of every phase, and restarts of either database:
the restarted workflow converges with no loss and no duplicates, and the slot never passes the target."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sluicegate.workflow.create import create_movetables

from ..conftest import EngineThread, wait_for
from .helpers import Writer, assert_same, caught_up, reap_group, slot_confirmed, stream_row

pytestmark = pytest.mark.spark


def start_driver(pair, workflow: str, log: Path, fault: str | None = None, fault_dir: Path | None = None):
    env = dict(os.environ)
    env.pop("SLUICEGATE_DRIVER_PID", None)
    if fault:
        env.update(SLUICEGATE_FAULT_PAUSE=fault, SLUICEGATE_FAULT_DIR=str(fault_dir))
    return subprocess.Popen(
        [sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", workflow, "--target", pair.target,
         "--no-progress"],
        env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
    )


def kill_at(pair, workflow: str, point: str, tmp_path, log) -> None:
    """Start `workflow run` as its own process, and kill -9 it once it reaches the fault point `point`."""
    driver = start_driver(pair, workflow, log, fault=point, fault_dir=tmp_path)
    try:
        wait_for(lambda: (tmp_path / point).exists() or driver.poll() is not None, timeout=240,
                 what=f"fault point {point}", describe=lambda: log.read_text()[-2000:])
        assert driver.poll() is None, log.read_text()[-2000:]
        os.kill(driver.pid, signal.SIGKILL)
    finally:
        reap_group(driver)
    (tmp_path / point).unlink()


# The default set kills at copy.before_progress and slice.mid_batch in test_table_shapes (every table shape,
# on 15 and 15 -> 18); these, on a plain table, with SLUICEGATE_ALL_TESTS=1.
POINTS = [
    pytest.param("copy.before_progress", marks=pytest.mark.slow),  # copy: rows on the target, lastpk not moved
    pytest.param("copy.before_index_build", marks=pytest.mark.slow),  # first cycle recorded, indexes not built
    pytest.param("caught_up.mid_batch", marks=pytest.mark.slow),  # catchup: inside a replay batch
    pytest.param("position.mid_batch", marks=pytest.mark.slow),  # fast-forward to a new snapshot, mid-batch
    pytest.param("slice.mid_batch", marks=pytest.mark.slow),  # replicate, mid-batch
    pytest.param("copy.before_commit", marks=pytest.mark.slow),  # a copy task's COPY sent, not committed
    pytest.param("replicate.before_commit", marks=pytest.mark.slow),  # data + position written, not committed
]


@pytest.mark.parametrize("point", POINTS)
def test_kill_9_then_resume(pair, tmp_path, point):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("INSERT INTO items SELECT g, 0, md5(g::text) FROM generate_series(1, 2000) g")
    create_movetables("k9", pair.source, pair.target, None, [], {"cycle_rows": 200, "chunk_rows": 70})
    writer = Writer(pair.source, 2000, pause=0.005)
    writer.start()
    log = tmp_path / "driver.log"
    try:
        kill_at(pair, "k9", point, tmp_path, log)
        s = stream_row(pair, "k9")
        confirmed = slot_confirmed(pair, s["slot"])
        assert confirmed is None or s["position"] is None or confirmed <= s["position"]

        driver = start_driver(pair, "k9", log)
        try:
            wait_for(lambda: stream_row(pair, "k9")["state"] == "Running", timeout=240, what="Running",
                     describe=lambda: log.read_text()[-2000:])
            writer.stop_event.set()
            writer.join()
            assert writer.error is None
            wait_for(lambda: caught_up(pair, "k9"), what="caught up", describe=lambda: log.read_text()[-2000:])
            driver.send_signal(signal.SIGTERM)  # a clean stop
            assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]
            assert stream_row(pair, "k9")["message"] == ""  # a clean stop records no fault
        finally:
            reap_group(driver)
    finally:
        writer.stop_event.set()
    assert assert_same(pair, "public.items", ["id"]) > 1000
    assert pair.dst("SELECT indexname FROM pg_indexes WHERE tablename = 'items'") == [("items_pkey",)]
    s = stream_row(pair, "k9")
    assert s["state"] == "Running"
    assert slot_confirmed(pair, s["slot"]) <= s["position"]


@pytest.mark.parametrize("side", ["source", "target"])
def test_database_restart_while_running(pair, spark, side):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("INSERT INTO items SELECT g, 0, md5(g::text) FROM generate_series(1, 2000) g")
    create_movetables("rs", pair.source, pair.target, None, [], {"cycle_rows": 500, "chunk_rows": 200})
    server = pair.source_server if side == "source" else pair.target_server
    with EngineThread(spark, pair.target, "rs"):
        wait_for(lambda: stream_row(pair, "rs")["state"] == "Running", what="Running")
        pair.src("UPDATE items SET qty = 1 WHERE id <= 500")
        server.restart(mode="immediate")  # a crash and recovery, not a polite shutdown
        pair.src("UPDATE items SET qty = 2 WHERE id > 1500")
        pair.src("INSERT INTO items VALUES (5000, 5, 'after restart')")
        wait_for(lambda: caught_up(pair, "rs"), timeout=120, what="caught up after restart",
                 describe=lambda: stream_row(pair, "rs"))
    assert assert_same(pair, "public.items", ["id"]) == 2001
    slot = stream_row(pair, "rs")["slot"]
    confirmed = slot_confirmed(pair, slot)  # the slot first: it is confirmed only after the position commits
    s = stream_row(pair, "rs")
    assert s["state"] == "Running"
    assert confirmed <= s["position"]


def test_lost_slot_stops_in_error_never_skips(pair, spark):
    """Guarantee 7: when the source can no longer supply the stream, it stops in Error naming the way out."""
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int)")
    pair.src("INSERT INTO items SELECT g, 0 FROM generate_series(1, 100) g")
    create_movetables("lost", pair.source, pair.target, None, [], {})
    with EngineThread(spark, pair.target, "lost") as run:
        wait_for(lambda: stream_row(pair, "lost")["state"] == "Running", what="Running")
        slot = stream_row(pair, "lost")["slot"]

        def drop_slot():
            # As an administrator would: end the stream's walsender (the play task holds it for as long as the
            # stream runs), then drop the slot while the engine backs off before its next try.
            pair.src("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                     "WHERE slot_name = %s AND active_pid IS NOT NULL", (slot,))
            wait_for(lambda: pair.src("SELECT active_pid IS NULL FROM pg_replication_slots WHERE slot_name = %s",
                                      (slot,))[0][0], timeout=10, what="the walsender gone")
            pair.src("SELECT pg_drop_replication_slot(%s)", (slot,))  # fails if a new walsender came first
            return True

        wait_for(lambda: pair.src("SELECT active_pid IS NOT NULL FROM pg_replication_slots WHERE slot_name = %s",
                                  (slot,))[0][0], what="the stream's walsender")  # the lost slot is a live one
        wait_for(drop_slot, what="slot dropped")
        pair.src("UPDATE items SET qty = 1")
        wait_for(lambda: stream_row(pair, "lost")["state"] == "Error", what="Error")
        run.thread.join(timeout=60)
        assert run.result == "Error"
    message = stream_row(pair, "lost")["message"]
    assert slot in message and "re-bootstrap" in message and "workflow delete lost" in message
    assert pair.dst("SELECT count(*) FROM items WHERE qty = 1")[0][0] == 0  # nothing skipped ahead


def test_spark_that_cannot_start_leaves_the_workflow_to_resume(pair, tmp_path):
    """`workflow run` starts Spark while the engine takes its snapshot and drops the indexes it defers
    (session.start_in_background). When Spark cannot start, the run ends with one error line and no row
    copied, the stream is not put in Error (the machine is at fault, not the workflow), and the next run
    copies every row and builds the indexes."""
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("INSERT INTO items SELECT g, 0, md5(g::text) FROM generate_series(1, 2000) g")
    create_movetables("nj", pair.source, pair.target, None, [], {})
    proc = subprocess.run(
        [sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", "nj", "--target", pair.target,
         "--no-progress"],
        env={**os.environ, "JAVA_HOME": "/nonexistent-java-home"}, capture_output=True, text=True,
        timeout=120, stdin=subprocess.DEVNULL, check=False)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: JAVA_HOME=/nonexistent-java-home has no bin/java"), lines
    s = stream_row(pair, "nj")
    assert (s["state"], s["message"]) == ("Copying", "")
    # The engine got as far as the copy's first job: the target's key was dropped, and recorded to be built.
    assert pair.dst("SELECT indexname FROM pg_indexes WHERE tablename = 'items'") == []
    assert pair.dst("SELECT deferred_indexes IS NOT NULL FROM sluicegate.copy_state") == [(True,)]
    assert pair.dst("SELECT count(*) FROM items") == [(0,)]

    log = tmp_path / "driver.log"
    driver = start_driver(pair, "nj", log)
    try:
        wait_for(lambda: stream_row(pair, "nj")["state"] == "Running", timeout=240, what="Running",
                 describe=lambda: log.read_text()[-2000:])
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]
    finally:
        reap_group(driver)
    assert assert_same(pair, "public.items", ["id"]) == 2000
    assert pair.dst("SELECT indexname FROM pg_indexes WHERE tablename = 'items'") == [("items_pkey",)]

"""Durable stream control (workflow/stream_control.py) against a running driver, real PostgreSQL and Spark:
a hold stops the stream at once, a stop position is reached exactly (the target then equals the source's
snapshot at it), a controller that dies leaves a hold the driver releases after the lapse, and a user's
`workflow stop` wins over a controller."""

from __future__ import annotations

import threading
import time

import pytest

from sluicegate.postgres.snapshot import take_snapshot
from sluicegate.workflow import state as st
from sluicegate.workflow import stream_control
from sluicegate.workflow.create import create_movetables

from ..conftest import EngineThread, wait_for
from .helpers import Writer, stream_row

pytestmark = pytest.mark.spark


def _control(pair) -> st.Control:
    (sid,) = pair.dst("SELECT id FROM sluicegate.streams WHERE workflow = 'wf'")[0]
    row = pair.dst("SELECT state, position::text, stop_position::text, stop_reason FROM sluicegate.streams "
                   "WHERE id = %s", (sid,))[0]
    from sluicegate.position import parse_lsn

    return sid, st.Control(row[0], parse_lsn(row[1]), parse_lsn(row[2]) if row[2] else None, row[3])


def _target_sums(pair):
    return pair.dst("SELECT count(*), COALESCE(sum(qty), 0), COALESCE(sum(id), 0) FROM items")[0]


def test_stop_position_reached_exactly_then_a_dead_controllers_hold_lapses(pair, spark, monkeypatch):
    monkeypatch.setenv("SLUICEGATE_STREAM_HOLD_SECONDS", "3")
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("INSERT INTO items SELECT g, g % 100, md5(g::text) FROM generate_series(1, 5000) g")
    create_movetables("wf", pair.source, pair.target, ["items"], [], {})
    writer = Writer(pair.source, 5000, pause=0.002)
    with EngineThread(spark, pair.target, "wf") as driver:
        wait_for(lambda: stream_row(pair, "wf")["state"] == "Running", what="Running")
        writer.start()
        wait_for(lambda: writer.commits > 30, what="writes going on")
        sid, _ = _control(pair)
        held_at = stream_control.hold(pair.target, sid, "a test controller")
        _, c = _control(pair)
        assert (c.state, c.stop_reason, c.stop_position) == ("Stopped", "a test controller", None)
        commits = writer.commits
        wait_for(lambda: writer.commits > commits + 20, what="more writes while held")
        assert _control(pair)[1].position == held_at, "a held stream must not move"

        with conn_snapshot(pair, sid) as snap:
            assert snap.position >= held_at
            stream_control.stop_at(pair.target, sid, snap.position, "a test controller")
            stream_control.wait_stopped(pair.target, sid, snap.position, "a test controller", threading.Event())
            stopped = time.monotonic()
            row = stream_row(pair, "wf")
            assert row["position"] == snap.position and "for a test controller" in row["message"]
            # Exactly the source as of the point: nothing after it applied, nothing before it missing.
            source = snap.conn.execute("SELECT count(*), COALESCE(sum(qty), 0), COALESCE(sum(id), 0) FROM items"
                                       ).fetchone()
            assert _target_sums(pair) == tuple(source)
        # The controller "dies" here: no release. The driver lets the stream go after the lapse.
        wait_for(lambda: stream_row(pair, "wf")["state"] == "Running", timeout=30, what="the lapsed hold released")
        assert time.monotonic() - stopped >= 2.5
        _, c = _control(pair)
        assert (c.stop_position, c.stop_reason) == (None, "")
        wait_for(lambda: stream_row(pair, "wf")["position"] > snap.position, what="replicating past the point")
        writer.stop_event.set()
        writer.join()
        assert writer.error is None
        assert driver.error is None


def test_a_users_stop_wins_over_a_controller(pair, spark):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("INSERT INTO items SELECT g, g, 'x' FROM generate_series(1, 100) g")
    create_movetables("wf", pair.source, pair.target, ["items"], [], {})
    with EngineThread(spark, pair.target, "wf") as driver:
        wait_for(lambda: stream_row(pair, "wf")["state"] == "Running", what="Running")
        sid, _ = _control(pair)
        stream_control.hold(pair.target, sid, "vdiff 1")
        with pair_target(pair) as conn:  # what `workflow stop` does
            st.lock_stream(conn, sid)
            st.set_state(conn, sid, st.STOPPED, "stopped by user")
        assert not stream_control.release(pair.target, sid, "vdiff 1")
        _, c = _control(pair)
        assert (c.state, c.stop_reason) == ("Stopped", "")
        driver.thread.join(60)  # a user's Stopped ends the driver, as before
        assert driver.result == "Stopped"
        with pytest.raises(Exception, match="taken away"):
            stream_control.stop_at(pair.target, sid, 1, "vdiff 1")


def conn_snapshot(pair, sid):
    with pair_target(pair) as conn:
        table = st.load_workflow(conn, "wf").streams[0].tables[0].table
    return take_snapshot(pair.source, table)


def pair_target(pair):
    from sluicegate.postgres.connect import connect

    return connect(pair.target, role="target")

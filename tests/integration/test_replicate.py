"""Replicate: one source, two sinks on their own servers, live writes; the consumers run as `workflow run`."""

from __future__ import annotations

import itertools
import threading
import time
from datetime import datetime, timezone

import pytest

from ..conftest import wait_for
from .cluster_helpers import (
    Consumer,
    assert_equal,
    caught_up,
    cli,
    create,
    load_items,
    run,
    status,
    stream,
)
from .helpers import Writer

pytestmark = pytest.mark.spark





class SafeTimeSampler(threading.Thread):
    """Each sink's safe time, once a second, from `status --json`'s top level."""

    def __init__(self, c):
        super().__init__(daemon=True)
        self.c, self.samples, self.stop_event = c, {s: [] for s in c.sinks}, threading.Event()

    def run(self):
        while not self.stop_event.is_set():
            for sink in self.c.sinks:
                try:
                    row = run(sink, "SELECT CASE WHEN bool_and(safe_time IS NOT NULL) THEN min(safe_time) END "
                                    "FROM sluicegate.streams WHERE workflow = %s", (self.c.workflow,))
                except Exception:  # noqa: BLE001 - a sink server being restarted
                    row = [(None,)]
                if row[0][0] is not None:
                    self.samples[sink].append(row[0][0])
            self.stop_event.wait(1.0)


# ~70 s: in the slow set; sinks under writes, restarts and safe time stay in the default set through
# test_replicate_recovery, test_durable_confirm and test_replicate_bidirectional
@pytest.mark.slow
def test_two_sinks_live_writes_kill_9_and_safe_time(rc, tmp_path):
    c = rc
    load_items(c)
    out = create(c)
    assert out.returncode == 0, out.stderr
    for sink in ("s1", "s2"):  # the bootstrap decision, printed per sink and table
        assert f"sink {sink} " in out.stdout and "public.items: copy — new setup, sink table created" in out.stdout
    writer = Writer(c.source, 5000, seed=11, pause=0.005)
    writer.start()
    consumers = [Consumer(c.workflow, s, tmp_path / f"run{i}.log").start() for i, s in enumerate(c.sinks)]
    sampler = SafeTimeSampler(c)
    sampler.start()
    try:
        wait_for(lambda: all(stream(s)["state"] == "Running" for s in c.sinks), 180, what="both sinks running")
        consumers[0].kill()  # kill -9 of one consumer: the other goes on
        wait_for(lambda: writer.commits > 50, 60, what="writes")
        consumers[0] = Consumer(c.workflow, c.sinks[0], tmp_path / "run0b.log").start()
        wait_for(lambda: caught_up(c, c.sinks[0]), 180, what="sink 1 resumed")
        consumers[1].kill()
        consumers[1] = Consumer(c.workflow, c.sinks[1], tmp_path / "run1b.log").start()
        wait_for(lambda: caught_up(c, c.sinks[1]), 180, what="sink 2 resumed")
        log = (tmp_path / "run1b.log").read_text()
        assert "resume from checkpoint" in log, log
        writer.stop_event.set()
        writer.join()
        assert writer.error is None, writer.error
        # Every transaction of the writer committed before this moment of the source's clock.
        quiet = c.src("SELECT clock_timestamp()")[0][0].astimezone(timezone.utc).isoformat().replace("+00:00", "Z")
        quiet_at = time.monotonic()
        for sink in c.sinks:
            wait_for(lambda sink=sink: (status(c.workflow, sink)["safe_time"] or "") >= quiet, 30,
                     what="safe time past the last commit")
        assert time.monotonic() - quiet_at < 5 + 2 * 3  # within 5 s (plus two status commands' start-up)
        for sink in c.sinks:
            wait_for(lambda sink=sink: caught_up(c, sink), 120, what="caught up")
            assert_equal(c, sink, "public.items", ["id"])
            out = cli("vdiff", c.workflow, "--target", sink, "--spark-master", "local[1]")
            assert out.returncode == 0, out.stdout + out.stderr  # the sink's running consumer does the diff
        # An idle source: safe time keeps moving
        first = {s: status(c.workflow, s)["safe_time"] for s in c.sinks}
        for sink in c.sinks:
            wait_for(lambda sink=sink: status(c.workflow, sink)["safe_time"] > first[sink], 30,
                     what="safe time moving on an idle source")
        st = status(c.workflow, c.sinks[0])
        assert st["safe_time_lag_seconds"] < 10
        assert [s["sink"] for s in st["sinks"]] == ["s1", "s2"] and all(s["exists"] for s in st["sinks"])
    finally:
        sampler.stop_event.set()
        writer.stop_event.set()
        for consumer in consumers:
            consumer.kill()
    for sink, samples in sampler.samples.items():
        assert samples, f"no safe time sampled on {sink}"
        assert all(a <= b for a, b in itertools.pairwise(samples)), f"safe time went backwards on {sink}"
        assert isinstance(samples[0], datetime)


@pytest.mark.slow
def test_random_kill_9_of_either_consumer_during_copy_and_replicate(rc, tmp_path):
    """Rounds of kill -9 of a random sink's consumer at a random moment (the copy of a bigger table included),
    under live writes: both sinks end equal to the source, and vdiff agrees."""
    import random

    c = rc
    load_items(c, rows=300_000)
    out = create(c, "--cycle-rows", "50000")
    assert out.returncode == 0, out.stderr
    writer = Writer(c.source, 300_000, seed=5, pause=0.005)
    writer.start()
    rng = random.Random(24)
    consumers = [Consumer(c.workflow, s, tmp_path / f"run{i}.log").start() for i, s in enumerate(c.sinks)]
    try:
        for n in range(6):
            time.sleep(rng.uniform(1.0, 8.0))  # a random moment: where the kill lands is the point
            i = rng.randrange(2)
            consumers[i].kill()
            consumers[i] = Consumer(c.workflow, c.sinks[i], tmp_path / f"run{i}_{n}.log").start()
        writer.stop_event.set()
        writer.join()
        assert writer.error is None, writer.error
        for sink in c.sinks:
            wait_for(lambda sink=sink: caught_up(c, sink), 300, what="caught up")
            assert_equal(c, sink, "public.items", ["id"])
            out = cli("vdiff", c.workflow, "--target", sink)
            assert out.returncode == 0, out.stdout + out.stderr
    finally:
        writer.stop_event.set()
        for consumer in consumers:
            consumer.kill()


@pytest.mark.slow  # ~80 s; test_schema_changes covers added columns in the default suite
def test_added_column_reaches_every_sink_and_a_drop_stops_them(rc, tmp_path):
    c = rc
    load_items(c)
    assert create(c).returncode == 0
    writer = Writer(c.source, 5000, seed=7, pause=0.005)
    writer.start()
    consumers = [Consumer(c.workflow, s, tmp_path / f"run{i}.log").start() for i, s in enumerate(c.sinks)]
    try:
        wait_for(lambda: all(caught_up(c, s) for s in c.sinks), 180, what="both sinks replicating")
        c.src("ALTER TABLE items ADD COLUMN tag text NOT NULL DEFAULT 'plain'")
        c.src("UPDATE items SET tag = 'hot' WHERE id % 10 = 0")  # rows that carry the new column's own values
        writer.stop_event.set()
        writer.join()
        assert writer.error is None, writer.error
        for sink in c.sinks:
            wait_for(lambda sink=sink: caught_up(c, sink), 120, what="caught up after ADD COLUMN")
            assert_equal(c, sink, "public.items", ["id"])
            (default,), = run(sink, "SELECT pg_get_expr(d.adbin, d.adrelid) FROM pg_attrdef d JOIN pg_attribute a "
                                    "ON a.attrelid = d.adrelid AND a.attnum = d.adnum "
                                    "WHERE d.adrelid = 'items'::regclass AND a.attname = 'tag'")
            assert default == "'plain'::text"
        c.src("ALTER TABLE items DROP COLUMN tag")
        c.src("INSERT INTO items (id, qty, note) VALUES (10000001, 1, 'after the drop')")
        for sink in c.sinks:
            wait_for(lambda sink=sink: stream(sink)["state"] == "Error", 120, what="Error after DROP COLUMN")
            message = stream(sink)["message"]
            assert "public.items" in message and "tag" in message, message
            assert run(sink, "SELECT count(*) FROM items WHERE id = 10000001")[0][0] == 0  # nothing of it applied
    finally:
        writer.stop_event.set()
        for consumer in consumers:
            consumer.kill()

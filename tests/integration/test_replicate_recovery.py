"""Replicate when things go wrong: a sink's server stopped under writes, the bootstrap decisions (rows already
on a sink, a slot dropped or invalidated behind a sink, a re-copy of one table), and the retention governor
releasing the slot of a sink whose consumer is down. Real servers, consumers run as `workflow run`."""

from __future__ import annotations

import re
import shlex
import subprocess
import threading
import time

import psycopg
import pytest
from psycopg import sql

from sluicegate.cluster.model import slot_name
from sluicegate.position import parse_lsn

from ..conftest import wait_for
from .cluster_helpers import (
    Consumer,
    assert_equal,
    caught_up,
    cli,
    create,
    load_items,
    run,
    settle,
    status,
    stream,
)
from .helpers import Writer

pytestmark = pytest.mark.spark

BOOTSTRAP = re.compile(r"`(sluicegate replicate bootstrap [^`]+)`")





class StreamWatch(threading.Thread):
    """One sink's stream (state, position), sampled every 0.2 s: a sink that must never stop."""

    def __init__(self, c, sink):
        super().__init__(daemon=True)
        self.c, self.sink, self.samples, self.stop_event = c, sink, [], threading.Event()

    def run(self):
        while not self.stop_event.is_set():
            s = stream(self.sink, self.c.workflow)
            self.samples.append((time.monotonic(), s["state"], s["position"]))
            self.stop_event.wait(0.2)

    def finish(self) -> list:
        self.stop_event.set()
        self.join()
        assert self.samples, f"no state sampled on {self.sink}"
        states = {state for _, state, _ in self.samples}
        assert states == {"Running"}, f"{self.sink} left Running: {states}"
        return self.samples


def _passes_now(c, sink):
    """A predicate: the sink's position has passed what the source has flushed now (under live writes, where
    `caught_up` chases a moving end)."""
    mark = parse_lsn(c.src("SELECT pg_current_wal_flush_lsn()::text")[0][0])

    def passed():
        s = stream(sink, c.workflow)
        return s["state"] == "Running" and (s["position"] or 0) >= mark
    return passed


def _slot(c, sink_index):
    return slot_name(c.workflow, f"s{sink_index + 1}")


def _slot_row(c, slot):
    rows = c.src("SELECT active_pid, wal_status, restart_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                 (slot,))
    return rows[0] if rows else None


def _stop_consumer(c, consumer, sink_index):
    """kill -9 of a consumer; then its walsender is gone (it goes when the socket does)."""
    consumer.kill()
    wait_for(lambda: (_slot_row(c, stream(c.sinks[sink_index])["slot"]) or (None,))[0] is None, 30,
             what="the killed consumer's walsender gone")


def _run_bootstrap(command: str) -> subprocess.CompletedProcess:
    """The command as a sink's message printed it (`sluicegate …`), run with this test's Python."""
    argv = shlex.split(command)
    assert argv[0] == "sluicegate"
    out = cli(*argv[1:])
    assert out.returncode == 0, out.stderr
    return out


def _wait_exit(consumer, timeout=180):
    wait_for(lambda: not consumer.running(), timeout, what="the consumer to stop in Error")
    return consumer.proc.returncode


def test_sink_server_stopped_and_started_under_writes(rc, sink_server, tmp_path):
    """Issue 24, item 1 (second half): s2's server stopped immediately, its consumer retrying; s1 goes on."""
    c = rc
    load_items(c)
    out = create(c)
    assert out.returncode == 0, out.stderr
    writer = Writer(c.source, 5000, seed=5, pause=0.005)
    writer.start()
    consumers = [Consumer(c.workflow, s, tmp_path / f"run{i}.log").start() for i, s in enumerate(c.sinks)]
    watch = StreamWatch(c, c.sinks[0])
    try:
        for sink in c.sinks:
            wait_for(_passes_now(c, sink), 240, what="both sinks running")
        watch.start()
        sink_server.stop(mode="immediate")
        try:
            down_at, commits = time.monotonic(), writer.commits
            # A while: the source takes a thousand commits, and s1 applies them, while s2's server is down
            wait_for(lambda: writer.commits > commits + 1000, 120, what="writes during s2's outage")
            wait_for(_passes_now(c, c.sinks[0]), 60, what="s1 applying during s2's outage")
            assert consumers[1].running(), "s2's consumer gave up while its server was down"
        finally:
            sink_server.start()
        up_at = time.monotonic()
        wait_for(_passes_now(c, c.sinks[1]), 180, what="s2 caught up after its server came back")
        settle(c, writer)
        assert consumers[1].running()
        log = (tmp_path / "run1.log").read_text()
        assert "retrying" in log, log[-3000:]
    finally:
        watch.stop_event.set()
        writer.stop_event.set()
        for consumer in consumers:
            consumer.kill()
    samples = watch.finish()
    during = [p for t, _, p in samples if down_at <= t <= up_at]
    assert len(during) >= 2 and during[-1] > during[0], "s1's position did not move while s2's server was down"


def test_bootstrap_decisions_rows_dropped_and_invalidated_slot(rc, source_server, tmp_path):
    """Issue 24, item 3: refuse a sink with rows (nothing changed anywhere), --overwrite; a slot dropped, then
    one invalidated, behind s1 while its consumer is down: Error with the bootstrap command, which converges,
    while s2 never stops."""
    c = rc
    load_items(c)
    run(c.sinks[1], "CREATE TABLE items (id bigint PRIMARY KEY, qty int, note text)")
    run(c.sinks[1], "INSERT INTO items VALUES (1, -1, 'mine'), (99999, -1, 'mine too')")
    out = create(c)
    assert out.returncode != 0
    err = out.stderr.strip()
    assert "public.items" in err and "sink s2 (" in err and "--overwrite" in err, err
    assert "sink s1" not in err, err  # s1's table does not exist yet: nothing to refuse there
    assert len(err.splitlines()) == 1, err
    # Nothing changed on any sink, nor on the source
    for sink in c.sinks:
        made = run(sink, "SELECT to_regclass('sluicegate.workflows') IS NOT NULL")[0][0]
        assert not made or not run(sink, "SELECT 1 FROM sluicegate.workflows WHERE workflow = %s", (c.workflow,))
    assert run(c.sinks[0], "SELECT to_regclass('public.items')")[0][0] is None
    assert run(c.sinks[1], "SELECT id, qty, note FROM items ORDER BY id") == [(1, -1, "mine"), (99999, -1, "mine too")]
    dbname = c.src("SELECT current_database()")[0][0]
    assert c.src("SELECT slot_name FROM pg_replication_slots WHERE database = %s", (dbname,)) == []
    assert c.src("SELECT pubname FROM pg_publication") == []

    out = create(c, "--overwrite")
    assert out.returncode == 0, out.stderr
    assert "sink s2 " in out.stdout and "(--overwrite)" in out.stdout, out.stdout
    before = status(c.workflow, c.sinks[0])  # no slot yet (nor publication): not "gone", for either sink
    assert not [w for w in before["warnings"] if w.startswith("sink s")], before["warnings"]
    assert [s["not_yet_run"] for s in before["sinks"]] == [True, True]
    consumers = [Consumer(c.workflow, s, tmp_path / f"run{i}.log").start() for i, s in enumerate(c.sinks)]
    writer = Writer(c.source, 5000, seed=7, pause=0.01)
    watch = StreamWatch(c, c.sinks[1])
    try:
        wait_for(lambda: all(caught_up(c, s) for s in c.sinks), 240, what="both sinks caught up")
        for i in (0, 1):
            assert "new setup: bootstrap by a copy" in (tmp_path / f"run{i}.log").read_text()
        assert_equal(c, c.sinks[1], "public.items", ["id"])  # the rows of s2 were replaced by the copy
        writer.start()
        watch.start()

        # (c) s1's slot dropped while its consumer is down
        _stop_consumer(c, consumers[0], 0)
        slot = _slot(c, 0)
        c.src("SELECT pg_drop_replication_slot(%s)", (slot,))
        consumers[0] = Consumer(c.workflow, c.sinks[0], tmp_path / "run0b.log").start()
        assert _wait_exit(consumers[0]) != 0
        s1 = stream(c.sinks[0])
        assert s1["state"] == "Error" and f"replication slot {slot} is gone" in s1["message"], s1
        command = BOOTSTRAP.search(s1["message"]).group(1)
        assert command.startswith(f"sluicegate replicate bootstrap {c.workflow} --sink "), command
        warnings = status(c.workflow, c.sinks[0])["warnings"]
        assert [w for w in warnings if w.startswith(f"sink s1: its replication slot {slot} is gone") and command in w]
        log = (tmp_path / "run0b.log").read_text()
        assert "cannot resume" in log and command in log, log[-3000:]
        out = _run_bootstrap(command)
        assert "public.items: copy (re-bootstrap" in out.stdout, out.stdout
        consumers[0] = Consumer(c.workflow, c.sinks[0], tmp_path / "run0c.log").start()
        wait_for(_passes_now(c, c.sinks[0]), 240, what="s1 re-bootstrapped and caught up")
        assert "re-bootstrap" in (tmp_path / "run0c.log").read_text()

        # (c') s1's slot invalidated (its WAL removed) while its consumer is down
        _stop_consumer(c, consumers[0], 0)
        c.src("ALTER SYSTEM SET max_slot_wal_keep_size = '64MB'")
        c.src("SELECT pg_reload_conf()")
        try:
            def lost():
                c.src("INSERT INTO items VALUES (-1, 0, 'wal') ON CONFLICT (id) DO UPDATE SET qty = items.qty + 1")
                c.src("SELECT pg_switch_wal()")
                c.src("CHECKPOINT")
                return _slot_row(c, slot)[1] == "lost"
            wait_for(lost, 120, interval=0.2, what=f"slot {slot} invalidated")
        finally:
            c.src("ALTER SYSTEM RESET max_slot_wal_keep_size")
            c.src("SELECT pg_reload_conf()")
        assert _slot_row(c, _slot(c, 1))[1] != "lost"  # s2 read along: its slot kept what it needs
        consumers[0] = Consumer(c.workflow, c.sinks[0], tmp_path / "run0d.log").start()
        assert _wait_exit(consumers[0]) != 0
        s1 = stream(c.sinks[0])
        assert s1["state"] == "Error" and "was invalidated (WAL removed)" in s1["message"], s1
        assert BOOTSTRAP.search(s1["message"]).group(1) == command
        assert command in (tmp_path / "run0d.log").read_text()
        _run_bootstrap(command)
        consumers[0] = Consumer(c.workflow, c.sinks[0], tmp_path / "run0e.log").start()
        wait_for(_passes_now(c, c.sinks[0]), 240, what="s1 re-bootstrapped again and caught up")

        settle(c, writer)
    finally:
        watch.stop_event.set()
        writer.stop_event.set()
        for consumer in consumers:
            consumer.kill()
    watch.finish()  # s2 stayed Running the whole time


class OrdersWriter(threading.Thread):
    """Inserts into orders, one row a commit: the other table, which must keep flowing."""

    def __init__(self, url, first):
        super().__init__(daemon=True)
        self.url, self.next, self.stop_event, self.error = url, first, threading.Event(), None

    def run(self):
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                while not self.stop_event.is_set():
                    conn.execute("INSERT INTO orders VALUES (%s, 'live')", (self.next,))
                    self.next += 1
                    self.stop_event.wait(0.01)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def test_bootstrap_one_table_while_the_other_flows(rc, tmp_path):
    """`replicate bootstrap --tables items` on a healthy sink re-copies items only; orders keeps arriving."""
    c = rc
    load_items(c, rows=40000)
    c.src("CREATE TABLE orders (id bigint PRIMARY KEY, note text)")
    c.src("INSERT INTO orders SELECT g, 'old' FROM generate_series(1, 1000) g")
    sink = c.sinks[0]
    out = create(c, "--cycle-rows", "4000", sinks=[sink])
    assert out.returncode == 0, out.stderr
    consumer = Consumer(c.workflow, sink, tmp_path / "run.log").start()
    items, orders = Writer(c.source, 40000, seed=3, pause=0.01), OrdersWriter(c.source, 1001)
    try:
        wait_for(lambda: caught_up(c, sink), 240, what="caught up")
        items.start()
        orders.start()
        # Rows a re-copy of items repairs, and one of orders that only a re-copy of orders would
        run(sink, "UPDATE items SET note = 'damaged' WHERE id BETWEEN 20001 AND 20005")
        run(sink, "UPDATE orders SET note = 'damaged' WHERE id = 7")
        before = dict(run(sink, "SELECT table_name, rows_copied FROM sluicegate.copy_state"))
        out = cli("replicate", "bootstrap", c.workflow, "--sink", sink, "--tables", "items")
        assert out.returncode == 0, out.stderr
        assert "public.items: copy (re-bootstrap asked for)" in out.stdout, out.stdout
        assert "public.orders resume from checkpoint" in out.stdout, out.stdout
        # While items is copied again, orders' new rows keep arriving on the sink
        seen = []

        def recopied():
            s = stream(sink)
            seen.append((s["state"], run(sink, "SELECT max(id) FROM orders")[0][0]))
            return s["state"] == "Running"
        wait_for(recopied, 240, interval=0.3, what="items re-copied")
        copying = [m for state, m in seen if state == "Copying"]
        assert len(copying) >= 2 and copying[-1] > copying[0], f"orders stalled during the re-copy: {seen}"
        after = dict(run(sink, "SELECT table_name, rows_copied FROM sluicegate.copy_state"))
        assert after["public.orders"] == before["public.orders"]
        assert after["public.items"] > 0
        items.stop_event.set()
        orders.stop_event.set()
        items.join()
        orders.join()
        assert items.error is None and orders.error is None, (items.error, orders.error)
        wait_for(lambda: caught_up(c, sink), 120, what="caught up")
        assert_equal(c, sink, "public.items", ["id"])  # the damaged rows were replaced by the copy
        assert run(sink, "SELECT note FROM orders WHERE id = 7") == [("damaged",)]  # orders was not re-copied
        run(sink, "UPDATE orders SET note = 'old' WHERE id = 7")
        assert_equal(c, sink, "public.orders", ["id"])
    finally:
        items.stop_event.set()
        orders.stop_event.set()
        consumer.kill()


def test_bootstrap_during_a_first_cycle_keeps_the_indexes_it_deferred(rc, tmp_path, monkeypatch):
    """A first copy cycle drops the table's indexes and records them; a kill -9 before the cycle is recorded,
    then `replicate bootstrap --tables`: the re-copy still builds them (their record says they exist)."""
    c = rc
    load_items(c, rows=3000)
    c.src("CREATE INDEX items_qty ON items (qty)")
    sink = c.sinks[0]
    out = create(c, sinks=[sink])
    assert out.returncode == 0, out.stderr
    indexes = "SELECT indexname FROM pg_indexes WHERE tablename = 'items' ORDER BY 1"
    assert run(sink, indexes) == [("items_pkey",), ("items_qty",)]
    monkeypatch.setenv("SLUICEGATE_FAULT_PAUSE", "copy.before_index_build")
    monkeypatch.setenv("SLUICEGATE_FAULT_DIR", str(tmp_path))
    consumer = Consumer(c.workflow, sink, tmp_path / "run.log").start()
    try:
        wait_for(lambda: (tmp_path / "copy.before_index_build").exists(), 240, what="the first cycle's end",
                 describe=lambda: (tmp_path / "run.log").read_text()[-2000:])
    finally:
        consumer.kill()
    assert run(sink, indexes) == []  # deferred: dropped for the cycle, not built yet
    out = cli("replicate", "bootstrap", c.workflow, "--sink", sink, "--tables", "items")
    assert out.returncode == 0 and "public.items: copy (re-bootstrap asked for)" in out.stdout, out.stdout
    monkeypatch.delenv("SLUICEGATE_FAULT_PAUSE")
    consumer = Consumer(c.workflow, sink, tmp_path / "run2.log").start()
    try:
        wait_for(lambda: caught_up(c, sink), 240, what="re-copied",
                 describe=lambda: (tmp_path / "run2.log").read_text()[-2000:])
        assert run(sink, indexes) == [("items_pkey",), ("items_qty",)]
        assert_equal(c, sink, "public.items", ["id"])
    finally:
        consumer.kill()


def _wal_segment(c, lsn: str) -> str:
    return c.src("SELECT pg_walfile_name(%s::pg_lsn)", (lsn,))[0][0]


def test_governor_releases_a_stopped_sinks_slot(rc, tmp_path):
    """Issue 24, item 4: --max-retained-wal 64MB, s1's consumer down, ~300 MB of WAL: s2's governor releases
    s1's slot, status says why and what to run, the WAL s1 held goes, s2 is unaffected, bootstrap recovers s1."""
    c = rc
    load_items(c)
    c.src("CREATE TABLE ballast (id bigserial PRIMARY KEY, pad text)")  # not replicated: WAL, nothing to apply
    out = create(c, "--tables", "items", "--max-retained-wal", "64MB")
    assert out.returncode == 0, out.stderr
    consumers = [Consumer(c.workflow, s, tmp_path / f"run{i}.log").start() for i, s in enumerate(c.sinks)]
    writer = Writer(c.source, 5000, seed=13, pause=0.01)
    watch = StreamWatch(c, c.sinks[1])
    s1_slot, s2_slot = _slot(c, 0), _slot(c, 1)
    try:
        wait_for(lambda: all(caught_up(c, s) for s in c.sinks), 240, what="both sinks caught up")
        writer.start()
        watch.start()
        _stop_consumer(c, consumers[0], 0)
        held_from = _slot_row(c, s1_slot)[2]
        segment = _wal_segment(c, held_from)
        assert c.src("SELECT count(*) FROM pg_ls_waldir() WHERE name = %s", (segment,))[0][0] == 1
        assert all(s["exists"] for s in status(c.workflow, c.sinks[0])["sinks"])
        for _ in range(30):  # ~10 MB of WAL a transaction
            c.src("INSERT INTO ballast (pad) SELECT repeat('x', 1000) FROM generate_series(1, 10000)")
        assert c.src("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", (held_from,))[0][0] > 300e6
        wait_for(lambda: _slot_row(c, s1_slot) is None, 60, what="s1's slot released by s2's governor")
        assert _slot_row(c, s2_slot) is not None

        st = status(c.workflow, c.sinks[0])
        s1_state = stream(c.sinks[0])
        assert s1_state["state"] == "Error", s1_state
        assert "retention governor released" in s1_state["message"] and "--max-retained-wal 64.0 MB" in \
            s1_state["message"], s1_state
        command = BOOTSTRAP.search(s1_state["message"]).group(1)
        assert command.startswith(f"sluicegate replicate bootstrap {c.workflow} --sink "), command
        gone = [w for w in st["warnings"] if w.startswith("sink s1: its replication slot")]
        assert gone and "retention governor" in gone[0] and command in gone[0], st["warnings"]
        entry = {s["sink"]: s for s in st["sinks"]}
        assert entry["s1"]["exists"] is False and "retention governor" in entry["s1"]["released"], entry
        assert entry["s2"]["exists"] is True, entry
        # The WAL s1's slot held is removed at the next checkpoints, and no slot of the workflow holds the cap
        def removed():
            c.src("CHECKPOINT")
            held = c.src("SELECT max(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)) FROM pg_replication_slots "
                         "WHERE slot_name = ANY(%s)", ([s1_slot, s2_slot],))[0][0]
            files = c.src("SELECT count(*) FROM pg_ls_waldir() WHERE name = %s", (segment,))[0][0]
            return files == 0 and held < 64 * 2**20
        wait_for(removed, 60, interval=1.0, what="the WAL s1 held removed")

        _run_bootstrap(command)
        consumers[0] = Consumer(c.workflow, c.sinks[0], tmp_path / "run0b.log").start()
        wait_for(_passes_now(c, c.sinks[0]), 240, what="s1 back after its bootstrap")
        settle(c, writer)
        assert all(s["exists"] for s in status(c.workflow, c.sinks[1])["sinks"])
    finally:
        watch.stop_event.set()
        writer.stop_event.set()
        for consumer in consumers:
            consumer.kill()
    watch.finish()  # s2 never left Running


@pytest.mark.slow  # the WAL cap test covers the governor in the default suite
def test_governor_age_cap(rc, tmp_path):
    """--max-retention-age: s1's consumer down while the source writes; once the WAL its slot holds is older
    than the cap (dated by s2's governor's samples of the source's WAL position), the slot is released."""
    c = rc
    load_items(c, rows=1000)
    out = create(c, "--max-retention-age", "10s")
    assert out.returncode == 0, out.stderr
    consumers = [Consumer(c.workflow, s, tmp_path / f"run{i}.log").start() for i, s in enumerate(c.sinks)]
    writer = Writer(c.source, 1000, seed=17, pause=0.05)
    s1_slot = _slot(c, 0)
    try:
        wait_for(lambda: all(caught_up(c, s) for s in c.sinks), 240, what="both sinks caught up")
        writer.start()
        _stop_consumer(c, consumers[0], 0)
        wait_for(lambda: _slot_row(c, s1_slot) is None, 90, what="s1's slot released for its age")
        s1 = stream(c.sinks[0])
        assert s1["state"] == "Error" and "over --max-retention-age 10 s" in s1["message"], s1
        assert BOOTSTRAP.search(s1["message"]), s1
        st = status(c.workflow, c.sinks[1])
        assert {s["sink"]: s["exists"] for s in st["sinks"]} == {"s1": False, "s2": True}, st["sinks"]
        assert stream(c.sinks[1])["state"] == "Running"
    finally:
        writer.stop_event.set()
        for consumer in consumers:
            consumer.kill()


def test_governor_release_races_a_starting_consumer(source_server):
    """Item 4's race, step by step on a real source: the governor judges a slot idle, and a consumer starts.
    (a) the consumer reads first: the drop fails, the slot and its changes stay, no note is left behind;
    (b) the consumer has checked the slot but not connected when the drop lands: it cannot start, looks again
    and fails with the governor's note and the bootstrap command; nothing is read past the gap;
    (c) a second governor that saw the same idle slot does not wipe the first one's note."""
    from sluicegate.cluster.governor import SlotHold, _release
    from sluicegate.cluster.model import Cluster as Model
    from sluicegate.errors import RetryableError, TerminalError
    from sluicegate.postgres import capture
    from sluicegate.postgres.replication import ChangeStream

    name = f"race{int(time.time() * 1000) % 10**9}"
    source_server.create_database(name)
    url = source_server.url(name)
    model = Model("rp", url, {"s1": url + "_s1", "s2": url + "_s2"}, "s2", max_retained_wal=1)
    slot = model.slot("s1")
    try:
        with psycopg.connect(url, autocommit=True) as src:
            src.execute("CREATE TABLE items (id int PRIMARY KEY)")
            src.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE items").format(sql.Identifier(slot)))
            start = capture.ensure_slot(src, slot)
            src.execute("INSERT INTO items VALUES (1)")
            hold = SlotHold("s1", slot, True, retained_bytes=2, active=False)  # as the governor saw it: idle

            # (a) the consumer is reading when the governor acts
            with ChangeStream(url, slot, slot, start):
                assert _release(src, model, hold, "over the cap") is None
            assert capture.slot_info(src, slot) is not None and capture.release_note(src, slot) is None

            # (b) checked, then released, then the consumer connects
            capture.check_slot(src, slot, start, model.way_out("s1"))
            wait_for(lambda: capture.slot_info(src, slot).active_pid is None, 10, what="reader gone")
            note = _release(src, model, hold, "over the cap")
            assert note and "retention governor released" in note
            with pytest.raises(RetryableError):
                ChangeStream(url, slot, slot, start)
            with pytest.raises(TerminalError) as failed:
                capture.check_slot(src, slot, start, model.way_out("s1"))
            assert "retention governor released" in str(failed.value)
            assert "sluicegate replicate bootstrap rp --sink " in str(failed.value)
            # (c) the other sink's governor, acting on the same stale look, leaves the slot's note alone
            assert _release(src, model, hold, "over the cap") is None
            assert capture.release_note(src, slot) == note
    finally:
        with psycopg.connect(source_server.url(), autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone():
                wait_for(lambda: conn.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                                              (slot,)).fetchone()[0] is None, 10, what="reader gone")
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        source_server.drop_database(name)


"""Replicate --bidirectional: A (on the target server) and B (on the sink server) both take writes; each side's
consumer runs as `workflow run W --target A|B` with its own Spark. Writes each direction applies carry its
replication origin, and the other direction's capture drops them: nothing comes back, nothing loops."""

from __future__ import annotations

import contextlib
import os
import random
import re
import threading
import time

import psycopg
import pytest

from sluicegate.cluster.governor import Governor
from sluicegate.cluster.model import origin_name
from sluicegate.localpg import LocalPostgres
from sluicegate.position import parse_lsn
from sluicegate.postgres import origins
from sluicegate.postgres.connect import strip_password

from ..conftest import drop_slots, wait_for
from .cluster_helpers import Consumer, cli, run, status, stream
from .helpers import table_rows

pytestmark = pytest.mark.spark
W = "rp"


class Pair:
    def __init__(self, a_server, b_server):
        self.name = f"bd{os.getpid()}_{random.randrange(10**6)}"
        self.servers = (a_server, b_server)
        for server in self.servers:
            server.create_database(self.name)
        self.a, self.b = (s.url(self.name) for s in self.servers)

    def create(self, *extra, sinks=None):
        return cli("replicate", "create", "--workflow", W, "--source", self.a,
                   *[x for s in (sinks or [self.b]) for x in ("--sink", s)], "--bidirectional", *extra)

    def wal(self, url) -> int:
        return parse_lsn(run(url, "SELECT pg_current_wal_lsn()::text")[0][0])

    def cleanup(self):
        for server, url, peer in ((self.servers[0], self.a, "b"), (self.servers[1], self.b, "a")):
            with contextlib.suppress(Exception), psycopg.connect(server.url(), autocommit=True) as c:
                c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                          "AND pid <> pg_backend_pid()", (self.name,))
                drop_slots(c, self.name)
                origins.drop(c, origin_name(W, strip_password(url), peer))
            with contextlib.suppress(Exception):
                server.drop_database(self.name)


@pytest.fixture
def bidi(target_server, sink_server):
    p = Pair(target_server, sink_server)
    yield p
    p.cleanup()


def caught_up(side: str, other: str) -> bool:
    """The direction whose sink is `side` has applied everything its source `other` has flushed."""
    s = stream(side, W)
    flushed = parse_lsn(run(other, "SELECT pg_current_wal_flush_lsn()::text")[0][0])
    return s["state"] == "Running" and s["position"] is not None and s["position"] >= flushed


def applied(side: str) -> int:
    return run(side, "SELECT rows_applied FROM sluicegate.streams WHERE workflow = %s", (W,))[0][0]


def equal(p: Pair) -> bool:
    return table_rows(p.a, "public.items", ["id"]) == table_rows(p.b, "public.items", ["id"])


def test_both_ways_no_copy_back_no_loop(bidi, tmp_path):
    p = bidi
    run(p.a, "CREATE TABLE items (id bigint PRIMARY KEY, qty int, note text)")
    run(p.a, "INSERT INTO items SELECT g, g % 7, md5(g::text) FROM generate_series(1, 20000) g")
    out = p.create()
    assert out.returncode == 0, out.stderr
    assert "sink b " in out.stdout and "public.items: copy — new setup, sink table created" in out.stdout
    assert "sink a " in out.stdout and "public.items: replicate — the copy's source" in out.stdout
    assert f"--target {strip_password(p.a)}" in out.stdout and f"--target {strip_password(p.b)}" in out.stdout
    # B's slot (for B->A) exists from create: B's copy, later, is in its range and must be dropped by origin.
    assert run(p.b, "SELECT count(*) FROM pg_replication_slots WHERE database = current_database()")[0][0] == 1
    a_before, b_before = p.wal(p.a), p.wal(p.b)
    consumers = [Consumer(W, p.a, tmp_path / "a.log").start()]  # A's first: B->A reads B's slot all along
    try:
        wait_for(lambda: stream(p.a, W)["state"] == "Running", 180, what="B->A running")
        consumers.append(Consumer(W, p.b, tmp_path / "b.log").start())
        wait_for(lambda: caught_up(p.b, p.a), 240, what="B copied and caught up",
                 describe=lambda: (tmp_path / "b.log").read_text()[-2000:])
        assert equal(p)
        wait_for(lambda: caught_up(p.a, p.b), 60, what="B->A past B's copy")
        copy_wal = p.wal(p.b) - b_before
        a_wal = p.wal(p.a) - a_before
        # Nothing of the copy came back to A: no row applied there, and A's WAL grew by its consumer's own
        # bookkeeping only, not by the copy's size.
        assert applied(p.a) == 0
        assert copy_wal > 1_000_000, copy_wal
        assert a_wal < copy_wal / 4, (a_wal, copy_wal)
        origin_rows = run(p.b, "SELECT count(*) FROM items WHERE pg_xact_commit_timestamp_origin(xmin) "
                               "IS NOT NULL AND (pg_xact_commit_timestamp_origin(xmin)).roident <> 0")[0][0]
        assert origin_rows == 20000  # the copy's rows carry the A->B origin

        # Writes on both sides, different keys: each reaches the other.
        with psycopg.connect(p.a, autocommit=True) as c:
            c.execute("INSERT INTO items SELECT g, 1, 'from a' FROM generate_series(100001, 100050) g")
            c.execute("UPDATE items SET qty = qty + 100, note = 'a' WHERE id BETWEEN 1 AND 2000")
            c.execute("DELETE FROM items WHERE id BETWEEN 5001 AND 5010")
        with psycopg.connect(p.b, autocommit=True) as c:
            c.execute("INSERT INTO items SELECT g, 2, 'from b' FROM generate_series(200001, 200050) g")
            c.execute("UPDATE items SET qty = qty + 200, note = 'b' WHERE id BETWEEN 2001 AND 4000")
            c.execute("DELETE FROM items WHERE id BETWEEN 6001 AND 6010")
        wait_for(lambda: caught_up(p.a, p.b) and caught_up(p.b, p.a) and equal(p), 120, what="both sides equal")
        assert run(p.a, "SELECT count(*) FROM items WHERE note = 'from b'")[0][0] == 50
        assert run(p.b, "SELECT count(*) FROM items WHERE note = 'from a'")[0][0] == 50
        assert run(p.a, "SELECT count(*), min(qty) FROM items WHERE note = 'b'")[0][0] == 2000
        assert run(p.b, "SELECT count(*) FROM items WHERE id BETWEEN 5001 AND 5010")[0][0] == 0
        # The applied rows carry the source's commit time (pg_replication_origin_xact_setup).
        assert run(p.a, "SELECT count(*) FROM items WHERE note = 'b' AND "
                        "(pg_xact_commit_timestamp_origin(xmin)).roident <> 0")[0][0] == 2000

        # No loop: idle, neither side applies anything more, and the WAL grows by heartbeats only. A loop of
        # the 2000-row updates above would write hundreds of kB per round trip.
        wait_for(lambda: applied(p.a) == 2000 + 50 + 10 and applied(p.b) == 2000 + 50 + 10, 30,
                 what="rows applied", describe=lambda: (applied(p.a), applied(p.b)))
        rows = applied(p.a), applied(p.b)
        a0, b0, t0 = p.wal(p.a), p.wal(p.b), time.monotonic()
        for _ in range(10):
            time.sleep(1)  # a measurement window, not a wait: every second, nothing more may be applied
            assert (applied(p.a), applied(p.b)) == rows
        seconds = time.monotonic() - t0
        grown = p.wal(p.a) - a0, p.wal(p.b) - b0
        print(f"idle WAL over {seconds:.1f}s: A {grown[0]} B, B {grown[1]} B")
        # The WAL is the whole server's (the previous test's DROP DATABASE, autovacuum, checkpoints land in it):
        # a loose bound; what decides is that nothing was applied on either side (above).
        assert max(grown) < (1 << 20) + 12_288 * seconds, grown  # heartbeats: ~5 kB/s here
        assert equal(p)
        # Each side records both clusters' fixed ids and its own; status works from either side.
        for side, me in ((p.a, 1), (p.b, 2)):
            c = run(side, "SELECT options -> 'cluster' FROM sluicegate.workflows WHERE name = %s", (W,))[0][0]
            assert c["bidirectional"] and c["cluster_ids"] == {"a": 1, "b": 2} and c["cluster_id"] == me
            st = status(W, side)
            assert st["safe_time"] and [s["sink"] for s in st["sinks"]] == [{1: "a", 2: "b"}[me]], st
    finally:
        for c in consumers:
            c.kill()
    # delete on both sides: slots, publications, state and the replication origins go
    for side in (p.a, p.b):
        out = cli("workflow", "delete", W, "--target", side)
        assert out.returncode == 0, out.stderr
        assert "replication origin sg_" in out.stdout, out.stdout
    for side in (p.a, p.b):
        assert run(side, "SELECT count(*) FROM pg_replication_slots WHERE database = current_database()")[0][0] == 0
        prefixes = [origin_name(W, strip_password(u), peer) for u, peer in ((p.a, "b"), (p.b, "a"))]
        assert run(side, "SELECT count(*) FROM pg_replication_origin WHERE roname LIKE ANY(%s)",
                   ([f"{x}%" for x in prefixes],))[0][0] == 0


def _nothing_created(*sides: str) -> None:
    for side in sides:
        assert run(side, "SELECT count(*) FROM pg_replication_slots WHERE database = current_database()")[0][0] == 0
        if run(side, "SELECT to_regclass('sluicegate.workflows') IS NOT NULL")[0][0]:
            assert run(side, "SELECT count(*) FROM sluicegate.workflows")[0][0] == 0


def test_bad_input(bidi, tmp_path):
    p = bidi
    run(p.a, "CREATE TABLE users (id uuid PRIMARY KEY, email text UNIQUE)")
    out = p.create("--tables", "users", sinks=[p.b, p.b])
    assert out.returncode != 0 and "two clusters" in out.stderr and len(out.stderr.strip().splitlines()) == 1

    out = cli("replicate", "create", "--workflow", W, "--source", p.a, "--sink", p.a, "--bidirectional")
    assert out.returncode != 0 and "is the source database itself" in out.stderr, out.stderr  # one cluster twice
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    _nothing_created(p.a, p.b)

    out = p.create("--tables", "users")
    assert out.returncode != 0, out.stdout
    assert "users_email_key (email)" in out.stderr and "public.users" in out.stderr and "drop it" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    _nothing_created(p.a, p.b)

    run(p.a, "CREATE TABLE orders (id serial PRIMARY KEY, amount int)")
    out = p.create("--tables", "orders")
    assert out.returncode != 0 and "key column id draws from a sequence" in out.stderr, out.stderr
    assert "UUID" in out.stderr and "INCREMENT BY" in out.stderr
    _nothing_created(p.a, p.b)
    # Interleaved sequences are safe: odd keys on A, even on B.
    run(p.a, "ALTER SEQUENCE orders_id_seq INCREMENT BY 2 RESTART WITH 1")
    run(p.b, "CREATE TABLE orders (id serial PRIMARY KEY, amount int)")
    run(p.b, "ALTER SEQUENCE orders_id_seq INCREMENT BY 2 RESTART WITH 2")
    run(p.b, "CREATE TABLE users (id uuid PRIMARY KEY, email text)")
    out = p.create("--tables", "orders,users", "--allow-unsafe-schema")
    assert out.returncode == 0, out.stderr
    assert "warning: --allow-unsafe-schema: table public.users has unique index users_email_key" in out.stderr
    assert "orders" not in out.stderr  # not unsafe: no warning
    # Another workflow from A into B now would loop through the pair: still refused.
    out = cli("replicate", "create", "--workflow", "other", "--source", p.a, "--sink", p.b)
    assert out.returncode != 0 and "loop" in out.stderr, out.stderr


def test_track_commit_timestamp_off(bidi, tmp_path):
    p = bidi
    server = LocalPostgres(tmp_path / "off", settings={"track_commit_timestamp": "off"}).init().start()
    try:
        server.create_database("off")
        url = server.url("off")
        run(p.a, "CREATE TABLE items (id bigint PRIMARY KEY)")
        for source, sink in ((p.a, url), (url, p.a)):
            if source == url:
                run(url, "CREATE TABLE items (id bigint PRIMARY KEY)")
            out = cli("replicate", "create", "--workflow", W, "--source", source, "--sink", sink, "--bidirectional")
            assert out.returncode != 0
            assert "track_commit_timestamp = off" in out.stderr, out.stderr
            assert "ALTER SYSTEM SET track_commit_timestamp = on" in out.stderr and "restart" in out.stderr
            assert len(out.stderr.strip().splitlines()) == 1, out.stderr
            _nothing_created(p.a, url)
    finally:
        server.stop()


def conflicts(side: str) -> set[tuple[int, str, str]]:
    """(key, type, winner) of every conflict this side resolved."""
    return {(int(k), t, w) for k, t, w in
            run(side, "SELECT key ->> 0, type, winner FROM sluicegate.conflicts WHERE table_name = 'public.items'")}


def test_last_writer_wins_with_consumers_stopped(bidi, tmp_path):
    """Issue 25, items 1 and 2: every race written with both consumers stopped, each side's write to a key
    later than the other's by wall clock (one machine's clock: the commit times follow), then both started."""
    p = bidi
    run(p.a, "CREATE TABLE items (id bigint PRIMARY KEY, qty int, note text)")
    run(p.a, "INSERT INTO items SELECT g, g, 'base' FROM generate_series(1, 10000) g")
    out = p.create("--cycle-rows", "2000")  # a copy of many cycles, A writing all along
    assert out.returncode == 0, out.stderr
    assert "not applied yet" not in out.stderr
    # note (text) may be stored out of line: create says how updates can carry it whole (the sink's table is
    # the one create makes)
    assert out.stderr.count('ALTER TABLE "public"."items" REPLICA IDENTITY FULL on both clusters') == 1, out.stderr
    for side in (p.a, p.b):  # the application's deletes leave tombstones on both sides
        assert run(side, "SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'sluicegate_tombstones%'")[0][0] == 2
    logs = {side: tmp_path / f"{n}.log" for side, n in ((p.a, "a"), (p.b, "b"))}

    def both_running():
        consumers = [Consumer(W, p.a, logs[p.a]).start()]
        wait_for(lambda: stream(p.a, W)["state"] == "Running", 180, what="B->A running")
        consumers.append(Consumer(W, p.b, logs[p.b]).start())
        return consumers

    def converged():
        return caught_up(p.a, p.b) and caught_up(p.b, p.a) and equal(p)

    def tail():
        return {str(s): path.read_text()[-1500:] for s, path in logs.items() if path.exists()}

    copying = threading.Event()
    copying.set()
    written = []

    def write_during_copy():
        """Changes on both sides of the copy's last key: those above it are the copy's to bring."""
        rnd = random.Random(25)
        with psycopg.connect(p.a, autocommit=True) as c:
            while copying.is_set():
                key = rnd.randrange(1000, 10001)
                c.execute("UPDATE items SET qty = qty + 1, note = 'during copy' WHERE id = %s", (key,))
                written.append(key)
                time.sleep(0.01)  # pacing the writer, not waiting for anything

    writer = threading.Thread(target=write_during_copy)
    consumers = both_running()
    writer.start()
    try:
        wait_for(lambda: stream(p.b, W)["state"] == "Running", 240, what="B copied", describe=tail)
        copying.clear()
        writer.join()
        wait_for(converged, 120, what="both sides equal after the copy", describe=tail)
    finally:
        copying.clear()
        writer.join()
        for c in consumers:
            c.kill()
    # Spark's Python workers run in their own process group: a play task outlives the kill by a moment (until
    # Spark's daemon sees the JVM gone). The races below need both directions really stopped.
    wait_for(lambda: not any(run(side, "SELECT count(*) FROM pg_replication_slots WHERE active AND "
                                       "database = current_database()")[0][0] for side in (p.a, p.b)),
             60, what="no play task left reading a slot")
    assert len(written) > 20, len(written)
    assert run(p.b, "SELECT count(*) FROM items WHERE note = 'during copy'")[0][0] == len(set(written))

    def write(side, text):
        run(side, text)  # autocommit: one transaction each, committed before the next begins

    # 1: the same row updated on A, later on B; the same new key inserted on A, later on B.
    write(p.a, "UPDATE items SET qty = 100, note = 'a' WHERE id = 1")
    write(p.b, "UPDATE items SET qty = 200, note = 'b' WHERE id = 1")
    write(p.a, "INSERT INTO items VALUES (10001, 100, 'a')")
    write(p.b, "INSERT INTO items VALUES (10001, 200, 'b')")
    # 2: (a) delete on A, later update on B: the row lives, with B's values (A gets it back whole)
    write(p.a, "DELETE FROM items WHERE id = 2")
    write(p.b, "UPDATE items SET qty = 202 WHERE id = 2")
    # (b) update on B, later delete on A: gone on both (A's tombstone outranks B's older update)
    write(p.b, "UPDATE items SET qty = 203 WHERE id = 3")
    write(p.a, "DELETE FROM items WHERE id = 3")
    # (c) delete on both
    write(p.a, "DELETE FROM items WHERE id = 4")
    write(p.b, "DELETE FROM items WHERE id = 4")
    # (d) update on A of a row whose later delete on B has not arrived yet: gone on both
    write(p.a, "UPDATE items SET qty = 105 WHERE id = 5")
    write(p.b, "DELETE FROM items WHERE id = 5")

    consumers = both_running()
    try:
        wait_for(converged, 240, what="both sides equal after the races", describe=tail)
        rows = {r[0]: r[1:] for r in run(p.a, "SELECT id, qty, note FROM items ORDER BY id")}
        assert rows[1] == (200, "b") and rows[10001] == (200, "b"), rows
        assert rows[2] == (202, "base"), rows
        assert 3 not in rows and 4 not in rows and 5 not in rows, rows
        assert rows[6] == (6, "base") and len(rows) == 9998, len(rows)
        # Each side's log names what it resolved and which version won.
        assert conflicts(p.a) == {
            (1, "update_exists", "remote"), (10001, "insert_exists", "remote"), (2, "update_deleted", "remote"),
            (3, "update_deleted", "local"), (4, "delete_deleted", "remote"), (5, "delete_exists", "remote")}
        assert conflicts(p.b) == {
            (1, "update_exists", "local"), (10001, "insert_exists", "local"), (2, "delete_exists", "local"),
            (3, "delete_exists", "remote"), (4, "delete_deleted", "local"), (5, "update_deleted", "local")}
        assert status(W, p.a)["conflicts"] == {"delete_deleted": 1, "delete_exists": 1, "insert_exists": 1,
                                               "update_deleted": 2, "update_exists": 1}
        assert status(W, p.b)["conflicts"] == {"delete_deleted": 1, "delete_exists": 2, "insert_exists": 1,
                                               "update_deleted": 1, "update_exists": 1}
        # The deleted keys keep their tombstones on both sides; the revived one has none.
        for side in (p.a, p.b):
            keys = {int(k) for (k,) in run(side, "SELECT key ->> 0 FROM sluicegate.tombstones")}
            assert keys == {3, 4, 5}, (side, keys)
        # A TRUNCATE cannot be ordered against the other side's writes: the direction stops, saying so.
        run(p.b, "TRUNCATE items")
        wait_for(lambda: stream(p.a, W)["state"] == "Error", 60, what="B->A stopped by the TRUNCATE",
                 describe=lambda: stream(p.a, W))
        assert "TRUNCATE of public.items" in stream(p.a, W)["message"]
        assert run(p.a, "SELECT count(*) FROM items")[0][0] == 9998
    finally:
        for c in consumers:
            c.kill()
    # Tombstone collection (the governor's, every minute): past the retention, this side's go.
    run(p.a, "UPDATE sluicegate.workflows SET options = jsonb_set(options, '{cluster,tombstone_retention}', "
             "'0.001') WHERE name = %s", (W,))
    assert run(p.a, "SELECT options #> '{cluster,tombstone_retention}' FROM sluicegate.workflows")[0][0]
    Governor(p.a, W, threading.Event()).check_once()
    assert run(p.a, "SELECT count(*) FROM sluicegate.tombstones")[0][0] == 0
    assert run(p.b, "SELECT count(*) FROM sluicegate.tombstones")[0][0] == 3
    for side in (p.a, p.b):
        out = cli("workflow", "delete", W, "--target", side)
        assert out.returncode == 0, out.stderr
        assert run(side, "SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'sluicegate_tombstones%'")[0][0] == 0


class SideWriter(threading.Thread):
    """Random updates, inserts and deletes of a small key range on one side, each its own transaction; every
    write that took effect is recorded with its commit time and the side's cluster id."""

    def __init__(self, url: str, cluster_id: int, keys: int, seed: int):
        super().__init__(daemon=True)
        self.url, self.cluster_id, self.keys, self.rng = url, cluster_id, keys, random.Random(seed)
        self.stop_event, self.writes, self.error = threading.Event(), [], None

    def run(self):
        try:
            with psycopg.connect(self.url, autocommit=True) as c:
                n = 0
                while not self.stop_event.is_set():
                    k, n, op = self.rng.randint(1, self.keys), n + 1, self.rng.random()
                    # No retry: the applier must never make the application's transactions fail.
                    row = self._write(c, k, n, op, f"{self.cluster_id}-{n}")
                    if row is not None:  # took effect: its commit time decides against the other side's writes
                        at = c.execute("SELECT pg_xact_commit_timestamp(%s::xid)", (row[3],)).fetchone()[0]
                        value = None if op >= 0.75 else f"({row[0]},{row[1]},{row[2]})"
                        self.writes.append((at, self.cluster_id, k, value))
                    self.stop_event.wait(0.005)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    @staticmethod
    def _write(c, k, n, op, note):
        if op < 0.5:
            return c.execute("UPDATE items SET qty = %s, note = %s WHERE id = %s "
                             "RETURNING id, qty, note, pg_current_xact_id()::text", (n, note, k)).fetchone()
        if op < 0.75:
            return c.execute("INSERT INTO items VALUES (%s, %s, %s) ON CONFLICT DO NOTHING "
                             "RETURNING id, qty, note, pg_current_xact_id()::text", (k, n, note)).fetchone()
        return c.execute("DELETE FROM items WHERE id = %s RETURNING id, NULL::int, NULL::text, "
                         "pg_current_xact_id()::text", (k,)).fetchone()


@pytest.mark.parametrize("seconds,kills", [  # slow: the default set has LWW in test_last_writer_wins_*
    pytest.param(12, 1, marks=pytest.mark.slow), pytest.param(60, 6, marks=pytest.mark.slow)])
def test_random_concurrent_writes_converge_to_the_later_commit(bidi, tmp_path, seconds, kills):
    """Issue 25, item 3: both sides write overlapping keys at once while each consumer is killed (-9) at random
    moments; afterwards A equals B row for row, and each key holds the write with the latest commit time (ties:
    the higher cluster id), or is absent if that write was a delete."""
    p = bidi
    keys = 60
    run(p.a, "CREATE TABLE items (id bigint PRIMARY KEY, qty int, note text)")
    run(p.a, "INSERT INTO items SELECT g, 0, 'base' FROM generate_series(1, %s) g", (keys,))
    assert p.create().returncode == 0
    sides = [(p.a, 1), (p.b, 2)]
    consumers = {p.a: Consumer(W, p.a, tmp_path / "a0.log").start()}
    wait_for(lambda: stream(p.a, W)["state"] == "Running", 180, what="B->A running")
    consumers[p.b] = Consumer(W, p.b, tmp_path / "b0.log").start()
    wait_for(lambda: caught_up(p.b, p.a), 180, what="B copied")
    writers = [SideWriter(url, cid, keys, seed=cid * 7) for url, cid in sides]
    rng = random.Random(25)
    try:
        for w in writers:
            w.start()
        deadline = time.monotonic() + seconds
        for n in range(kills * 2):  # each side's consumer `kills` times, at random moments
            time.sleep(rng.uniform(0, (deadline - time.monotonic()) / (kills * 2 - n)))  # a random moment
            side = sides[n % 2][0]
            consumers[side].kill()
            consumers[side] = Consumer(W, side, tmp_path / f"{n}.log").start()
        time.sleep(max(0.0, deadline - time.monotonic()))  # the writing goes on for its whole length
        for w in writers:
            w.stop_event.set()
            w.join()
            assert w.error is None, w.error
        wait_for(lambda: caught_up(p.a, p.b) and caught_up(p.b, p.a) and equal(p), 240, what="both sides equal")
        # Item 4: converged and no application writes -> no loop: neither side's WAL moves by more than the
        # consumers' own bookkeeping, and the conflict counters stand still. The writes' dead rows are vacuumed
        # first: an autovacuum inside the quiet period would count against the bound (a run saw 1.5 MB).
        for side, _ in sides:
            run(side, "VACUUM (ANALYZE)")
        before = {side: (p.wal(side), status(W, side)["conflicts"], applied(side)) for side, _ in sides}
        assert sum(sum(c.values()) for _, c, _ in before.values()) > 0  # the races did conflict
        idle = 30 if seconds >= 60 else 10
        time.sleep(idle)  # a quiet period of a given length is what is measured
        for side, _ in sides:
            grown = p.wal(side) - before[side][0]
            # The server's WAL, not the database's (autovacuum, the previous test's cleanup): a loose bound;
            # what decides is that nothing was applied and no conflict counted on either side.
            assert grown < (1 << 20) + idle * 12_000, (side, grown)
            assert status(W, side)["conflicts"] == before[side][1]
            assert applied(side) == before[side][2]
    finally:
        for w in writers:
            w.stop_event.set()
        for consumer in consumers.values():
            consumer.kill()
    latest: dict[int, tuple] = {}
    for at, cid, k, value in sorted(w for writer in writers for w in writer.writes):
        latest[k] = value  # sorted by (commit time, cluster id): the last one wins
    expected = sorted((f"({k},0,base)" for k in range(1, keys + 1) if k not in latest),
                      key=lambda r: int(r[1:].split(",")[0]))
    expected = sorted(expected + [v for v in latest.values() if v is not None],
                      key=lambda r: int(r[1:].split(",")[0]))
    assert sum(len(w.writes) for w in writers) > 100
    assert table_rows(p.a, "public.items", ["id"]) == expected


class IdentityWriter(threading.Thread):
    """Inserts (the key from the side's identity sequence), updates and deletes of random rows, on one side."""

    def __init__(self, url: str, seed: int):
        super().__init__(daemon=True)
        self.url, self.rng = url, random.Random(seed)
        self.stop_event, self.inserted, self.error = threading.Event(), [], None

    def run(self):
        try:
            with psycopg.connect(self.url, autocommit=True) as c:
                while not self.stop_event.is_set():
                    op = self.rng.random()
                    if op < 0.5:
                        self.inserted.append(c.execute("INSERT INTO items (qty, note) VALUES (%s, 'new') "
                                                       "RETURNING id", (self.rng.randint(0, 99),)).fetchone()[0])
                    elif op < 0.85:
                        c.execute("UPDATE items SET qty = qty + 1, note = 'upd' WHERE id = "
                                  "(SELECT id FROM items ORDER BY random() LIMIT 1)")
                    else:
                        c.execute("DELETE FROM items WHERE id = (SELECT id FROM items ORDER BY random() LIMIT 1)")
                    self.stop_event.wait(0.005)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def test_generated_always_identity_keys_both_ways(bidi, tmp_path):
    """Issue 34: a GENERATED ALWAYS identity key, each side's sequence set as create's advice says (odd keys on
    one side, even on the other): inserts, updates and deletes on both sides at once while both consumers
    run; every insert replicates (OVERRIDING SYSTEM VALUE) and the two sides end equal."""
    p = bidi
    ddl = "CREATE TABLE items (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, qty int, note text)"
    run(p.a, ddl)
    run(p.a, "INSERT INTO items (qty, note) SELECT g % 7, 'base' FROM generate_series(1, 200) g")
    run(p.b, ddl)  # empty: create copies into it
    out = p.create()
    assert out.returncode != 0 and "key column id draws from a sequence" in out.stderr, out.stderr
    # The advice's own statements, above every key either side has, odd on the source and even on the sink.
    advice = dict(re.findall(r"on (source|sink): (ALTER TABLE [^;]+)", out.stderr))
    assert advice == {side: f'ALTER TABLE "public"."items" ALTER COLUMN "id" SET INCREMENT BY 2 RESTART WITH {n}'
                      for side, n in (("source", 203), ("sink", 204))}, out.stderr
    _nothing_created(p.a, p.b)
    run(p.a, advice["source"])
    run(p.b, advice["sink"])
    out = p.create()
    assert out.returncode == 0, out.stderr
    consumers = [Consumer(W, p.a, tmp_path / "a.log").start()]
    writers = [IdentityWriter(url, seed) for url, seed in ((p.a, 1), (p.b, 2))]
    try:
        wait_for(lambda: stream(p.a, W)["state"] == "Running", 180, what="B->A running")
        consumers.append(Consumer(W, p.b, tmp_path / "b.log").start())
        wait_for(lambda: caught_up(p.b, p.a), 180, what="B copied and caught up",
                 describe=lambda: (stream(p.b, W), (tmp_path / "b.log").read_text()[-2000:]))
        # Issue 34's message nit: a second driver is refused before any progress line, naming the holder.
        began = time.monotonic()
        second = cli("workflow", "run", W, "--target", p.a, "--no-progress", timeout=120)
        assert second.returncode != 0 and second.stdout == "", second.stdout + second.stderr
        assert "already being run" in second.stderr and f"pid {consumers[0].proc.pid} " in second.stderr, \
            second.stderr
        assert len(second.stderr.strip().splitlines()) == 1, second.stderr
        assert time.monotonic() - began < 30
        assert run(p.a, "SELECT driver_pid FROM sluicegate.workflows WHERE name = %s", (W,))[0][0] == \
            consumers[0].proc.pid  # the refused driver did not record itself as the driver

        for w in writers:
            w.start()
        wait_for(lambda: all(len(w.inserted) >= 100 for w in writers) or any(w.error for w in writers), 60,
                 what="both sides writing")
        for w in writers:
            w.stop_event.set()
            w.join()
            assert w.error is None, w.error
        wait_for(lambda: caught_up(p.a, p.b) and caught_up(p.b, p.a) and equal(p), 120, what="both sides equal",
                 describe=lambda: (stream(p.a, W), stream(p.b, W)))
        for side in (p.a, p.b):
            assert stream(side, W)["state"] == "Running"
        a_keys, b_keys = writers[0].inserted, writers[1].inserted
        assert all(k % 2 == 1 and k >= 203 for k in a_keys) and all(k % 2 == 0 and k >= 204 for k in b_keys)
        # each side's inserts reached the other (those not deleted since)
        for side, keys in ((p.b, a_keys), (p.a, b_keys)):
            present = run(side, "SELECT count(*) FROM items WHERE id = ANY(%s)", (keys,))[0][0]
            assert present >= len(keys) // 2, (present, len(keys))
    finally:
        for w in writers:
            w.stop_event.set()
        for c in consumers:
            c.kill()

"""Replicate: tables added to a running workflow (issue 24 item 5), bad input to create and add-tables (item 7),
and `workflow status`'s human output for a sink.

The bad-input tests need no consumer (every command fails before one would start): no Spark there.
"""

from __future__ import annotations

import random
import subprocess
import threading
from urllib.parse import quote

import psycopg
import pytest
from psycopg import sql

from sluicegate.appliers import postgres as pg_applier
from sluicegate.workflow.engine import Engine

from ..conftest import wait_for
from .cluster_helpers import CLI, Consumer, assert_equal, caught_up, cli, cluster, create, run, stream

WORKFLOW = "rp"


@pytest.fixture
def rc(source_server, target_server, sink_server):
    with cluster(source_server, target_server, sink_server) as c:
        c.source_server = source_server
        yield c


def _load(c, items=2000, orders=0):
    c.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int, note text)")
    c.src("INSERT INTO items SELECT g, g %% 7, md5(g::text) FROM generate_series(1, %s) g", (items,))
    c.src("CREATE TABLE orders (id bigint PRIMARY KEY, item bigint, amount int, note text)")
    c.src("INSERT INTO orders SELECT g, g %% 1000, g %% 97, md5(g::text) FROM generate_series(1, %s) g", (orders,))


def failed(proc, *needles: str) -> str:
    """The one `error:` line of a failed command, naming every needle."""
    assert proc.returncode != 0, f"expected failure, got exit 0: {proc.stdout}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one error line: {proc.stderr!r}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} missing from {lines[0]!r}"
    return lines[0]


def _made(c) -> dict:
    """What create could have made: slots and publications on the source, workflows on each sink."""
    out = {"slots": c.src("SELECT slot_name FROM pg_replication_slots WHERE database = current_database()"),
           "publications": c.src("SELECT pubname FROM pg_publication")}
    for i, sink in enumerate(c.sinks):
        has = run(sink, "SELECT to_regclass('sluicegate.workflows') IS NOT NULL")[0][0]
        out[f"sink{i}"] = run(sink, "SELECT name, kind FROM sluicegate.workflows ORDER BY 1") if has else None
        out[f"sink{i} tables"] = run(sink, "SELECT relname FROM pg_class WHERE relkind = 'r' AND "
                                           "relnamespace = 'public'::regnamespace ORDER BY 1")
    return out


def socket_url(server, dbname: str) -> str:
    """The same database as server.url(dbname), reached through the server's unix socket instead of TCP."""
    return (f"postgresql://{quote(server.user, safe='')}:{quote(server.password, safe='')}@/{quote(dbname)}"
            f"?host={quote(str(server._sockdir), safe='')}&port={server.port}")


def test_create_bad_input_is_one_line_and_creates_nothing(rc):
    c = rc
    _load(c)
    dbname = c.servers[0][1]
    source_by_socket = socket_url(c.source_server, dbname)
    assert run(source_by_socket, "SELECT inet_server_addr() IS NULL")[0][0]  # really another way in: the socket
    sink_by_socket = socket_url(c.servers[1][0], dbname)
    # A MoveTables workflow on sink 2 that writes items there already.
    out = cli("movetables", "create", "--workflow", "mt", "--source", c.source, "--target", c.sinks[1],
              "--tables", "items")
    assert out.returncode == 0, out.stderr
    before = _made(c)
    assert before["sink1"] == [("mt", "MoveTables")]
    cases = [
        (create(c, sinks=[c.source, c.sinks[0]]), ["sink s1", "is the source database itself"]),
        (create(c, sinks=[c.sinks[0], source_by_socket]), ["sink s2", "is the source database itself"]),
        (create(c, sinks=[c.sinks[0], sink_by_socket]), ["sinks s1", "and s2", "the same database"]),
        (create(c, sinks=[c.sinks[0], c.sinks[0]]), ["sinks s1", "and s2", "the same database"]),
        (create(c), ["sink s2", "already the target of workflow 'mt'", "public.items"]),
        (create(c, "--tables", "items,nosuch", sinks=c.sinks[:1]), ["nosuch"]),
        (create(c, "--exclude-tables", "nosuch", sinks=c.sinks[:1]), ["--exclude-tables", "nosuch"]),
        (create(c, "--max-retained-wal", "12parsecs", sinks=c.sinks[:1]), ["--max-retained-wal", "12parsecs"]),
        (create(c, "--max-retention-age", "soon", sinks=c.sinks[:1]), ["--max-retention-age", "soon"]),
        (create(c, "--max-retained-wal", "0", sinks=c.sinks[:1]), ["--max-retained-wal", "above zero"]),
    ]
    for proc, needles in cases:
        failed(proc, *needles)
        assert c.servers[0][0].password not in proc.stderr
    assert _made(c) == before  # nothing on any sink (no workflow, no table), no slot or publication
    # The same command with good input does create (the checks above could have passed)
    out = create(c, "--tables", "items", "--max-retained-wal", "64MB", "--max-retention-age", "36h",
                  sinks=c.sinks[:1])
    assert out.returncode == 0, out.stderr
    assert run(c.sinks[0], "SELECT options -> 'cluster' ->> 'max_retained_wal', "
                           "options -> 'cluster' ->> 'max_retention_age' FROM sluicegate.workflows "
                           "WHERE name = %s", (c.workflow,)) == [(str(64 << 20), "129600.0")]
    # Its status before the consumer's first run: no safe time yet, and no slot, which is not a lost one
    text = cli("workflow", "status", c.workflow, "--target", c.sinks[0], timeout=60)
    assert text.returncode == 0, text.stderr
    assert "safe time (sink s1): -" in text.stdout and "not yet created" in text.stdout, text.stdout
    assert "is gone" not in text.stdout and "bootstrap" not in text.stdout, text.stdout


def _copy_state(sink) -> list:
    return run(sink, "SELECT c.table_name, c.lastpk::text, c.done FROM sluicegate.copy_state c "
                     "JOIN sluicegate.streams s ON s.id = c.stream_id WHERE s.workflow = %s ORDER BY c.ordinal",
               (WORKFLOW,))


def test_add_tables_bad_input(rc):
    """Already replicated, unknown, a sink table with rows (refused, nothing changed; --overwrite takes it)."""
    c = rc
    _load(c, orders=100)
    c.src("CREATE TABLE customers (id bigint PRIMARY KEY, name text)")
    out = create(c, "--tables", "items")
    assert out.returncode == 0, out.stderr

    def add(*tables, extra=(), sink=None):
        return cli("replicate", "add-tables", c.workflow, "--tables", ",".join(tables), "--target",
                   sink or c.sinks[1], *extra)

    run(c.sinks[1], "CREATE TABLE orders (id bigint PRIMARY KEY, item bigint, amount int, note text)")
    run(c.sinks[1], "INSERT INTO orders VALUES (1, 1, 1, 'on the sink before')")
    before = [_copy_state(s) for s in c.sinks]
    failed(add("items"), "public.items", "already replicated", "leave it out")
    failed(add("orders", "nosuch"), "nosuch")
    failed(add("orders", sink=c.source), "schema sluicegate is missing")  # the source is not a sink
    failed(add("orders", "customers"), "sink s2", "public.orders", "--overwrite")
    failed(add("orders", extra=("--shard-key", "orders=item")), "--shard-key", "one source database")
    assert [_copy_state(s) for s in c.sinks] == before
    assert run(c.sinks[0], "SELECT to_regclass('public.orders') IS NULL")[0][0]  # not created on s1 either
    assert run(c.sinks[1], "SELECT note FROM orders") == [("on the sink before",)]
    out = add("orders", "customers", extra=("--overwrite",))
    assert out.returncode == 0, out.stderr
    assert "sink s2" in out.stdout and "public.orders: copy" in out.stdout and "--overwrite" in out.stdout
    for sink in c.sinks:
        assert _copy_state(sink) == [("public.items", None, False), ("public.orders", None, False),
                                     ("public.customers", None, False)]
    failed(add("customers"), "public.customers", "already replicated")
    # An add-tables that reached only one sink (s2 lost its rows of it): running it again finishes the other
    for s in c.sinks[1:]:
        run(s, "DELETE FROM sluicegate.copy_state WHERE table_name = 'public.customers'")
    out = add("customers", sink=c.sinks[0])
    assert out.returncode == 0, out.stderr
    assert "sink s2 " in out.stdout and "sink s1 " not in out.stdout
    assert [_copy_state(s) for s in c.sinks] == [_copy_state(c.sinks[0])] * 2


def _published(c) -> set[str]:
    return {r[0] for r in c.src("SELECT tablename FROM pg_publication_tables")}


def test_init_publishes_tables_that_joined_meanwhile(rc):
    """A first run's init read the stream's tables, then add-tables (no slot yet: it leaves the publication to
    init) adds one: init must not move the stream on with a publication that lacks it. No Spark: init is
    the driver's work."""
    c = rc
    _load(c, orders=50)
    out = create(c, "--tables", "items", sinks=c.sinks[:1])
    assert out.returncode == 0, out.stderr
    engine = Engine(c.sinks[0], c.workflow, runner=None)
    try:
        wf = engine._load()
        stale = engine._stream(wf)  # what an init under way has read
        out = cli("replicate", "add-tables", c.workflow, "--tables", "orders", "--target", c.sinks[0])
        assert out.returncode == 0, out.stderr
        assert _published(c) == set()
        engine.init_stream(wf, stale)
        assert _published(c) == {"items"} and stream(c.sinks[0])["state"] == "Init"
        wf = engine._load()
        engine.init_stream(wf, engine._stream(wf))  # the next turn
        assert _published(c) == {"items", "orders"} and stream(c.sinks[0])["state"] == "Copying"
    finally:
        engine.close()


def test_add_tables_sees_a_copy_that_finished_while_it_waited(rc):
    """add-tables waits for the stream's lock (a batch committing); the initial copy ends meanwhile (Copying ->
    Running). The stream must go back to Copying, or the new table would never be copied."""
    c = rc
    _load(c, orders=50)
    out = create(c, "--tables", "items", sinks=c.sinks[:1])
    assert out.returncode == 0, out.stderr
    sink = c.sinks[0]
    run(sink, "UPDATE sluicegate.streams SET state = 'Copying' WHERE workflow = %s", (c.workflow,))
    with psycopg.connect(sink) as batch:  # a consumer's batch holding the stream's lock
        batch.execute("SELECT 1 FROM sluicegate.streams WHERE workflow = %s FOR UPDATE", (c.workflow,))
        proc = subprocess.Popen([*CLI, "replicate", "add-tables", c.workflow, "--tables", "orders", "--target",
                                 sink], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: run(sink, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                       "AND wait_event_type = 'Lock' AND query LIKE '%%FOR UPDATE%%'")[0][0] == 1,
                     60, what="add-tables waiting for the stream's lock")
            batch.execute("UPDATE sluicegate.streams SET state = 'Running' WHERE workflow = %s", (c.workflow,))
            batch.commit()  # the copy is done: the batch that ends it
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, err
    assert stream(sink)["state"] == "Copying"
    assert [t for t, _, done in _copy_state(sink)] == ["public.items", "public.orders"]


class Writer(threading.Thread):
    """Transactions over both tables: inserts of increasing ids (logged once committed, never deleted), updates
    of any row, deletes of rows loaded before. A missing logged id on a sink is a lost insert."""

    TABLES = ("items", "orders")

    def __init__(self, url: str, loaded: dict[str, int], seed: int = 5, pause: float = 0.01):
        super().__init__(daemon=True)
        self.url, self.loaded, self.rng, self.pause = url, loaded, random.Random(seed), pause
        self.next_id = {t: n + 1 for t, n in loaded.items()}
        self.inserted: dict[str, list[int]] = {t: [] for t in self.TABLES}
        self.both: list[tuple[int, int]] = []  # (items id, orders id) inserted by one transaction
        self.commits = 0
        self.stop_event = threading.Event()
        self.error = None

    def run(self):
        try:
            with psycopg.connect(self.url) as conn:
                while not self.stop_event.is_set():
                    new = {t: [] for t in self.TABLES}
                    for _ in range(self.rng.randint(2, 5)):
                        table = self.rng.choice(self.TABLES)
                        ident, op = sql.Identifier(table), self.rng.random()
                        if op < 0.4:
                            conn.execute(sql.SQL("INSERT INTO {} (id, note) VALUES (%s, 'new')").format(ident),
                                         (self.next_id[table],))
                            new[table].append(self.next_id[table])
                            self.next_id[table] += 1
                        elif op < 0.85:
                            conn.execute(sql.SQL("UPDATE {} SET note = md5(random()::text) WHERE id = %s").format(
                                ident), (self.rng.randint(1, self.next_id[table] - 1),))
                        else:
                            conn.execute(sql.SQL("DELETE FROM {} WHERE id = %s").format(ident),
                                         (self.rng.randint(1, self.loaded[table]),))
                    conn.commit()
                    for table, ids in new.items():
                        self.inserted[table] += ids
                    if new["items"] and new["orders"]:
                        self.both.append((new["items"][-1], new["orders"][-1]))
                    self.commits += 1
                    self.stop_event.wait(self.pause)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


class CopySampler(threading.Thread):
    """Per sink, a few times a second: the new table's copy state and the newest row of the old table."""

    def __init__(self, sinks: list[str], table: str):
        super().__init__(daemon=True)
        self.sinks, self.table = sinks, table
        self.samples: dict[str, list[tuple]] = {s: [] for s in sinks}  # (lastpk, done, items max id)
        self.stop_event = threading.Event()

    def run(self):
        while not self.stop_event.is_set():
            for sink in self.sinks:
                row = run(sink, "SELECT c.lastpk::text, c.done, (SELECT max(id) FROM items) "
                                "FROM sluicegate.copy_state c WHERE c.table_name = %s", (self.table,))
                if row:
                    self.samples[sink].append(row[0])
            self.stop_event.wait(0.25)


def _missing(url: str, table: str, ids: list[int]) -> list[int]:
    found = {r[0] for r in run(url, sql.SQL("SELECT id FROM {} WHERE id = ANY(%s)").format(sql.Identifier(table)),
                               (ids,))}
    return [i for i in ids if i not in found]


def _count(url: str, table: str) -> int:
    return run(url, sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table)))[0][0]


@pytest.mark.spark
def test_add_tables_while_running_under_writes(rc, tmp_path):
    """Both consumers run and the source writes both tables throughout. First the hand-off window held open:
    the new table is in the sinks' publications before they know it (what add-tables' step 1 leaves until
    step 2), and the running consumers meet its rows mid-transaction, on the C fast lane, and ignore them.
    Then `replicate add-tables` copies it in several cycles while the old table keeps replicating."""
    c = rc
    assert pg_applier._RowSink is not None, "the C fast lane (postgres/_pgoutput_rows.c) is not built"
    _load(c, items=5000, orders=200_000)
    out = create(c, "--tables", "items", "--cycle-rows", "20000")
    assert out.returncode == 0, out.stderr
    consumers = [Consumer(c.workflow, s, tmp_path / f"run{i}.log").start() for i, s in enumerate(c.sinks)]
    writer = Writer(c.source, {"items": 5000, "orders": 200_000})
    sampler = CopySampler(c.sinks, "public.orders")
    try:
        wait_for(lambda: all(stream(s)["state"] == "Running" for s in c.sinks), 180, what="both sinks running")
        writer.start()
        # The window between add-tables' steps 1 and 2, held open: orders published, unknown to the sinks.
        for sink in c.sinks:
            pub = run(sink, "SELECT publication FROM sluicegate.streams WHERE workflow = %s", (c.workflow,))[0][0]
            c.src(sql.SQL("ALTER PUBLICATION {} ADD TABLE orders").format(sql.Identifier(pub)))
        wait_for(lambda: len(writer.both) >= 20, 60, what="transactions writing both tables")
        items_id, _ = writer.both[-1]
        for sink in c.sinks:  # the items rows of those transactions arrive; their orders rows are ignored
            wait_for(lambda sink=sink: not _missing(sink, "items", [items_id]), 60, what="items replicated")
            assert stream(sink)["state"] == "Running" and stream(sink)["message"] == "", stream(sink)
            assert run(sink, "SELECT to_regclass('public.orders') IS NULL")[0][0]
        assert all(consumer.running() for consumer in consumers)

        out = cli("replicate", "add-tables", c.workflow, "--tables", "orders", "--target", c.sinks[0])
        assert out.returncode == 0, out.stderr
        for sink in ("s1", "s2"):
            assert f"sink {sink} " in out.stdout and "public.orders: copy — new setup, sink table created" in out.stdout
        sampler.start()
        mark = writer.inserted["items"][-1]  # committed before add-tables returned
        for sink in c.sinks:
            wait_for(lambda sink=sink: stream(sink)["state"] == "Running" and _copy_state(sink)[-1][2], 400,
                     what="orders copied", describe=lambda sink=sink: (stream(sink), _copy_state(sink)))
        commits = writer.commits
        wait_for(lambda: writer.commits >= commits + 30, 60, what="writes after the copy")
        writer.stop_event.set()
        writer.join()
        assert writer.error is None, writer.error
        for sink in c.sinks:
            wait_for(lambda sink=sink: caught_up(c, sink), 180, what="caught up")
        sampler.stop_event.set()
        sampler.join()
        for sink in c.sinks:
            for table in ("items", "orders"):
                rows = assert_equal(c, sink, f"public.{table}", ["id"])
                assert _count(sink, table) == _count(c.source, table) == rows
                assert not _missing(sink, table, writer.inserted[table]), f"{table} inserts lost on {sink}"
            assert stream(sink)["state"] == "Running" and stream(sink)["message"] == ""
        assert len(writer.inserted["orders"]) > 100, "too few orders written to show anything"
        for sink, samples in sampler.samples.items():
            copying = [(lastpk, items_max) for lastpk, done, items_max in samples if not done and lastpk]
            assert len({lastpk for lastpk, _ in copying}) >= 2, f"orders copied in one cycle on {sink}: {samples}"
            # the old table kept replicating while the new one was mid-copy
            assert any(items_max > mark for _, items_max in copying), f"items stalled during the copy on {sink}"
        text = cli("workflow", "status", c.workflow, "--target", c.sinks[0], timeout=60)
        assert text.returncode == 0, text.stderr
        assert "safe time (sink s1): 20" in text.stdout, text.stdout
        for name in ("s1 (this)", "s2", "active"):
            assert name in text.stdout, text.stdout
    finally:
        sampler.stop_event.set()
        writer.stop_event.set()
        for consumer in consumers:
            consumer.kill()


def test_deleting_a_sink_takes_it_off_the_others(rc):
    c = rc
    _load(c)
    assert create(c).returncode == 0
    out = cli("workflow", "delete", c.workflow, "--target", c.sinks[0])
    assert out.returncode == 0, out.stderr
    (sinks,), = run(c.sinks[1], "SELECT options -> 'cluster' -> 'sinks' FROM sluicegate.workflows WHERE name = %s",
                    (c.workflow,))
    assert list(sinks) == ["s2"]  # s2's governor and status no longer look for s1's slot
    assert run(c.sinks[0], "SELECT count(*) FROM sluicegate.workflows")[0][0] == 0

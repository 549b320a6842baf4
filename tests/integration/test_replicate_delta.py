"""Replicate into a PostgreSQL sink and a Delta sink (delta:PATH) at once: live writes, kill -9 of the Delta
sink's consumer, safe time, a slot dropped behind it and `replicate bootstrap`; and the refusals of create."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import psycopg
import pytest

from sluicegate.position import parse_lsn
from sluicegate.targets.delta.read import points
from sluicegate.targets.delta.state import Store

from ..conftest import wait_for
from .cluster_helpers import Consumer, assert_equal, caught_up, cli, create, load_items, run, status, stream
from .helpers import Writer
from .test_lake_movetables import by_key, delta_rows, source_rows

pytestmark = pytest.mark.spark


def lake_caught_up(c, root: Path) -> bool:
    wf = Store(root).load(c.workflow)
    flushed = parse_lsn(c.src("SELECT pg_current_wal_flush_lsn()::text")[0][0])
    return wf.state == "Running" and wf.position is not None and wf.position >= flushed


def assert_lake_equal(c, root: Path) -> None:
    src, dst = by_key(source_rows(c.source, "public.items")), by_key(delta_rows(root, "public.items"))
    assert src == dst, f"source {len(src)} rows, Delta sink {len(dst)}"


class SafeTimes(threading.Thread):
    """The Delta sink's safe time, from its state document, every half second."""

    def __init__(self, root: Path, workflow: str):
        super().__init__(daemon=True)
        self.store, self.workflow, self.samples = Store(root), workflow, []
        self.stop_event = threading.Event()

    def run(self):
        while not self.stop_event.is_set():
            safe = self.store.load(self.workflow).safe_time
            if safe is not None:
                self.samples.append(safe)
            self.stop_event.wait(0.5)


@pytest.mark.slow  # ~1 min; the default set kills a Delta driver in test_lake_movetables
def test_postgres_and_delta_sinks_kill_9_safe_time_and_bootstrap(rc, tmp_path):
    c = rc
    load_items(c, rows=3000)
    root = tmp_path / "lake"
    lake = f"delta:{root}"
    out = create(c, sinks=[c.sinks[0], lake])
    assert out.returncode == 0, out.stderr
    assert "sink s2 (delta:" in out.stdout
    assert "public.items: copy — new setup, Delta table created" in out.stdout
    writer = Writer(c.source, 3000, seed=27, pause=0.005)
    writer.start()
    pg = Consumer(c.workflow, c.sinks[0], tmp_path / "pg.log").start()
    dl = Consumer(c.workflow, lake, tmp_path / "delta.log").start()
    times = SafeTimes(root, c.workflow)
    times.start()
    try:
        wait_for(lambda: Store(root).load(c.workflow).state == "Running", 180, what="Delta sink running",
                 describe=lambda: (tmp_path / "delta.log").read_text()[-2000:])
        wait_for(lambda: Store(root).load(c.workflow).safe_time is not None, 60, what="a safe time")
        dl.kill()  # kill -9 of the Delta sink's consumer while it replicates
        before = writer.commits
        wait_for(lambda: writer.commits > before + 30, 60, what="writes")
        dl = Consumer(c.workflow, lake, tmp_path / "delta2.log").start()
        # under writes it never reaches the latest flush position: it passes this one
        mark = parse_lsn(c.src("SELECT pg_current_wal_flush_lsn()::text")[0][0])
        wait_for(lambda: (Store(root).load(c.workflow).position or 0) >= mark, 180, what="Delta sink resumed",
                 describe=lambda: (tmp_path / "delta2.log").read_text()[-2000:])
        assert "sink s2: resume from checkpoint" in (tmp_path / "delta2.log").read_text()
        writer.stop_event.set()
        writer.join()
        assert writer.error is None, writer.error
        wait_for(lambda: lake_caught_up(c, root), 120, what="Delta sink caught up")
        wait_for(lambda: caught_up(c, c.sinks[0]), 120, what="PostgreSQL sink caught up")
        assert_equal(c, c.sinks[0], "public.items", ["id"])
        assert_lake_equal(c, root)
        # An idle source: the Delta sink's safe time keeps moving
        idle = Store(root).load(c.workflow).safe_time
        wait_for(lambda: Store(root).load(c.workflow).safe_time > idle, 30,
                 what="safe time moving, source idle")
        st = status(c.workflow, lake)
        assert st["kind"] == "Replicate" and st["sink"] == "s2" and st["safe_time"].endswith("Z")
        assert st["safe_time_lag_seconds"] < 30
        assert [s["sink"] for s in st["sinks"]] == ["s1", "s2"] and all(s["exists"] for s in st["sinks"])
        text = cli("workflow", "status", c.workflow, "--target", lake)
        assert text.returncode == 0 and "sink s2: safe time 20" in text.stdout, text.stdout + text.stderr
        times.stop_event.set()

        # The Delta sink's slot dropped behind its stopped consumer: its next run ends in Error, with the
        # bootstrap command
        dl.kill()
        slot = Store(root).load(c.workflow).slot
        def dropped():  # the killed consumer's walsender may not have noticed yet
            c.src("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = %s "
                  "AND active_pid IS NOT NULL", (slot,))
            c.src("SELECT pg_drop_replication_slot(%s)", (slot,))
            return True

        wait_for(dropped, 30, what="the Delta sink's slot dropped")
        c.src("UPDATE items SET qty = qty + 100 WHERE id % 10 = 0")  # changes the Delta sink must not miss
        out = cli("workflow", "run", c.workflow, "--target", lake, "--no-progress",
                  "--spark-master", "local[1]")
        command = f"sluicegate replicate bootstrap {c.workflow} --sink {lake}"
        assert out.returncode != 0 and command in out.stderr, out.stderr[-2000:]
        assert Store(root).load(c.workflow).state == "Error"
        out = cli("replicate", "bootstrap", c.workflow, "--sink", lake)
        assert out.returncode == 0 and "table public.items: copy (re-bootstrap:" in out.stdout, out.stderr
        dl = Consumer(c.workflow, lake, tmp_path / "delta3.log").start()
        c.src("DELETE FROM items WHERE id % 10 = 1")
        wait_for(lambda: lake_caught_up(c, root), 180, what="Delta sink re-bootstrapped",
                 describe=lambda: (tmp_path / "delta3.log").read_text()[-2000:])
        assert_lake_equal(c, root)
        assert pg.running(), "the PostgreSQL sink's consumer stopped"
        wait_for(lambda: caught_up(c, c.sinks[0]), 120, what="PostgreSQL sink caught up")
        assert_equal(c, c.sinks[0], "public.items", ["id"])
        dl.kill()
        out = cli("vdiff", c.workflow, "--target", lake, "--spark-master", "local[1]")
        assert out.returncode == 0, out.stdout + out.stderr
    finally:
        times.stop_event.set()
        writer.stop_event.set()
        pg.kill()
        dl.kill()
    assert len(times.samples) > 3
    assert all(a <= b for a, b in itertools.pairwise(times.samples)), "safe time went backwards"


def test_delta_sink_refusals_create_nothing(rc, tmp_path):
    import pyarrow as pa
    from deltalake import write_deltalake

    c = rc
    load_items(c, rows=10)
    root = tmp_path / "lake"
    write_deltalake(str(root / "public" / "items"), pa.table({"id": [1], "qty": [1], "note": ["x"]}))
    out = create(c, sinks=[c.sinks[0], f"delta:{root}"])
    assert out.returncode != 0
    assert "sink tables already hold rows: sink s2 (delta:" in out.stderr, out.stderr
    assert "public.items" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    # nothing anywhere: no state on either sink, no slot or publication on the source
    assert not Store(root).exists(c.workflow)
    made = run(c.sinks[0], "SELECT to_regclass('public.items'), to_regclass('sluicegate.workflows')")
    assert made[0] == (None, None)
    assert c.src("SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'sg%%'")[0][0] == 0
    out = create(c, sinks=[f"delta:{root}", f"delta:{root}/"])
    assert out.returncode != 0 and "same Delta directory" in out.stderr, out.stderr
    out = create(c, "--bidirectional", sinks=[f"delta:{tmp_path / 'other'}"])
    assert out.returncode != 0 and "--bidirectional" in out.stderr, out.stderr
    # an emptied table that still carries an earlier workflow rp's changes past the source's position
    from deltalake import CommitProperties, Transaction

    stale = tmp_path / "stale"
    later = CommitProperties(app_transactions=[Transaction(f"sluicegate:{c.workflow}", 1 << 60)])
    empty = pa.table({"id": [1], "qty": [1], "note": ["x"]}).slice(0, 0)
    write_deltalake(str(stale / "public" / "items"), empty, commit_properties=later)
    out = create(c, "--overwrite", sinks=[f"delta:{stale}"])
    assert out.returncode != 0 and "changes would be skipped" in out.stderr, out.stderr
    assert not Store(stale).exists(c.workflow)
    out = cli("replicate", "create", "--workflow", c.workflow, "--source-shard", f"-={c.source}",
              "--sink", f"delta:{root}")
    assert out.returncode != 0 and "Delta sink" in out.stderr, out.stderr


def test_delete_delta_sink_leaves_the_other_sinks_list(rc, tmp_path):
    c = rc
    load_items(c, rows=10)
    root = tmp_path / "lake"
    out = create(c, sinks=[c.sinks[0], f"delta:{root}"])
    assert out.returncode == 0, out.stderr
    sinks = run(c.sinks[0], "SELECT options->'cluster'->'sinks' FROM sluicegate.workflows WHERE name = %s",
                (c.workflow,))[0][0]
    assert list(sinks) == ["s1", "s2"] and sinks["s2"] == f"delta:{root}"
    out = create(c, sinks=[f"delta:{root}"])  # a Delta-only workflow, but PATH already holds one of that name
    assert out.returncode != 0 and f"sink s1 (delta:{root}) already holds workflow" in out.stderr, out.stderr
    out = cli("replicate", "add-tables", c.workflow, "--tables", "items", "--target", c.sinks[0])
    assert out.returncode != 0 and "already replicated by workflow" in out.stderr, out.stderr
    out = cli("workflow", "delete", c.workflow, "--target", f"delta:{root}")
    assert out.returncode == 0, out.stderr
    assert not Store(root).exists(c.workflow)
    sinks = run(c.sinks[0], "SELECT options->'cluster'->'sinks' FROM sluicegate.workflows WHERE name = %s",
                (c.workflow,))[0][0]
    assert list(sinks) == ["s1"]


class OrdersWriter(threading.Thread):
    """Transactions that insert an order and update an older one and an item: the new table and the old."""

    def __init__(self, url: str, first_id: int):
        super().__init__(daemon=True)
        self.url, self.next_id = url, first_id
        self.inserted: list[int] = []
        self.stop_event = threading.Event()
        self.error = None

    def run(self):
        try:
            with psycopg.connect(self.url) as c:
                while not self.stop_event.is_set():
                    c.execute("INSERT INTO orders VALUES (%s, %s, 1)", (self.next_id, self.next_id % 100))
                    c.execute("UPDATE orders SET amount = amount + 1 WHERE id = %s", (self.next_id // 3,))
                    c.execute("UPDATE items SET qty = qty + 1 WHERE id = %s", (self.next_id % 2000 + 1,))
                    c.commit()
                    self.inserted.append(self.next_id)
                    self.next_id += 1
                    self.stop_event.wait(0.005)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


@pytest.mark.slow  # the default set adds tables to a Delta sink in test_lake_s3
def test_add_tables_on_a_delta_sink_while_it_runs(rc, tmp_path):
    """add-tables on a workflow with a PostgreSQL and a Delta sink, both consumers running and the source
    writing the old table and the new one throughout: each sink copies the new table and ends equal, nothing
    lost or doubled; on the Delta sink, no consistent point has the new table before the stream passed its
    copy, and the copy ran while the consumer kept running. Then `replicate bootstrap --tables items` re-copies
    an old table the same way, the consumer running."""
    c = rc
    load_items(c, rows=2000)
    c.src("CREATE TABLE orders (id bigint PRIMARY KEY, item bigint, amount int)")
    c.src("INSERT INTO orders SELECT g, g % 100, 0 FROM generate_series(1, 20000) g")
    root = tmp_path / "lake"
    lake = f"delta:{root}"
    out = create(c, "--tables", "items", "--cycle-rows", "5000", sinks=[c.sinks[0], lake])
    assert out.returncode == 0, out.stderr
    store = Store(root)
    pg = Consumer(c.workflow, c.sinks[0], tmp_path / "pg.log").start()
    dl = Consumer(c.workflow, lake, tmp_path / "delta.log").start()
    writer = OrdersWriter(c.source, 20001)
    try:
        wait_for(lambda: store.load(c.workflow).state == "Running" and stream(c.sinks[0])["state"] == "Running",
                 180, what="both sinks running", describe=lambda: (tmp_path / "delta.log").read_text()[-2000:])
        writer.start()
        wait_for(lambda: len(writer.inserted) > 50, 60, what="writes")
        # the Delta consumer's first consistent point comes with its first batch of those writes
        before = wait_for(lambda: points(root, c.workflow), 120, what="a consistent point",
                          describe=lambda: (tmp_path / "delta.log").read_text()[-2000:])
        assert all("public.orders" not in p.versions for p in before)
        out = cli("replicate", "add-tables", c.workflow, "--tables", "orders", "--target", lake)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "sink s2 (delta:" in out.stdout and "public.orders: copy — new setup, Delta table created" in out.stdout
        assert "sink s1 " in out.stdout, out.stdout
        wait_for(lambda: store.load(c.workflow).state == "Running" and store.load(c.workflow).table(
            "public.orders").done, 300, what="orders copied into Delta",
            describe=lambda: (tmp_path / "delta.log").read_text()[-2000:])
        wait_for(lambda: len(points(root, c.workflow)) > len(before) and "public.orders" in
                 points(root, c.workflow)[-1].versions, 120, what="a point with orders")
        # bootstrap --tables on a healthy slot, the consumer still running: items is copied again meanwhile
        recopied = store.load(c.workflow).table("public.items").cycles
        out = cli("replicate", "bootstrap", c.workflow, "--sink", lake, "--tables", "items")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "table public.items: copy (re-bootstrap asked for)" in out.stdout, out.stdout
        wait_for(lambda: store.load(c.workflow).state == "Running" and store.load(c.workflow).table(
            "public.items").cycles > recopied, 120, what="items copied again",
            describe=lambda: (tmp_path / "delta.log").read_text()[-2000:])
        count = len(writer.inserted)
        wait_for(lambda: len(writer.inserted) > count + 30, 60, what="writes after the copies")
        writer.stop_event.set()
        writer.join()
        assert writer.error is None, writer.error
        assert dl.running() and pg.running(), "a consumer stopped"
        wait_for(lambda: lake_caught_up(c, root), 180, what="Delta sink caught up")
        wait_for(lambda: caught_up(c, c.sinks[0]), 180, what="PostgreSQL sink caught up")
    finally:
        writer.stop_event.set()
        pg.kill()
        dl.kill()
    wf = store.load(c.workflow)
    orders = wf.table("public.orders")
    assert orders.cycles >= 4, orders  # copied in several cycles (--cycle-rows 5000)
    for table in ("public.items", "public.orders"):
        src, dst = by_key(source_rows(c.source, table)), by_key(delta_rows(root, table))
        assert [r["id"] for r in dst] == sorted({r["id"] for r in dst}), f"{table}: duplicate keys"
        assert src == dst, f"{table}: source {len(src)} rows, Delta sink {len(dst)}"
        assert_equal(c, c.sinks[0], table, ["id"])
    assert {r["id"] for r in delta_rows(root, "public.orders")} >= set(writer.inserted)
    recorded = points(root, c.workflow)
    with_orders = [p for p in recorded if "public.orders" in p.versions]
    assert with_orders and all(p.position >= orders.copied_to for p in with_orders), \
        [(p.position, orders.copied_to) for p in with_orders[:3]]
    assert all(p.position < orders.copy_from for p in recorded if "public.orders" not in p.versions)


@pytest.mark.slow
def test_postgres_sinks_governor_releases_the_delta_sinks_slot(rc, tmp_path):
    """--max-retained-wal: the Delta sink's consumer stopped, WAL written on the source; the PostgreSQL sink's
    consumer releases the Delta sink's slot and puts it in Error; `replicate bootstrap` brings it back."""
    c = rc
    load_items(c, rows=2000)
    c.src("CREATE TABLE filler (id bigint, pad text)")
    root = tmp_path / "lake"
    lake = f"delta:{root}"
    out = create(c, "--tables", "items", "--max-retained-wal", "4MB", sinks=[c.sinks[0], lake])
    assert out.returncode == 0, out.stderr
    pg = Consumer(c.workflow, c.sinks[0], tmp_path / "pg.log").start()
    dl = Consumer(c.workflow, lake, tmp_path / "delta.log").start()
    try:
        wait_for(lambda: lake_caught_up(c, root), 180, what="Delta sink running",
                 describe=lambda: (tmp_path / "delta.log").read_text()[-2000:])
        # the Delta sink's governor dates the WAL from samples in its state document
        wait_for(lambda: Store(root).load(c.workflow).wal_samples, 60, what="WAL samples in the Delta state")
        dl.kill()
        c.src("INSERT INTO filler SELECT g, repeat('x', 200) FROM generate_series(1, 60000) g")
        c.src("UPDATE items SET qty = qty + 1")
        wait_for(lambda: Store(root).load(c.workflow).state == "Error", 180, what="the Delta sink released",
                 describe=lambda: (tmp_path / "pg.log").read_text()[-2000:])
        message = Store(root).load(c.workflow).message
        assert "retention governor released" in message and "--max-retained-wal" in message, message
        assert f"sluicegate replicate bootstrap {c.workflow} --sink {lake}" in message, message
        st = status(c.workflow, lake)
        mine = next(s for s in st["sinks"] if s["sink"] == "s2")
        assert not mine["exists"] and mine["released"], st
        assert any("replicate bootstrap" in w for w in st["warnings"]), st
        assert pg.running()
        out = cli("replicate", "bootstrap", c.workflow, "--sink", lake)
        assert out.returncode == 0 and "copy (re-bootstrap:" in out.stdout, out.stdout + out.stderr
        dl = Consumer(c.workflow, lake, tmp_path / "delta2.log").start()
        wait_for(lambda: lake_caught_up(c, root), 180, what="Delta sink back",
                 describe=lambda: (tmp_path / "delta2.log").read_text()[-2000:])
        assert_lake_equal(c, root)
        wait_for(lambda: caught_up(c, c.sinks[0]), 120, what="PostgreSQL sink caught up")
        assert_equal(c, c.sinks[0], "public.items", ["id"])

        # A healthy slot, --tables: that table re-copied (its first cycle replaces the rows), then replicated
        dl.kill()
        cycles = Store(root).load(c.workflow).tables[0].cycles
        out = cli("replicate", "bootstrap", c.workflow, "--sink", lake, "--tables", "items")
        assert out.returncode == 0 and "public.items: copy (re-bootstrap asked for)" in out.stdout, out.stdout
        c.src("UPDATE items SET qty = qty + 1 WHERE id % 3 = 0")
        dl = Consumer(c.workflow, lake, tmp_path / "delta3.log").start()
        wait_for(lambda: lake_caught_up(c, root), 180, what="Delta sink re-copied",
                 describe=lambda: (tmp_path / "delta3.log").read_text()[-2000:])
        assert Store(root).load(c.workflow).tables[0].cycles > cycles
        assert_lake_equal(c, root)

        # The Delta sink's consumer governs the PostgreSQL sink's slot: stopped, past the cap, released
        pg.kill()
        c.src("INSERT INTO filler SELECT g, repeat('y', 200) FROM generate_series(1, 60000) g")
        wait_for(lambda: stream(c.sinks[0])["state"] == "Error", 180, what="the PostgreSQL sink released",
                 describe=lambda: (tmp_path / "delta3.log").read_text()[-2000:])
        assert "retention governor released" in stream(c.sinks[0])["message"]
        assert Store(root).load(c.workflow).state == "Running"
    finally:
        pg.kill()
        dl.kill()


def test_add_only_publication_keeps_what_a_racing_writer_added(rc):
    """A Delta sink's Init and add-tables widen its publication add-only: a writer holding a stale table list
    (Init read before add-tables appended) cannot take a table out, where SET TABLE would."""
    from sluicegate.postgres import capture, catalog

    for name in ("a", "b", "c"):
        rc.src(f"CREATE TABLE {name} (id int PRIMARY KEY)")

    def published(conn):
        return {r[0] for r in conn.execute("SELECT tablename FROM pg_publication_tables WHERE pubname = 'sg_t'")}

    with psycopg.connect(rc.source, autocommit=True) as conn:
        a, b, c = catalog.resolve_tables(conn, ["a", "b", "c"])
        try:
            capture.ensure_publication(conn, "sg_t", [a], add_only=True)  # made
            capture.ensure_publication(conn, "sg_t", [a, b], add_only=True)  # add-tables b
            capture.ensure_publication(conn, "sg_t", [a, c], add_only=True)  # a list read before b joined
            assert published(conn) == {"a", "b", "c"}
            capture.ensure_publication(conn, "sg_t", [a, c])  # SET TABLE: what other callers rely on
            assert published(conn) == {"a", "c"}
        finally:
            conn.execute("DROP PUBLICATION IF EXISTS sg_t")

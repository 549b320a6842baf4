"""Materialize into Delta tables through a rule (rename, computed columns, a WHERE), under live writes that move
rows in and out of the filter, with `workflow run` killed -9 during the copy and during replication: the Delta
table ends equal to the rule applied to the source, each key once. And MoveTables with a rule, the refusals."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from decimal import Decimal
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from sluicegate.errors import UsageError
from sluicegate.position import parse_lsn
from sluicegate.targets import resolve
from sluicegate.targets.delta import cli as lake
from sluicegate.targets.delta.state import Store, app_id

from ..conftest import wait_for
from .helpers import slot_confirmed
from .test_lake_movetables import delta_rows, kill_at

pytestmark = pytest.mark.spark

RULE = ("orders_out: SELECT id AS order_id, upper(name) AS name_uc, qty * price AS total, status "
        "FROM orders WHERE status <> 'void'")
# The rule's SELECT as PostgreSQL runs it: the rows the Delta table must hold
EXPECTED = "SELECT id, upper(name), qty * price, status FROM orders WHERE status <> 'void'"
STATUSES = ("new", "paid", "void", "shipped")


def make_orders(pair, rows: int) -> None:
    """The rule's source table, `rows` orders of every status."""
    pair.src("CREATE TABLE orders (id bigint PRIMARY KEY, name text NOT NULL, qty int NOT NULL, "
             "price numeric(10,2) NOT NULL, status text NOT NULL)")
    pair.src("""INSERT INTO orders SELECT g, 'item' || g, g %% 7, (g %% 13) + 0.99,
                (ARRAY['new', 'paid', 'void', 'shipped'])[1 + g %% 4] FROM generate_series(1, %s) g""", (rows,))


class OrderWriter(threading.Thread):
    """Inserts, updates that move rows in and out of the rule's filter (status 'void'), key changes, deletes."""

    def __init__(self, url: str, max_id: int):
        super().__init__(daemon=True)
        self.url, self.rng, self.next_id = url, random.Random(7), max_id + 1
        self.stop_event = threading.Event()
        self.commits = 0
        self.error = None

    def run(self):
        rng = self.rng
        try:
            with psycopg.connect(self.url) as c:
                while not self.stop_event.is_set():
                    for _ in range(rng.randint(1, 3)):
                        op, k = rng.random(), rng.randint(1, self.next_id)
                        if op < 0.45:  # in or out of the filter, or staying
                            c.execute("UPDATE orders SET status = %s, qty = qty + 1 WHERE id = %s",
                                      (rng.choice(STATUSES), k))
                        elif op < 0.6:
                            c.execute("UPDATE orders SET name = name || 'x', price = price + 0.25 WHERE id = %s", (k,))
                        elif op < 0.75:
                            c.execute("DELETE FROM orders WHERE id = %s", (k,))
                        elif op < 0.93:
                            c.execute("INSERT INTO orders VALUES (%s, %s, 2, 1.50, %s) ON CONFLICT DO NOTHING",
                                      (self.next_id, f"n{self.next_id}", rng.choice(STATUSES)))
                            self.next_id += 1
                        else:  # the key moves: the old target key goes
                            c.execute("UPDATE orders SET id = %s WHERE id = %s AND NOT EXISTS "
                                      "(SELECT 1 FROM orders WHERE id = %s)", (self.next_id, k, self.next_id))
                            self.next_id += 1
                    c.commit()
                    self.commits += 1
                    self.stop_event.wait(0.01)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


class LakeEngineThread:
    """`workflow run` of a Delta workflow in a thread of the test process, on the shared Spark session."""

    def __init__(self, spark, target: str, workflow: str):
        from sluicegate.spark.runner import SparkRunner
        from sluicegate.targets.delta.engine import LakeEngine

        self.engine = LakeEngine(target, workflow, SparkRunner(spark), stop=threading.Event(), max_backoff=1.0)
        self.result = self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            self.result = self.engine.run()
        except BaseException as exc:  # noqa: BLE001 - raised by __exit__
            self.error = exc

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.engine.stop.set()
        self.thread.join(timeout=120)
        if self.error and not exc[0]:
            raise self.error


def caught_up(pair, store, name: str) -> None:
    flushed = parse_lsn(pair.src("SELECT pg_current_wal_flush_lsn()::text")[0][0])
    wait_for(lambda: store.load(name).position >= flushed or store.load(name).state == "Error", timeout=60,
             what="caught up")
    assert store.load(name).state == "Running", store.load(name).message


def expected_rows(url: str) -> list[tuple]:
    with psycopg.connect(url) as c:
        return sorted(c.execute(EXPECTED).fetchall())


def lake_rows(root: Path) -> list[tuple]:
    return sorted((r["order_id"], r["name_uc"], r["total"], r["status"])
                  for r in delta_rows(root, "public.orders_out"))


@pytest.mark.slow  # ~31 s; the default set streams a rule into Delta beside a driver (test_lake_rule_vdiff.py)
def test_materialize_into_delta_through_a_rule_survives_kill_9(pair, spark, tmp_path):
    make_orders(pair, 2000)
    root = tmp_path / "lake"
    target = f"delta:{root}"
    moved, made = resolve(target).create_materialize("lr", pair.source, [RULE], {"cycle_rows": 1200,
                                                                                  "chunk_rows": 300}, {}, [])
    assert moved == ["public.orders_out"] and made[0] == f"Delta table {root / 'public' / 'orders_out'}"
    store = Store(root)
    wf = store.load("lr")
    assert wf.kind == "Materialize" and wf.tables[0].rule and wf.tables[0].lake.key == ("order_id",)
    schema = pa.schema(DeltaTable(str(root / "public" / "orders_out")).schema().to_arrow())
    assert [(f.name, str(f.type)) for f in schema][:4] == [
        ("order_id", "int64"), ("name_uc", "string"), ("total", "decimal128(21, 2)"), ("status", "string")]

    writer = OrderWriter(pair.source, 2000)
    writer.start()
    log = tmp_path / "driver.log"
    try:
        # During the copy: a cycle's files written by its task, none committed.
        kill_at(target, "lr", log, "lake.copy.task_written", tmp_path)
        assert store.load("lr").state == "Copying"
        # During replication: the batch merged into Delta, the state not told.
        kill_at(target, "lr", log, "lake.replicate.before_state", tmp_path)
        wf = store.load("lr")
        assert wf.state == "Running"
        confirmed = slot_confirmed(pair, wf.slot)
        assert confirmed is None or confirmed <= wf.position

        with LakeEngineThread(spark, target, "lr"):  # resumed (in this process: one JVM start less)
            wait_for(lambda: store.load("lr").first_point, timeout=120, what="the first consistent point")
            writer.stop_event.set()
            writer.join()
            assert writer.error is None and writer.commits > 30
            pair.src("UPDATE orders SET status = 'void' WHERE id % 10 = 1")  # out of the filter
            pair.src("UPDATE orders SET status = 'paid' WHERE id % 10 = 2")  # into it
            caught_up(pair, store, "lr")
    finally:
        writer.stop_event.set()

    wf = store.load("lr")
    assert wf.state == "Running" and wf.message == "", wf.message
    got, want = lake_rows(root), expected_rows(pair.source)
    keys = [r[0] for r in got]
    assert len(keys) == len(set(keys)), "duplicate keys"
    assert len(want) > 1000 and any(r[2] == Decimal("0.00") for r in want)
    assert got == want, f"{len(got)} rows in Delta, {len(want)} by the rule on the source"
    t = wf.tables[0]
    assert DeltaTable(str(root / "public" / "orders_out")).transaction_version(app_id("lr")) == t.applied
    assert slot_confirmed(pair, wf.slot) <= wf.position
    status = lake.status("lr", target)
    assert [x["table"] for x in status["tables"]] == ["public.orders_out"]
    resolve(target).check_vdiff("lr", False)  # comparable (test_lake_rule_vdiff.py compares one)
    lake.delete("lr", target)


BIG = "(SELECT string_agg(md5({} || '.' || i), '') FROM generate_series(1, 200) i)"  # stored out of line


def test_movetables_with_a_rule_moves_columns_into_delta(pair, spark, tmp_path):
    """A rule that only picks and renames columns (no Spark per row), beside a table moved as it is; a row's
    unchanged TOAST value stays the Delta table's."""
    pair.src("CREATE TABLE a (id int PRIMARY KEY, big text, v int)")
    pair.src("CREATE TABLE b (id int PRIMARY KEY, w int)")
    pair.src(f"INSERT INTO a SELECT g, {BIG.format('g')}, g FROM generate_series(1, 300) g")
    pair.src("INSERT INTO b SELECT g, g FROM generate_series(1, 300) g")
    root = tmp_path / "lake"
    target = f"delta:{root}"
    moved, _ = resolve(target).create_movetables("mv", pair.source, ["a", "b"], None,
                                                 ["a_slim: SELECT id AS key, big AS body, v FROM a"], {}, {}, {}, [])
    assert moved == ["public.a_slim", "public.b"]
    store = Store(root)
    with LakeEngineThread(spark, target, "mv"):
        wait_for(lambda: store.load("mv").first_point, timeout=120, what="copied")
        pair.src("UPDATE a SET v = v + 1000 WHERE id <= 50")  # big unchanged: not sent (TOAST)
        pair.src("UPDATE a SET id = id + 1000, big = 'moved' WHERE id = 60")  # (a key change carries no TOAST)
        pair.src("DELETE FROM a WHERE id = 70")
        pair.src("UPDATE b SET w = -w WHERE id <= 10")
        caught_up(pair, store, "mv")
    got = sorted((r["key"], r["body"], r["v"]) for r in delta_rows(root, "public.a_slim"))
    with psycopg.connect(pair.source) as c:
        assert got == sorted(c.execute("SELECT id, big, v FROM a").fetchall())
        assert sorted((r["id"], r["w"]) for r in delta_rows(root, "public.b")) == sorted(
            c.execute("SELECT id, w FROM b").fetchall())
    # vdiff reads a rule that only moves columns as its copy does (its columns under its names), beside a table
    # moved as it is; the report names each by its source table
    from sluicegate.spark.runner import SparkRunner
    from sluicegate.targets.delta import vdiff as lake_vdiff

    report = lake_vdiff.run("mv", target, SparkRunner(spark))
    assert report["equal"], report
    assert {q: t["rows_compared"] for q, t in report["tables"].items()} == {"public.a": 299, "public.b": 300}


@pytest.mark.slow  # ~23 s; the default set has the PostgreSQL twin (test_rules.py) and the Delta rule player
def test_a_row_brought_into_the_filter_without_its_toasted_value_stops_with_the_way_out(pair, spark, tmp_path):
    pair.src("CREATE TABLE items (id int PRIMARY KEY, region text, descr text)")
    pair.src(f"INSERT INTO items VALUES (1, 'us', {BIG.format(1)}), (2, 'eu', 'short')")
    root = tmp_path / "lake"
    target = f"delta:{root}"
    resolve(target).create_materialize("tf", pair.source, ["eu_items: SELECT id, descr FROM items WHERE region = 'eu'"],
                                       {}, {}, [])
    store = Store(root)
    with LakeEngineThread(spark, target, "tf") as run:
        wait_for(lambda: store.load("tf").first_point, timeout=120, what="copied")
        pair.src("UPDATE items SET region = 'eu' WHERE id = 1")  # descr is TOASTed and not in the change
        wait_for(lambda: store.load("tf").state == "Error", timeout=60, what="Error")
        run.thread.join(timeout=60)
    message = store.load("tf").message
    assert "REPLICA IDENTITY FULL" in message and "public.items" in message and "(id)=(1)" in message
    assert sorted(r["id"] for r in delta_rows(root, "public.eu_items")) == [2]  # nothing half-applied


def test_delta_create_refuses_rules_it_cannot_keep(pair, spark, tmp_path):
    pair.src("CREATE TABLE nokey (id int, v int)")
    pair.src("CREATE TABLE full_id (id int, v int)")
    pair.src("ALTER TABLE full_id REPLICA IDENTITY FULL")
    pair.src("CREATE TABLE keyed (id int PRIMARY KEY, v int)")
    target = resolve(f"delta:{tmp_path / 'lake'}")
    # A rule's target is keyed by its source's key: a table without one is refused, naming the way out
    with pytest.raises(UsageError, match=r"table public.nokey has no primary key.*add a primary key"):
        target.create_materialize("r1", pair.source, ["nk: SELECT id, v FROM nokey"], {}, {}, [])
    with pytest.raises(UsageError, match=r"rule 'fk'.*public.full_id has no primary key.*add a primary key"):
        target.create_materialize("r1", pair.source, ["fk: SELECT id, v FROM full_id"], {}, {}, [])
    with pytest.raises(UsageError, match=r"rule 'arr'.*array<int>.*CAST"):
        target.create_materialize("r2", pair.source, ["arr: SELECT id, array(v) AS vs FROM keyed"], {}, {}, [])
    assert not (tmp_path / "lake" / "public").exists() or not any((tmp_path / "lake" / "public").iterdir())
    assert not Store(tmp_path / "lake").names()
    # The CLI reaches the Delta target's create (a malformed rule is refused before Spark starts)
    out = subprocess.run([sys.executable, "-m", "sluicegate.cli.main", "materialize", "create", "--workflow", "r3",
                          "--source", pair.source, "--target", f"delta:{tmp_path / 'lake'}",
                          "--rule", "x SELECT id FROM keyed"], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode != 0 and "is not 'TABLE: SELECT" in out.stderr, out.stderr

"""Tables without a key (REPLICA IDENTITY FULL) through MoveTables to PostgreSQL: a copy split by heap pages and
redone from scratch after a kill -9, changes applied to exactly one equal row each (duplicates stay duplicates),
vdiff as multisets; and the kinds that cannot take them refuse at create."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading

import psycopg
import pytest

from sluicegate.cluster.create import create_replicate
from sluicegate.errors import UsageError
from sluicegate.postgres.catalog import Table, describe_table
from sluicegate.targets.delta.cli import create as lake_create
from sluicegate.workflow import copier
from sluicegate.workflow.create import create_materialize, create_movetables
from sluicegate.workflow.reshard import create_reshard

from ..conftest import wait_for
from .helpers import caught_up, reap_group, stream_row
from .test_kill_restart import start_driver
from .test_vdiff import report, vdiff

pytestmark = pytest.mark.spark

BIG = "(SELECT string_agg(md5(i::text), '') FROM generate_series(1, 4000) i)"  # ~128 kB: TOASTed


def multiset(url: str, table: str) -> dict[str, int]:
    """The table as {row's text form: copies}, read with plain SQL, independent of Sluicegate."""
    with psycopg.connect(url) as c:
        return dict(c.execute(f"SELECT t::text, count(*) FROM {table} t GROUP BY 1").fetchall())


class KeylessWriter(threading.Thread):
    """Inserts of duplicates, updates and deletes of one of several equal rows (by ctid), NULLs set and unset."""

    def __init__(self, url: str, seed: int = 5):
        super().__init__(daemon=True)
        self.url, self.rng = url, random.Random(seed)
        self.stop_event = threading.Event()
        self.commits, self.error = 0, None

    def run(self):
        try:
            with psycopg.connect(self.url) as c:
                while not self.stop_event.is_set():
                    a = self.rng.randint(0, 499)
                    op = self.rng.random()
                    one = "ctid = (SELECT ctid FROM logs WHERE a = %s LIMIT 1)"
                    if op < 0.3:
                        c.execute("INSERT INTO logs SELECT * FROM logs WHERE " + one, (a,))  # a duplicate
                    elif op < 0.55:
                        c.execute("UPDATE logs SET b = NULL WHERE " + one, (a,))
                    elif op < 0.75:
                        c.execute("UPDATE logs SET b = 'w' || a, j = json_build_object('w', a) WHERE " + one, (a,))
                    elif op < 0.9:
                        c.execute("DELETE FROM logs WHERE " + one, (a,))
                    else:
                        c.execute("INSERT INTO logs VALUES (%s, NULL, NULL, NULL, NULL)", (a,))
                    c.commit()
                    self.commits += 1
                    self.stop_event.wait(0.005)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def make_tables(pair, rows: int = 3000) -> None:
    pair.src("CREATE TABLE logs (a int, b text, j json, p point, big text)")
    pair.src("ALTER TABLE logs REPLICA IDENTITY FULL")
    # g and g + 1500 are equal rows: 1500 pairs of duplicates; every 7th b is NULL
    pair.src("""INSERT INTO logs SELECT g %% 500, CASE WHEN g %% 7 <> 0 THEN 'v' || g %% 300 END,
                       json_build_object('g', g %% 50), point(g %% 10, 1), NULL
                FROM generate_series(1, %s) g""", (rows,))
    pair.src(f"INSERT INTO logs VALUES (-1, 'toasted', '{{}}', '(0,0)', {BIG})")
    pair.src("CREATE TABLE marks (k text, n int)")
    pair.src("ALTER TABLE marks REPLICA IDENTITY FULL")
    pair.src("INSERT INTO marks SELECT 'm', g % 3 FROM generate_series(1, 30) g")
    pair.src("ANALYZE logs")


@pytest.mark.slow  # the default set replicates keyless tables in the tests below
def test_keyless_copy_killed_then_replicated_as_multisets(versions_pair_system, tmp_path):
    pair = versions_pair_system  # on the system's PostgreSQL, on 18, and from 15 to 18
    make_tables(pair)
    with psycopg.connect(pair.source) as c:  # the copy's plan: one cycle, in parallel page ranges, all open ended
        plan = copier.plan_cycle(c, Table.from_json(describe_table(c, "public", "logs").to_json()), None,
                                 cycle_rows=1000, chunk_rows=300, slots=2)
        assert plan.done and plan.new_lastpk is None and len(plan.pages) >= 4 and plan.pages[-1][1] is None
    # small tasks: the copy of logs splits into several page ranges; cycles far smaller than the table, which
    # is copied in one all the same (no lastpk to resume from)
    create_movetables("kl", pair.source, pair.target, ["logs", "marks"], [], {"chunk_rows": 300, "cycle_rows": 500})
    spec = {r[0]: r[1] for r in pair.dst("SELECT table_name, spec FROM sluicegate.copy_state")}
    assert spec["public.logs"]["key"] == [] and spec["public.logs"]["keyless"] is True
    assert pair.dst("SELECT relreplident FROM pg_class WHERE relname = 'logs'") == [("f",)]
    log = tmp_path / "driver.log"
    writer = KeylessWriter(pair.source)
    writer.start()
    try:
        # kill -9 once logs' copy tasks have committed and before the cycle is recorded
        driver = start_driver(pair, "kl", log, fault="copy.before_progress", fault_dir=tmp_path)
        try:
            wait_for(lambda: (tmp_path / "copy.before_progress").exists() or driver.poll() is not None,
                     timeout=240, what="paused before the copy's progress", describe=lambda: log.read_text()[-2000:])
            assert driver.poll() is None, log.read_text()[-2000:]
            os.kill(driver.pid, signal.SIGKILL)
        finally:
            reap_group(driver)
        assert pair.dst("SELECT count(*) FROM logs")[0][0] > 0  # the killed copy left rows behind
        assert not any(r[0] for r in pair.dst("SELECT done FROM sluicegate.copy_state"))

        driver = start_driver(pair, "kl", log)
        try:
            wait_for(lambda: stream_row(pair, "kl")["state"] == "Running", timeout=240, what="Running",
                     describe=lambda: log.read_text()[-2000:])
            wait_for(lambda: writer.commits > 100, what="writes going on")
            one = "ctid = (SELECT ctid FROM {t} WHERE {w} LIMIT 1)"
            pair.src("INSERT INTO logs SELECT 9001, 'triple', '[1]', '(1,1)', NULL FROM generate_series(1, 3)")
            pair.src("DELETE FROM logs WHERE " + one.format(t="logs", w="a = 9001"))  # one of three
            pair.src("INSERT INTO logs SELECT 9002, 'pair', '[2]', '(2,2)', NULL FROM generate_series(1, 2)")
            pair.src("UPDATE logs SET b = 'one of a pair' WHERE " + one.format(t="logs", w="a = 9002"))
            pair.src("UPDATE logs SET b = NULL, p = NULL WHERE a = 7")
            pair.src("UPDATE logs SET b = 'back', p = '(7,7)' WHERE a = 7")
            pair.src("UPDATE logs SET a = -2 WHERE a = -1")  # the TOASTed value unchanged
            pair.src("BEGIN; TRUNCATE marks; INSERT INTO marks VALUES ('t', 1), ('t', 1), (NULL, NULL); COMMIT")
            pair.src("""BEGIN; UPDATE logs SET j = '{"x": [1, 2]}' WHERE a = 3;
                        DELETE FROM logs WHERE a = 4; INSERT INTO logs SELECT 4, 'again', NULL, NULL, NULL; COMMIT""")
            writer.stop_event.set()
            writer.join()
            assert writer.error is None, writer.error
            wait_for(lambda: caught_up(pair, "kl"), what="caught up", describe=lambda: log.read_text()[-2000:])
            driver.send_signal(signal.SIGTERM)
            assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]
        finally:
            reap_group(driver)
    finally:
        writer.stop_event.set()

    for table in ("logs", "marks"):
        source, target = multiset(pair.source, table), multiset(pair.target, table)
        assert source == target, table
    assert max(multiset(pair.source, "logs").values()) >= 2  # duplicates moved as duplicates
    assert pair.src("SELECT count(*) FROM logs WHERE a = 9001")[0][0] == 2
    assert pair.dst("SELECT count(*) FROM logs WHERE a = -2 AND big = " + BIG)[0][0] == 1
    assert pair.dst("SELECT count(*) FROM marks")[0][0] == 3
    status = subprocess.run([sys.executable, "-m", "sluicegate.cli.main", "workflow", "status", "kl", "--json",
                             "--target", pair.target], capture_output=True, text=True, timeout=120, check=False)
    assert status.returncode == 0, status.stderr
    tables = {t["table"]: t for t in json.loads(status.stdout)["streams"][0]["tables"]}
    assert tables["public.logs"]["state"] == "Copied" and tables["public.logs"]["lastpk"] is None
    text = subprocess.run([sys.executable, "-m", "sluicegate.cli.main", "workflow", "status", "kl",
                           "--target", pair.target], capture_output=True, text=True, timeout=120, check=False)
    assert text.returncode == 0 and "public.logs" in text.stdout, text.stderr

    out = vdiff(pair.target, "kl", "--json")
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert report(out)["tables"]["public.logs"]["rows_compared"] == sum(multiset(pair.source, "logs").values())

    # one of two equal rows gone from the target: exactly one row missing
    pair.dst("DELETE FROM logs WHERE ctid = (SELECT ctid FROM logs WHERE a = 9001 LIMIT 1)")
    out = vdiff(pair.target, "kl", "--json")
    assert out.returncode == 1, (out.stdout, out.stderr)
    t = report(out)["tables"]["public.logs"]
    assert (t["missing"], t["extra"], t["mismatched"]) == (1, 0, 0)
    assert [(s["kind"], s["source"]["a"], s["source"]["b"]) for s in t["samples"]] == [("missing", "9001", "triple")]
    assert report(out)["tables"]["public.marks"]["missing"] == 0
    out = vdiff(pair.target, "kl", "--tables", "logs")  # the text report: the row, with no key to show
    assert out.returncode == 1 and "missing    1 row(s) equal to" in out.stdout and "triple" in out.stdout, out


def test_keyless_update_of_a_row_the_target_lacks_stops(pair, spark):
    from ..conftest import EngineThread

    pair.src("CREATE TABLE notes (body text, n int)")
    pair.src("ALTER TABLE notes REPLICA IDENTITY FULL")
    pair.src("INSERT INTO notes VALUES ('a', 1), ('a', 1), ('b', 2)")
    create_movetables("kn", pair.source, pair.target, ["notes"], [], {})
    with EngineThread(spark, pair.target, "kn") as run:
        wait_for(lambda: caught_up(pair, "kn"), what="caught up")
        pair.dst("DELETE FROM notes WHERE body = 'b'")  # the target is out of step
        pair.src("UPDATE notes SET n = 3 WHERE body = 'b'")
        wait_for(lambda: stream_row(pair, "kn")["state"] == "Error", what="Error")
        run.thread.join(timeout=60)
    message = stream_row(pair, "kn")["message"]
    assert "public.notes" in message and "not on the target" in message, message
    assert pair.dst("SELECT body, n FROM notes ORDER BY 1, 2") == [("a", 1), ("a", 1)]  # nothing half-applied


def test_keyless_refusals(pair, tmp_path):
    pair.src("CREATE TABLE plain (a int, b text)")  # no key, REPLICA IDENTITY DEFAULT
    pair.src('CREATE TABLE "Odd Name" (a int)')
    pair.src('ALTER TABLE "Odd Name" REPLICA IDENTITY NOTHING')
    pair.src("CREATE TABLE full_t (a int, b text)")
    pair.src("ALTER TABLE full_t REPLICA IDENTITY FULL")
    pair.src("CREATE TABLE full_unique (code text NOT NULL, b text); CREATE UNIQUE INDEX ON full_unique (code); "
             "ALTER TABLE full_unique REPLICA IDENTITY FULL")
    with psycopg.connect(pair.source) as c:
        assert not describe_table(c, "public", "full_t").key and describe_table(c, "public", "full_t").keyless
        # under FULL, a non-null unique key identifies rows: it is the key, the table is not keyless
        unique = describe_table(c, "public", "full_unique")
        assert unique.key == ("code",) and not unique.keyless
    with pytest.raises(UsageError) as e:
        create_movetables("r1", pair.source, pair.target, ["plain"], [], {})
    assert "ALTER TABLE public.plain REPLICA IDENTITY FULL" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UsageError) as e:
        create_movetables("r2", pair.source, pair.target, ["Odd Name"], [], {})
    assert 'ALTER TABLE public."Odd Name" REPLICA IDENTITY FULL' in str(e.value)
    with pytest.raises(UsageError, match=r"public\.full_t.*no primary key.*without a rule"):
        create_materialize("r3", pair.source, pair.target, ["full_copy: SELECT a, b FROM full_t"], {})
    with pytest.raises(UsageError, match=r"public\.full_t has no primary key.*Reshard.*sharding column"):
        create_reshard("r7", {"-80": pair.source, "80-": pair.source}, {"-": pair.target}, ["full_t"], {}, [], {})
    pair.src("CREATE TABLE keyed (id int PRIMARY KEY)")
    with pytest.raises(UsageError, match=r"public\.full_t has no primary key.*without --rule"):
        create_movetables("r6", pair.source, pair.target, ["full_t", "keyed"], ["keyed: SELECT id FROM keyed"], {})
    with pytest.raises(UsageError, match=r"public\.full_t has no primary key.*Delta target"):
        lake_create("r4", pair.source, f"delta:{tmp_path}/lake", ["full_t"], None, [], {})
    with pytest.raises(UsageError, match=r"public\.full_t has no primary key.*last writer wins"):
        create_replicate("r5", pair.source, [pair.target], ["full_t"], None, {}, bidirectional=True)
    assert not pair.dst("SELECT 1 FROM pg_tables WHERE tablename IN ('plain', 'full_t', 'full_copy', 'keyed')")


def test_keyless_replicate_to_a_postgres_sink(rc, tmp_path):
    """A Replicate sink on PostgreSQL copies and applies as MoveTables does: keyless tables move too. Identity
    columns GENERATED ALWAYS (a keyless table's, a key) keep the source's values (issue 34)."""
    from .cluster_helpers import Consumer, create
    from .cluster_helpers import caught_up as sink_caught_up
    from .cluster_helpers import run as run_sql
    from .helpers import table_rows

    c = rc
    c.src("CREATE TABLE logs (a int, b text, j json, p point, big text, n int GENERATED ALWAYS AS IDENTITY)")
    c.src("ALTER TABLE logs REPLICA IDENTITY FULL")
    c.src("INSERT INTO logs SELECT g % 50, 'v', '{}', '(1,1)', NULL FROM generate_series(1, 500) g")
    c.src("CREATE TABLE orders (id int GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v int)")
    c.src("INSERT INTO orders (v) SELECT g FROM generate_series(1, 10) g")
    sink = c.sinks[0]
    # made by hand like the source's (create would make n BY DEFAULT: postgres/table_definition.py)
    run_sql(sink, "CREATE TABLE logs (a int, b text, j json, p point, big text, n int GENERATED ALWAYS AS IDENTITY)")
    out = create(c, sinks=[sink])
    assert out.returncode == 0, out.stderr
    consumer = Consumer(c.workflow, sink, tmp_path / "run.log").start()
    try:
        wait_for(lambda: sink_caught_up(c, sink), 240, what="sink caught up",
                 describe=lambda: (tmp_path / "run.log").read_text()[-2000:])
        c.src("UPDATE logs SET b = 'changed' WHERE ctid = (SELECT ctid FROM logs WHERE a = 1 LIMIT 1)")
        c.src("DELETE FROM logs WHERE ctid = (SELECT ctid FROM logs WHERE a = 2 LIMIT 1)")
        c.src("INSERT INTO logs (a, b, j, p, big) SELECT a, b, j, p, big FROM logs WHERE a = 3")
        c.src("INSERT INTO orders (v) SELECT g FROM generate_series(11, 20) g")
        c.src("UPDATE orders SET v = -v WHERE id <= 5")
        wait_for(lambda: sink_caught_up(c, sink), 120, what="sink caught up after writes")
    finally:
        consumer.kill()
    assert multiset(c.source, "logs") == multiset(sink, "logs")
    assert run_sql(sink, "SELECT attidentity FROM pg_attribute WHERE attrelid = 'orders'::regclass "
                         "AND attname = 'id'") == [("a",)]  # the sink's table is made like the source's
    assert table_rows(c.source, "orders", ["id"]) == table_rows(sink, "orders", ["id"])
    assert len(table_rows(sink, "orders", ["id"])) == 20
    assert sum(multiset(sink, "logs").values()) == 500 - 1 + 10


def test_keyless_through_transaction_messages(pair):
    """The Transaction applier (appliers/transactions.py) applies a keyless table's changes as the player does."""
    from sluicegate.appliers.transactions import TransactionApplier
    from sluicegate.postgres import capture

    from .test_transaction_messages import Reader

    for run in (pair.src, pair.dst):
        run("CREATE TABLE logs (a int, b text, j json, big text); ALTER TABLE logs REPLICA IDENTITY FULL")
    with psycopg.connect(pair.source, autocommit=True) as c:
        capture.ensure_publication(c, "pub", [describe_table(c, "public", "logs")])
        start = capture.ensure_slot(c, "sg_test")
    reader = Reader(pair.source, "sg_test", "pub", start, threshold=1 << 20)
    with reader.stream:
        pair.src(f"INSERT INTO logs SELECT g % 3, 'v', '[1]', NULL FROM generate_series(1, 9) g; "
                 f"INSERT INTO logs VALUES (9, 'toasted', NULL, {BIG})")
        pair.src("UPDATE logs SET b = 'one' WHERE ctid = (SELECT ctid FROM logs WHERE a = 1 LIMIT 1)")
        pair.src("DELETE FROM logs WHERE ctid = (SELECT ctid FROM logs WHERE a = 2 LIMIT 1)")
        pair.src("UPDATE logs SET a = 10 WHERE a = 9")  # the TOASTed value unchanged
        pair.src("UPDATE logs SET j = NULL WHERE a = 0")
        with psycopg.connect(pair.source) as c:
            end = capture.wal_flush_position(c)[0]
        reader.until(end)
    applier = TransactionApplier(pair.target, name="t1")
    try:
        for x in reader.messages:
            applier.apply(x)
    finally:
        applier.close()
    assert multiset(pair.source, "logs") == multiset(pair.target, "logs")
    assert pair.dst("SELECT count(*) FROM logs WHERE a = 10 AND big = " + BIG) == [(1,)]

"""Schema changes captured on the source (`sluicegate ddl install`) and replayed in the stream as the
workflow's --on-ddl says (ddl/), on real PostgreSQL and real local Spark: a migration under live writes with
exec ends with the target table's schema and rows equal to the source's; stop, ignore and exec-ignore each
do what the README says with a statement the target cannot run."""

from __future__ import annotations

import random
import subprocess
import sys
import threading

import psycopg
import pytest

from sluicegate.workflow.create import create_movetables

from ..conftest import EngineThread, wait_for
from .helpers import assert_same, caught_up, stream_row
from .test_schema_changes import columns, start_workflow

pytestmark = pytest.mark.spark

ROWS = 2000


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluicegate.cli.main", *args], capture_output=True, text=True,
                          timeout=120, check=False)


class Writes(threading.Thread):
    """Updates, inserts and deletes of `items` by id and qty only (columns the migration keeps), committed
    continuously while the migration runs. Inserts from `next_id` by `step` (2: one side of an active-active
    pair its parity); updates and deletes at keys up to `keys` (default: every key so far)."""

    def __init__(self, url: str, next_id: int, *, step: int = 1, seed: int = 11, keys: int | None = None):
        super().__init__(daemon=True)
        self.url, self.next_id, self.step, self.keys, self.rng = url, next_id, step, keys, random.Random(seed)
        self.stop_event, self.commits, self.error = threading.Event(), 0, None

    def run(self):
        try:
            with psycopg.connect(self.url) as c:
                while not self.stop_event.is_set():
                    try:
                        for _ in range(self.rng.randint(1, 3)):
                            op, k = self.rng.random(), self.rng.randint(1, self.keys or self.next_id)
                            if op < 0.6:
                                c.execute("UPDATE items SET qty = qty + 1 WHERE id = %s", (k,))
                            elif op < 0.9:
                                c.execute("INSERT INTO items (id, qty) VALUES (%s, 1)", (self.next_id,))
                                self.next_id += self.step
                            else:
                                c.execute("DELETE FROM items WHERE id = %s", (k,))
                        c.commit()
                        self.commits += 1
                    except psycopg.errors.DeadlockDetected:
                        c.rollback()  # with the migration's backfill: an application tries again
                    self.stop_event.wait(0.005)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def finish(self):
        self.stop_event.set()
        self.join(timeout=30)
        assert self.error is None, self.error
        assert self.commits > 0


def backfill(url: str, rows: int = ROWS, step: int = 500) -> None:
    """The migration's backfill of status, a transaction per `step` keys, each tried again after a deadlock
    with the application's writes (as a migration tool does)."""
    for lo in range(1, rows + 1, step):
        with psycopg.connect(url, autocommit=True) as c:
            for _ in range(20):
                try:
                    c.execute("UPDATE items SET status = 'n' || (id %% 3) WHERE id BETWEEN %s AND %s",
                              (lo, lo + step - 1))
                    break
                except psycopg.errors.DeadlockDetected:
                    continue
            else:
                raise AssertionError(f"the backfill of {lo}.. met a deadlock 20 times")


def load(pair, rows: int = ROWS) -> None:
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int, name text, legacy text)")
    pair.src("INSERT INTO items SELECT g, g %% 7, 'item ' || g, 'old' FROM generate_series(1, %s) g", (rows,))


def install(pair) -> None:
    out = cli("ddl", "install", "--source", pair.source)
    assert out.returncode == 0, out.stderr


def indexes(url: str) -> list[str]:
    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute(
            "SELECT pg_get_indexdef(indexrelid) FROM pg_index WHERE indrelid = 'items'::regclass ORDER BY 1")]


def constraints(url: str) -> list[tuple]:
    with psycopg.connect(url) as c:
        return c.execute("SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
                         "WHERE conrelid = 'items'::regclass ORDER BY 1").fetchall()


def settled(pair, workflow: str):
    wait_for(lambda: caught_up(pair, workflow), what="caught up", describe=lambda: stream_row(pair, workflow))


def test_migration_under_writes_with_exec(pair, spark):
    load(pair)
    install(pair)
    create_movetables("mig", pair.source, pair.target, ["items"], [], {"on_ddl": "exec"})
    with EngineThread(spark, pair.target, "mig"):
        wait_for(lambda: stream_row(pair, "mig")["state"] == "Running", what="Running")
        writes = Writes(pair.source, ROWS + 1)
        writes.start()
        wait_for(lambda: writes.commits > 10, what="writes")
        with psycopg.connect(pair.source) as c:  # rows before and after a statement in one transaction
            c.execute("INSERT INTO items (id, qty) VALUES (100001, 1)")
            c.execute("ALTER TABLE items ADD COLUMN extra int DEFAULT 5")
            c.execute("INSERT INTO items (id, qty, extra) VALUES (100002, 2, 7)")
            c.execute("UPDATE items SET extra = 9 WHERE id = 100001")
        pair.src("ALTER TABLE items ADD COLUMN status text DEFAULT 'new'")
        backfill(pair.source)
        pair.src("UPDATE items SET status = 'late' WHERE status IS NULL")
        pair.src("ALTER TABLE items ALTER COLUMN status SET NOT NULL")
        pair.src("CREATE INDEX CONCURRENTLY items_status ON items (status)")
        pair.src("ALTER TABLE items RENAME COLUMN name TO title")
        pair.src("ALTER TABLE items ALTER COLUMN qty TYPE bigint USING qty::bigint * 10")
        pair.src("ALTER TABLE items ADD CONSTRAINT qty_nonneg CHECK (qty >= 0)")
        pair.src("ALTER TABLE items ALTER COLUMN extra DROP DEFAULT")
        pair.src("ALTER TABLE items DROP COLUMN legacy")
        wait_for(lambda: writes.commits > 60, what="writes after the migration")
        writes.finish()
        settled(pair, "mig")
        assert stream_row(pair, "mig")["state"] == "Running", stream_row(pair, "mig")
        assert columns(pair.target) == columns(pair.source)
        assert [c[0] for c in columns(pair.target)] == ["id", "qty", "title", "extra", "status"]
        assert indexes(pair.target) == indexes(pair.source)
        assert constraints(pair.target) == constraints(pair.source)
        assert assert_same(pair, "public.items", ["id"]) > ROWS
        assert pair.dst("SELECT extra FROM items WHERE id IN (100001, 100002) ORDER BY id") == [(9,), (7,)]
    vdiff = cli("vdiff", "mig", "--target", pair.target)
    assert vdiff.returncode == 0, vdiff.stdout + vdiff.stderr


def test_types_and_sequences_made_altered_and_used_under_exec(pair, spark):
    """CREATE TYPE in the moved schema, a column of it, ALTER TYPE … ADD VALUE and rows using the new label in
    the very next transactions (the target can use a label only once the transaction that added it committed);
    an ALTER TYPE of a type the target does not have is passed over. Sequences made, altered and dropped."""
    load(pair)
    install(pair)
    pair.src("CREATE SCHEMA elsewhere")
    create_movetables("enums", pair.source, pair.target, ["items"], [], {"on_ddl": "exec"})
    with EngineThread(spark, pair.target, "enums"):
        wait_for(lambda: stream_row(pair, "enums")["state"] == "Running", what="Running")
        pair.src("CREATE TYPE mood AS ENUM ('sad', 'ok')")
        pair.src("CREATE TYPE elsewhere.other AS ENUM ('x')")  # no moved table in that schema: not made
        pair.src("ALTER TABLE items ADD COLUMN mood mood DEFAULT 'ok'")
        pair.src("UPDATE items SET mood = 'sad' WHERE id <= 10")
        with psycopg.connect(pair.source, autocommit=True) as c:  # no pause between these transactions
            c.execute("ALTER TYPE mood ADD VALUE 'happy' BEFORE 'ok'")
            for i in range(11, 31):
                c.execute("UPDATE items SET mood = 'happy' WHERE id = %s", (i,))
            c.execute("ALTER TYPE elsewhere.other ADD VALUE 'y'")
        pair.src("CREATE SEQUENCE ticket START 500 INCREMENT 5")
        pair.src("ALTER SEQUENCE ticket INCREMENT 7")
        pair.src("CREATE SEQUENCE gone")
        pair.src("DROP SEQUENCE gone")
        pair.src("CREATE SEQUENCE elsewhere.s")  # not in a moved schema: not made
        settled(pair, "enums")
        sequences = ("SELECT schemaname, sequencename, start_value, increment_by FROM pg_sequences "
                     "WHERE schemaname <> 'sluicegate' ORDER BY 1, 2")
        assert pair.dst(sequences) == [("public", "ticket", 500, 7)]
        assert stream_row(pair, "enums")["state"] == "Running", stream_row(pair, "enums")
        assert columns(pair.target) == columns(pair.source)
        assert pair.dst("SELECT enum_range(NULL::mood)::text") == [("{sad,happy,ok}",)]
        assert pair.dst("SELECT to_regtype('elsewhere.other')") == [(None,)]
        assert pair.dst("SELECT count(*) FROM items WHERE mood = 'happy'") == [(20,)]
        assert assert_same(pair, "public.items", ["id"]) == ROWS


def test_stop_names_the_statement_then_by_hand_and_start(pair, spark):
    load(pair)
    install(pair)
    create_movetables("halt", pair.source, pair.target, ["items"], [], {})  # the default: stop
    with EngineThread(spark, pair.target, "halt"):
        wait_for(lambda: stream_row(pair, "halt")["state"] == "Running", what="Running")
        pair.src("ALTER TABLE items ADD COLUMN note text")  # an added column follows under stop
        pair.src("UPDATE items SET note = 'n', qty = 100 WHERE id <= 10")
        statement = "ALTER TABLE items ADD CONSTRAINT qty_small CHECK (qty < 1000)"
        pair.src(statement)
        pair.src("UPDATE items SET qty = 200 WHERE id <= 10")
        wait_for(lambda: stream_row(pair, "halt")["state"] == "Error", what="Error")
    message = stream_row(pair, "halt")["message"]
    assert statement in message and "--on-ddl stop" in message and "by hand" in message, message
    # what came before the statement's transaction is applied, nothing after it
    assert pair.dst("SELECT DISTINCT qty, note FROM items WHERE id <= 10") == [(100, "n")]
    assert constraints(pair.target) == [("items_pkey", "PRIMARY KEY (id)")]
    pair.dst(statement)  # the way out: by hand, then start
    start_workflow(pair, "halt")
    with EngineThread(spark, pair.target, "halt"):
        settled(pair, "halt")
    assert constraints(pair.target) == constraints(pair.source)
    assert assert_same(pair, "public.items", ["id"]) == ROWS


def test_ignore_passes_statements_over_and_relation_handling_stays(pair, spark):
    load(pair)
    install(pair)
    create_movetables("skip", pair.source, pair.target, ["items"], [], {"on_ddl": "exec"})
    out = cli("workflow", "set", "skip", "--on-ddl", "ignore", "--target", pair.target)
    assert out.returncode == 0, out.stderr
    with EngineThread(spark, pair.target, "skip"):
        wait_for(lambda: stream_row(pair, "skip")["state"] == "Running", what="Running")
        pair.src("CREATE INDEX items_qty ON items (qty)")
        pair.src("UPDATE items SET qty = 50 WHERE id <= 5")
        settled(pair, "skip")
        assert indexes(pair.target) == ["CREATE UNIQUE INDEX items_pkey ON public.items USING btree (id)"]
        assert assert_same(pair, "public.items", ["id"]) == ROWS
        # a rename, ignored, meets the Relation handling: it stops the stream naming it
        pair.src("ALTER TABLE items RENAME COLUMN name TO title")
        pair.src("UPDATE items SET qty = 60 WHERE id <= 5")
        wait_for(lambda: stream_row(pair, "skip")["state"] == "Error", what="Error")
    assert "renamed to title" in stream_row(pair, "skip")["message"]


def test_exec_ignore_goes_on_past_a_failing_statement_and_exec_stops(pair, spark):
    load(pair)
    install(pair)
    create_movetables("onward", pair.source, pair.target, ["items"], [], {"on_ddl": "exec-ignore"})
    pair.dst("CREATE TABLE items_qty (x int)")  # takes the name of the index the source will build
    with EngineThread(spark, pair.target, "onward"):
        wait_for(lambda: stream_row(pair, "onward")["state"] == "Running", what="Running")
        pair.src("CREATE INDEX items_qty ON items (qty)")
        pair.src("UPDATE items SET qty = 70 WHERE id <= 5")
        settled(pair, "onward")
        row = stream_row(pair, "onward")
        assert row["state"] == "Running" and "exec-ignore" in row["message"] and "42P07" in row["message"], row
        assert assert_same(pair, "public.items", ["id"]) == ROWS
        assert not any("items_qty" in i for i in indexes(pair.target))
        # under exec the same kind of failure stops the stream, before the statement's transaction
        out = cli("workflow", "set", "onward", "--on-ddl", "exec", "--target", pair.target)
        assert out.returncode == 0, out.stderr
        pair.dst("CREATE TABLE items_name (x int)")
        pair.src("UPDATE items SET qty = 80 WHERE id <= 5")
        pair.src("CREATE INDEX items_name ON items (name)")
        pair.src("UPDATE items SET qty = 90 WHERE id <= 5")
        wait_for(lambda: stream_row(pair, "onward")["state"] == "Error", what="Error")
    row = stream_row(pair, "onward")
    assert "CREATE INDEX items_name" in row["message"] and "42P07" in row["message"], row
    assert pair.dst("SELECT DISTINCT qty FROM items WHERE id <= 5") == [(80,)]


def swap_names(url: str, a: int, b: int) -> None:
    """Exchange two rows' values of the unique `name` in one transaction: applied set-based, an update that
    the unique index refuses row by row (the applier's plan must know of the index: appliers/plans.py)."""
    with psycopg.connect(url) as c:
        na, nb = (c.execute("SELECT name FROM items WHERE id = %s", (k,)).fetchone()[0] for k in (a, b))
        c.execute("UPDATE items SET name = 'swapping' WHERE id = %s", (a,))
        c.execute("UPDATE items SET name = %s WHERE id = %s", (na, b))
        c.execute("UPDATE items SET name = %s WHERE id = %s", (nb, a))


def test_kept_plans_follow_a_unique_index_and_columns_under_exec(pair, spark):
    """Many batches with plans kept across them (appliers/plans.py) while statements change the table: a new
    unique index (then an exchange of its values), an added and a dropped column; the target equals the source."""
    load(pair, 500)
    # rows of their own for the exchanges: the writes touch positive keys only
    pair.src("INSERT INTO items (id, qty, name) SELECT -g, 0, 'neg ' || g FROM generate_series(1, 4) g")
    install(pair)
    create_movetables("kp", pair.source, pair.target, ["items"], [], {"on_ddl": "exec"})
    with EngineThread(spark, pair.target, "kp"):
        wait_for(lambda: stream_row(pair, "kp")["state"] == "Running", what="Running")
        writes = Writes(pair.source, 501)
        writes.start()
        wait_for(lambda: writes.commits > 20, what="writes")
        pair.src("CREATE UNIQUE INDEX items_name ON items (name)")
        swap_names(pair.source, -1, -2)
        pair.src("ALTER TABLE items ADD COLUMN extra int DEFAULT 3")
        wait_for(lambda: writes.commits > 40, what="writes after the index")
        swap_names(pair.source, -3, -4)
        pair.src("ALTER TABLE items DROP COLUMN legacy")
        swap_names(pair.source, -1, -3)
        wait_for(lambda: writes.commits > 60, what="writes after the columns changed")
        writes.finish()
        settled(pair, "kp")
        assert stream_row(pair, "kp")["state"] == "Running", stream_row(pair, "kp")
        assert columns(pair.target) == columns(pair.source)
        assert indexes(pair.target) == indexes(pair.source)
        assert assert_same(pair, "public.items", ["id"]) > 500
        assert pair.dst("SELECT name FROM items WHERE id < 0 ORDER BY id") == \
            [("neg 3",), ("neg 2",), ("neg 1",), ("neg 4",)]


def test_rows_after_a_statement_that_moves_or_makes_the_key_under_exec(pair, spark):
    """A statement that changes where a table's key sits in its rows: a column dropped before the key, a key
    added to a table without one. Rows after it are staged by the new key (a row keyed by its old position
    would be keyed by `v`: two rows with the same v would become one)."""
    pair.src("CREATE TABLE tagged (note text, id bigint PRIMARY KEY, v int)")
    pair.src("INSERT INTO tagged SELECT 'n', g, g % 5 FROM generate_series(1, 100) g")
    pair.src("CREATE TABLE loose (id bigint NOT NULL, v int)")
    pair.src("ALTER TABLE loose REPLICA IDENTITY FULL")
    pair.src("INSERT INTO loose SELECT g, g % 5 FROM generate_series(1, 100) g")
    install(pair)
    create_movetables("rekey", pair.source, pair.target, ["tagged", "loose"], [], {"on_ddl": "exec"})
    with EngineThread(spark, pair.target, "rekey"):
        wait_for(lambda: stream_row(pair, "rekey")["state"] == "Running", what="Running")
        pair.src("ALTER TABLE tagged DROP COLUMN note")
        pair.src("ALTER TABLE loose ADD PRIMARY KEY (id)")
        with psycopg.connect(pair.source) as c:  # one transaction: one chunk, where keys meet
            for table in ("tagged", "loose"):
                c.execute(f"INSERT INTO {table} (id, v) VALUES (1001, 7), (1002, 7)")
                c.execute(f"UPDATE {table} SET v = 7 WHERE id IN (5, 6)")
                c.execute(f"DELETE FROM {table} WHERE id = 8")
        settled(pair, "rekey")
        assert stream_row(pair, "rekey")["state"] == "Running", stream_row(pair, "rekey")
        for table in ("tagged", "loose"):
            assert columns(pair.target, table) == columns(pair.source, table)
            assert assert_same(pair, f"public.{table}", ["id"]) == 101
        assert pair.dst("SELECT count(*) FROM tagged WHERE v = 7") == [(4,)]

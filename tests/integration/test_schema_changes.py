"""Schema changes of a replicated table, on real PostgreSQL and real local Spark (workflow/schema_changes.py):
added columns follow (type, collation, default; older rows' values), while copying too; a dropped column, a
type change or a volatile default stop the stream in Error naming them, with nothing of the batch applied;
the target made to match by hand, `workflow start` carries on."""

from __future__ import annotations

import random
import subprocess
import sys
import threading

import psycopg
import pytest
from psycopg import sql

from sluicegate.position import parse_lsn
from sluicegate.workflow.create import create_movetables

from ..conftest import EngineThread, wait_for
from .helpers import assert_same, caught_up, stream_row

pytestmark = pytest.mark.spark

ROWS = 3000


class Writes(threading.Thread):
    """Updates, inserts and deletes of `items`, committed continuously; `extra` (column -> SQL expression) is
    what they also set: the test adds columns while it runs."""

    def __init__(self, url: str, next_id: int, seed: int = 5):
        super().__init__(daemon=True)
        self.url, self.next_id, self.rng = url, next_id, random.Random(seed)
        self.extra: dict[str, str] = {}
        self.stop_event, self.commits, self.error = threading.Event(), 0, None

    def run(self):
        try:
            with psycopg.connect(self.url) as c:
                while not self.stop_event.is_set():
                    extra = dict(self.extra)
                    names = [sql.Identifier(n) for n in extra]
                    values = [sql.SQL(v) for v in extra.values()]
                    for _ in range(self.rng.randint(1, 3)):
                        op, k = self.rng.random(), self.rng.randint(1, self.next_id)
                        if op < 0.6:
                            sets = sql.SQL("").join(sql.SQL(", {} = {}").format(n, v)
                                                    for n, v in zip(names, values))
                            c.execute(sql.SQL("UPDATE items SET qty = qty + 1{} WHERE id = %s").format(sets),
                                      (k,))
                        elif op < 0.9:
                            c.execute(sql.SQL("INSERT INTO items (id, qty{}) VALUES (%s, 0{})").format(
                                sql.SQL("").join(sql.SQL(", {}").format(n) for n in names),
                                sql.SQL("").join(sql.SQL(", {}").format(v) for v in values)), (self.next_id,))
                            self.next_id += 1
                        else:
                            c.execute("DELETE FROM items WHERE id = %s", (k,))
                    c.commit()
                    self.commits += 1
                    self.stop_event.wait(0.01)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def finish(self):
        self.stop_event.set()
        self.join(timeout=30)
        assert self.error is None, self.error
        assert self.commits > 0


def start_workflow(pair, workflow: str) -> None:
    out = subprocess.run([sys.executable, "-m", "sluicegate.cli.main", "workflow", "start", workflow,
                          "--target", pair.target], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr


def load_items(pair, rows: int = ROWS) -> None:
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int, name text)")
    pair.src("INSERT INTO items SELECT g, g %% 7, 'item ' || g FROM generate_series(1, %s) g", (rows,))


def columns(url: str, table: str = "items") -> list[tuple]:
    """(name, type, collation, not null, default) of each column: what the target must match."""
    with psycopg.connect(url) as c:
        return c.execute(
            """SELECT a.attname, format_type(a.atttypid, a.atttypmod), co.collname, a.attnotnull,
                      pg_get_expr(d.adbin, d.adrelid)
               FROM pg_attribute a LEFT JOIN pg_collation co ON co.oid = a.attcollation
               LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
               WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum""",
            (table,)).fetchall()


def spec_columns(pair, workflow: str) -> list[str]:
    rows = pair.dst("""SELECT c.spec FROM sluicegate.copy_state c
                       JOIN sluicegate.streams s ON s.id = c.stream_id WHERE s.workflow = %s""", (workflow,))
    return [col[0] for col in rows[0][0]["columns"]]


def test_added_columns_follow_under_writes(pair, spark):
    load_items(pair)
    create_movetables("grow", pair.source, pair.target, ["items"], [], {})
    with EngineThread(spark, pair.target, "grow"):
        wait_for(lambda: stream_row(pair, "grow")["state"] == "Running", what="Running")
        writes = Writes(pair.source, ROWS + 1)
        writes.start()
        wait_for(lambda: writes.commits > 20, what="writes")
        # With a default (NOT NULL too), without one, a collation and a typmod, and a default whose value
        # depends on when it is computed (older rows keep the one the source recorded at the ALTER).
        pair.src("ALTER TABLE items ADD COLUMN note text NOT NULL DEFAULT 'x'")
        writes.extra = {"note": "md5(random()::text)"}
        wait_for(lambda: writes.commits > 40, what="writes with the new column")
        pair.src("""ALTER TABLE items ADD COLUMN tag varchar(12) COLLATE "C",
                                      ADD COLUMN price numeric(10,2) DEFAULT 1.5,
                                      ADD COLUMN seen timestamptz DEFAULT now()""")
        writes.extra = {"note": "md5(random()::text)", "tag": "left(md5(random()::text), 12)",
                        "price": "round((random() * 100)::numeric, 2)"}
        wait_for(lambda: writes.commits > 80, what="writes with the new columns")
        writes.finish()
        wait_for(lambda: caught_up(pair, "grow"), what="caught up",
                 describe=lambda: stream_row(pair, "grow"))
        assert stream_row(pair, "grow")["state"] == "Running"
        assert columns(pair.target) == columns(pair.source)
        assert [c[0] for c in columns(pair.target)] == ["id", "qty", "name", "note", "tag", "price", "seen"]
        assert assert_same(pair, "public.items", ["id"]) > ROWS
        # the older rows got the values the source gave them, not the target's own now()
        assert pair.dst("SELECT count(DISTINCT seen) FROM items WHERE id <= %s", (ROWS,)) == \
            pair.src("SELECT count(DISTINCT seen) FROM items WHERE id <= %s", (ROWS,))
        assert spec_columns(pair, "grow") == ["id", "qty", "name", "note", "tag", "price", "seen"]


def test_added_column_while_copying(pair, spark):
    """The copy reads the columns the stream's description lists: a table still being copied gets the new
    column from catchup, and the next cycle copies it (rows above lastpk with their own values)."""
    load_items(pair, 6000)
    create_movetables("copying", pair.source, pair.target, ["items"], [],
                      {"cycle_rows": 1500, "chunk_rows": 700})
    lastpk = "SELECT lastpk FROM sluicegate.copy_state"
    with EngineThread(spark, pair.target, "copying"):
        wait_for(lambda: pair.dst(lastpk)[0][0] is not None, what="a first copy cycle")
    copied = int(pair.dst(lastpk)[0][0][0])
    assert copied < 6000 and stream_row(pair, "copying")["state"] == "Copying"
    pair.src("ALTER TABLE items ADD COLUMN note text DEFAULT 'x'")
    # rows already copied (replayed by catchup) and rows not yet copied (the next cycles bring them)
    pair.src("UPDATE items SET note = 'below ' || id WHERE id %% 10 = 0 AND id <= %s", (copied,))
    pair.src("UPDATE items SET note = 'above ' || id WHERE id %% 10 = 0 AND id > %s", (copied,))
    pair.src("INSERT INTO items (id, qty, note) SELECT g, 1, 'new' FROM generate_series(7001, 7100) g")
    with EngineThread(spark, pair.target, "copying"):
        wait_for(lambda: caught_up(pair, "copying"), what="copied and caught up",
                 describe=lambda: stream_row(pair, "copying"))
    assert columns(pair.target) == columns(pair.source)
    assert assert_same(pair, "public.items", ["id"]) == 6100
    assert pair.dst("SELECT count(*) FROM items WHERE note LIKE 'above %'")[0][0] > 0


def test_dropped_column_stops_before_the_batch(pair, spark):
    """A drop under writes: Error naming the table and column; nothing of the transaction that met it applied
    (the stream stops right before it); the target fixed by hand, `workflow start` goes on from there."""
    load_items(pair)
    create_movetables("drop", pair.source, pair.target, ["items"], [], {})
    with EngineThread(spark, pair.target, "drop") as run:
        wait_for(lambda: stream_row(pair, "drop")["state"] == "Running", what="Running")
        writes = Writes(pair.source, ROWS + 1)
        writes.start()
        wait_for(lambda: writes.commits > 20, what="writes")
        with psycopg.connect(pair.source) as c:
            c.execute("ALTER TABLE items DROP COLUMN name")
            c.execute("INSERT INTO items VALUES (100001, 1)")
            # Writers of items wait for the drop's lock: every transaction before this one is committed.
            inside = parse_lsn(c.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])
        after = parse_lsn(pair.src("SELECT pg_current_wal_lsn()::text")[0][0])
        first_after = writes.next_id  # every id from here on was written after the drop
        wait_for(lambda: stream_row(pair, "drop")["state"] == "Error", what="Error")
        writes.finish()
        run.thread.join(timeout=60)
    s = stream_row(pair, "drop")
    assert "public.items" in s["message"] and "column name was dropped" in s["message"]
    assert "ALTER TABLE public.items DROP COLUMN name" in s["message"]
    assert "workflow start drop" in s["message"]
    # at the commit of the transaction that dropped the column: everything before it applied, nothing of it
    assert inside <= s["position"] < after
    assert pair.dst("SELECT count(*) FROM items WHERE id >= 100001 OR id >= %s", (first_after,))[0][0] == 0
    assert [c[0] for c in columns(pair.target)] == ["id", "qty", "name"]

    pair.dst("ALTER TABLE items DROP COLUMN name")  # the way out the message names
    start_workflow(pair, "drop")
    with EngineThread(spark, pair.target, "drop"):
        wait_for(lambda: caught_up(pair, "drop"), what="caught up after the fix",
                 describe=lambda: stream_row(pair, "drop"))
    assert assert_same(pair, "public.items", ["id"]) > ROWS
    assert spec_columns(pair, "drop") == ["id", "qty"]


@pytest.mark.parametrize("ddl, said", [
    ("ALTER TABLE items ALTER COLUMN qty TYPE bigint", "column qty changed type from integer to bigint"),
    ("ALTER TABLE items ADD COLUMN r float8 DEFAULT random()",
     "column r was added to source table public.items with the volatile default random()"),
], ids=["type", "volatile default"])
def test_other_changes_stop_naming_them(pair, spark, ddl, said):
    load_items(pair, 500)
    create_movetables("stops", pair.source, pair.target, ["items"], [], {})
    with EngineThread(spark, pair.target, "stops") as run:
        wait_for(lambda: stream_row(pair, "stops")["state"] == "Running", what="Running")
        pair.src(ddl)
        pair.src("UPDATE items SET qty = qty + 1 WHERE id = 1")
        after = parse_lsn(pair.src("SELECT pg_current_wal_lsn()::text")[0][0])
        wait_for(lambda: stream_row(pair, "stops")["state"] == "Error", what="Error")
        run.thread.join(timeout=60)
    s = stream_row(pair, "stops")
    assert said in s["message"] and "public.items" in s["message"], s["message"]
    assert s["position"] < after
    assert pair.dst("SELECT qty FROM items WHERE id = 1")[0][0] == 1  # the update is not applied
    assert [c[0] for c in columns(pair.target)] == ["id", "qty", "name"]

"""Rules, Materialize: a Spark SQL projection/filter/rename applied the same in the copy and in replicate."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading

import psycopg
import pytest

from sluicegate.errors import UsageError
from sluicegate.rules.udfs import parse_udfs
from sluicegate.workflow.create import create_materialize, create_movetables

from ..conftest import EngineThread, wait_for
from .helpers import caught_up, stream_row

pytestmark = pytest.mark.spark

RULE = ("items_eu: SELECT id AS item_id, upper(name) AS uname, price * qty AS total, region, descr, created, "
        "slug(name) AS slug FROM items WHERE region = 'eu' AND qty > 0")
UDFS = {"slug": "tests.integration.rule_udfs:slug"}  # a Python function the rule calls
# The same rule in PostgreSQL's SQL: what the target must hold, row for row (text forms).
EXPECTED = ("SELECT id, upper(name), price * qty, region, descr, created, replace(lower(name), ' ', '-') FROM items "
            "WHERE region = 'eu' AND qty > 0 ORDER BY id")


BIG = "(SELECT string_agg(md5({} || '.' || i), '') FROM generate_series(1, 200) i)"  # stored out of line


def _source(pair, rows: int) -> None:
    pair.src("""CREATE TABLE items (id bigint PRIMARY KEY, name text, region text, price numeric(10,2), qty int,
                                   descr text, created timestamptz)""")
    # every change carries the whole old row, so a row moving into the filter brings its TOASTed descr
    pair.src("ALTER TABLE items REPLICA IDENTITY FULL")
    pair.src(f"""INSERT INTO items SELECT g, 'item ' || g, (ARRAY['eu','us','apac'])[1 + g % 3],
                   (g % 1000) / 8.0, g % 5, CASE WHEN g % 50 = 0 THEN {BIG.format('g')} ELSE 'd' || g END,
                   '2024-01-01 00:00:00+00'::timestamptz + g * interval '1 minute'
                 FROM generate_series(1, {rows}) g""")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "sluicegate.cli.main", *args], capture_output=True, text=True,
                          timeout=300, check=False)


def _target_rows(pair) -> list[tuple]:
    return pair.dst("SELECT item_id, uname, total, region, descr, created, slug FROM items_eu ORDER BY item_id")


class _Mover(threading.Thread):
    """Updates that move rows into and out of the filter, key moves, deletes and inserts, continuously."""

    def __init__(self, url: str, max_id: int):
        super().__init__(daemon=True)
        self.url, self.max_id, self.rng = url, max_id, random.Random(11)
        self.stop_event, self.commits, self.error = threading.Event(), 0, None

    def run(self):
        try:
            with psycopg.connect(self.url) as c:
                next_id = self.max_id + 1
                while not self.stop_event.is_set():
                    k = self.rng.randint(1, next_id)
                    op = self.rng.random()
                    if op < 0.3:
                        c.execute("UPDATE items SET region = CASE region WHEN 'eu' THEN 'us' ELSE 'eu' END WHERE id = %s", (k,))
                    elif op < 0.5:
                        c.execute("UPDATE items SET qty = (qty + 1) %% 3, price = price + 1 WHERE id = %s", (k,))
                    elif op < 0.6:
                        c.execute("UPDATE items SET name = name || '!' WHERE id BETWEEN %s AND %s", (k, k + 20))
                    elif op < 0.7:
                        c.execute("DELETE FROM items WHERE id = %s", (k,))
                    elif op < 0.85:
                        c.execute("INSERT INTO items VALUES (%s, 'new', 'eu', 2.5, 1, repeat('z', 3000), now())",
                                  (next_id,))
                        next_id += 1
                    else:
                        c.execute("UPDATE items SET id = %s WHERE id = %s", (next_id, k))
                        next_id += 1
                    c.commit()
                    self.commits += 1
                    self.stop_event.wait(0.005)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def test_materialize_projects_filters_renames_through_copy_and_replicate(pair, spark):
    _source(pair, 6000)
    created = create_materialize("mat", pair.source, pair.target, [RULE], {"cycle_rows": 2500, "chunk_rows": 900},
                                 UDFS)
    assert created == ["public.items_eu"]
    cols = pair.dst("""SELECT column_name, data_type FROM information_schema.columns
                       WHERE table_name = 'items_eu' ORDER BY ordinal_position""")
    assert cols == [("item_id", "bigint"), ("uname", "text"), ("total", "numeric"), ("region", "text"),
                    ("descr", "text"), ("created", "timestamp with time zone"), ("slug", "text")]
    assert pair.dst("""SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid
                       AND a.attnum = ANY(i.indkey) WHERE i.indrelid = 'items_eu'::regclass AND i.indisprimary""") \
        == [("item_id",)]
    mover = _Mover(pair.source, 6000)
    mover.start()
    try:
        with EngineThread(spark, pair.target, "mat"):
            wait_for(lambda: stream_row(pair, "mat")["state"] == "Running" or mover.error, what="Running",
                     describe=lambda: stream_row(pair, "mat"))
            wait_for(lambda: mover.commits > 300 or mover.error, what="writes while Running",
                     describe=lambda: (mover.commits, mover.error, stream_row(pair, "mat")))
            mover.stop_event.set()
            mover.join()
            assert mover.error is None
            pair.src("UPDATE items SET region = 'eu', qty = 1 WHERE id % 50 = 0")  # TOASTed rows move in
            pair.src("UPDATE items SET qty = 0 WHERE id % 49 = 0")  # and some move out
            wait_for(lambda: caught_up(pair, "mat"), what="caught up", describe=lambda: stream_row(pair, "mat"))
            expected = pair.src(EXPECTED)
            assert len(expected) > 500
            assert _target_rows(pair) == expected
            # vdiff runs the source's rows through the rule (in the running driver) and compares them
            out = _cli("vdiff", "mat", "--target", pair.target, "--json", "--range-rows", "1500")
            assert out.returncode == 0, out.stdout + out.stderr
            report = json.loads(out.stdout)
            table = report["tables"]["public.items"]
            assert report["equal"] and table["rows_compared"] == len(expected) and table["ranges"] >= 4
            keys = [r[0] for r in expected]
            pair.dst("UPDATE items_eu SET uname = 'tampered' WHERE item_id = %s", (keys[3],))
            pair.dst("DELETE FROM items_eu WHERE item_id = %s", (keys[-1],))
            pair.dst("INSERT INTO items_eu (item_id, uname) VALUES (-1, 'extra')")
            out = _cli("vdiff", "mat", "--target", pair.target, "--json")
            assert out.returncode == 1, out.stdout + out.stderr
            table = json.loads(out.stdout)["tables"]["public.items"]
            assert (table["missing"], table["extra"], table["mismatched"]) == (1, 1, 1)
            assert sorted(s["key"][0] for s in table["samples"]) == sorted(["-1", str(keys[3]), str(keys[-1])])
    finally:
        mover.stop_event.set()


def test_update_moving_a_row_into_the_filter_without_its_toasted_value_stops_with_the_way_out(pair, spark):
    pair.src("CREATE TABLE items (id int PRIMARY KEY, region text, descr text)")
    pair.src(f"INSERT INTO items VALUES (1, 'us', {BIG.format(1)}), (2, 'eu', 'short')")
    toast = pair.src("SELECT reltoastrelid::regclass::text FROM pg_class WHERE relname = 'items'")[0][0]
    assert pair.src(f"SELECT count(*) FROM {toast}")[0][0] > 0  # descr of row 1 is stored out of line
    create_materialize("m2", pair.source, pair.target,
                       ["eu_items: SELECT id, descr FROM items WHERE region = 'eu'"], {})
    with EngineThread(spark, pair.target, "m2") as run:
        wait_for(lambda: caught_up(pair, "m2"), what="caught up")
        pair.src("UPDATE items SET region = 'eu' WHERE id = 1")  # descr is TOASTed and not in the change
        wait_for(lambda: stream_row(pair, "m2")["state"] == "Error", what="Error")
        run.thread.join(timeout=60)
    message = stream_row(pair, "m2")["message"]
    assert "REPLICA IDENTITY FULL" in message and "public.items" in message
    assert pair.dst("SELECT id FROM eu_items ORDER BY id") == [(2,)]  # nothing half-applied


BAD_RULES = [
    ("x: SELECT id, nme FROM items", "rule 'x'", "nme"),
    ("x: SELECT id, nosuch(name) AS n FROM items", "rule 'x'", "nosuch"),
    ("x: SELECT name FROM items", "rule 'x'", "key column 'id'"),
    ("x: SELECT id, rand() AS r FROM items", "rule 'x'", "'r' is not deterministic"),
    ("x: SELECT region, count(*) AS n FROM items GROUP BY region", "rule 'x'", "aggregations"),
    ("x: SELECT id FROM itemz", "itemz", "did you mean 'items'"),
    ("x: SELECT id FROM items WHERE rand() > 0.5", "rule 'x'", "WHERE is not deterministic"),
    ("x SELECT id FROM items", "not 'TABLE: SELECT", "x SELECT"),
]


def test_bad_rules_are_refused_before_anything_is_created(pair, spark):
    pair.src("CREATE TABLE items (id int PRIMARY KEY, name text, region text)")
    pair.src("CREATE TABLE other (id int PRIMARY KEY)")
    for rule, *fragments in BAD_RULES:
        with pytest.raises(UsageError) as err:
            create_materialize("bad", pair.source, pair.target, [rule], {})
        for fragment in fragments:
            assert fragment in str(err.value), (rule, str(err.value))
        assert "\n" not in str(err.value)
    with pytest.raises(UsageError, match="cannot import nosuchmodule"):
        parse_udfs(["slug=nosuchmodule:slug"])
    with pytest.raises(UsageError, match="no function 'nope'"):
        parse_udfs(["slug=tests.integration.rule_udfs:nope"])
    with pytest.raises(UsageError, match="does not move"):
        create_movetables("bad", pair.source, pair.target, ["items"], ["x: SELECT id FROM other"], {})
    assert pair.dst("SELECT to_regclass('sluicegate.workflows')")[0][0] is None  # nothing was created
    assert pair.dst("SELECT to_regclass('public.x')")[0][0] is None
    # the command line: one line on stderr, exit 1
    out = subprocess.run([sys.executable, "-m", "sluicegate.cli.main", "materialize", "create", "--workflow", "bad",
                          "--source", pair.source, "--target", pair.target, "--rule", BAD_RULES[0][0]],
                         capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "nme" in out.stderr and "rule 'x'" in out.stderr, out.stderr


def test_a_pattern_rule_matches_tables_by_name_and_keeps_their_names(pair, spark):
    for name in ("item_a", "item_b", "other"):
        pair.src(f"CREATE TABLE {name} (id int PRIMARY KEY, region text)")
        pair.src(f"INSERT INTO {name} VALUES (1, 'eu'), (2, 'us')")
    created = create_materialize("pat", pair.source, pair.target,
                                 ["item_*: SELECT id, upper(region) AS region FROM `item_*` WHERE region = 'eu'"], {})
    assert created == ["public.item_a", "public.item_b"]
    with EngineThread(spark, pair.target, "pat"):
        wait_for(lambda: caught_up(pair, "pat"), what="caught up")
        pair.src("UPDATE item_b SET region = 'eu' WHERE id = 2")
        wait_for(lambda: pair.dst("SELECT count(*) FROM item_b")[0][0] == 2, what="the update moved a row in")
    assert pair.dst("SELECT * FROM item_a") == [(1, "EU")]
    assert pair.dst("SELECT * FROM item_b ORDER BY id") == [(1, "EU"), (2, "EU")]
    assert pair.dst("SELECT to_regclass('public.other')")[0][0] is None
    with pytest.raises(UsageError, match="FROM `item_\\*`"):
        create_materialize("pat2", pair.source, pair.target, ["item_*: SELECT id FROM item_a"], {})


def test_a_rule_goes_on_past_changes_of_columns_it_does_not_read(pair, spark):
    """Source columns the rule does not read may be added, dropped, renamed or retyped: the stream goes on in
    the shape the rule was made for. A change of one it reads stops the stream, naming the column and the rule,
    before anything of that batch is applied."""
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, name text, region text, qty int, legacy text)")
    pair.src("INSERT INTO items SELECT g, 'item ' || g, (ARRAY['eu','us'])[1 + g % 2], g % 9, 'old' "
             "FROM generate_series(1, 3000) g")
    create_materialize("shape", pair.source, pair.target,
                       ["items_eu: SELECT id AS item_id, qty * 2 AS dbl FROM items WHERE region = 'eu'"], {})
    expected = "SELECT id, qty * 2 FROM items WHERE region = 'eu' ORDER BY id"
    target = lambda: pair.dst("SELECT item_id, dbl FROM items_eu ORDER BY item_id")
    with EngineThread(spark, pair.target, "shape"):
        wait_for(lambda: stream_row(pair, "shape")["state"] == "Running", what="Running",
                 describe=lambda: stream_row(pair, "shape"))
        for statement, change in (
                ("ALTER TABLE items ADD COLUMN note text DEFAULT 'n'", "UPDATE items SET qty = qty + 1 WHERE id <= 40"),
                ("ALTER TABLE items DROP COLUMN legacy", "UPDATE items SET qty = qty + 1 WHERE id % 7 = 0"),
                ("ALTER TABLE items RENAME COLUMN name TO title",
                 "INSERT INTO items (id, title, region, qty) SELECT g, 't', 'eu', 5 FROM generate_series(5001, 5020) g"),
                ("ALTER TABLE items ALTER COLUMN title TYPE varchar(40)",
                 "UPDATE items SET region = 'eu' WHERE id BETWEEN 41 AND 60")):
            with psycopg.connect(pair.source) as c:  # rows before and after the change in one transaction
                c.execute("UPDATE items SET qty = qty + 2 WHERE id BETWEEN 100 AND 110")
                c.execute(statement)
                c.execute(change)
        pair.src("DELETE FROM items WHERE id BETWEEN 200 AND 210")
        wait_for(lambda: caught_up(pair, "shape"), what="caught up", describe=lambda: stream_row(pair, "shape"))
        assert stream_row(pair, "shape")["state"] == "Running"
        assert target() == pair.src(expected)
        out = _cli("vdiff", "shape", "--target", pair.target, "--json")  # through the rule, in the new shape
        assert out.returncode == 0, out.stdout + out.stderr
        assert json.loads(out.stdout)["equal"]
        pair.src("ALTER TABLE items RENAME COLUMN qty TO amount")
        pair.src("UPDATE items SET amount = 100 WHERE id <= 10")
        wait_for(lambda: stream_row(pair, "shape")["state"] == "Error", what="Error")
    message = stream_row(pair, "shape")["message"]
    assert "qty" in message and "the rule for public.items" in message, message
    assert pair.dst("SELECT count(*) FROM items_eu WHERE dbl = 200") == [(0,)]  # nothing of that batch

"""Table shapes beyond one plain table of schema public: partitioned tables (moved as their root), inheritance
parents and children, schemas and names that need quoting, keys with INCLUDE columns; the refusals (UNLOGGED,
a partition named alone); and a stream that meets a change it cannot place stops instead of dropping it.

Every comparison is a digest of the rows' text forms on each side, independent of Sluicegate."""

from __future__ import annotations

import signal
import threading

import psycopg
import pytest

from sluicegate.errors import UsageError
from sluicegate.workflow.create import create_movetables

from ..conftest import EngineThread, wait_for
from .helpers import caught_up, reap_group, stream_row
from .test_kill_restart import kill_at, start_driver
from .test_vdiff import report, vdiff

pytestmark = pytest.mark.spark

SHAPES = """
CREATE SCHEMA "Sales Dept";
CREATE TABLE "Sales Dept"."Order Items" (id int PRIMARY KEY, item text);
CREATE TABLE events (id bigint, created date NOT NULL, payload text, PRIMARY KEY (id, created))
    PARTITION BY RANGE (created);
CREATE TABLE events_2023 PARTITION OF events FOR VALUES FROM ('2023-01-01') TO ('2024-01-01');
CREATE TABLE events_2024 PARTITION OF events FOR VALUES FROM ('2024-01-01') TO ('2025-01-01')
    PARTITION BY HASH (id);
CREATE TABLE events_2024_a PARTITION OF events_2024 FOR VALUES WITH (MODULUS 2, REMAINDER 0);
CREATE TABLE events_2024_b PARTITION OF events_2024 FOR VALUES WITH (MODULUS 2, REMAINDER 1);
CREATE TABLE events_other PARTITION OF events DEFAULT;
CREATE INDEX events_payload ON events (payload);
CREATE TABLE animals (id int PRIMARY KEY, name text);
CREATE TABLE dogs (breed text) INHERITS (animals);
ALTER TABLE dogs ADD PRIMARY KEY (id);
CREATE TABLE incl (id int, code text NOT NULL, extra text, PRIMARY KEY (id) INCLUDE (extra));
INSERT INTO "Sales Dept"."Order Items" SELECT g, 'item ' || g FROM generate_series(1, 3000) g;
INSERT INTO events SELECT g, date '2022-12-01' + (g % 800), 'p' || g FROM generate_series(1, 6000) g;
INSERT INTO animals SELECT g, 'animal ' || g FROM generate_series(1, 1500) g;
INSERT INTO dogs SELECT g, 'dog ' || g, 'breed ' || (g % 7) FROM generate_series(2001, 3500) g;
INSERT INTO incl SELECT g, 'c' || g, 'x' || g FROM generate_series(1, 2000) g;
"""

TABLES = ["events", '"Sales Dept"."Order Items"', "animals", "dogs", "incl"]
# Each side's own rows: ONLY, so a parent is not read with its children (the target's are plain tables).
READS = {"public.events": "events", "Sales Dept.Order Items": '"Sales Dept"."Order Items"',
         "public.animals": "ONLY animals", "public.dogs": "dogs", "public.incl": "incl"}


def digest(url: str, relation: str) -> tuple[int, str]:
    with psycopg.connect(url) as c:
        return c.execute(f"SELECT count(*), md5(COALESCE(string_agg(t::text, E'\\n' ORDER BY t::text), '')) "
                         f"FROM {relation} t").fetchone()


def assert_all_same(pair) -> dict[str, int]:
    counts = {}
    for name, relation in READS.items():
        src, dst = digest(pair.source, relation), digest(pair.target, relation)
        assert src == dst, f"{name}: source {src}, target {dst}"
        counts[name] = src[0]
    return counts


class ShapeWriter(threading.Thread):
    """Transactions that touch every shape, until stopped: rows moving between partitions (and between
    sub-partitions), a parent's own rows and its child's, keys with INCLUDE columns, quoted names."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop_event, self.commits, self.error = url, threading.Event(), 0, None

    def run(self):
        try:
            with psycopg.connect(self.url, autocommit=True) as c:
                i = 0
                while not self.stop_event.is_set():
                    i += 1
                    n = 10_000 + i
                    with c.transaction():
                        c.execute("INSERT INTO events VALUES (%s, date '2023-06-01' + %s, 'new')", (n, i % 500))
                        # moves a row to another partition (and the 2024 ones between their hash halves)
                        c.execute("UPDATE events SET created = created + 200, payload = payload || '>' "
                                  "WHERE id = %s", (i * 7 % 6000 + 1,))
                        c.execute("DELETE FROM events WHERE id = %s", (i * 13 % 6000 + 1,))
                        c.execute('UPDATE "Sales Dept"."Order Items" SET item = item || %s WHERE id = %s',
                                  (str(i), i % 3000 + 1))
                        c.execute('INSERT INTO "Sales Dept"."Order Items" VALUES (%s, %s)', (n, "new"))
                        c.execute("INSERT INTO animals VALUES (%s, 'cat')", (n,))
                        c.execute("INSERT INTO dogs VALUES (%s, 'pup', 'mutt')", (n + 100_000,))
                        c.execute("UPDATE dogs SET breed = breed || '+' WHERE id = %s", (2001 + i % 1500,))
                        c.execute("DELETE FROM animals WHERE id = %s", (1 + i * 11 % 1500,))  # and its child's
                        c.execute("UPDATE incl SET extra = extra || '!' , code = code || '?' WHERE id = %s",
                                  (i % 2000 + 1,))
                    self.commits += 1
                    self.stop_event.wait(0.01)  # a steady rate, not a flood the catchup never ends
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def test_shapes_move_and_every_change_lands(versions_pair_sampled, tmp_path):
    """kill -9 of `workflow run` in the copy and in replication, under live writes to every shape."""
    pair = versions_pair_sampled  # 15 -> 18; 15 -> 15 and 18 -> 18 in the slow set
    for statement in SHAPES.split(";\n"):
        if statement.strip():
            pair.src(statement)
    create_movetables("wf", pair.source, pair.target, TABLES, [], {"cycle_rows": 2500, "chunk_rows": 1000})
    # The key is the primary key's own columns, not its INCLUDE ones (the key is built after the first cycle).
    assert pair.dst("SELECT attnotnull FROM pg_attribute WHERE attrelid = 'incl'::regclass "
                    "AND attname = 'extra'") == [(False,)]
    writer = ShapeWriter(pair.source)
    writer.start()
    log = tmp_path / "driver.log"
    try:
        kill_at(pair, "wf", "copy.before_progress", tmp_path, log)
        assert stream_row(pair, "wf")["state"] == "Copying"
        kill_at(pair, "wf", "slice.mid_batch", tmp_path, log)
        assert stream_row(pair, "wf")["state"] == "Running"
        driver = start_driver(pair, "wf", log)
        try:
            commits = writer.commits
            wait_for(lambda: writer.commits > commits + 20, what="writes after the restart")
            writer.stop_event.set()
            writer.join()
            assert writer.error is None, writer.error
            # TRUNCATE in order with the rows around it
            pair.src('BEGIN; INSERT INTO "Sales Dept"."Order Items" VALUES (-1, \'before\'); '
                     'TRUNCATE "Sales Dept"."Order Items"; '
                     'INSERT INTO "Sales Dept"."Order Items" VALUES (-2, \'after\'); COMMIT')
            wait_for(lambda: caught_up(pair, "wf") or stream_row(pair, "wf")["state"] == "Error",
                     what="caught up", describe=lambda: log.read_text()[-2000:])
            assert stream_row(pair, "wf")["state"] == "Running", stream_row(pair, "wf")["message"]
            counts = assert_all_same(pair)
            # The target has the same partitions, and every row sits in the partition the source has it in.
            for partition in ("events_2023", "events_2024_a", "events_2024_b", "events_other"):
                assert digest(pair.source, partition) == digest(pair.target, partition), partition
            assert pair.dst("SELECT pg_get_partkeydef('events'::regclass), pg_get_partkeydef('events_2024'::regclass)"
                            ) == [("RANGE (created)", "HASH (id)")]
            indexed = "SELECT count(*) FROM pg_index WHERE indkey::text = '3' AND indisvalid AND indrelid IN " \
                      "(SELECT relid FROM pg_partition_tree('events'))"
            assert pair.dst(indexed) == pair.src(indexed) == [(6,)]  # the root's, and every partition's
            assert pair.dst("SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = 'incl'::regclass "
                            "AND contype = 'p'") == [("PRIMARY KEY (id)",)]
            assert counts["public.dogs"] > 1500 and counts["Sales Dept.Order Items"] == 1
            # rows did move between partitions on the source, and the target holds them under the root
            assert pair.src("SELECT count(*) FROM events_2024 WHERE payload LIKE '%>'")[0][0] > 0
            out = vdiff(pair.target, "wf", "--json")  # served by the running driver
            assert out.returncode == 0, (out.stdout, out.stderr)
            tables = report(out)["tables"]
            assert set(tables) == set(READS), tables
            assert all((t["missing"], t["extra"], t["mismatched"]) == (0, 0, 0) for t in tables.values()), tables
            driver.send_signal(signal.SIGTERM)
            assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]
        finally:
            reap_group(driver)
    finally:
        writer.stop_event.set()


def test_a_change_the_stream_cannot_place_stops_it(pair, spark):
    """The publication sends a relation the workflow does not move (here made so by hand: partitions under
    their own names, as a publication of an older Sluicegate did): the stream stops in Error naming it, and
    nothing of that transaction is applied."""
    pair.src("CREATE TABLE events (id int, created date, PRIMARY KEY (id, created)) PARTITION BY RANGE (created)")
    pair.src("CREATE TABLE events_2023 PARTITION OF events FOR VALUES FROM ('2023-01-01') TO ('2024-01-01')")
    pair.src("CREATE TABLE items (id int PRIMARY KEY)")
    pair.src("INSERT INTO events VALUES (1, '2023-02-01')")
    create_movetables("wf", pair.source, pair.target, ["events", "items"], [], {})
    with EngineThread(spark, pair.target, "wf") as run:
        wait_for(lambda: stream_row(pair, "wf")["state"] == "Running", what="Running")
        pair.src("INSERT INTO events VALUES (2, '2023-03-01')")
        wait_for(lambda: caught_up(pair, "wf"), what="caught up")
        assert pair.dst("SELECT id FROM events ORDER BY id") == [(1,), (2,)]  # the root's name: applied
        publication = pair.src("SELECT pubname FROM pg_publication")[0][0]
        pair.src(f"ALTER PUBLICATION {publication} SET (publish_via_partition_root = false)")
        pair.src("BEGIN; INSERT INTO items VALUES (1); INSERT INTO events VALUES (3, '2023-04-01'); COMMIT")
        wait_for(lambda: stream_row(pair, "wf")["state"] == "Error", what="Error")
        message = stream_row(pair, "wf")["message"]
        assert "public.events_2023" in message and "partition or inheritance child" in message, message
        run.thread.join(timeout=60)
    assert pair.dst("SELECT count(*) FROM items")[0][0] == 0  # nothing of that transaction
    assert pair.dst("SELECT id FROM events ORDER BY id") == [(1,), (2,)]


def test_refusals_name_the_way_out(pair):
    pair.src("CREATE UNLOGGED TABLE scratch (id int PRIMARY KEY)")
    pair.src("CREATE TABLE events (id int, created date, PRIMARY KEY (id, created)) PARTITION BY RANGE (created)")
    pair.src("CREATE TABLE events_2023 PARTITION OF events FOR VALUES FROM ('2023-01-01') TO ('2024-01-01')")
    pair.src("CREATE VIEW v AS SELECT 1 AS one")
    with pytest.raises(UsageError, match=r"table public.scratch is UNLOGGED.*ALTER TABLE public.scratch SET LOGGED"):
        create_movetables("wf", pair.source, pair.target, ["scratch"], [], {})
    with pytest.raises(UsageError, match=r"public.events_2023 is a partition of public.events: move public.events"):
        create_movetables("wf", pair.source, pair.target, ["events_2023"], [], {})
    with pytest.raises(UsageError, match=r"public.v is a view, not a table"):
        create_movetables("wf", pair.source, pair.target, ["v"], [], {})
    assert pair.dst("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")[0][0] == 0

"""Schema changes under active-active (`replicate create --bidirectional --on-ddl exec`): a migration run on side
A, and an index made on side B, while both sides take writes, reach the other side once — the replayed statement
is not captured again, so nothing loops — and both end with the same columns, indexes and rows, conflicts
resolved by last writer wins as before. A statement that is unsafe both ways (a unique index) stops the
direction that meets it, naming why. Real PostgreSQL servers; each side's consumer is a `workflow run` process."""

from __future__ import annotations

import psycopg
import pytest

from ..conftest import wait_for
from .cluster_helpers import Consumer, cli, run, stream
from .test_ddl_flow import Writes, backfill, indexes
from .test_replicate_bidirectional import Pair, W, applied, caught_up, equal
from .test_schema_changes import columns

pytestmark = pytest.mark.spark
ROWS = 2000


@pytest.fixture
def sides(target_server, sink_server):
    p = Pair(target_server, sink_server)
    yield p
    p.cleanup()


def test_migration_on_one_side_reaches_the_other_once(sides, tmp_path):
    p = sides
    run(p.a, "CREATE TABLE items (id bigint PRIMARY KEY, qty int, name text)")
    run(p.a, f"INSERT INTO items SELECT g, g % 7, 'item ' || g FROM generate_series(1, {ROWS}) g")
    for side in (p.a, p.b):
        out = cli("ddl", "install", "--source", side)
        assert out.returncode == 0, out.stderr
    out = p.create("--on-ddl", "exec")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "captures no DDL" not in out.stderr
    consumers = [Consumer(W, p.a, tmp_path / "a.log").start()]
    writers = []
    try:
        wait_for(lambda: stream(p.a, W)["state"] == "Running", 180, what="B->A running")
        consumers.append(Consumer(W, p.b, tmp_path / "b.log").start())
        wait_for(lambda: caught_up(p.b, p.a) and caught_up(p.a, p.b), 240, what="both ways running",
                 describe=lambda: (tmp_path / "b.log").read_text()[-2000:])
        # odd keys inserted on A, even on B; updates and deletes anywhere: the sides write the same rows
        writers = [Writes(p.a, 10 * ROWS + 1, step=2, seed=1, keys=ROWS),
                   Writes(p.b, 10 * ROWS + 2, step=2, seed=2, keys=ROWS)]
        for w in writers:
            w.start()
        wait_for(lambda: all(w.commits > 10 for w in writers), what="writes on both sides")
        with psycopg.connect(p.a) as c:  # rows before and after the statement in one transaction
            c.execute("INSERT INTO items (id, qty) VALUES (900001, 1)")
            c.execute("ALTER TABLE items ADD COLUMN status text DEFAULT 'new'")
            c.execute("INSERT INTO items (id, qty, status) VALUES (900003, 3, 'first')")
        backfill(p.a, ROWS)  # on A while B writes the old columns
        run(p.a, "CREATE INDEX CONCURRENTLY items_status ON items (status)")
        run(p.a, "ALTER TABLE items ALTER COLUMN status SET DEFAULT 'fresh', ADD COLUMN score numeric")
        run(p.b, "CREATE INDEX items_qty ON items (qty)")  # the other way too
        wait_for(lambda: all(w.commits > 60 for w in writers), what="writes after the migration")
        for w in writers:
            w.finish()
        wait_for(lambda: caught_up(p.a, p.b) and caught_up(p.b, p.a) and equal(p), 180, what="both sides equal",
                 describe=lambda: (stream(p.a, W), stream(p.b, W)))
        assert columns(p.a) == columns(p.b)
        assert [c[0] for c in columns(p.a)] == ["id", "qty", "name", "status", "score"]
        assert indexes(p.a) == indexes(p.b) and len(indexes(p.a)) == 3, indexes(p.b)
        assert run(p.b, "SELECT status FROM items WHERE id IN (900001, 900003) ORDER BY id") == \
            [("new",), ("first",)]
        # Once: idle, neither side applies anything more (a statement coming back would fail: it exists).
        rows = applied(p.a), applied(p.b)
        wait_for(lambda: caught_up(p.a, p.b) and caught_up(p.b, p.a), 60, what="idle, caught up")
        assert (applied(p.a), applied(p.b)) == rows
        assert stream(p.a, W)["state"] == stream(p.b, W)["state"] == "Running"

        # Not replayed (B->A set to stop): a column added on B follows from its rows, as one way.
        out = cli("workflow", "set", W, "--target", p.a, "--on-ddl", "stop")
        assert out.returncode == 0, out.stderr
        run(p.b, "ALTER TABLE items ADD COLUMN tag text")
        run(p.b, "UPDATE items SET tag = 'b' WHERE id <= 10")
        wait_for(lambda: caught_up(p.a, p.b) and caught_up(p.b, p.a) and equal(p), 60, what="tag on A",
                 describe=lambda: (stream(p.a, W), stream(p.b, W)))
        assert columns(p.a) == columns(p.b) and columns(p.a)[-1][0] == "tag"

        # Unsafe both ways: the direction that meets it stops, naming why; the other goes on.
        run(p.a, "CREATE UNIQUE INDEX items_name ON items (name)")
        wait_for(lambda: stream(p.b, W)["state"] == "Error", 60, what="A->B stopped")
        message = stream(p.b, W)["message"]
        assert "unique index" in message and "items_name" in message, message
        assert "items_name" not in " ".join(indexes(p.b))
        assert stream(p.a, W)["state"] == "Running"
    finally:
        for w in writers:
            w.stop_event.set()
        for c in consumers:
            c.kill()

"""The copy phase's gotchas (VReplication seed): writes to rows below and above lastpk between many
small copy cycles must all reach the target; TRUNCATE replicates; a huge transaction applies atomically."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from sluicegate.workflow.create import create_movetables

from ..conftest import EngineThread, wait_for
from .helpers import Writer, assert_same, caught_up, stream_row

pytestmark = pytest.mark.spark


def test_many_cycles_under_concurrent_writes(pair, spark):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("INSERT INTO items SELECT g, 0, md5(g::text) FROM generate_series(1, 3000) g")
    pair.src("CREATE TABLE other (k text PRIMARY KEY, v int)")
    pair.src("INSERT INTO other SELECT 'k' || g, g FROM generate_series(1, 500) g")
    # 150-row cycles of 40-row tasks: ~25 snapshots, each followed by catchup and fast-forward
    create_movetables("gotchas", pair.source, pair.target, None, [], {"cycle_rows": 150, "chunk_rows": 40})
    writer = Writer(pair.source, 3000)
    writer.start()
    try:
        with EngineThread(spark, pair.target, "gotchas"):
            wait_for(lambda: stream_row(pair, "gotchas")["state"] == "Running", timeout=300, what="Running",
                     describe=lambda: pair.dst("SELECT table_name, lastpk, rows_copied FROM sluicegate.copy_state"))
            commits = writer.commits
            wait_for(lambda: writer.commits > commits + 20, what="writes while Running")
            writer.stop_event.set()
            writer.join()
            assert writer.error is None
            pair.src("UPDATE other SET v = v * 2 WHERE v % 3 = 0")
            wait_for(lambda: caught_up(pair, "gotchas"), what="caught up")
    finally:
        writer.stop_event.set()
    assert writer.commits > 50  # the copy really raced with writers
    assert assert_same(pair, "public.items", ["id"]) > 2000
    assert assert_same(pair, "public.other", ["k"]) == 500
    # the copy_state says every row was copied in cycles
    rows = pair.dst("SELECT table_name, done, rows_copied FROM sluicegate.copy_state ORDER BY 1")
    assert [r[:2] for r in rows] == [("public.items", True), ("public.other", True)]


def _worker_rss_mb() -> float:
    """Total RSS of this test process's PySpark Python workers (where Spark tasks apply changes): the
    descendants of this process (its Spark JVM's daemon and workers), never another run's on the machine."""
    import os

    parents = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError, ValueError):
                continue
    ours, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - ours
        ours |= frontier
    total = 0
    for pid in ours:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            if b"pyspark.daemon" not in cmd and b"pyspark.worker" not in cmd:
                continue
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total / 1024


def test_truncate_and_million_row_transaction_atomic(pair, spark):
    pair.src("CREATE TABLE big (id bigint PRIMARY KEY, payload text)")
    pair.src("CREATE TABLE small (id int PRIMARY KEY)")
    pair.src("INSERT INTO small SELECT generate_series(1, 10)")
    create_movetables("atomic", pair.source, pair.target, None, [], {})
    with EngineThread(spark, pair.target, "atomic"):
        wait_for(lambda: stream_row(pair, "atomic")["state"] == "Running", what="Running")
        pair.src("TRUNCATE small")
        pair.src("INSERT INTO small VALUES (42)")
        wait_for(lambda: caught_up(pair, "atomic"), what="truncate replicated")
        assert pair.dst("SELECT array_agg(id) FROM small")[0][0] == [42]

        seen: set[int] = set()
        peak = [0.0]
        done = threading.Event()

        def watch():
            with psycopg.connect(pair.target, autocommit=True) as c:
                while not done.is_set():
                    seen.add(c.execute("SELECT count(*) FROM big").fetchone()[0])
                    peak[0] = max(peak[0], _worker_rss_mb())

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        base_rss = _worker_rss_mb()
        t0 = time.monotonic()
        pair.src("INSERT INTO big SELECT g, repeat('x', 100) FROM generate_series(1, 1000000) g")
        wait_for(lambda: caught_up(pair, "atomic"), timeout=300, what="1M-row transaction applied")
        elapsed = time.monotonic() - t0
        done.set()
        watcher.join()
    assert pair.dst("SELECT count(*) FROM big")[0][0] == 1_000_000
    # a concurrent reader saw the transaction entirely or not at all
    assert seen <= {0, 1_000_000}, sorted(seen)[:10]
    # 1M rows of ~110 bytes held in Python would take well over 1 GB; chunked staging keeps it bounded
    print(f"1M-row transaction replicated in {elapsed:.1f}s; worker RSS {base_rss:.0f} -> peak {peak[0]:.0f} MB")
    assert peak[0] - base_rss < 400, (base_rss, peak[0])


def test_cycle_plan_follows_the_key_order_not_its_text(pair):
    """Bounds are every chunk-th key in the key's own order (text order would put 10 before 9)."""
    import psycopg

    from sluicegate.postgres.catalog import describe_table
    from sluicegate.workflow.copier import plan_cycle

    pair.src("CREATE TABLE nums (id int PRIMARY KEY)")
    pair.src("INSERT INTO nums SELECT generate_series(1, 25)")
    with psycopg.connect(pair.source) as c:
        table = describe_table(c, "public", "nums")
        plan = plan_cycle(c, table, None, cycle_rows=10, chunk_rows=4)
        assert plan.ranges == [(None, ["4"]), (["4"], ["8"]), (["8"], ["10"])]
        assert (plan.new_lastpk, plan.rows, plan.done) == (["10"], 10, False)
        tail = plan_cycle(c, table, ["20"], cycle_rows=10, chunk_rows=4)
        assert tail.ranges == [(["20"], ["24"]), (["24"], ["25"])]
        assert (tail.new_lastpk, tail.rows, tail.done) == (["25"], 5, True)
        empty = plan_cycle(c, table, ["25"], cycle_rows=10, chunk_rows=4)
        assert (empty.ranges, empty.new_lastpk, empty.rows, empty.done) == ([], ["25"], 0, True)
        # a composite key: the last key of a short chunk is the greatest in every column's order
        pair.src("CREATE TABLE lines (o int, l int, PRIMARY KEY (o, l))")
        pair.src("INSERT INTO lines SELECT o, l FROM generate_series(1, 3) o, generate_series(1, 3) l")
        lines = describe_table(c, "public", "lines")
        plan = plan_cycle(c, lines, ["1", "2"], cycle_rows=100, chunk_rows=50)
        assert plan.ranges == [(["1", "2"], ["3", "3"])] and (plan.rows, plan.done) == (7, True)


def test_cycle_plan_by_value_for_a_whole_table_with_an_integer_key(pair):
    """A table that fits in one cycle and has one integer key column is split into equal-width value ranges
    (two index lookups instead of walking every key); the ranges cover every row exactly once. Too big for
    one cycle, never analyzed, or already started: the walk, as before."""
    import psycopg

    from sluicegate.postgres import keyrange
    from sluicegate.postgres.catalog import describe_table
    from sluicegate.workflow.copier import plan_cycle

    pair.src("CREATE TABLE ints (id bigint PRIMARY KEY, v text)")
    pair.src("INSERT INTO ints SELECT g * 3, 'x' FROM generate_series(1, 1000) g")  # ids 3, 6, … 3000
    with psycopg.connect(pair.source) as c:
        table = describe_table(c, "public", "ints")
        walked = plan_cycle(c, table, None, cycle_rows=5000, chunk_rows=300)  # no statistics yet: walk
        assert walked.ranges[0] == (None, ["900"]) and walked.rows == 1000
        c.execute("ANALYZE ints")
        plan = plan_cycle(c, table, None, cycle_rows=5000, chunk_rows=300)
        assert plan.ranges == [(None, ["751"]), (["751"], ["1501"]), (["1501"], ["2250"]), (["2250"], ["3000"])]
        assert (plan.new_lastpk, plan.done) == (["3000"], True)
        counts = [c.execute(sql_count(table, keyrange.in_range(table, lo, hi))).fetchone()[0] for lo, hi in plan.ranges]
        assert sum(counts) == 1000 and min(counts) >= 240, counts
        spread = plan_cycle(c, table, None, cycle_rows=5000, chunk_rows=300, slots=3)  # 4 chunks: 1 wave of 3
        assert len(spread.ranges) == 3 and spread.ranges[-1][1] == ["3000"]
        waves = plan_cycle(c, table, None, cycle_rows=5000, chunk_rows=150, slots=3)  # 7 chunks: 2 waves of 3
        assert len(waves.ranges) == 6 and waves.ranges[-1][1] == ["3000"]
        assert plan_cycle(c, table, None, cycle_rows=500, chunk_rows=300).ranges[0] == (None, ["900"])  # too big
        assert plan_cycle(c, table, ["900"], cycle_rows=5000, chunk_rows=300).ranges[0] == (["900"], ["1800"])


def sql_count(table, where):
    from psycopg import sql

    return sql.SQL("SELECT count(*) FROM {} WHERE {}").format(table.ident, where)


def test_cycle_plan_by_pages_reads_each_visible_row_once(pair):
    """A whole table in one cycle, any key type, is split into heap page ranges (TID range scans) that tile
    the table: every row visible in the snapshot is read by exactly one task, wherever updates and deletes
    left its version; the last range is open; the cycle ends at the greatest key."""
    import psycopg

    from sluicegate.postgres.catalog import describe_table
    from sluicegate.workflow.copier import plan_cycle, task_where

    pair.src("CREATE TABLE words (w text PRIMARY KEY, n int)")
    pair.src("INSERT INTO words SELECT md5(g::text), g FROM generate_series(1, 3000) g")
    pair.src("DELETE FROM words WHERE n % 7 = 0")
    pair.src("UPDATE words SET n = -n WHERE n % 5 = 0")  # new versions, on other pages
    pair.src("ANALYZE words")
    with psycopg.connect(pair.source) as c:
        table = describe_table(c, "public", "words")
        expected = sorted(r[0] for r in c.execute("SELECT w FROM words"))
        plan = plan_cycle(c, table, None, cycle_rows=10_000, chunk_rows=500, slots=2, by_pages=True)
        assert plan.ranges == [] and plan.done and plan.new_lastpk == [expected[-1]]
        assert len(plan.pages) % 2 == 0 and len(plan.pages) >= 4, plan.pages
        assert plan.pages[0][0] == 0 and plan.pages[-1][1] is None
        assert all(a[1] == b[0] for a, b in zip(plan.pages, plan.pages[1:]))  # contiguous, no gap or overlap
        tasks = plan.tasks(pair.source, pair.target, table, "snapshot")
        seen = []
        for task in tasks:
            query = sql_select_keys(table, task_where(table, task))
            seen += [r[0] for r in c.execute(query)]
            assert "Tid Range Scan" in "\n".join(r[0] for r in c.execute(sql_explain(query)))
        assert sorted(seen) == expected  # each once
        # a rule's copy reads key ranges; too big for one cycle or already started: by key, as before
        assert plan_cycle(c, table, None, cycle_rows=10_000, chunk_rows=500).pages is None
        assert plan_cycle(c, table, None, cycle_rows=1000, chunk_rows=500, by_pages=True).pages is None
        assert plan_cycle(c, table, [expected[10]], cycle_rows=10_000, chunk_rows=500, by_pages=True).pages is None


def sql_select_keys(table, where):
    from psycopg import sql

    return sql.SQL("SELECT {} FROM {} WHERE {}").format(sql.Identifier(table.key[0]), table.ident, where)


def sql_explain(query):
    from psycopg import sql

    return sql.SQL("EXPLAIN {}").format(query)

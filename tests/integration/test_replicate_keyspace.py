"""Replicate from a keyspace: two source shards into two sinks, each sink receiving every shard's rows."""

from __future__ import annotations

import contextlib
import itertools
import threading
from datetime import timezone

import psycopg
import pytest

from sluicegate.position import parse_lsn

from ..conftest import drop_slots, wait_for
from .cluster_helpers import Consumer, cli, run, status
from .helpers import ShardWriter, load_shard, table_rows

pytestmark = pytest.mark.spark

SHARDS = ["-80", "80-"]
TABLES = {"public.accounts": ["id"], "public.events": ["id"]}


@pytest.fixture
def keyspace(rc, source_server):
    """rc's source database is shard -80; a second database on the source server is shard 80-."""
    second = f"{rc.servers[0][1]}_b"
    source_server.create_database(second)
    shards = {"-80": rc.source, "80-": source_server.url(second)}
    try:
        yield rc, shards
    finally:
        with contextlib.suppress(Exception), psycopg.connect(source_server.url(), autocommit=True) as conn:
            drop_slots(conn, second)
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                         "AND pid <> pg_backend_pid()", (second,))
        with contextlib.suppress(Exception):
            source_server.drop_database(second)


def streams(sink: str) -> list[dict]:
    rows = run(sink, "SELECT source_shard, state, position::text, slot_name, safe_time FROM sluicegate.streams "
                     "WHERE workflow = 'rp' ORDER BY source_shard")
    return [{"shard": r[0], "state": r[1], "position": parse_lsn(r[2]) if r[2] else None, "slot": r[3],
             "safe_time": r[4]} for r in rows]


def flushed(shards: dict[str, str]) -> dict[str, int]:
    return {shard: parse_lsn(run(url, "SELECT pg_current_wal_flush_lsn()::text")[0][0])
            for shard, url in shards.items()}


def sink_caught_up(shards: dict[str, str], sink: str, upto: dict[str, int] | None = None) -> bool:
    """Every stream Running at or past its own shard's flushed WAL (now, or `upto`)."""
    upto = upto or flushed(shards)
    return all(s["state"] == "Running" and s["position"] is not None and s["position"] >= upto[s["shard"]]
               for s in streams(sink))


def union(shards: dict[str, str], table: str) -> list[str]:
    return sorted(row for url in shards.values() for row in table_rows(url, table, TABLES[table]))


class SafeTimes(threading.Thread):
    """Each sink's safe time (min over its streams), once a second."""

    def __init__(self, sinks):
        super().__init__(daemon=True)
        self.sinks, self.samples, self.stop_event = sinks, {s: [] for s in sinks}, threading.Event()

    def run(self):
        while not self.stop_event.is_set():
            for sink in self.sinks:
                with contextlib.suppress(Exception):
                    (t,), = run(sink, "SELECT CASE WHEN bool_and(safe_time IS NOT NULL) THEN min(safe_time) END "
                                      "FROM sluicegate.streams WHERE workflow = 'rp'")
                    if t is not None:
                        self.samples[sink].append(t)
            self.stop_event.wait(1.0)


@pytest.mark.slow  # ~1 min; the default suite keeps to its time (SLUICEGATE_ALL_TESTS=1 runs it)
def test_two_shards_two_sinks_union_kill_9_safe_time_vdiff(keyspace, tmp_path):
    c, shards = keyspace
    for shard, url in shards.items():
        load_shard(url, shard, ids=2000)
    out = cli("replicate", "create", "--workflow", c.workflow,
              *[a for shard, url in shards.items() for a in ("--source-shard", f"{shard}={url}")],
              "--shard-key", "events=account_id", *[a for s in c.sinks for a in ("--sink", s)])
    assert out.returncode == 0, out.stderr
    assert "from 2 source shard(s) to 2 sink(s)" in out.stdout, out.stdout
    for sink in c.sinks:  # a stream per source shard, each with its own slot
        ss = streams(sink)
        assert [s["shard"] for s in ss] == SHARDS and len({s["slot"] for s in ss}) == 2
    assert len({s["slot"] for sink in c.sinks for s in streams(sink)}) == 4

    writers = [ShardWriter(url, shard, seed=i, ids=2000) for i, (shard, url) in enumerate(shards.items())]
    for w in writers:
        w.start()
    consumers = [Consumer(c.workflow, s, tmp_path / f"run{i}.log").start() for i, s in enumerate(c.sinks)]
    sampler = SafeTimes(c.sinks)
    sampler.start()
    try:
        wait_for(lambda: all(s["state"] == "Running" for sink in c.sinks for s in streams(sink)), 240,
                 what="every stream of both sinks running")
        consumers[0].kill()  # kill -9 of one consumer: the other sink goes on
        commits = sum(w.commits for w in writers)
        wait_for(lambda: sum(w.commits for w in writers) > commits + 50, 60, what="writes on both shards")
        consumers[0] = Consumer(c.workflow, c.sinks[0], tmp_path / "run0b.log").start()
        upto = flushed(shards)  # under live writes: past what both shards had written by the restart
        wait_for(lambda: sink_caught_up(shards, c.sinks[0], upto), 180, what="sink 1 resumed")
        log = (tmp_path / "run0b.log").read_text()
        assert "source shard -80: resume from checkpoint" in log and "source shard 80-: resume" in log, log
        for w in writers:
            w.stop_event.set()
            w.join()
            assert w.error is None, w.error
        for sink in c.sinks:
            wait_for(lambda sink=sink: sink_caught_up(shards, sink), 180, what=f"{sink} caught up")
            for table, key in TABLES.items():  # each sink holds the union of the shards' rows
                got, want = sorted(table_rows(sink, table, key)), union(shards, table)
                assert got == want, f"{table} on {sink}: {len(got)} rows, shards {len(want)}"
            ss = streams(sink)  # the sink's safe time is the minimum over its streams
            shown = status(c.workflow, sink)
            assert shown["safe_time"] is not None
            assert all(s["safe_time"] is not None for s in ss)
            # every (sink, shard) slot, each on its own shard, shown by either sink
            assert sorted((s["sink"], s["source_shard"]) for s in shown["sinks"]) == \
                [(k, shard) for k in ("s1", "s2") for shard in SHARDS]
            assert all(s["exists"] for s in shown["sinks"]) and not shown["warnings"], shown
        for sink in c.sinks:  # several streams into one sink: a vdiff wants them stopped
            assert cli("workflow", "stop", c.workflow, "--target", sink).returncode == 0
        for consumer in consumers:
            wait_for(lambda consumer=consumer: not consumer.running(), 120, what="consumer stopped")
        for sink in c.sinks:
            # stopped: the streams' safe times hold still, and the sink's is the smaller of the two
            least = min(s["safe_time"] for s in streams(sink)).astimezone(timezone.utc)
            assert status(c.workflow, sink)["safe_time"] == least.isoformat().replace("+00:00", "Z")
        # The killed sink's vdiff (each sink's rows are compared above): every shard's stream against its shard
        out = cli("vdiff", c.workflow, "--target", c.sinks[0], "--spark-master", "local[1]")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "public.accounts <- -80" in out.stdout and "public.events <- 80-" in out.stdout, out.stdout
    finally:
        sampler.stop_event.set()
        for w in writers:
            w.stop_event.set()
        for consumer in consumers:
            consumer.kill()
    for sink, samples in sampler.samples.items():
        assert samples, f"no safe time sampled on {sink}"
        assert all(a <= b for a, b in itertools.pairwise(samples)), f"safe time went backwards on {sink}"


@pytest.mark.slow  # the default set adds tables while running in test_replicate_tables
def test_add_tables_from_a_keyspace_while_it_runs(keyspace, tmp_path):
    """add-tables on a keyspace source: both consumers running, both shards writing accounts and events;
    events joins with its sharding column (--shard-key events=account_id, as at create). Each (sink, shard)
    stream copies its shard's rows of events, and both sinks end with the union of the shards, nothing lost
    or doubled. A table missing on one shard, or sharded by another column than the one named, is refused
    with nothing changed (at create too)."""
    c, shards = keyspace
    for shard, url in shards.items():
        load_shard(url, shard, ids=2000)
    run(shards["-80"], "CREATE TABLE only_here (id bigint PRIMARY KEY)")

    def create(tables):
        return cli("replicate", "create", "--workflow", c.workflow, "--tables", tables,
                   *[a for shard, url in shards.items() for a in ("--source-shard", f"{shard}={url}")],
                   *[a for s in c.sinks for a in ("--sink", s)])

    # events is sharded by account_id: by its key, most rows of each shard lie in the other's range
    out = create("accounts,events")
    assert out.returncode != 0 and "public.events on source shard -80 lie outside its key range by column 'id'" \
        in out.stderr and "--shard-key events=COLUMN" in out.stderr, out.stderr
    assert run(c.sinks[0], "SELECT to_regclass('sluicegate.workflows')") == [(None,)]
    out = create("accounts")
    assert out.returncode == 0, out.stderr
    writers = [ShardWriter(url, shard, seed=i, ids=2000) for i, (shard, url) in enumerate(shards.items())]
    consumers = [Consumer(c.workflow, s, tmp_path / f"run{i}.log").start() for i, s in enumerate(c.sinks)]
    try:
        wait_for(lambda: all(s["state"] == "Running" for sink in c.sinks for s in streams(sink)), 240,
                 what="every stream of both sinks running")
        for w in writers:
            w.start()
        wait_for(lambda: all(w.commits > 50 for w in writers), 60, what="writes on both shards")
        bad = cli("replicate", "add-tables", c.workflow, "--tables", "only_here", "--target", c.sinks[0])
        assert bad.returncode != 0 and "only_here on source shard 80-" in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        bad = cli("replicate", "add-tables", c.workflow, "--tables", "events", "--target", c.sinks[0])
        assert bad.returncode != 0 and "lie outside its key range by column 'id'" in bad.stderr, bad.stderr
        out = cli("replicate", "add-tables", c.workflow, "--tables", "events", "--shard-key", "events=account_id",
                  "--target", c.sinks[1])
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.count("public.events: copy") == 2, out.stdout  # a decision per sink
        for sink in c.sinks:  # each shard's stream has the table, with its own shard's key range on account_id
            specs = run(sink, "SELECT s.source_shard, cs.spec -> 'rule' FROM sluicegate.copy_state cs JOIN "
                              "sluicegate.streams s ON s.id = cs.stream_id WHERE cs.table_name = 'public.events' "
                              "ORDER BY 1")
            assert [shard for shard, _ in specs] == SHARDS and all(rule for _, rule in specs), specs
        count = sum(w.commits for w in writers)
        wait_for(lambda: sum(w.commits for w in writers) > count + 100, 60, what="writes during the copy")
        for w in writers:
            w.stop_event.set()
            w.join()
            assert w.error is None, w.error
        for sink in c.sinks:
            wait_for(lambda sink=sink: sink_caught_up(shards, sink), 240, what=f"{sink} caught up",
                     describe=lambda sink=sink: streams(sink))
            for table, key in TABLES.items():
                got, want = sorted(table_rows(sink, table, key)), union(shards, table)
                assert got == want, f"{table} on {sink}: {len(got)} rows, shards {len(want)}"
        assert all(consumer.running() for consumer in consumers), "a consumer stopped"
        for shard, url in shards.items():  # only the tables asked for: only_here joined no publication
            published = run(url, "SELECT count(*) FROM pg_publication_tables WHERE tablename = 'only_here'")
            assert published[0][0] == 0, shard
    finally:
        for w in writers:
            w.stop_event.set()
        for consumer in consumers:
            consumer.kill()

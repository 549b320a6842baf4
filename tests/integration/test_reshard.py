"""Reshard 2 -> 3 with live writes on both source shards and kill -9 of the driver during the copy: every
target shard ends up holding exactly the rows of its key range, none lost or duplicated."""

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

from sluicegate.errors import UsageError
from sluicegate.position import parse_lsn
from sluicegate.sharding.keyrange import KeyRange, keyspace_id
from sluicegate.workflow.reshard import create_reshard, parse_shards

from ..conftest import Pair, wait_for

pytestmark = pytest.mark.spark

SOURCES = ["-80", "80-"]
TARGETS = ["-55", "55-aa", "aa-"]
TABLES = {"accounts": ("id", "SELECT id, owner, balance FROM accounts ORDER BY id"),
          "events": ("account_id", "SELECT id, account_id, kind FROM events ORDER BY id")}


@pytest.fixture
def keyspace(source_server, target_server):
    pairs = [Pair(source_server, target_server, f"ks{os.getpid()}_{i}_{random.randrange(10**6)}") for i in range(3)]
    yield {"sources": {n: p.source for n, p in zip(SOURCES, pairs)},
           "targets": {n: p.target for n, p in zip(TARGETS, pairs)}}
    for p in pairs:
        p.cleanup()


def _sql(url, text, params=None):
    with psycopg.connect(url, autocommit=True) as c:
        cur = c.execute(text, params)
        return cur.fetchall() if cur.description else None


def _ids_in(shard: str, start: int, count: int) -> list[int]:
    r = KeyRange.parse(shard)
    return [i for i in range(start, start + count) if r.contains(keyspace_id(str(i)))]


def _load(url: str, shard: str) -> None:
    _sql(url, "CREATE TABLE accounts (id bigint PRIMARY KEY, owner text NOT NULL, balance numeric(12,2))")
    _sql(url, "CREATE TABLE events (id bigint PRIMARY KEY, account_id bigint NOT NULL, kind text)")
    accounts = _ids_in(shard, 1, 6000)
    with psycopg.connect(url) as c:
        with c.cursor().copy("COPY accounts FROM STDIN") as cp:
            for i in accounts:
                cp.write_row((i, f"owner {i}", i % 997))
        with c.cursor().copy("COPY events FROM STDIN") as cp:
            for i in accounts[:2000]:  # events live with their account: event ids are unique per shard
                cp.write_row((i * 10 + 1, i, "open"))


class _ShardWriter(threading.Thread):
    """Updates, inserts and deletes that stay inside one source shard, committed continuously."""

    def __init__(self, url: str, shard: str, seed: int):
        super().__init__(daemon=True)
        self.url, self.rng = url, random.Random(seed)
        self.existing = _ids_in(shard, 1, 6000)
        self.fresh = iter(_ids_in(shard, 100_000, 50_000))
        self.stop_event, self.commits, self.error = threading.Event(), 0, None

    def run(self):
        try:
            with psycopg.connect(self.url) as c:
                while not self.stop_event.is_set():
                    k = self.rng.choice(self.existing)
                    op = self.rng.random()
                    if op < 0.4:
                        c.execute("UPDATE accounts SET balance = balance + 1 WHERE id = %s", (k,))
                    elif op < 0.6:
                        n = next(self.fresh)
                        c.execute("INSERT INTO accounts VALUES (%s, 'new', 0)", (n,))
                        c.execute("INSERT INTO events VALUES (%s, %s, 'open')", (n * 10 + 1, n))
                        self.existing.append(n)
                    elif op < 0.7:
                        c.execute("DELETE FROM accounts WHERE id = %s", (k,))
                    elif op < 0.9:
                        c.execute("INSERT INTO events VALUES (%s, %s, 'tx') ON CONFLICT (id) DO UPDATE SET kind = 'tx2'",
                                  (k * 10 + 2, k))
                    else:
                        c.execute("DELETE FROM events WHERE account_id = %s", (k,))
                    c.commit()
                    self.commits += 1
                    self.stop_event.wait(0.005)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def _driver(target: str, log, fault: str | None = None, fault_dir=None) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("SLUICEGATE_DRIVER_PID", None)
    if fault:
        env.update(SLUICEGATE_FAULT_PAUSE=fault, SLUICEGATE_FAULT_DIR=str(fault_dir))
    return subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", "rs", "--target", target,
                             "--no-progress"], env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "sluicegate.cli.main", *args], capture_output=True, text=True,
                          timeout=300, check=False)


def _status(target: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "sluicegate.cli.main", "workflow", "status", "rs", "--target", target,
                          "--json"], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _streams(ks) -> list[tuple]:
    rows = []
    for shard, url in ks["targets"].items():
        rows += [(shard, *r) for r in _sql(url, "SELECT source_shard, state, position::text, message "
                                                 "FROM sluicegate.streams ORDER BY id")]
    return rows


def _all_caught_up(ks) -> bool:
    flushed = parse_lsn(_sql(next(iter(ks["sources"].values())), "SELECT pg_current_wal_flush_lsn()::text")[0][0])
    return all(state == "Running" and pos and parse_lsn(pos) >= flushed for _, _, state, pos, _ in _streams(ks))


def test_reshard_2_to_3_with_live_writes_and_kill_9_during_copy(keyspace, spark, tmp_path):
    ks = keyspace
    for shard, url in ks["sources"].items():
        _load(url, shard)
    created = create_reshard("rs", parse_shards("source", [f"{n}={u}" for n, u in ks["sources"].items()]),
                             parse_shards("target", [f"{n}={u}" for n, u in ks["targets"].items()]),
                             None, {"events": "account_id"}, [], {"cycle_rows": 800, "chunk_rows": 300})
    assert len(created) == 3
    # one stream per overlapping (source, target): -55 <- -80; 55-aa <- -80, 80-; aa- <- 80-
    assert sorted((t, s) for t, s, *_ in _streams(ks)) == [("-55", "-80"), ("55-aa", "-80"), ("55-aa", "80-"),
                                                          ("aa-", "80-")]
    writers = [_ShardWriter(url, shard, seed) for seed, (shard, url) in enumerate(ks["sources"].items())]
    for w in writers:
        w.start()
    any_target = ks["targets"]["55-aa"]
    log = tmp_path / "driver.log"
    try:
        proc = _driver(any_target, log, "copy.before_progress", tmp_path)
        try:
            wait_for(lambda: (tmp_path / "copy.before_progress").exists(), timeout=180, what="a copy cycle paused",
                     describe=lambda: log.read_text()[-2000:])
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        proc = _driver(any_target, log)
        try:
            wait_for(lambda: all(state == "Running" for _, _, state, _, _ in _streams(ks)), timeout=300,
                     what="every stream Running", describe=lambda: (_streams(ks), log.read_text()[-2000:]))
            assert all(w.commits > 50 and w.error is None for w in writers), [(w.commits, w.error) for w in writers]
            for w in writers:
                w.stop_event.set()
                w.join()
            wait_for(lambda: _all_caught_up(ks), timeout=120, what="caught up after the writes",
                     describe=lambda: _streams(ks))
            # a TRUNCATE on one source shard empties only that shard's share of each target table
            _sql(ks["sources"]["80-"], "TRUNCATE events")
            wait_for(lambda: _all_caught_up(ks), timeout=120, what="caught up after the truncate",
                     describe=lambda: _streams(ks))
            status = _status(ks["targets"]["aa-"])
            assert status["kind"] == "Reshard" and status["state"] == "Running"
            assert sorted(s["target_shard"] for s in status["streams"]) == ["-55", "55-aa", "55-aa", "aa-"]
        finally:
            proc.send_signal(signal.SIGTERM)  # a clean stop of every stream's engine
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait(timeout=30)
        assert rc == 0, log.read_text()[-2000:]
    finally:
        for w in writers:
            w.stop_event.set()
    # vdiff per target shard (the workflow stopped: each stream is brought to its own point)
    assert _cli("workflow", "stop", "rs", "--target", any_target).returncode == 0
    out = _cli("vdiff", "rs", "--target", any_target, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["equal"] and [s["target_shard"] for s in report["shards"]] == TARGETS
    assert set(report["shards"][1]["tables"]) == {"public.accounts <- -80", "public.accounts <- 80-",
                                                  "public.events <- -80", "public.events <- 80-"}
    one = _sql(ks["targets"]["aa-"], "SELECT id FROM accounts ORDER BY id LIMIT 1")[0][0]
    _sql(ks["targets"]["aa-"], "UPDATE accounts SET balance = -1 WHERE id = %s", (one,))
    out = _cli("vdiff", "rs", "--target", any_target, "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    shards = {s["target_shard"]: s for s in json.loads(out.stdout)["shards"]}
    assert shards["-55"]["equal"] and shards["55-aa"]["equal"] and not shards["aa-"]["equal"]
    assert shards["aa-"]["tables"]["public.accounts <- 80-"]["mismatched"] == 1
    _sql(ks["targets"]["aa-"], "UPDATE accounts SET balance = %s WHERE id = %s",
         (_sql(ks["sources"]["80-"], "SELECT balance FROM accounts WHERE id = %s", (one,))[0][0], one))
    for table, (column, query) in TABLES.items():
        source_rows = [r for url in ks["sources"].values() for r in _sql(url, query)]
        assert len({r[0] for r in source_rows}) == len(source_rows)
        position = {"accounts": 0, "events": 1}[table]
        total = 0
        for shard, url in ks["targets"].items():
            r = KeyRange.parse(shard)
            expected = sorted(row for row in source_rows if r.contains(keyspace_id(str(row[position]))))
            assert _sql(url, query) == expected, (table, shard)
            # 80- truncated its events: aa- has none left, 55-aa keeps those that came from -80
            assert expected or (table, shard) == ("events", "aa-"), (table, shard)
            total += len(expected)
        assert total == len(source_rows)  # every row in exactly one target shard


def test_bad_shards_are_refused(keyspace, spark):
    ks = keyspace
    for shard, url in ks["sources"].items():
        _load(url, shard)
    with pytest.raises(UsageError, match="gap"):
        parse_shards("target", [f"-40={ks['targets']['-55']}", f"80-={ks['targets']['aa-']}"])
    with pytest.raises(UsageError, match="Vitess notation"):
        parse_shards("target", [f"zz={ks['targets']['-55']}"])
    sources = parse_shards("source", [f"{n}={u}" for n, u in ks["sources"].items()])
    targets = parse_shards("target", [f"{n}={u}" for n, u in ks["targets"].items()])
    with pytest.raises(UsageError, match="no column 'acct'"):
        create_reshard("bad", sources, targets, None, {"events": "acct"}, [], {})
    with pytest.raises(UsageError, match="may be NULL"):
        create_reshard("bad", sources, targets, None, {"events": "kind"}, [], {})
    _sql(ks["sources"]["80-"], "ALTER TABLE events ADD COLUMN extra int")
    with pytest.raises(UsageError, match="differs"):
        create_reshard("bad", sources, targets, None, {"events": "account_id"}, [], {})
    for url in ks["targets"].values():  # nothing was created anywhere
        assert _sql(url, "SELECT to_regclass('sluicegate.workflows')")[0][0] is None

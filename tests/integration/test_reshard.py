"""Reshard 2 -> 3 with live writes on both source shards and kill -9 of the driver during the copy: every
target shard ends up holding exactly the rows of its key range, none lost or duplicated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from sluicegate.errors import UsageError
from sluicegate.workflow.reshard import create_reshard, parse_shards

from ..conftest import wait_for
from .helpers import RESHARD_TARGETS as TARGETS
from .helpers import ShardWriter as _ShardWriter
from .helpers import assert_resharded, reshard_keyspace
from .helpers import load_shard as _load
from .helpers import reshard_caught_up as _all_caught_up
from .helpers import reshard_streams as _streams
from .helpers import run_sql as _sql

pytestmark = pytest.mark.spark


@pytest.fixture
def keyspace(source_server, target_server):
    with reshard_keyspace(source_server, target_server) as ks:
        yield ks


def _driver(target: str, log, fault: str | None = None, fault_dir=None) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("SLUICEGATE_DRIVER_PID", None)
    if fault:
        env.update(SLUICEGATE_FAULT_PAUSE=fault, SLUICEGATE_FAULT_DIR=str(fault_dir))
    return subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", "rs", "--target", target,
                             "--no-progress"], env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "sluicegate.cli.main", *args], capture_output=True,
                          text=True, timeout=300, check=False)


def _status(target: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "sluicegate.cli.main", "workflow", "status", "rs",
                          "--target", target, "--json"], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_reshard_2_to_3_with_live_writes_and_kill_9_during_copy(keyspace, spark, tmp_path):
    ks = keyspace
    for shard, url in ks["sources"].items():
        _load(url, shard)
    created = create_reshard("rs", parse_shards("source", [f"{n}={u}" for n, u in ks["sources"].items()]),
                             parse_shards("target", [f"{n}={u}" for n, u in ks["targets"].items()]),
                             None, {"events": "account_id"}, [], {"cycle_rows": 4000, "chunk_rows": 1500})
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
    counts = assert_resharded(ks)
    # 80- truncated its events: aa- has none left, 55-aa keeps those that came from -80
    assert [k for k, n in counts.items() if not n] == [("events", "aa-")], counts


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


def test_workflow_set_reaches_every_target_shard(keyspace):
    ks = keyspace
    for shard, url in ks["sources"].items():
        _load(url, shard)
    create_reshard("rs", parse_shards("source", [f"{n}={u}" for n, u in ks["sources"].items()]),
                   parse_shards("target", [f"{n}={u}" for n, u in ks["targets"].items()]),
                   None, {"events": "account_id"}, [], {"cycle_rows": 4000})
    out = _cli("workflow", "set", "rs", "cycle_rows=123", "batch_changes=456", "--on-ddl", "ignore",
               "--target", ks["targets"]["55-aa"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "workflow rs: on-ddl ignore, cycle_rows 123, batch_changes 456"
    for url in ks["targets"].values():  # each target shard's engine reads its own row
        options = _sql(url, "SELECT options FROM sluicegate.workflows WHERE name = 'rs'")[0][0]
        assert (options["cycle_rows"], options["batch_changes"], options["on_ddl"]) == (123, 456, "ignore"), \
            (url, options)

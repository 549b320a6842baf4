"""Workflows on a real Spark cluster, executors in processes of their own: `local-cluster[2,1,1024]` in the
default run, a standalone master and worker started from the installed PySpark in the full run. MoveTables
copies and replicates under writes, a Materialize projects and filters, a Reshard goes from 2 to 3 shards,
and `sluicegate vdiff` finds each target equal to its source."""

from __future__ import annotations

import json
import os

import pytest

from sluicegate.workflow.create import create_materialize, create_movetables
from sluicegate.workflow.reshard import create_reshard, parse_shards

from ..conftest import wait_for
from .helpers import (
    EU_EXPECTED,
    EU_RULE,
    EU_TARGET,
    RESHARD_TARGETS,
    ShardWriter,
    Writer,
    assert_resharded,
    assert_same,
    caught_up,
    load_priced_items,
    load_shard,
    move_priced_items,
    reshard_caught_up,
    reshard_keyspace,
    reshard_streams,
    run_sql,
    stream_row,
)
from .spark_cluster import (
    LocalCluster,
    StandaloneCluster,
    describe,
    executor_chain,
    replication_chain,
    rule_reader_chain,
    slot_reader,
    sluicegate,
    start_driver,
    stop_driver,
)

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module", params=["local-cluster", pytest.param("standalone", marks=pytest.mark.slow)])
def cluster(request, tmp_path_factory):
    """One cluster for the module's tests (a local cluster is the driver's own: each driver starts one)."""
    if request.param == "local-cluster":
        with LocalCluster(workers=2, cores=1, memory_mb=1024) as c:
            yield c
    else:
        with StandaloneCluster(tmp_path_factory.mktemp("spark-standalone"), cores=2, memory="1g") as c:
            yield c


def _diagnose(cluster, log):
    return lambda: f"{log.read_text(errors='replace')[-3000:]}\n{cluster.executor_logs()}"


def _assert_replicates_in_an_executor(cluster, pair, workflow: str, driver) -> None:
    """The play task, which holds the stream's replication connection while the stream runs, is a Python
    worker of an executor JVM: a process other than the driver's Python and JVM."""
    chain = replication_chain(pair, workflow)
    executor = cluster.assert_in_executor(chain, driver.pid)
    assert chain[0] != driver.pid and executor != driver.pid, describe(chain)


def _vdiff_equal(cluster, workflow: str, target: str) -> dict:
    out = sluicegate("vdiff", workflow, "--target", target, "--json", *cluster.spark_args)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["equal"], report
    return report


def test_movetables_copies_and_replicates_under_writes(cluster, pair, tmp_path):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("INSERT INTO items SELECT g, g % 100, md5(g::text) FROM generate_series(1, 8000) g")
    create_movetables("mt", pair.source, pair.target, ["items"], [], {"cycle_rows": 3000, "chunk_rows": 1000})
    writer = Writer(pair.source, 8000, pause=0.005)
    writer.start()  # the copy cycles, their catchups and fast-forwards all run under writes
    log = tmp_path / "driver.log"
    driver = start_driver("mt", pair.target, log, cluster.spark_args)
    try:
        wait_for(lambda: stream_row(pair, "mt")["state"] == "Running" or driver.poll() is not None,
                 timeout=300, what="Running", describe=_diagnose(cluster, log))
        assert driver.poll() is None, log.read_text()[-3000:]
        _assert_replicates_in_an_executor(cluster, pair, "mt", driver)
        running = writer.commits
        wait_for(lambda: writer.commits > running + 100 or writer.error, what="writes while Running")
        report = _vdiff_equal(cluster, "mt", pair.target)  # the running driver compares, under writes
        assert report["tables"]["public.items"]["rows_compared"] > 7000
        writer.stop_event.set()
        writer.join()
        assert writer.error is None
        wait_for(lambda: caught_up(pair, "mt"), what="caught up", describe=_diagnose(cluster, log))
        assert assert_same(pair, "public.items", ["id"]) > 7000
    finally:
        writer.stop_event.set()
        rc = stop_driver(driver)
    assert rc == 0, log.read_text()[-3000:]


@pytest.mark.slow  # rules under local[*] run in the default suite (test_rules.py); here with the slow ones
def test_materialize_with_a_rule_projects_and_filters(cluster, pair, tmp_path):
    load_priced_items(pair, 6000)
    create_materialize("mat", pair.source, pair.target, [EU_RULE], {"cycle_rows": 10_000, "chunk_rows": 1500})
    log = tmp_path / "driver.log"
    driver = start_driver("mat", pair.target, log, cluster.spark_args)
    try:
        wait_for(lambda: stream_row(pair, "mat")["state"] == "Running" or driver.poll() is not None,
                 timeout=300, what="Running", describe=_diagnose(cluster, log))
        assert driver.poll() is None, log.read_text()[-3000:]
        busy = lambda: pair.src("UPDATE items SET qty = qty WHERE id % 97 = 0")
        chain = rule_reader_chain(pair.source, busy)
        cluster.assert_in_executor(chain, driver.pid)  # the rule's replicate tasks: on an executor
        move_priced_items(pair, 6000)
        wait_for(lambda: caught_up(pair, "mat"), what="caught up", describe=_diagnose(cluster, log))
        expected = pair.src(EU_EXPECTED)
        assert len(expected) > 2000
        assert pair.dst(EU_TARGET) == expected
        report = _vdiff_equal(cluster, "mat", pair.target)
        assert report["tables"]["public.items"]["rows_compared"] == len(expected)
    finally:
        rc = stop_driver(driver)
    assert rc == 0, log.read_text()[-3000:]


@pytest.fixture
def keyspace(source_server, target_server):
    with reshard_keyspace(source_server, target_server) as ks:
        yield ks


def test_reshard_2_to_3(cluster, keyspace, tmp_path, request):
    if request.node.callspec.params["cluster"] == "local-cluster" and os.environ.get("SLUICEGATE_ALL_TESTS") != "1":
        pytest.skip("slow: set SLUICEGATE_ALL_TESTS=1 to run (CI runs it on no cluster: test_reshard.py)")
    ks = keyspace
    for shard, url in ks["sources"].items():
        load_shard(url, shard, ids=2000)
    create_reshard("rs", parse_shards("source", [f"{n}={u}" for n, u in ks["sources"].items()]),
                   parse_shards("target", [f"{n}={u}" for n, u in ks["targets"].items()]),
                   None, {"events": "account_id"}, [], {"cycle_rows": 10_000, "chunk_rows": 1000})
    writers = [ShardWriter(url, shard, seed, ids=2000)
               for seed, (shard, url) in enumerate(ks["sources"].items())]
    for w in writers:
        w.start()
    any_target = ks["targets"]["55-aa"]
    log = tmp_path / "driver.log"
    driver = start_driver("rs", any_target, log, cluster.spark_args)
    try:
        wait_for(lambda: all(s[2] == "Running" for s in reshard_streams(ks)) or driver.poll() is not None,
                 timeout=300, what="every stream Running", describe=_diagnose(cluster, log))
        assert driver.poll() is None, log.read_text()[-3000:]
        # -55's one stream, from -80
        slot = run_sql(ks["targets"]["-55"], "SELECT slot_name FROM sluicegate.streams")[0][0]
        chain = executor_chain(ks["sources"]["-80"], slot_reader(ks["sources"]["-80"], slot))
        cluster.assert_in_executor(chain, driver.pid)
        wait_for(lambda: all(w.commits > 50 or w.error for w in writers), what="writes while Running")
        for w in writers:
            w.stop_event.set()
            w.join()
            assert w.error is None
        wait_for(lambda: reshard_caught_up(ks), what="caught up", describe=lambda: reshard_streams(ks))
    finally:
        for w in writers:
            w.stop_event.set()
        rc = stop_driver(driver)
    assert rc == 0, log.read_text()[-3000:]
    assert sluicegate("workflow", "stop", "rs", "--target", any_target).returncode == 0
    report = _vdiff_equal(cluster, "rs", any_target)  # no driver runs: vdiff's own application
    assert [s["target_shard"] for s in report["shards"]] == RESHARD_TARGETS
    assert all(assert_resharded(ks).values())

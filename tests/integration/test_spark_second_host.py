"""A Spark worker on a second host: a network namespace of the test's own, linked to this one by a veth pair
on a /30. The master, the driver and both PostgreSQL servers are on the host side's address, which is all
the namespace can reach; the workflow's URLs name that address. MoveTables copies and replicates under
writes, a Materialize copies through its rule, and both targets equal their sources."""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass

import pytest

from sluicegate.localpg import LocalPostgres
from sluicegate.workflow.create import create_materialize, create_movetables
from sluicegate.workflow.rule_player import READER

from ..conftest import Pair, wait_for
from .helpers import (
    EU_EXPECTED,
    EU_RULE,
    EU_TARGET,
    Writer,
    assert_same,
    caught_up,
    load_priced_items,
    move_priced_items,
    stream_row,
)
from .spark_cluster import (
    NamespaceUnavailable,
    NetworkNamespace,
    StandaloneCluster,
    describe,
    replication_chain,
    sluicegate,
    start_driver,
    stop_driver,
    walsender,
)

pytestmark = [pytest.mark.spark, pytest.mark.slow]  # a few minutes: the full run

_ids = itertools.count()


@dataclass
class Site:
    ns: NetworkNamespace
    source: LocalPostgres
    target: LocalPostgres
    cluster: StandaloneCluster


@pytest.fixture(scope="module")
def site(tmp_path_factory, pgpass):
    work = tmp_path_factory.mktemp("second-host")
    with contextlib.ExitStack() as stack:
        try:
            ns = stack.enter_context(NetworkNamespace())
        except NamespaceUnavailable as exc:
            pytest.skip(f"no network namespace for a second host (needs root or CAP_NET_ADMIN): {exc}")
        with pgpass.open("a") as f:  # the servers' password at the host side's address too (no password is stored)
            f.write(f"{ns.host_ip}:*:*:postgres:sluicegate\n")
        servers = []
        for side in ("source", "target"):
            # Each connection is logged with its client's address: which of them came from the namespace.
            server = LocalPostgres(work / side, interfaces=(f"{ns.host_ip}/30",),
                                   settings={"log_connections": "on", "log_line_prefix": "%h "})
            stack.callback(server.stop)
            servers.append(server.init().start())
        cluster = stack.enter_context(StandaloneCluster(work / "spark", host=ns.host_ip, netns=ns))
        cluster.spark_args += ["--conf", f"spark.driver.host={ns.host_ip}",
                               "--conf", f"spark.driver.bindAddress={ns.host_ip}"]
        yield Site(ns, *servers, cluster)


@pytest.fixture
def pair(site):
    """Fresh databases on the site's servers, their URLs on the host side's address."""
    p = Pair(site.source, site.target, f"h{os.getpid()}_{next(_ids)}")
    p.source = site.source.url(p.name, host=site.ns.host_ip)
    p.target = site.target.url(p.name, host=site.ns.host_ip)
    yield p
    p.cleanup()


def _connections_from(server: LocalPostgres, host: str, database: str, application: str = "") -> int:
    """Sessions of `database` the server let in from `host` (its log; log_line_prefix is the client), of
    `application` if given."""
    return sum(1 for line in server.logfile.read_text(errors="replace").splitlines()
               if line.startswith(f"{host} ") and "connection authorized" in line
               and f"database={database} " in f"{line} "
               and (not application or f"application_name={application}" in line))


def _diagnose(site, log):
    return lambda: f"{log.read_text(errors='replace')[-3000:]}\n{site.cluster.executor_logs()}"


def test_movetables_with_the_executor_on_a_second_host(site, pair, tmp_path):
    ns = site.ns
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("INSERT INTO items SELECT g, g % 100, md5(g::text) FROM generate_series(1, 8000) g")
    create_movetables("far", pair.source, pair.target, ["items"], [],
                      {"cycle_rows": 3000, "chunk_rows": 1000})
    writer = Writer(pair.source, 8000, pause=0.005)
    writer.start()
    log = tmp_path / "driver.log"
    driver = start_driver("far", pair.target, log, site.cluster.spark_args)
    try:
        wait_for(lambda: stream_row(pair, "far")["state"] == "Running" or driver.poll() is not None,
                 timeout=300, what="Running", describe=_diagnose(site, log))
        assert driver.poll() is None, log.read_text()[-3000:]
        # The copy's tasks read the source and wrote the target from the namespace ...
        assert _connections_from(site.source, ns.ns_ip, pair.name) >= 2
        assert _connections_from(site.target, ns.ns_ip, pair.name) >= 2
        # ... and the stream's replication connection comes from there, held by an executor's Python worker.
        chain = replication_chain(pair, "far")
        site.cluster.assert_in_executor(chain, driver.pid)
        client = pair.src("SELECT host(client_addr) FROM pg_stat_replication WHERE pid = %s",
                          (walsender(pair, "far"),))
        assert client == [(ns.ns_ip,)], (client, describe(chain))
        running = writer.commits
        wait_for(lambda: writer.commits > running + 100 or writer.error, what="writes while Running")
        out = sluicegate("vdiff", "far", "--target", pair.target, "--json", *site.cluster.spark_args)
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
        writer.stop_event.set()
        writer.join()
        assert writer.error is None
        wait_for(lambda: caught_up(pair, "far"), what="caught up", describe=_diagnose(site, log))
        assert assert_same(pair, "public.items", ["id"]) > 7000
    finally:
        writer.stop_event.set()
        rc = stop_driver(driver)
    assert rc == 0, log.read_text()[-3000:]


def test_materialize_with_the_executor_on_a_second_host(site, pair, tmp_path):
    ns = site.ns
    load_priced_items(pair, 6000)
    create_materialize("farmat", pair.source, pair.target, [EU_RULE], {"cycle_rows": 2500, "chunk_rows": 900})
    log = tmp_path / "driver.log"
    driver = start_driver("farmat", pair.target, log, site.cluster.spark_args)
    try:
        wait_for(lambda: stream_row(pair, "farmat")["state"] == "Running" or driver.poll() is not None,
                 timeout=300, what="Running", describe=_diagnose(site, log))
        assert driver.poll() is None, log.read_text()[-3000:]
        # the copy's rule ran in Spark tasks there, which wrote the target from the namespace
        assert _connections_from(site.target, ns.ns_ip, pair.name) >= 2
        # the rule's replicate tasks (each batch's peek at the slot) ran there too
        pair.src("UPDATE items SET qty = qty WHERE id % 97 = 0")
        wait_for(lambda: _connections_from(site.source, ns.ns_ip, pair.name, READER) > 0,
                 what="a rule player's reader from the namespace", describe=_diagnose(site, log))
        move_priced_items(pair, 6000)
        wait_for(lambda: caught_up(pair, "farmat"), what="caught up", describe=_diagnose(site, log))
        expected = pair.src(EU_EXPECTED)
        assert len(expected) > 2000
        assert pair.dst(EU_TARGET) == expected
        out = sluicegate("vdiff", "farmat", "--target", pair.target, "--json", *site.cluster.spark_args)
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    finally:
        rc = stop_driver(driver)
    assert rc == 0, log.read_text()[-3000:]

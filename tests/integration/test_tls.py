"""TLS to PostgreSQL: servers that accept TCP clients only over TLS (hostssl, no host lines), reached with
`sslmode=verify-full` and a test CA. MoveTables copies and replicates (control, replication and Spark tasks'
connections), vdiff compares, the target's state holds the CA file's path and no certificate; a wrong CA or
host name is refused with the way out. In the slow set, the same with the Spark worker on a second host."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest

from sluicegate.errors import ConnectError, RetryableError
from sluicegate.localpg import LocalPostgres
from sluicegate.postgres.connect import connect, strip_password
from sluicegate.postgres.replication import ChangeStream
from sluicegate.workflow.create import create_movetables

from ..conftest import EngineThread, Pair, wait_for
from .helpers import assert_same, caught_up, stream_row
from .spark_cluster import (
    NamespaceUnavailable,
    NetworkNamespace,
    StandaloneCluster,
    replication_chain,
    sluicegate,
    start_driver,
    stop_driver,
    walsender,
)
from .tlscerts import TestCA

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def tls(pg_workdir):
    """(CA, another CA, source server, target server): both servers TLS-only, certificates for 127.0.0.1."""
    ca = TestCA(pg_workdir / "tls-ca")
    other = TestCA(pg_workdir / "tls-other", "other")
    servers = []
    try:
        for name in ("tls-source", "tls-target"):
            issued = ca.issue(name, ips=("127.0.0.1",))
            servers.append(LocalPostgres(pg_workdir / name, tls=(issued.cert, issued.key)).init().start())
        yield ca, other, *servers
    finally:
        for s in servers:
            s.stop()


def verify_full(url: str, ca: TestCA) -> str:
    return f"{url}?sslmode=verify-full&sslrootcert={ca.path}"


@pytest.fixture
def tls_pair(tls):
    ca, _, source, target = tls
    p = Pair(source, target, f"tls{os.getpid()}")
    p.source, p.target = (verify_full(s.url(p.name), ca) for s in (source, target))
    yield p
    p.cleanup()


def sg(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "SLUICEGATE_SPARK_MASTER": "local[2]", **(env or {})}
    return subprocess.run([sys.executable, "-m", "sluicegate.cli.main", *args], capture_output=True, text=True,
                          timeout=240, env=env, stdin=subprocess.DEVNULL, check=False)


def test_movetables_and_vdiff_over_verify_full(tls, tls_pair, spark):
    ca, pair = tls[0], tls_pair
    assert "hostssl" in (pair.source_server.datadir / "pg_hba.conf").read_text()
    assert " host " not in f" {(pair.target_server.datadir / 'pg_hba.conf').read_text()}"
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, name text, qty int)")
    pair.src("INSERT INTO items SELECT g, 'item ' || g, g % 7 FROM generate_series(1, 3000) g")
    create_movetables("wf", pair.source, pair.target, ["items"], [], {"cycle_rows": 1000, "chunk_rows": 400})
    with EngineThread(spark, pair.target, "wf"):
        wait_for(lambda: stream_row(pair, "wf")["state"] == "Running", what="Running",
                 describe=lambda: stream_row(pair, "wf"))
        pair.src("INSERT INTO items VALUES (5001, 'new', 1)")
        pair.src("UPDATE items SET qty = qty + 100 WHERE id % 10 = 0")
        pair.src("DELETE FROM items WHERE id BETWEEN 100 AND 199")
        wait_for(lambda: caught_up(pair, "wf"), what="caught up")
        assert assert_same(pair, "public.items", ["id"]) == 2901
        # Every session of Sluicegate's on the source, the walsender included, is a verified TLS one.
        sessions = pair.src("SELECT a.backend_type, s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) "
                            "WHERE a.datname = current_database() AND a.application_name LIKE 'sluicegate%'")
        assert sessions and all(ssl for _, ssl in sessions)
        assert "walsender" in {kind for kind, _ in sessions}

    out = sg("vdiff", "wf", "--json", "--target", pair.target)
    assert out.returncode == 0, (out.stdout, out.stderr)
    t = json.loads(out.stdout)["tables"]["public.items"]
    assert (t["missing"], t["extra"], t["mismatched"], t["rows_compared"]) == (0, 0, 0, 2901)

    # The target's state names the CA file; no certificate or key content anywhere in it.
    state = " ".join(r[0] for r in pair.dst(
        "SELECT format('%s', to_jsonb(t)) FROM sluicegate.workflows t UNION ALL "
        "SELECT format('%s', to_jsonb(t)) FROM sluicegate.streams t"))
    assert str(ca.path) in state and "verify-full" in state
    assert "BEGIN" not in state and "PRIVATE KEY" not in state and ca.path.read_text().splitlines()[1] not in state
    assert strip_password(pair.source) in state  # stored as given, the TLS parameters too, without the password


def test_wrong_ca_or_host_refused_with_the_way_out(tls, tls_pair, monkeypatch):
    ca, other, source, _ = tls
    name = tls_pair.name
    wrong_ca = verify_full(source.url(name), other)
    with pytest.raises(ConnectError, match="certificate verify failed.*CA file that signed"):
        connect(wrong_ca, role="source")
    with pytest.raises(ConnectError, match="does not match host name.*certificate lists"):
        connect(verify_full(source.url(name, host="localhost"), ca), role="source")
    with pytest.raises(ConnectError, match="pg_hba.conf; if it admits TLS connections only.*sslmode=verify-full"):
        connect(source.url(name) + "?sslmode=disable", role="source")
    with pytest.raises(ConnectError, match="root certificate file.*same path on every host"):
        connect(source.url(name) + "?sslmode=verify-full&sslrootcert=/nonexistent/ca.crt", role="source")
    with pytest.raises(RetryableError, match="certificate verify failed.*CA file that signed"):  # psycopg2
        ChangeStream(wrong_ca, "no_slot", "no_pub", 0)
    with pytest.raises(RetryableError, match="if it admits TLS connections only.*sslmode=verify-full"):
        ChangeStream(source.url(name) + "?sslmode=disable", "no_slot", "no_pub", 0)

    # libpq's environment works as well as the URL's parameters
    monkeypatch.setenv("PGSSLMODE", "verify-full")
    monkeypatch.setenv("PGSSLROOTCERT", str(other.path))
    with pytest.raises(ConnectError, match="certificate verify failed"):
        connect(source.url(name), role="source")
    monkeypatch.setenv("PGSSLROOTCERT", str(ca.path))
    connect(source.url(name), role="source").close()
    monkeypatch.undo()

    # the CLI: a one-line error with the way out, no traceback, nothing created
    out = sg("movetables", "create", "--workflow", "wf", "--source", wrong_ca, "--target", tls_pair.target)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert "certificate verify failed" in out.stderr and "sslrootcert" in out.stderr, out.stderr
    if tls_pair.dst("SELECT to_regclass('sluicegate.workflows') IS NOT NULL")[0][0]:
        assert not tls_pair.dst("SELECT 1 FROM sluicegate.workflows")


@pytest.mark.slow  # a standalone Spark cluster with its worker in a network namespace: a minute or two
def test_executors_on_a_second_host_over_verify_full(pg_workdir, pgpass, tmp_path):
    """The worker is a second host (its own network namespace, the same files: the CA at the same path, as the
    README says); its copy and replication connections are verified TLS ones from the namespace's address."""
    with contextlib.ExitStack() as stack:
        try:
            ns = stack.enter_context(NetworkNamespace())
        except NamespaceUnavailable as exc:
            pytest.skip(f"no network namespace for a second host (needs root or CAP_NET_ADMIN): {exc}")
        with pgpass.open("a") as f:
            f.write(f"{ns.host_ip}:*:*:postgres:sluicegate\n")
        ca = TestCA(tmp_path / "ca")
        servers = []
        for side in ("source", "target"):
            cert = ca.issue(f"far-{side}", ips=(ns.host_ip, "127.0.0.1"))
            server = LocalPostgres(tmp_path / side, interfaces=(f"{ns.host_ip}/30",), tls=(cert.cert, cert.key),
                                   settings={"log_connections": "on", "log_line_prefix": "%h "})
            stack.callback(server.stop)
            servers.append(server.init().start())
        cluster = stack.enter_context(StandaloneCluster(tmp_path / "spark", host=ns.host_ip, netns=ns))
        cluster.spark_args += ["--conf", f"spark.driver.host={ns.host_ip}",
                               "--conf", f"spark.driver.bindAddress={ns.host_ip}"]
        pair = Pair(*servers, "far")
        stack.callback(pair.cleanup)
        pair.source, pair.target = (verify_full(s.url("far", host=ns.host_ip), ca) for s in servers)
        pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
        pair.src("INSERT INTO items SELECT g, g % 100, md5(g::text) FROM generate_series(1, 4000) g")
        create_movetables("far", pair.source, pair.target, ["items"], [], {"cycle_rows": 2000, "chunk_rows": 700})
        log = tmp_path / "driver.log"
        driver = start_driver("far", pair.target, log, cluster.spark_args)
        try:
            wait_for(lambda: stream_row(pair, "far")["state"] == "Running" or driver.poll() is not None,
                     timeout=300, what="Running", describe=lambda: log.read_text()[-3000:] + cluster.executor_logs())
            assert driver.poll() is None, log.read_text()[-3000:]
            pair.src("UPDATE items SET qty = -1 WHERE id % 50 = 0")
            wait_for(lambda: caught_up(pair, "far"), what="caught up")
            assert assert_same(pair, "public.items", ["id"]) == 4000
            # The stream's walsender serves an executor's Python worker, from the namespace, over TLS.
            cluster.assert_in_executor(replication_chain(pair, "far"), driver.pid)
            assert pair.src("SELECT host(r.client_addr), s.ssl FROM pg_stat_replication r JOIN pg_stat_ssl s "
                            "USING (pid) WHERE pid = %s", (walsender(pair, "far"),)) == [(ns.ns_ip, True)]
            # The copy's tasks connected from the namespace too (every TCP connection is TLS: hostssl only).
            for server in servers:
                assert any(line.startswith(f"{ns.ns_ip} ") and "connection authorized" in line and "SSL" in line
                           for line in server.logfile.read_text(errors="replace").splitlines())
            out = sluicegate("vdiff", "far", "--target", pair.target, "--json", *cluster.spark_args)
            assert out.returncode == 0, out.stdout + out.stderr[-3000:]
        finally:
            assert stop_driver(driver) == 0, log.read_text()[-3000:]

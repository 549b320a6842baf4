"""LocalPostgres against a real server (no mocks): auth, settings, and crash/restart lifecycle."""
from __future__ import annotations

import psycopg
import pytest

from sluicegate.localpg import LocalPostgres, LocalPostgresError, find_bindir
from sluicegate.procs import pid_alive

try:
    find_bindir()
except LocalPostgresError as e:  # pragma: no cover - machines without any PostgreSQL binaries
    pytest.skip(str(e), allow_module_level=True)


@pytest.fixture
def pg(tmp_path):
    server = LocalPostgres(tmp_path / "data")
    try:
        yield server.start()
    finally:
        server.stop(mode="immediate")  # leave no server behind, whatever the test did


def test_password_login_and_logical_wal(pg):
    with psycopg.connect(pg.url()) as conn:
        assert conn.execute("SHOW wal_level").fetchone()[0] == "logical"
        assert conn.execute("SELECT current_user").fetchone()[0] == "postgres"
    assert pg.psql("SHOW max_replication_slots") == "20"


def test_wrong_password_is_refused(pg):
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(pg.url(password="not-the-password"), connect_timeout=5)


def test_listens_on_loopback_only(pg):
    assert pg.psql("SHOW listen_addresses") == "127.0.0.1"
    assert pg.url().startswith(f"postgresql://postgres:sluicegate@127.0.0.1:{pg.port}/")


def test_databases_and_psql(pg):
    pg.create_database("Odd Name")
    assert pg.psql("SELECT 1, NULL; SELECT 'x'", dbname="Odd Name") == "1\t\nx"
    pg.drop_database("Odd Name")
    assert pg.psql("SELECT count(*) FROM pg_database WHERE datname = 'Odd Name'") == "0"


def test_restart_keeps_data(pg):
    pg.psql("CREATE TABLE t (v int); INSERT INTO t VALUES (1), (2)")
    old = pg.pid
    pg.restart()
    assert pg.pid != old and not pid_alive(old)
    assert pg.psql("SELECT sum(v) FROM t") == "3"


def test_kill_then_start_recovers_committed_data(pg):
    pg.psql("CREATE TABLE t (v int); INSERT INTO t VALUES (42)")
    old = pg.pid
    pg.kill()
    assert not pg.running and not pid_alive(old)
    pg.start()
    assert pg.psql("SELECT v FROM t") == "42"
    assert "not properly shut down" in pg.logfile.read_text()  # it really did crash recovery


def test_stop_leaves_no_process_and_is_idempotent(pg):
    old = pg.pid
    pg.stop()
    assert pg.pid is None and not pg.running and not pid_alive(old)  # a lingering zombie counts as gone
    pg.stop()  # no-op when not running


def test_without_template_cache_and_start_failure_shows_log(tmp_path, monkeypatch):
    monkeypatch.setattr(LocalPostgres, "template_cache", False)
    with LocalPostgres(tmp_path / "fresh", password="other pw/@") as server:
        assert server.psql("SELECT 1") == "1"
    assert not server.running
    bad = LocalPostgres(tmp_path / "bad", settings={"shared_buffers": "lots"})
    with pytest.raises(LocalPostgresError, match="shared_buffers") as err:
        bad.start(timeout=20)
    assert "server log tail" in str(err.value)
    assert not bad.running


def test_long_datadir_uses_short_socket_dir_and_servers_coexist(tmp_path):
    a = LocalPostgres(tmp_path / ("x" * 90) / "data")
    b = LocalPostgres(tmp_path / "b")
    with a, b:
        assert a.port != b.port
        assert len(a.psql("SHOW unix_socket_directories")) < 40
        a.psql("CREATE TABLE only_in_a ()")
        assert b.psql("SELECT count(*) FROM pg_class WHERE relname = 'only_in_a'") == "0"
        a.stop(mode="smart")
        b.stop(mode="immediate")
        assert not a.running and not b.running
    a.kill()  # no-op when not running
    assert not a._sockdir.exists()  # the short socket dir goes with the server


def test_extra_interface_is_listened_on_and_its_network_admitted(tmp_path):
    # 127.0.0.2 stands for a test's own network namespace link: another address of this machine
    with LocalPostgres(tmp_path / "data", interfaces=("127.0.0.2/31",)) as server:
        assert server.psql("SHOW listen_addresses") == "127.0.0.1,127.0.0.2"
        url = server.url(host="127.0.0.2")
        assert url.startswith(f"postgresql://postgres:sluicegate@127.0.0.2:{server.port}/")
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT host(inet_server_addr())").fetchone()[0] == "127.0.0.2"
    hba = (server.datadir / "pg_hba.conf").read_text().splitlines()
    assert {"host all all 127.0.0.2/31 scram-sha-256", "host replication all 127.0.0.2/31 scram-sha-256"} <= set(hba)

"""Tests for the demo shop data: schema, deterministic bulk load and the live writer."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import psycopg
import pytest
from psycopg import sql

from sluicegate.demo import shop

PG_BIN = "/usr/lib/postgresql/15/bin"


def _as_postgres(*cmd: str) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else list(cmd)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # an unreaped zombie counts as gone
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture(scope="module")
def server():
    """A throwaway PostgreSQL 15 on 127.0.0.1 with wal_level=logical; yields a url factory."""
    if not os.path.exists(f"{PG_BIN}/initdb"):
        pytest.skip("PostgreSQL 15 binaries not installed")
    base = tempfile.mkdtemp(prefix="sluicegate-shop-", dir="/tmp")
    data = os.path.join(base, "data")
    if os.geteuid() == 0:
        shutil.chown(base, "postgres", "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    initdb = [f"{PG_BIN}/initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8"]
    subprocess.run(_as_postgres(*initdb), check=True, capture_output=True)
    log = open(os.path.join(base, "log"), "wb")
    # postgres runs as our (runuser's) child rather than daemonized by pg_ctl, so it is always reaped
    settings = [f"port={port}", "listen_addresses=127.0.0.1", "wal_level=logical", "fsync=off",
                f"unix_socket_directories={base}"]
    args = [a for kv in settings for a in ("-c", kv)]
    proc = subprocess.Popen(_as_postgres(f"{PG_BIN}/postgres", "-D", data, *args), stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, "postgres exited: " + open(os.path.join(base, "log")).read()
            try:
                psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                assert time.monotonic() < deadline, "postgres did not start"
                time.sleep(0.1)
        yield lambda db: f"postgresql://postgres@127.0.0.1:{port}/{db}"
    finally:
        try:
            with open(os.path.join(data, "postmaster.pid")) as fh:
                pid = int(fh.readline())
        except (OSError, ValueError):
            pid = None
        if pid is not None and not _gone(pid):
            os.kill(pid, signal.SIGINT)  # fast shutdown
            deadline = time.monotonic() + 30
            while not _gone(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _gone(pid), "postgres did not stop"
        proc.wait(10)
        log.close()
        shutil.rmtree(base, ignore_errors=True)


def _new_db(server, name: str) -> str:
    with psycopg.connect(server("postgres"), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return server(name)


def _digests(conn) -> dict[str, str]:
    out = {}
    for table in shop.TABLES:
        q = sql.SQL("SELECT md5(string_agg(t::text, '|' ORDER BY t::text)) FROM {} t")
        q = q.format(sql.Identifier(table))
        out[table] = conn.execute(q).fetchone()[0]
    return out


@pytest.fixture(scope="module")
def loaded(server):
    urls, counts = [], []
    for name in ("shop_a", "shop_b"):
        url = _new_db(server, name)
        with psycopg.connect(url) as conn:
            shop.create_schema(conn)
            counts.append(shop.load(conn, rows=20_000, seed=7))
        urls.append(url)
    return urls, counts


def test_load_counts_and_determinism(loaded):
    (url_a, url_b), (counts_a, counts_b) = loaded
    assert set(counts_a) == set(shop.TABLES)
    assert sum(counts_a.values()) >= 20_000
    assert all(n > 0 for n in counts_a.values())
    assert counts_a == counts_b
    with psycopg.connect(url_a) as a, psycopg.connect(url_b) as b:
        assert shop.table_counts(a) == counts_a
        assert _digests(a) == _digests(b)


def test_load_other_seed_differs(server, loaded):
    url = _new_db(server, "shop_c")
    with psycopg.connect(url) as c, psycopg.connect(loaded[0][0]) as a:
        shop.create_schema(c)
        shop.load(c, rows=2_000, seed=8)
        assert _digests(c)["customers"] != _digests(a)["customers"]


def test_large_toasted_descriptions(loaded):
    with psycopg.connect(loaded[0][0]) as conn:
        big, longest = conn.execute(
            "SELECT count(*) FILTER (WHERE length(description) > 8192), max(length(description))"
            " FROM products"
        ).fetchone()
        assert big > 0 and longest <= 40_000
        # stored out of line, not just compressed inline
        assert conn.execute("SELECT max(pg_column_size(description)) FROM products").fetchone()[0] > 8192
        assert conn.execute("SELECT typname FROM pg_type WHERE typname = 'order_status'").fetchone()


def test_live_writer(loaded):
    url = loaded[0][0]
    with psycopg.connect(url) as conn:
        before = shop.table_counts(conn)
        max_before = conn.execute("SELECT max(id) FROM orders").fetchone()[0]
    writer = shop.LiveWriter(url, pause=0.001)
    writer.start()
    deadline = time.monotonic() + 60
    while writer.transactions < 200 and writer.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    t0 = time.monotonic()
    writer.stop()
    writer.join(5)
    assert not writer.is_alive() and time.monotonic() - t0 < 1.5
    assert writer.error is None, repr(writer.error)
    assert writer.transactions >= 200 and writer.ops >= writer.transactions
    with psycopg.connect(url) as conn:
        assert shop.table_counts(conn) != before
        assert conn.execute("SELECT max(id) FROM orders").fetchone()[0] > max_before


def test_live_writer_max_ops_and_error(loaded):
    writer = shop.LiveWriter(loaded[0][0], max_ops=20, pause=0)
    writer.start()
    writer.join(10)
    assert not writer.is_alive() and writer.error is None and 20 <= writer.ops < 25
    bad = shop.LiveWriter("postgresql://postgres@127.0.0.1:1/nope")
    bad.start()
    bad.join(10)
    assert not bad.is_alive() and isinstance(bad.error, psycopg.OperationalError)

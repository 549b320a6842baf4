"""Tests for the demo shop data: schema, deterministic bulk load and the live writer."""

from __future__ import annotations

import time

import psycopg
import pytest
from psycopg import sql

from sluicegate.demo import shop
from sluicegate.localpg import LocalPostgres


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A throwaway PostgreSQL on 127.0.0.1 with wal_level=logical; yields a url factory."""
    pg = LocalPostgres(tmp_path_factory.mktemp("shop") / "data").init().start()
    try:
        yield pg.url
    finally:
        pg.stop()


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

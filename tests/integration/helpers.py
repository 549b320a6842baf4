"""Assertions shared by the integration tests."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading

import psycopg
from psycopg import sql

from sluicegate.position import parse_lsn
from sluicegate.postgres.catalog import FIRST_USER_OID
from sluicegate.sharding.keyrange import KeyRange, keyspace_id


def table_rows(url: str, table: str, key: list[str]) -> list[str]:
    schema, _, name = table.rpartition(".")
    ident = sql.Identifier(schema or "public", name)
    order = sql.SQL(", ").join(map(sql.Identifier, key))
    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute(sql.SQL("SELECT t::text FROM {} t ORDER BY {}").format(ident, order))]


def assert_same(pair, table: str, key: list[str]) -> int:
    """Source and target hold the same rows (by PostgreSQL's text form of each row); the row count."""
    src = table_rows(pair.source, table, key)
    dst = table_rows(pair.target, table, key)
    if src != dst:
        missing = sorted(set(src) - set(dst))[:5]
        extra = sorted(set(dst) - set(src))[:5]
        raise AssertionError(f"{table}: source {len(src)} rows, target {len(dst)}; "
                             f"missing {missing}, extra {extra}")
    return len(src)


def stream_row(pair, workflow: str) -> dict:
    rows = pair.dst(
        "SELECT state, message, position::text, slot_name FROM sluicegate.streams WHERE workflow = %s",
        (workflow,),
    )
    state, message, position, slot = rows[0]
    return {"state": state, "message": message, "position": parse_lsn(position) if position else None,
            "slot": slot}


def slot_confirmed(pair, slot: str) -> int | None:
    rows = pair.src("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (slot,))
    return parse_lsn(rows[0][0]) if rows and rows[0][0] else None


def caught_up(pair, workflow: str) -> bool:
    """Running, and the stream has applied everything the source has flushed now."""
    s = stream_row(pair, workflow)
    if s["state"] != "Running" or s["position"] is None:
        return False
    flushed = parse_lsn(pair.src("SELECT pg_current_wal_flush_lsn()::text")[0][0])
    return s["position"] >= flushed


class Writer(threading.Thread):
    """Random single-row and multi-row writes over the whole key space, committed continuously."""

    def __init__(self, url: str, max_id: int, seed: int = 3, pause: float = 0.01):
        super().__init__(daemon=True)
        self.url, self.max_id, self.rng, self.pause = url, max_id, random.Random(seed), pause
        self.stop_event = threading.Event()
        self.commits = 0
        self.error = None

    def run(self):
        try:
            with psycopg.connect(self.url) as c:
                next_id = self.max_id + 1
                while not self.stop_event.is_set():
                    for _ in range(self.rng.randint(1, 4)):
                        op = self.rng.random()
                        k = self.rng.randint(1, next_id)
                        if op < 0.5:
                            c.execute("UPDATE items SET qty = qty + 1, note = md5(random()::text) WHERE id = %s", (k,))
                        elif op < 0.65:
                            c.execute("DELETE FROM items WHERE id = %s", (k,))
                        elif op < 0.8:
                            c.execute("INSERT INTO items VALUES (%s, 0, 'new') ON CONFLICT DO NOTHING", (next_id,))
                            next_id += 1
                        elif op < 0.9:  # a gap below lastpk filled again
                            c.execute("INSERT INTO items VALUES (%s, 1, 'refill') ON CONFLICT DO NOTHING", (k,))
                        else:  # a key moves across the whole range
                            c.execute("UPDATE items SET id = %s WHERE id = %s AND NOT EXISTS "
                                      "(SELECT 1 FROM items WHERE id = %s)", (next_id, k, next_id))
                            next_id += 1
                    c.commit()
                    self.commits += 1
                    self.stop_event.wait(self.pause)  # a busy application, not a bulk load the copy can never finish
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def reap_group(proc: subprocess.Popen) -> None:
    """The driver's JVM and Python workers follow it down; make sure, then collect them."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


# A Materialize rule that projects and filters, and the same in PostgreSQL's SQL: what its target must hold.
EU_RULE = ("items_eu: SELECT id AS item_id, upper(name) AS uname, price * qty AS total FROM items "
           "WHERE region = 'eu' AND qty > 0")
EU_EXPECTED = "SELECT id, upper(name), price * qty FROM items WHERE region = 'eu' AND qty > 0 ORDER BY id"
EU_TARGET = "SELECT item_id, uname, total FROM items_eu ORDER BY item_id"


def load_priced_items(pair, rows: int) -> None:
    """items with a region (a third each of eu, us, apac), a price and a quantity (a fifth of them 0)."""
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, name text, region text, price numeric(10,2), qty int)")
    pair.src("""INSERT INTO items SELECT g, 'item ' || g, (ARRAY['eu','us','apac'])[1 + g %% 3],
                (g %% 1000) / 8.0, g %% 5 FROM generate_series(1, %s) g""", (rows,))


def move_priced_items(pair, max_id: int) -> None:
    """Changes that move rows into the rule's filter and out of it, delete, change keys and insert."""
    pair.src("UPDATE items SET region = 'eu', qty = 1 WHERE id % 7 = 0")
    pair.src("UPDATE items SET qty = 0 WHERE id % 11 = 0")
    pair.src("DELETE FROM items WHERE id % 13 = 0")
    pair.src("UPDATE items SET id = id + %s WHERE id %% 17 = 0", (max_id + 100_000,))
    pair.src("INSERT INTO items SELECT g, 'new ' || g, 'eu', 3.5, 2 FROM generate_series(%s::int, %s::int) g",
             (max_id + 1, max_id + 300))


def run_sql(url: str, text, params=None):
    with psycopg.connect(url, autocommit=True) as c:
        cur = c.execute(text, params)
        return cur.fetchall() if cur.description else None


# Reshard 2 -> 3: the shards' key ranges, and the tables with the query that lists each one's rows and the
# place of its sharding column in them.
RESHARD_SOURCES = ["-80", "80-"]
RESHARD_TARGETS = ["-55", "55-aa", "aa-"]
RESHARD_TABLES = {"accounts": ("SELECT id, owner, balance FROM accounts ORDER BY id", 0),
                  "events": ("SELECT id, account_id, kind FROM events ORDER BY id", 1)}


@contextlib.contextmanager
def reshard_keyspace(source_server, target_server):
    """Fresh databases: two source shards on the source server, three target shards on the target's;
    {"sources": {range: url}, "targets": {range: url}}."""
    from ..conftest import Pair

    pairs = [Pair(source_server, target_server, f"ks{os.getpid()}_{i}_{random.randrange(10**6)}")
             for i in range(3)]
    try:
        yield {"sources": {n: p.source for n, p in zip(RESHARD_SOURCES, pairs)},
               "targets": {n: p.target for n, p in zip(RESHARD_TARGETS, pairs)}}
    finally:
        for p in pairs:
            p.cleanup()


def ids_in_shard(shard: str, start: int, count: int) -> list[int]:
    r = KeyRange.parse(shard)
    return [i for i in range(start, start + count) if r.contains(keyspace_id(str(i)))]


def load_shard(url: str, shard: str, ids: int = 6000) -> None:
    """accounts (the ids of 1..`ids` in the shard's range) and events (one for each of its first 2000)."""
    run_sql(url, "CREATE TABLE accounts (id bigint PRIMARY KEY, owner text NOT NULL, balance numeric(12,2))")
    run_sql(url, "CREATE TABLE events (id bigint PRIMARY KEY, account_id bigint NOT NULL, kind text)")
    accounts = ids_in_shard(shard, 1, ids)
    with psycopg.connect(url) as c:
        with c.cursor().copy("COPY accounts FROM STDIN") as cp:
            for i in accounts:
                cp.write_row((i, f"owner {i}", i % 997))
        with c.cursor().copy("COPY events FROM STDIN") as cp:
            for i in accounts[:2000]:  # events live with their account: event ids are unique per shard
                cp.write_row((i * 10 + 1, i, "open"))


class ShardWriter(threading.Thread):
    """Updates, inserts and deletes that stay inside one source shard, committed continuously."""

    def __init__(self, url: str, shard: str, seed: int, ids: int = 6000):
        super().__init__(daemon=True)
        self.url, self.rng = url, random.Random(seed)
        self.existing = ids_in_shard(shard, 1, ids)
        self.fresh = iter(ids_in_shard(shard, 100_000, 50_000))
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
                        c.execute("INSERT INTO events VALUES (%s, %s, 'tx') "
                                  "ON CONFLICT (id) DO UPDATE SET kind = 'tx2'", (k * 10 + 2, k))
                    else:
                        c.execute("DELETE FROM events WHERE account_id = %s", (k,))
                    c.commit()
                    self.commits += 1
                    self.stop_event.wait(0.005)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def reshard_streams(ks) -> list[tuple]:
    """(target shard, source shard, state, position, message) of every stream."""
    rows = []
    for shard, url in ks["targets"].items():
        rows += [(shard, *r) for r in run_sql(url, "SELECT source_shard, state, position::text, message "
                                                   "FROM sluicegate.streams ORDER BY id")]
    return rows


def reshard_caught_up(ks) -> bool:
    """Every stream Running, at or past both source shards' flushed WAL (they share one server)."""
    any_source = next(iter(ks["sources"].values()))
    flushed = parse_lsn(run_sql(any_source, "SELECT pg_current_wal_flush_lsn()::text")[0][0])
    return all(state == "Running" and pos and parse_lsn(pos) >= flushed
               for _, _, state, pos, _ in reshard_streams(ks))


def assert_resharded(ks) -> dict[tuple[str, str], int]:
    """Every target shard holds exactly the source rows of its key range, each row in one target shard;
    the rows of each (table, target shard)."""
    counts = {}
    for table, (query, position) in RESHARD_TABLES.items():
        source_rows = [r for url in ks["sources"].values() for r in run_sql(url, query)]
        assert len({r[0] for r in source_rows}) == len(source_rows)
        total = 0
        for shard, url in ks["targets"].items():
            r = KeyRange.parse(shard)
            expected = sorted(row for row in source_rows if r.contains(keyspace_id(str(row[position]))))
            assert run_sql(url, query) == expected, (table, shard)
            counts[table, shard] = len(expected)
            total += len(expected)
        assert total == len(source_rows)  # every row in exactly one target shard
    return counts


def sluicegate_objects(url: str) -> dict:
    """What Sluicegate may leave in a database: its schema, slots, publications, triggers, functions."""
    with psycopg.connect(url, autocommit=True) as c:
        return {
            "schema": c.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'sluicegate'").fetchone()[0],
            "slots": c.execute("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()"
                               ).fetchone()[0],
            "publications": c.execute("SELECT count(*) FROM pg_publication").fetchone()[0],
            "triggers": c.execute("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'sluicegate%'").fetchone()[0],
            "functions": c.execute("SELECT count(*) FROM pg_proc WHERE proname = 'deny_write'").fetchone()[0],
        }


# Types whose cast to text differs from their output function, which is what pgoutput sends: char(n) keeps its
# padding ('ab   ', not 'ab'), an inet host its bare address ('10.0.0.1', not '10.0.0.1/32').
_CAST_DIFFERS = {1042, 869}


def output_text(column) -> sql.Composable:
    """A SELECT's expression for the column's value as its type's output function writes it (the stream's
    text), NULL as NULL: the reference the Delta copy's COPY of bare columns is checked against. A user type (a
    domain over char(n) or inet, say) may cast as its base type does: format() too."""
    ident = sql.Identifier(column.name)
    if column.type_oid in _CAST_DIFFERS or column.type_oid >= FIRST_USER_OID:
        return sql.SQL("CASE WHEN {} IS NULL THEN NULL ELSE format('%s', {}) END").format(ident, ident)
    return sql.SQL("{}::text").format(ident)

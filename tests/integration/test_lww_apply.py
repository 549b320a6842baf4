"""Last-writer-wins apply (appliers/lww.py) between two real databases, A (cluster 1) and B (cluster 2).

Each side's application writes for real (commit times from track_commit_timestamp, tombstones from the
triggers); `ship` stands in for the capture and the bidirectional applier: it reads a changed row (or its
tombstone) on one side with its commit time and cluster, and applies it on the other under a replication
origin whose commit time is the change's, as the applier does, so that the applied row carries the same
version on both sides."""

from __future__ import annotations

import re
import threading
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from psycopg import sql

from sluicegate.appliers.lww import (
    Incoming,
    LwwTable,
    collect_tombstones,
    conflict_counts,
    decide,
    install_tombstone_triggers,
    origin_ids,
    remove_tombstone_triggers,
)
from sluicegate.errors import TerminalError
from sluicegate.postgres.catalog import describe_table

from ..conftest import wait_for

A_ID, B_ID = 1, 2


class Side:
    def __init__(self, server, url: str, cluster: int, tag: str):
        self.server, self.url, self.cluster, self.tag = server, url, cluster, tag
        self.origins: dict[str, int] = {}  # replication origin name -> the cluster it stands for

    def sql(self, text, params=None):
        with psycopg.connect(self.url, autocommit=True) as c:
            cur = c.execute(text, params)
            return cur.fetchall() if cur.description else None

    def add_origin(self, cluster: int, what: str) -> str:
        name = f"{self.tag}_{what}"  # origins are per server: named after the test's databases
        self.sql("SELECT pg_replication_origin_create(%s)", (name,))
        self.origins[name] = cluster
        return name

    def drop_origins(self):
        for name in self.origins:
            self.sql("SELECT pg_replication_origin_drop(%s)", (name,))

    def table(self, name="items"):
        with psycopg.connect(self.url, autocommit=True) as c:
            return describe_table(c, "public", name)

    def lww(self, conn, table):
        return LwwTable(conn, table, local_cluster=self.cluster, origins=origin_ids(conn, self.origins))

    def row(self, key, table="items"):
        rows = self.sql(sql.SQL("SELECT * FROM {} WHERE id = %s").format(sql.Identifier(table)), (key,))
        return rows[0] if rows else None

    def version(self, key):
        """(commit time, cluster) of the row's current version, as the applier reads it."""
        origins = self.origin_ids()
        got = self.sql("SELECT v.timestamp, v.roident FROM items, "
                       "pg_xact_commit_timestamp_origin(items.xmin) v "
                       "WHERE id = %s", (key,))
        if not got:
            return None
        ts, roident = got[0]
        return ts, self.cluster if roident == 0 else origins[roident]

    def origin_ids(self):
        with psycopg.connect(self.url, autocommit=True) as c:
            return origin_ids(c, self.origins)

    def tombstone(self, key, table="public.items"):
        got = self.sql("SELECT COALESCE(deleted_at, pg_xact_commit_timestamp(xid::xid)), cluster_id "
                       "FROM sluicegate.tombstones "
                       "WHERE table_name = %s AND key = jsonb_build_array(%s::text)",
                       (table, str(key)))
        return got[0] if got else None

    def counts(self):
        with psycopg.connect(self.url, autocommit=True) as c:
            return conflict_counts(c)

    def conflicts(self):
        return self.sql("SELECT key->>0, type, winner, local_cluster, remote_cluster "
                        "FROM sluicegate.conflicts "
                        "ORDER BY id")


@pytest.fixture
def sides(pair):
    a = Side(pair.source_server, pair.source, A_ID, f"{pair.name}_a")
    b = Side(pair.target_server, pair.target, B_ID, f"{pair.name}_b")
    a.peer, b.peer = b, a
    for side in (a, b):
        side.sql("CREATE TABLE items (id int PRIMARY KEY, v text, n int)")
        with psycopg.connect(side.url, autocommit=True) as c:
            install_tombstone_triggers(c, describe_table(c, "public", "items"), side.cluster)
        side.from_peer = side.add_origin(side.peer.cluster, "from_peer")
    yield a, b
    for side in (a, b):
        side.drop_origins()


def applying(side: Side, origin: str, time):
    """A connection in a transaction as the applier has it: replica role, the origin's commit time."""
    conn = psycopg.connect(side.url, autocommit=True)
    conn.execute("SET session_replication_role = replica")
    conn.execute("SELECT pg_replication_origin_session_setup(%s)", (origin,))
    conn.autocommit = False
    conn.execute("SELECT pg_replication_origin_xact_setup('0/1', %s)", (time,))
    return conn


def incoming(src: Side, op: str, key: int) -> Incoming:
    """The change `op` of `key` as src's capture would send it: the row's values, or its tombstone's time."""
    if op == "D":
        time, cluster = src.tombstone(key)
        return Incoming("D", (str(key), None, None), time, cluster)
    values = src.sql("SELECT id::text, v, n::text FROM items WHERE id = %s", (key,))[0]
    return Incoming(op, values, *src.version(key))


def ship(src: Side, dst: Side, changes: list[tuple[str, int]]):
    """Apply src's changes on dst, one transaction per commit time (an origin stamps one per transaction)."""
    batches: dict = {}
    for op, key in changes:
        ch = incoming(src, op, key)
        batches.setdefault(ch.time, []).append(ch)
    outcomes = []
    for time, rows in sorted(batches.items()):
        with applying(dst, dst.from_peer, time) as conn:
            outcomes.append(dst.lww(conn, dst.table()).apply(rows))
            conn.commit()
    return outcomes


def start(a: Side, b: Side, *keys: int):
    """Rows written on A and replicated to B (ordinary inserts: no conflict)."""
    for k in keys:
        a.sql("INSERT INTO items VALUES (%s, %s, 0)", (k, f"a{k}"))
    ship(a, b, [("I", k) for k in keys])
    for k in keys:
        assert b.row(k) == a.row(k) and b.version(k) == a.version(k)


def assert_converged(a: Side, b: Side, key: int):
    assert a.row(key) == b.row(key)
    if a.row(key) is not None:
        assert a.version(key) == b.version(key)


def test_newer_update_wins_on_both_sides(sides):
    a, b = sides
    start(a, b, 1)
    assert a.conflicts() == b.conflicts() == []
    a.sql("UPDATE items SET v = 'from A' WHERE id = 1")
    b.sql("UPDATE items SET v = 'from B' WHERE id = 1")  # later
    (out_b,) = ship(a, b, [("U", 1)])
    (out_a,) = ship(b, a, [("U", 1)])
    assert (out_b.lost, out_b.updated, out_a.updated) == (1, 0, 1)
    assert a.row(1) == b.row(1) == (1, "from B", 0)
    assert a.version(1) == b.version(1) and a.version(1)[1] == B_ID
    assert b.conflicts() == [("1", "update_exists", "local", B_ID, A_ID)]
    assert a.conflicts() == [("1", "update_exists", "remote", A_ID, B_ID)]


def test_ordinary_replication_is_no_conflict(sides):
    a, b = sides
    start(a, b, 1)
    a.sql("UPDATE items SET n = 1 WHERE id = 1")
    ship(a, b, [("U", 1)])
    a.sql("UPDATE items SET n = 2 WHERE id = 1")
    ship(a, b, [("U", 1)])
    a.sql("DELETE FROM items WHERE id = 1")
    a.sql("INSERT INTO items VALUES (1, 'again', 3)")  # delete and insert again: the peer gets both in order
    ship(a, b, [("D", 1)])
    ship(a, b, [("I", 1)])
    assert_converged(a, b, 1)
    assert b.row(1) == (1, "again", 3)
    assert b.conflicts() == [] and b.counts() == {}


def test_tie_goes_to_the_higher_cluster_on_both_sides(sides):
    a, b = sides
    start(a, b, 1)
    a.sql("UPDATE items SET v = 'A at t' WHERE id = 1")
    t = a.version(1)[0]
    # B's own write committed at the same microsecond: stamped with t under an origin that stands for B itself
    own = b.add_origin(B_ID, "self")
    with applying(b, own, t) as conn:
        conn.execute("UPDATE items SET v = 'B at t' WHERE id = 1")
        conn.commit()
    assert b.version(1) == (t, B_ID)
    ship(a, b, [("U", 1)])
    with applying(a, a.from_peer, t) as conn:  # B's version as B's capture would send it
        a.lww(conn, a.table()).apply([Incoming("U", ("1", "B at t", "0"), t, B_ID)])
        conn.commit()
    assert a.row(1) == b.row(1) == (1, "B at t", 0)
    assert a.conflicts() == [("1", "update_exists", "remote", A_ID, B_ID)]
    assert b.conflicts() == [("1", "update_exists", "local", B_ID, A_ID)]


def test_insert_of_the_same_key_on_both_sides(sides):
    a, b = sides
    a.sql("INSERT INTO items VALUES (7, 'A', 1)")
    b.sql("INSERT INTO items VALUES (7, 'B', 2)")  # the later insert
    ship(a, b, [("I", 7)])
    ship(b, a, [("I", 7)])
    assert_converged(a, b, 7)
    assert a.row(7) == (7, "B", 2)
    assert a.conflicts() == [("7", "insert_exists", "remote", A_ID, B_ID)]
    assert b.conflicts() == [("7", "insert_exists", "local", B_ID, A_ID)]


def test_delete_on_a_then_later_update_on_b(sides):
    a, b = sides
    start(a, b, 1)
    a.sql("DELETE FROM items WHERE id = 1")
    b.sql("UPDATE items SET v = 'B' WHERE id = 1")
    ship(a, b, [("D", 1)])
    ship(b, a, [("U", 1)])
    assert_converged(a, b, 1)
    assert a.row(1) == (1, "B", 0)  # the later update brought the row back, whole
    assert a.tombstone(1) is None  # ...and took the tombstone away
    assert b.conflicts() == [("1", "delete_exists", "local", B_ID, A_ID)]
    assert a.conflicts() == [("1", "update_deleted", "remote", A_ID, B_ID)]


def test_update_on_b_then_later_delete_on_a(sides):
    a, b = sides
    start(a, b, 1)
    b.sql("UPDATE items SET v = 'B' WHERE id = 1")
    a.sql("DELETE FROM items WHERE id = 1")
    ship(b, a, [("U", 1)])
    ship(a, b, [("D", 1)])
    assert a.row(1) is None and b.row(1) is None
    assert a.tombstone(1) == b.tombstone(1)  # both sides remember the same delete
    assert a.conflicts() == [("1", "update_deleted", "local", A_ID, B_ID)]
    assert b.conflicts() == [("1", "delete_exists", "remote", B_ID, A_ID)]


def test_delete_on_both_sides(sides):
    a, b = sides
    start(a, b, 1)
    a.sql("DELETE FROM items WHERE id = 1")
    b.sql("DELETE FROM items WHERE id = 1")
    ship(a, b, [("D", 1)])
    ship(b, a, [("D", 1)])
    assert a.row(1) is None and b.row(1) is None
    assert a.tombstone(1) == b.tombstone(1) and a.tombstone(1)[1] == B_ID  # the later delete's
    assert a.conflicts() == [("1", "delete_deleted", "remote", A_ID, B_ID)]
    assert b.conflicts() == [("1", "delete_deleted", "local", B_ID, A_ID)]


def test_update_arriving_before_the_newer_delete_of_its_row(sides):
    """B updates; A deletes later without having seen it; B's update reaches A (the row is gone there) before
    A's delete reaches B: the older update must not bring the row back on A."""
    a, b = sides
    start(a, b, 1, 2)
    b.sql("UPDATE items SET v = 'B' WHERE id IN (1, 2)")
    a.sql("DELETE FROM items WHERE id IN (1, 2)")
    assert b.row(1) == (1, "B", 0)  # A's delete has not arrived at B
    ship(b, a, [("U", 1), ("U", 2)])
    assert a.row(1) is None and a.row(2) is None
    ship(a, b, [("D", 1), ("D", 2)])
    for k in (1, 2):
        assert_converged(a, b, k)
        assert a.row(k) is None
    assert a.counts() == {"update_deleted": 2}
    assert b.counts() == {"delete_exists": 2}


def test_update_and_delete_of_a_missing_row(sides):
    """No row, no tombstone (never arrived, or the tombstone was collected): an update makes the row whole,
    a delete leaves a tombstone, both logged."""
    a, b = sides
    a.sql("INSERT INTO items VALUES (1, 'A', 1), (2, 'A', 2)")
    a.sql("UPDATE items SET v = 'A2'")
    a.sql("DELETE FROM items WHERE id = 2")
    ship(a, b, [("U", 1), ("D", 2)])
    assert b.row(1) == (1, "A2", 1) and b.row(2) is None
    assert b.tombstone(2) == a.tombstone(2)
    assert b.conflicts() == [("1", "update_missing", "remote", None, A_ID),
                             ("2", "delete_missing", "remote", None, A_ID)]


def test_partial_update(sides):
    """An update that leaves a (TOASTed) column out keeps the row's value; for a missing row it is refused."""
    a, b = sides
    start(a, b, 1)
    later = datetime.now(timezone.utc) + timedelta(seconds=1)
    with applying(b, b.from_peer, later) as conn:
        out = b.lww(conn, b.table()).apply([Incoming("U", ("1", None, "5"), later, A_ID, (1,))])
        conn.commit()
    assert out.updated == 1 and b.row(1) == (1, "a1", 5)
    refused = re.escape('key ["9"] wins but carries only some columns') + ".*REPLICA IDENTITY FULL"
    with applying(b, b.from_peer, later) as conn, pytest.raises(TerminalError, match=refused):
        b.lww(conn, b.table()).apply([Incoming("U", ("9", None, "5"), later, A_ID, (1,))])
    assert b.row(9) is None


def test_applier_deletes_leave_no_local_tombstone_and_skip_foreign_keys(sides):
    """The tombstone triggers are ordinary: replica role skips them for the applier (whose tombstones carry
    the change's time and cluster), as it skips foreign-key checks; without it the applier refuses."""
    a, b = sides
    start(a, b, 1)
    b.sql("CREATE TABLE parts (id int PRIMARY KEY, item int REFERENCES items)")
    a.sql("DELETE FROM items WHERE id = 1")
    ship(a, b, [("D", 1)])
    assert b.sql("SELECT cluster_id, xid FROM sluicegate.tombstones") == [(A_ID, None)]
    t = datetime.now(timezone.utc)
    with applying(b, b.from_peer, t) as conn:  # a child row before its parent (another batch brings it)
        out = b.lww(conn, b.table("parts")).apply([Incoming("I", ("1", "42"), t, A_ID)])
        conn.commit()
    assert out.inserted == 1 and b.sql("SELECT item FROM parts") == [(42,)]
    with psycopg.connect(b.url) as conn, pytest.raises(TerminalError, match="role = origin.*= replica"):
        b.lww(conn, b.table()).apply([Incoming("D", ("1", None, None), t, A_ID)])


def test_timestamptz_keys_match_whatever_the_session_time_zone(sides):
    """A tombstone's key text is made under fixed settings, so the application's session (New York) and the
    applier's (Tokyo) write and find the same one."""
    _, b = sides
    b.sql("CREATE TABLE events (at timestamptz PRIMARY KEY, v text)")
    with psycopg.connect(b.url, autocommit=True) as c:
        install_tombstone_triggers(c, describe_table(c, "public", "events"), B_ID)
        c.execute("SET TimeZone = 'America/New_York'")
        c.execute("INSERT INTO events VALUES ('2026-03-01 12:00+00', 'x')")
        old = c.execute("SELECT now() - interval '1 hour'").fetchone()[0]
        c.execute("DELETE FROM events")
    with applying(b, b.from_peer, old) as conn:
        conn.execute("SET TimeZone = 'Asia/Tokyo'")
        out = b.lww(conn, b.table("events")).apply([Incoming("U", ("2026-03-01 21:00+09", "y"), old, A_ID)])
        conn.commit()
    assert out.lost == 1 and b.sql("SELECT count(*) FROM events") == [(0,)]
    assert b.conflicts() == [("2026-03-01 12:00:00+00", "update_deleted", "local", B_ID, A_ID)]


def test_tombstone_gc(sides):
    _, b = sides
    b.sql("INSERT INTO items SELECT g, 'b', 0 FROM generate_series(100, 104) g")
    b.sql("DELETE FROM items WHERE id >= 100")  # five local tombstones, their time not yet read
    old = datetime.now(timezone.utc) - timedelta(days=10)
    with applying(b, b.from_peer, old) as conn:
        b.lww(conn, b.table()).apply([Incoming("D", (str(k), None, None), old, A_ID) for k in range(30)])
        conn.commit()
    assert b.sql("SELECT count(*) FILTER (WHERE deleted_at IS NULL), count(*) "
                 "FROM sluicegate.tombstones") == [(5, 35)]
    with psycopg.connect(b.url, autocommit=True) as c:
        assert collect_tombstones(c, limit=20) == 20  # bounded per call
        assert collect_tombstones(c, limit=20) == 10
        assert collect_tombstones(c, limit=20) == 0
        # the local ones got their commit time and stay within the retention
        assert c.execute("SELECT count(*) FROM sluicegate.tombstones "
                         "WHERE deleted_at > now() - interval '1 hour' AND xid IS NULL").fetchone() == (5,)
        assert collect_tombstones(c, retention=timedelta(0)) == 5


def test_sql_agrees_with_the_rules(sides):
    """Every case of `decide` (row / tombstone / nothing, each op, local version older / equal / newer, from
    the same or another cluster, lower or higher id) in one batch: the SQL does what the rules say."""
    _, b = sides
    t = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(minutes=5)
    origins = {c: b.add_origin(c, f"c{c}") for c in (1, 3, 4)}  # lower, the same and higher than remote's
    cases, key = [], 0
    for found in ("r", "t", "n"):
        locals_ = [(t + timedelta(seconds=dt), c) for dt in (-1, 0, 1) for c in (1, 3, 4)] if found != "n" \
            else [None]
        for local in locals_:
            for op in "IUD":
                key += 1
                cases.append((key, found, local, op))
    for dt in (-1, 0, 1):  # local versions: rows written under an origin standing for their cluster
        for c in (1, 3, 4):
            with applying(b, origins[c], t + timedelta(seconds=dt)) as conn:
                conn.execute("SET session_replication_role = origin")  # no tombstones from the setup
                for k, found, local, _ in cases:
                    if local == (t + timedelta(seconds=dt), c):
                        if found == "r":
                            conn.execute("INSERT INTO items VALUES (%s, 'local', 0)", (k,))
                        else:
                            conn.execute("INSERT INTO sluicegate.tombstones VALUES ('public.items', "
                                         "jsonb_build_array(%s::text), %s, %s)", (str(k), local[0], c))
                conn.commit()
    remote = (t, 3)
    with applying(b, b.from_peer, t) as conn:
        ids = origin_ids(conn, b.origins)
        lww = LwwTable(conn, b.table(), local_cluster=B_ID, origins=ids)
        lww.apply([Incoming(op, (str(k), "remote", "1"), *remote) for k, _, _, op in cases])
        conn.commit()
    logged = {int(k): (ty, w) for k, ty, w, _, _ in b.conflicts()}
    for k, found, local, op in cases:
        win, conflict = decide(op, found, local, remote)
        row = b.row(k)
        expect_row = (k, "remote", 1) if win and op != "D" else (k, "local", 0) if found == "r" and not win \
            else None
        assert row == expect_row, (found, local, op)
        assert logged.get(k) == ((conflict, "remote" if win else "local") if conflict else None), \
            (found, local, op)
        tomb = b.tombstone(k)
        if op == "D" and win:
            assert tomb == remote
        elif op != "D" and win:
            assert tomb is None
        elif found == "t":
            assert tomb == local


class CountingCursor(psycopg.Cursor):
    """Counts the statements sent (COPY included): the applier's count is checked against it."""
    sent = 0

    def execute(self, *args, **kwargs):
        CountingCursor.sent += 1
        return super().execute(*args, **kwargs)

    def copy(self, *args, **kwargs):
        CountingCursor.sent += 1
        return super().copy(*args, **kwargs)


def test_a_batch_of_10k_rows_takes_a_bounded_number_of_statements(sides):
    _, b = sides
    b.sql("INSERT INTO items SELECT g, 'b', 0 FROM generate_series(1, 6000) g")
    b.sql("DELETE FROM items WHERE id > 5000")  # 1000 tombstones, newer than the batch
    t = datetime.now(timezone.utc)
    batch = ([Incoming("U", (str(k), "new", "1"), t, A_ID) for k in range(1, 4001)]  # newer: win
             + [Incoming("D", (str(k), None, None), t, A_ID) for k in range(4001, 5001)]
             + [Incoming("U", (str(k), "old", "1"), t - timedelta(days=1), A_ID) for k in range(5001, 6001)]
             + [Incoming("I", (str(k), "new", "1"), t, A_ID) for k in range(6001, 10001)])
    with applying(b, b.from_peer, t) as conn:
        conn.cursor_factory = CountingCursor
        lww = b.lww(conn, b.table())
        lww.statements = CountingCursor.sent = 0
        out = lww.apply(batch)
        conn.commit()
    assert (out.updated, out.deleted, out.inserted, out.lost) == (4000, 1000, 4000, 1000)
    assert CountingCursor.sent == lww.statements <= 12
    assert b.sql("SELECT count(*), count(*) FILTER (WHERE v = 'new') FROM items") == [(8000, 8000)]
    assert b.counts() == {"update_exists": 4000, "delete_exists": 1000,
                                                        "update_deleted": 1000}


def test_a_local_key_change_leaves_a_tombstone_for_the_old_key(sides):
    """An update that moves a row to another key deletes the old key as far as the peer is concerned (it gets
    a delete of the old key): an older update of the old key arriving later must not bring it back."""
    a, b = sides
    start(a, b, 1)
    b.sql("UPDATE items SET v = 'B' WHERE id = 1")  # older than A's key change
    a.sql("UPDATE items SET id = 10 WHERE id = 1")
    moved_at = a.version(10)[0]
    assert a.tombstone(1) == (moved_at, A_ID) and a.tombstone(10) is None
    ship(b, a, [("U", 1)])
    assert a.row(1) is None and a.conflicts() == [("1", "update_deleted", "local", A_ID, B_ID)]
    with psycopg.connect(a.url, autocommit=True) as c:
        remove_tombstone_triggers(c, a.table())
    a.sql("DELETE FROM items")
    assert a.sql("SELECT count(*) FROM sluicegate.tombstones") == [(1,)]


def test_a_row_the_application_inserts_meanwhile_is_a_version_like_any_other(sides):
    """The application inserts keys the batch did not find (its transaction still open): the applier's insert
    waits for it, then keeps whichever version is later."""
    _, b = sides
    app = psycopg.connect(b.url)
    app.execute("INSERT INTO items VALUES (1, 'app', 0), (2, 'app', 0)")
    now = datetime.now(timezone.utc)
    older, newer = now - timedelta(hours=1), now + timedelta(hours=1)
    done = {}

    def apply():
        with applying(b, b.from_peer, newer) as conn:
            done["out"] = b.lww(conn, b.table()).apply([Incoming("I", ("1", "old", "1"), older, A_ID),
                                                        Incoming("I", ("2", "new", "1"), newer, A_ID)])
            conn.commit()

    worker = threading.Thread(target=apply)
    worker.start()
    try:
        wait_for(lambda: b.sql("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                               "AND wait_event_type = 'Lock'") == [(1,)], 60, what="the applier waiting")
    finally:
        app.commit()
        app.close()
        worker.join(60)
    assert "out" in done
    assert b.row(1) == (1, "app", 0) and b.row(2) == (2, "new", 1)


def test_a_table_being_copied_takes_changes_up_to_its_last_copied_key(sides):
    """During a copy (`upto`): keys above the last one copied are the copy's to bring, not the stream's."""
    a, b = sides
    a.sql("INSERT INTO items VALUES (3, 'A', 1), (8, 'A', 1)")
    rows = [incoming(a, "I", 3), incoming(a, "I", 8)]
    with applying(b, b.from_peer, rows[0].time) as conn:
        out = LwwTable(conn, b.table(), local_cluster=B_ID, origins=origin_ids(conn, b.origins),
                       upto=["5"]).apply(rows)
        conn.commit()
    assert out.inserted == 1
    assert b.row(3) == (3, "A", 1) and b.row(8) is None


def test_a_delete_applies_to_a_table_with_a_not_null_domain(sides):
    """A staged delete carries only the key: a NOT NULL domain column must not refuse its NULLs."""
    a, b = sides
    for side in (a, b):
        side.sql("CREATE DOMAIN counter AS int NOT NULL CHECK (VALUE >= 0)")
        side.sql("ALTER TABLE items ALTER COLUMN n TYPE counter")
    start(a, b, 1, 2)
    a.sql("UPDATE items SET n = 5 WHERE id = 2")
    a.sql("DELETE FROM items WHERE id = 1")
    ship(a, b, [("D", 1), ("U", 2)])
    assert b.row(1) is None and b.row(2) == (2, "a2", 5)
    assert_converged(a, b, 2)

"""Assertions shared by the integration tests."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading

import psycopg
from psycopg import sql

from sluicegate.position import parse_lsn


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

"""Assertions shared by the integration tests."""

from __future__ import annotations

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

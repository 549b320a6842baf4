"""Reading a logical slot's changes without consuming them (`pg_logical_slot_peek_binary_changes`).

A peek is replayable: the same slot state and bounds give the same messages, so a reader that dies can
simply read again. It returns the transactions whose commit record *begins* before `upto` (the server
decodes records until one ends at or past it); a slot confirmed at L skips those beginning before L. So a
position that no record straddles (an insert position, a commit's end) splits the stream exactly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
from psycopg import sql

from ..position import format_lsn
from .pgoutput import BEGIN, COMMIT, RELATION, TYPE, begin_final_lsn

FETCH_ROWS = 5000  # rows per round trip of the server-side cursor
SLOT_BUSY_TIMEOUT = 30.0  # seconds to wait for a slot that another peek, an advance or a reader holds


def quote_publication(name: str) -> str:
    """pgoutput splits publication_names like identifiers (lower-casing unquoted ones): always quote."""
    return '"' + name.replace('"', '""') + '"'


def peek(conn: psycopg.Connection, slot: str, publication: str, upto: int,
         nchanges: int | None = None, messages: bool = False) -> Iterator[tuple[int, bytes]]:
    """(lsn, pgoutput message) from the slot's confirmed position up to `upto`; the server stops after the
    transaction that brings its row count to `nchanges`; `messages`: logical messages too (the DDL capture's).
    `conn` must not be in autocommit (a named cursor); the peek's transaction is rolled back at the end."""
    cur, first = _open(conn, slot, publication, upto, nchanges, messages)
    try:
        yield from first
        yield from cur
    finally:  # (also when the reader stops early and closes this generator, maybe after the connection)
        if not conn.closed:
            cur.close()
            conn.rollback()


_PEEK = sql.SQL("SELECT (lsn - '0/0'::pg_lsn)::int8, data FROM pg_logical_slot_peek_binary_changes("
               "%s, %s::pg_lsn, %s, 'proto_version', '1', 'publication_names', %s{})")


def _open(conn, slot, publication, upto, nchanges, messages):
    query = _PEEK.format(sql.SQL(", 'messages', 'true'") if messages else sql.SQL(""))
    deadline = time.monotonic() + SLOT_BUSY_TIMEOUT
    while True:
        cur = conn.cursor(name="sluicegate_peek", binary=True)
        cur.itersize = FETCH_ROWS
        try:
            cur.execute(
                query,
                (slot, format_lsn(upto), nchanges, quote_publication(publication)),
            )
            return cur, cur.fetchmany(FETCH_ROWS)  # the server decodes (taking the slot) at the first fetch
        except psycopg.errors.ObjectInUse:
            conn.rollback()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def in_range(rows: Iterator[tuple[int, bytes]], start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """Only the messages of transactions whose commit record begins in [start, end), before they are
    decoded; Relation and Type messages always (they describe tables for every later transaction)."""
    keep = False
    for lsn, data in rows:
        kind = data[0]
        if kind == BEGIN:
            keep = start <= begin_final_lsn(data) < end
        elif kind in (RELATION, TYPE):
            yield lsn, data
            continue
        if keep:
            yield lsn, data
        if kind == COMMIT:
            keep = False

"""Lock timeouts for every DDL and explicit lock Sluicegate takes, on either side.

A statement that waits for a lock waits behind whoever holds it, and everything that comes later waits
behind the statement: an ALTER TABLE blocked by a reader's open transaction holds up the application's
writes too. So each runs under a short lock_timeout (transaction-local, in a savepoint of its own); when the
timeout passes, the error names the sessions that hold the lock (pid, application, user, since when, what
they run) and is retryable: the engine records it on the stream, backs off and tries again.

A statement waiting for a lock can also be cancelled from another thread (`cancel_waiting`): SIGTERM does
not have to wait out the timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone

import psycopg
from psycopg import sql

from .. import config
from ..errors import RetryableError

# Long enough for the brief locks of a busy application, short enough that the queue behind us stays short
# and that a blocked step says so promptly. SLUICEGATE_LOCK_TIMEOUT (seconds) overrides it (config.py).
DEFAULT_TIMEOUT = config.default("lock_timeout")

# Lock modes each requested mode must wait for (PostgreSQL's table-level conflict table).
_CONFLICTS = {
    "AccessShareLock": {"AccessExclusiveLock"},
    "RowShareLock": {"ExclusiveLock", "AccessExclusiveLock"},
    "RowExclusiveLock": {"ShareLock", "ShareRowExclusiveLock", "ExclusiveLock", "AccessExclusiveLock"},
    "ShareUpdateExclusiveLock": {"ShareUpdateExclusiveLock", "ShareLock", "ShareRowExclusiveLock",
                                 "ExclusiveLock", "AccessExclusiveLock"},
    "ShareLock": {"RowExclusiveLock", "ShareUpdateExclusiveLock", "ShareRowExclusiveLock", "ExclusiveLock",
                  "AccessExclusiveLock"},
    "ShareRowExclusiveLock": {"RowExclusiveLock", "ShareUpdateExclusiveLock", "ShareLock",
                              "ShareRowExclusiveLock", "ExclusiveLock", "AccessExclusiveLock"},
    "ExclusiveLock": {"RowShareLock", "RowExclusiveLock", "ShareUpdateExclusiveLock", "ShareLock",
                      "ShareRowExclusiveLock", "ExclusiveLock", "AccessExclusiveLock"},
}
_CONFLICTS["AccessExclusiveLock"] = _CONFLICTS["ExclusiveLock"] | {"AccessShareLock"}


class LockTimeout(RetryableError):
    """A lock Sluicegate needs is held by another session for longer than the lock timeout."""


def timeout_seconds() -> float:
    return config.from_env("lock_timeout")


# Connections whose statement waits for a lock now, by the thread that runs it: cancel_waiting(thread) ends
# the wait of one engine's thread without touching other engines of the process.
_waiting: dict[int, list] = {}  # (a list: guards nest, on one connection too)
_waiting_lock = threading.Lock()


@contextmanager
def _registered(conn) -> Iterator[None]:
    me = threading.get_ident()
    with _waiting_lock:
        _waiting.setdefault(me, []).append(conn)
    try:
        yield
    finally:
        with _waiting_lock:
            _waiting[me].remove(conn)
            if not _waiting[me]:
                del _waiting[me]


def cancel_waiting(thread: int | None = None) -> None:
    """Cancel the statements waiting under `guard` in `thread` (every thread: None). Thread-safe."""
    with _waiting_lock:
        conns = list({id(c): c for t, cs in _waiting.items() if thread is None or t == thread for c in cs}.values())
    for conn in conns:
        try:
            conn.cancel()
        except Exception:  # noqa: BLE001, S110 - the statement may have just finished: nothing to cancel
            pass


@contextmanager
def guard(conn: psycopg.Connection, what: str, relations: Sequence[str] = (), mode: str = "AccessExclusiveLock",
          *, side: str = "target", timeout: float | None = None,
          holders: Callable[[psycopg.Connection], str] | None = None, then: str = "will retry") -> Iterator[None]:
    """Run the block's statements under a lock timeout, in a savepoint of the caller's transaction (a
    transaction of its own on an autocommit connection). `what` says what was being done, `relations`
    (regclass texts) and `mode` which lock it needed: a timeout raises LockTimeout naming the sessions that
    hold a conflicting lock on them (or whom `holders(conn)` names). Other errors pass through unchanged."""
    seconds = timeout_seconds() if timeout is None else timeout
    if not conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        conn.execute("SELECT 1")  # open the caller's transaction: ours below is a savepoint, never a commit
    try:
        with _registered(conn), conn.transaction():
            conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(seconds * 1000)}ms",))
            yield
    except psycopg.errors.LockNotAvailable:
        named = holders(conn) if holders else describe_holders(conn, relations, mode)
        raise LockTimeout(f"{what} on the {side} waited {seconds:g} s for a lock{named}; {then} "
                          f"(end that session's transaction, or wait for it)") from None


def describe_holders(conn: psycopg.Connection, relations: Sequence[str], mode: str = "AccessExclusiveLock") -> str:
    """': held by pid 123 (application 'psql', user app, transaction since …, idle in transaction)' for
    the sessions holding a lock on `relations` that conflicts with `mode`; else the sessions with any lock on
    them; '' when none is left. Best effort (a lock may be gone by now)."""
    try:
        rows = _holders(conn, relations, sorted(_CONFLICTS.get(mode, _CONFLICTS["AccessExclusiveLock"])))
    except psycopg.Error:
        return ""
    if not rows:
        return ""
    return ": held by " + "; ".join(_session(*r) for r in rows[:3]) + (f" and {len(rows) - 3} more" if len(rows) > 3
                                                                        else "")


def describe_transactions(conn: psycopg.Connection) -> str:
    """': held by pid …' for the oldest transactions with a transaction id of the database's server, which
    a new logical slot waits for: its snapshot needs every transaction running at its start to end."""
    try:
        with conn.transaction():
            rows = conn.execute(
                """SELECT pid, application_name, usename, state, xact_start, query_start FROM pg_stat_activity
                   WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid() ORDER BY xact_start LIMIT 4"""
            ).fetchall()
    except psycopg.Error:
        return ""
    return ": held by " + "; ".join(_session(*r) for r in rows[:3]) if rows else ""


def _holders(conn: psycopg.Connection, relations: Sequence[str], modes: list[str]) -> list[tuple]:
    if not relations:
        return []
    with conn.transaction():  # a savepoint: a relation gone meanwhile must not break the caller's transaction
        return conn.execute(
            sql.SQL("""
            SELECT a.pid, a.application_name, a.usename, a.state, a.xact_start, a.query_start
            FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
            WHERE l.locktype = 'relation' AND l.granted AND l.pid <> pg_backend_pid()
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.relation = ANY(ARRAY(SELECT to_regclass(r) FROM unnest(%(rels)s::text[]) r))
            GROUP BY 1, 2, 3, 4, 5, 6
            ORDER BY bool_or(l.mode = ANY(%(modes)s)) DESC, a.xact_start NULLS LAST
            """),
            {"modes": modes, "rels": list(relations)},
        ).fetchall()


def _session(pid, application, user, state, xact_start, query_start) -> str:
    # Not the query's text: it may hold the application's data.
    parts = [f"application {application!r}" if application else "no application name"]
    if user:
        parts.append(f"user {user}")
    if xact_start:
        parts.append(f"transaction since {_time(xact_start)}")
    if query_start:
        parts.append(f"query started {_time(query_start)}")
    if state:
        parts.append(state)
    return f"pid {pid} ({', '.join(parts)})"


def _time(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")

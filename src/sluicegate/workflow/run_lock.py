"""One driver per workflow: a session advisory lock on the target, held by `workflow run` while it runs.

`workflow run` takes it before anything else starts (Spark, its heartbeat, progress lines), so a second
driver is refused at once, naming the one that holds it: the pid and host its heartbeat recorded
(heartbeat.py), and the target session that holds the lock.
"""

from __future__ import annotations

import psycopg

from ..errors import UsageError
from ..postgres.connect import connect
from . import state as st

_LOCK = "SELECT pg_try_advisory_lock(hashtext('sluicegate'), hashtext(%s))"
_HOLDER = """SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2
             AND classid = hashtext('sluicegate')::oid AND objid = hashtext(%s)::oid
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) LIMIT 1"""


def take(target_url: str, workflow: str, key: str | None = None, former: tuple | None = None
         ) -> psycopg.Connection:
    """The lock of `workflow` (`key`: one stream's, for a Reshard's engines) in a new autocommit session
    that holds it until closed; a UsageError naming the holder when another session has it.

    `former`: session(conn) of this driver's own earlier lock session. After a network cut the target may
    not yet know that session's client is gone (it learns from its keepalives, or never while idle with
    none), and it still holds the lock: that session is ended, not taken for another driver's."""
    key = key or workflow
    conn = connect(target_url, role="target", autocommit=True)
    try:
        if conn.execute(_LOCK, (key,)).fetchone()[0]:
            return conn
        if former is not None and _holder_session(conn, key) == former:
            conn.execute("SELECT pg_terminate_backend(%s, 10000)", (former[0],))
            if conn.execute(_LOCK, (key,)).fetchone()[0]:
                return conn
        raise UsageError(f"workflow {workflow!r} is already being run by another `sluicegate workflow run` "
                         f"({holder(conn, workflow, key)}): stop that one first (SIGTERM, or `sluicegate "
                         f"workflow stop {workflow}`), or let it run")
    except BaseException:
        conn.close()
        raise


def session(conn: psycopg.Connection) -> tuple:
    """(backend pid, backend start) of a session: which one it is, even once the pid is used again."""
    return tuple(conn.execute("SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
                              ).fetchone())


def _holder_session(conn: psycopg.Connection, key: str) -> tuple | None:
    row = conn.execute(f"SELECT pid, backend_start FROM pg_stat_activity WHERE pid = ({_HOLDER})", (key,)).fetchone()
    return tuple(row) if row else None


def holder(conn: psycopg.Connection, workflow: str, key: str) -> str:
    """Who holds the lock, as far as the target knows: the driver's last heartbeat, its session's pid."""
    parts = []
    try:
        driver = st.load_workflow(conn, workflow).driver
    except (UsageError, psycopg.Error):
        driver = None
    if driver is not None and driver.pid is not None:
        where = f" on host {driver.host}" if driver.host else ""
        seen = (f", its last heartbeat {driver.seen_seconds_ago:.0f} s ago"
                if driver.seen_seconds_ago is not None else "")
        parts.append(f"pid {driver.pid}{where}{seen}")
    row = conn.execute(_HOLDER, (key,)).fetchone()
    if row is not None:
        parts.append(f"its target session is backend pid {row[0]}")
    return "; ".join(parts) or "holder unknown: it released the lock just now"

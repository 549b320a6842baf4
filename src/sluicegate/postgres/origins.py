"""Replication origins on a sink of a bidirectional workflow: what keeps applied changes from looping back.

Every session that writes a direction's rows on its sink (the play task, the copy tasks, the driver's
clearing before a copy cycle) sets up a replication origin named for the direction; the commit records of
its transactions then carry that origin, and the capture of the opposite direction drops them (pgoutput's
`origin 'none'` on PostgreSQL 16+, the Origin message on 14/15: postgres/replication.py, workflow/player.py).
The play task also stamps each transaction with the source's commit position and time
(`pg_replication_origin_xact_setup`), so `pg_xact_commit_timestamp` of an applied row is its source's
commit time.

PostgreSQL lets one session at a time use an origin, and a copy runs several sessions at once: a direction
has a small pool of origins (its name, then `_1`, `_2`, …), each held by whoever holds a session advisory
lock on its name — released when that session ends, however it ends. The opposite capture drops every
origin, so which one of the pool a session got does not matter.

Works on psycopg 3 and psycopg2 connections alike (copy tasks run on psycopg2): plain cursors, no imports.
"""

from __future__ import annotations

from ..errors import RetryableError, TerminalError
from .needs import BIDIRECTIONAL, names

POOL = 16  # sessions of one direction writing at once: the copy's parallel tasks, a play task, the driver
_LOCK_SPACE = "sluicegate-origin"


def acquire(conn, prefix: str) -> str:
    """Set up a free origin of the direction `prefix` for the session (created if missing); its name.
    Commits (an origin created in a transaction rolled back later would vanish under the session)."""
    cur = conn.cursor()
    for k in range(POOL):
        name = prefix if k == 0 else f"{prefix}_{k}"
        cur.execute("SELECT pg_try_advisory_lock(hashtext(%s), hashtext(%s))", (_LOCK_SPACE, name))
        if not cur.fetchone()[0]:
            continue
        try:
            cur.execute("SELECT pg_replication_origin_oid(%s)", (name,))
            if cur.fetchone()[0] is None:
                cur.execute("SELECT pg_replication_origin_create(%s)", (name,))
            cur.execute("SELECT pg_replication_origin_session_setup(%s)", (name,))
            conn.commit()
        except Exception as exc:  # noqa: BLE001 - either driver's error, translated below by SQLSTATE
            conn.rollback()
            cur.execute("SELECT pg_advisory_unlock(hashtext(%s), hashtext(%s))", (_LOCK_SPACE, name))
            conn.commit()
            raise _translate(exc, name) from None
        return name
    raise RetryableError(f"all {POOL} replication origins {prefix}[_n] are in use on the sink; will retry")


def xact_setup(conn, lsn: str, commit_time) -> None:
    """Stamp the session's current transaction with the source's commit position and time."""
    conn.cursor().execute("SELECT pg_replication_origin_xact_setup(%s::pg_lsn, %s)", (lsn, commit_time))


def drop(conn, prefix: str) -> list[str]:
    """Drop the direction's origins on this database's server, ending sessions that still hold one (a killed
    consumer's leftovers); the names dropped. `conn` must be in autocommit."""
    cur = conn.cursor()
    cur.execute("SELECT roname FROM pg_replication_origin WHERE roname = %s OR left(roname, %s) = %s",
                (prefix, len(prefix) + 1, prefix + "_"))
    names = [r[0] for r in cur.fetchall() if r[0] == prefix or r[0][len(prefix) + 1:].isdigit()]
    for name in names:
        cur.execute("""SELECT pg_terminate_backend(pid) FROM pg_locks
                       WHERE locktype = 'advisory' AND objsubid = 2 AND classid::int = hashtext(%s)
                         AND objid::int = hashtext(%s) AND pid <> pg_backend_pid()""", (_LOCK_SPACE, name))
        cur.execute("SELECT pg_replication_origin_drop(%s)", (name,))
    return [f"replication origin {n}" for n in names]


def _translate(exc: Exception, name: str) -> Exception:
    code = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)
    text = " ".join(str(exc).split())
    if code == "55006":  # in use: a killed session's backend, on its way out
        return RetryableError(f"replication origin {name} is still in use on the sink ({text}); will retry",
                              code)
    if code == "42501":
        return TerminalError(f"the sink user may not use replication origin {name} ({text}): connect as a "
                             f"superuser, or GRANT EXECUTE ON FUNCTION {', '.join(names('function', {BIDIRECTIONAL}))} "
                             f"TO the user (`sluicegate check replicate … --bidirectional` prints each statement)",
                             code)
    if code and code.startswith(("08", "57")):
        return RetryableError(f"setting up replication origin {name}: {text}", code)
    return TerminalError(f"setting up replication origin {name}: {text}", code)

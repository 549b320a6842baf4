"""A consistent snapshot of tables tied to a position (VReplication's copy snapshot on PostgreSQL).

Briefly lock the tables in SHARE mode (waits out its writers, blocks new ones), open a REPEATABLE READ
transaction in a second session, export its snapshot and read the WAL insert position, then release the
lock. Every change to the tables committed before the position is in the snapshot; every later one
commits after it. The lock is taken with a short lock_timeout and retried, so a long-running writer
never makes the application's writes queue behind us for long.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psycopg
from psycopg import sql

from ..errors import RetryableError
from ..position import parse_lsn
from .catalog import Table
from .connect import connect
from .locks import LockTimeout, describe_holders

if TYPE_CHECKING:
    from typing import Self


@dataclass
class TableSnapshot:
    name: str  # for SET TRANSACTION SNAPSHOT in other sessions
    position: int
    conn: psycopg.Connection  # holds the snapshot open: keep it idle-in-transaction while others import it
    xids: str = ""  # the snapshot as txid_current_snapshot() shows it (xmin:xmax:in-progress): see committed_since

    def close(self) -> None:
        try:
            self.conn.rollback()
        finally:
            self.conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def take_snapshot(source_url: str, tables: Table | list[Table], *, lock_timeout_ms: int = 500,
                  attempts: int = 20, stop: threading.Event | None = None) -> TableSnapshot:
    """`stop`: set, the retries end at once (RetryableError)."""
    tables = [tables] if isinstance(tables, Table) else list(tables)
    names = sql.SQL(", ").join(t.ident for t in tables)
    shown = ", ".join(t.qualified for t in tables)
    locker = connect(source_url, role="source")
    holder = connect(source_url, role="source")
    holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    holder.read_only = True
    try:
        for attempt in range(attempts):
            try:
                locker.execute("SELECT set_config('lock_timeout', %s, true)", (f"{lock_timeout_ms}ms",))
                locker.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(names))
                break
            except psycopg.errors.LockNotAvailable:
                locker.rollback()
                # back off; writers go on meanwhile
                if (stop or threading.Event()).wait(min(0.05 * 2**attempt, 2.0)):
                    raise RetryableError(f"stopped while locking {shown} for a snapshot") from None
        else:
            holders = describe_holders(locker, [t.ident.as_string(locker) for t in tables], "ShareLock")
            raise LockTimeout(
                f"could not lock {shown} on the source for a snapshot in {attempts} tries of {lock_timeout_ms} ms"
                f"{holders or ': a long transaction writes to it'}; will retry"
            )
        name, lsn, xids = holder.execute(
            "SELECT pg_export_snapshot(), pg_current_wal_insert_lsn()::text, txid_current_snapshot()::text"
        ).fetchone()
        locker.rollback()  # release the lock: the snapshot is taken
        return TableSnapshot(name, parse_lsn(lsn), holder, xids)
    except BaseException:
        holder.close()
        raise
    finally:
        locker.close()


def committed_since(conn: psycopg.Connection, xids: str) -> bool:
    """Whether any transaction has ended since a snapshot was taken (`TableSnapshot.xids`), by comparing it
    with a new one: a commit or an abort moves xmax (the latest ended xid + 1) or leaves the in-progress list,
    and every change to a table commits with an xid. Equal snapshots: nothing committed in between, whatever
    WAL the server wrote meanwhile (checkpoints, its running-transactions records every 15 s)."""
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise ValueError("committed_since needs a session outside a transaction (a fresh snapshot)")
    now = conn.execute("SELECT txid_current_snapshot()::text").fetchone()[0]
    conn.rollback()
    return now != xids

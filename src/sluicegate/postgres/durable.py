"""A source position is confirmed (the slot lets the source drop the WAL before it) only once the target
transaction that recorded it is on the target's disk.

A target server with `synchronous_commit = off` returns from COMMIT before the commit record is flushed: a
crash of that server can lose the last commits after the slot was confirmed past them, and the stream could
then only be re-bootstrapped. The sessions that record positions commit with `synchronous_commit = local`
when the server's setting is off (one flush per batch, not per source transaction); any other setting
already flushes locally and is kept as the user chose it (with synchronous standbys it waits for them too).
Earlier commits of other sessions (a copy's tasks) are in the WAL before that commit record, so one flushed
commit makes them durable as well.
"""

from __future__ import annotations

import psycopg


def flush_on_commit(conn: psycopg.Connection) -> None:
    """This session's commits return once flushed on its server. In the caller's transaction (if any): the
    setting is session-wide once that commits (set_config(..., false))."""
    conn.execute("SELECT set_config('synchronous_commit', 'local', false) "
                 "WHERE current_setting('synchronous_commit') = 'off'")

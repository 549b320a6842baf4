"""Target failover: confirm a source position only once the target's physical standbys have it too.

durable.py makes the commit that records a position flushed on the target itself. A target that is a primary
with asynchronous standbys can still fail over to a standby that lacks its last commits: had the source slot
been confirmed past them, the promoted target would stand behind the slot, and the stream could only be
re-bootstrapped. With the workflow option `confirm_after_target_standbys`, a position is confirmed only once
every physical standby streaming from the target has flushed past the target WAL position read right after
the commit that recorded it (that position is at or after the commit record's end).

The gate keeps (target WAL position, source position) pairs in commit order and releases the newest pair
whose target position every standby has flushed. With no standby streaming it releases nothing: the source
keeps its WAL meanwhile (max_slot_wal_keep_size and Replicate's governor cap it), and `note` says so for the
stream's status. Reading the standbys' positions in pg_stat_replication takes pg_read_all_stats for a user
that is not a superuser (postgres/needs.py).
"""

from __future__ import annotations

from collections import deque

import psycopg

from ..errors import TerminalError
from ..position import format_lsn, parse_lsn

OPTION = "confirm_after_target_standbys"  # the workflow option (workflows.options) that turns it on
MAX_PENDING = 256  # pairs kept; past it every other older one goes (releasing later is always safe)

# Physical walsenders only: a logical one (a reverse stream, another subscriber) holds a logical slot.
# A standby streams (state 'streaming', or 'catchup' while it is behind); one that has not reported a flush
# position yet counts as having flushed nothing. Without pg_read_all_stats a user sees only the walsenders'
# pids (every other column null): `hidden`.
_STANDBYS = """
    SELECT pg_current_wal_lsn()::text,
           coalesce(min(coalesce(r.flush_lsn, '0/0')) FILTER (WHERE r.state IN ('streaming', 'catchup')),
                    '0/0')::text,
           count(*) FILTER (WHERE r.state IN ('streaming', 'catchup')), count(r.pid) FILTER (WHERE r.state IS NULL)
    FROM (SELECT 1) one LEFT JOIN pg_stat_replication r ON r.pid IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM pg_replication_slots s WHERE s.active_pid = r.pid AND s.slot_type = 'logical')"""


def enabled(options: dict) -> bool:
    return bool(options.get(OPTION))


def set_enabled(conn: psycopg.Connection, workflow: str, on: bool) -> None:
    """`workflow set`: turn the option on or off for an existing workflow, in the caller's transaction."""
    conn.execute("UPDATE sluicegate.workflows SET options = options || jsonb_build_object(%s::text, %s::boolean) "
                 "WHERE name = %s", (OPTION, on, workflow))


class StandbyGate:
    """Which recorded source position may be confirmed now. Disabled: each one, as soon as it is recorded."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.pending: deque[tuple[int, int]] = deque()  # (target WAL position, source position), oldest first
        self.note = ""  # why confirmation is held, for the stream's message; "" when it is not
        self._shown = ""  # the note as the stream's message last said it

    def recorded(self, conn: psycopg.Connection, position: int) -> int | None:
        """`position` was just committed on the target by a transaction of `conn`'s server: the position to
        confirm now, if any (the newest released). Call right after that commit; `conn` is left as found."""
        if not self.enabled:
            return position
        return self._release(conn, position)

    def release(self, conn: psycopg.Connection) -> int | None:
        """Between commits: the newest pending position the standbys have flushed since, if any."""
        if not self.enabled or not self.pending:
            return None
        return self._release(conn, None)

    def note_changed(self) -> str | None:
        """The note, if the stream's message must change to say it (or to clear it); else None."""
        if self.note == self._shown:
            return None
        self._shown = self.note
        return self.note

    def _release(self, conn: psycopg.Connection, position: int | None) -> int | None:
        idle = not conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        try:
            now, flushed, streaming, hidden = conn.execute(_STANDBYS).fetchone()
        finally:
            if idle:
                conn.rollback()  # a read-only transaction the caller did not open
        if position is not None:
            self.pending = push(self.pending, parse_lsn(now), position)
        if hidden:
            user = conn.execute("SELECT current_user").fetchone()[0]
            if idle:
                conn.rollback()
            raise TerminalError(
                f"the workflow confirms source positions only once the target's standbys have them "
                f"({OPTION}), but user {user} may not read their positions in pg_stat_replication: "
                f"GRANT pg_read_all_stats TO {user} on the target, or connect as a superuser")
        if not streaming:
            held = format_lsn(self.pending[0][1]) if self.pending else "?"
            self.note = (f"confirming source positions waits for the target's standbys: none is streaming from "
                         f"the target (pg_stat_replication); the source slot stays before {held}, and the "
                         f"source keeps its WAL")
            return None
        self.note = ""
        return take(self.pending, parse_lsn(flushed))


def push(pending: deque, target_lsn: int, position: int) -> deque:
    """`pending` with the pair added (a position not past the newest one adds nothing), at most MAX_PENDING
    long: past it every other older pair goes — dropping one only delays its release to a later one's."""
    if pending and position <= pending[-1][1]:
        return pending
    pending.append((target_lsn, position))
    if len(pending) <= MAX_PENDING:
        return pending
    newest = pending.pop()
    return deque([*list(pending)[1::2], newest])


def take(pending: deque, flushed: int) -> int | None:
    """Pop the pairs whose target position the standbys have flushed; the newest source position of them."""
    released = None
    while pending and pending[0][0] <= flushed:
        released = pending.popleft()[1]
    return released

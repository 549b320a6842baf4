"""Safe time: the source time T such that every source transaction committed at or before T is on the sink.

Each stream keeps its own (`sluicegate.streams.safe_time`), moved in the same target transaction as the batch
it describes (workflow/state.save_position): the commit time of the last transaction applied, or, when the
batch left nothing the source had flushed unapplied, the source's clock when it read that flush position (so an
idle source still moves it). It only moves forward, and only while the stream is Running: a table being
(re-)copied is not all there. A sink's safe time is the minimum over its streams, each of which only grows, so
it never goes backwards either; it is NULL until every stream has one.

PostgreSQL takes a transaction's commit time just before writing its commit record, so transactions that
commit at the same moment may reach the WAL in the other order; safe time inherits that skew (the time it
takes to write and flush one commit record).
"""

from __future__ import annotations

from datetime import datetime, timezone

from ..workflow import state as st


def sink_safe_time(conn, workflow: str) -> datetime | None:
    row = conn.execute(
        """SELECT CASE WHEN bool_and(safe_time IS NOT NULL) THEN min(safe_time) END
           FROM sluicegate.streams WHERE workflow = %s""", (workflow,)).fetchone()
    return row[0] if row else None


def safe_time_fields(wf: st.Workflow, conn, source_now: datetime | None) -> dict:
    """`safe_time` (ISO 8601, UTC) and `safe_time_lag_seconds` (by the source's clock when known, else the
    sink's), for status."""
    safe = sink_safe_time(conn, wf.name)
    if source_now is None:
        source_now = conn.execute("SELECT now()").fetchone()[0]
    return _fields(safe, source_now)


def _fields(safe: datetime | None, now: datetime) -> dict:
    if safe is None:
        return {"safe_time": None, "safe_time_lag_seconds": None}
    lag = round(max(0.0, (now - safe).total_seconds()), 3)
    return {"safe_time": format_time(safe), "safe_time_lag_seconds": lag}


def advance_safe_time(previous: str | None, commit_time: datetime | None,
                      source_now: datetime | None) -> str | None:
    """A Delta sink's safe time after a batch (kept in its state document as ISO 8601 UTC): the latest of the
    previous one, the batch's last applied commit time, and the source's clock when the batch reached the
    flush position read at that clock (None when it did not). Never earlier than `previous`."""
    times = [t for t in (parse_time(previous), commit_time, source_now) if t is not None]
    return format_time(max(times)) if times else None


def parse_time(text: str | None) -> datetime | None:
    if text is None:
        return None
    t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def format_time(t: datetime) -> str:
    return t.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


def lake_safe_time_fields(safe_time: str | None, source_now: datetime | None) -> dict:
    """`safe_time` and `safe_time_lag_seconds` of a Delta sink (by the source's clock when known, else this
    machine's)."""
    return _fields(parse_time(safe_time), source_now or datetime.now(timezone.utc))

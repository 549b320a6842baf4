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

from datetime import datetime

from ..workflow import state as st


def sink_safe_time(conn, workflow: str) -> datetime | None:
    row = conn.execute(
        """SELECT CASE WHEN bool_and(safe_time IS NOT NULL) THEN min(safe_time) END
           FROM sluicegate.streams WHERE workflow = %s""", (workflow,)).fetchone()
    return row[0] if row else None


def safe_time_fields(wf: st.Workflow, conn, source_now: datetime | None) -> dict:
    """`safe_time` (ISO 8601, UTC) and `safe_time_lag_seconds` (by the source's clock when known, else the
    sink's), for status."""
    from datetime import timezone

    safe = sink_safe_time(conn, wf.name)
    if source_now is None:
        source_now = conn.execute("SELECT now()").fetchone()[0]
    if safe is None:
        return {"safe_time": None, "safe_time_lag_seconds": None}
    return {"safe_time": safe.astimezone(timezone.utc).isoformat().replace("+00:00", "Z"),
            "safe_time_lag_seconds": round(max(0.0, (source_now - safe).total_seconds()), 3)}

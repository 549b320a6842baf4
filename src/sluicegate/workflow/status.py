"""A workflow's status as plain data: what `status --json` prints and the progress display reads."""

from __future__ import annotations

from datetime import datetime, timezone

from ..position import format_lsn
from ..postgres.connect import redact
from . import state as st


def workflow_status(wf: st.Workflow, now: datetime | None = None) -> dict:
    now = now or datetime.now(timezone.utc)
    streams = []
    for s in wf.streams:
        lag = None
        if s.caught_up_at is not None and s.state == st.RUNNING:
            lag = max(0.0, (now - s.caught_up_at).total_seconds())
        tables = []
        for t in s.tables:
            total = max(t.table.estimated_rows, t.rows_copied)
            tables.append({
                "table": t.table.qualified,
                "state": "Copied" if t.done else ("Copying" if t.lastpk is not None else "Pending"),
                "rows_copied": t.rows_copied,
                "rows_total": total,
                "lastpk": t.lastpk,
            })
        streams.append({
            "id": s.id,
            "source": redact(s.source_url),
            "source_shard": s.source_shard,
            "state": s.state,
            "message": s.message,
            "position": format_lsn(s.position) if s.position is not None else None,
            "lag_seconds": round(lag, 3) if lag is not None else None,
            "transaction_time": s.transaction_time.isoformat() if s.transaction_time else None,
            "updated_at": s.updated_at.isoformat(),
            "slot": s.slot_name,
            "tables": tables,
        })
    states = {s["state"] for s in streams}
    state = st.ERROR if st.ERROR in states else (states.pop() if len(states) == 1 else "Mixed")
    message = next((s["message"] for s in streams if s["message"]), "")
    return {"workflow": wf.name, "kind": wf.kind, "state": state, "message": message, "streams": streams}


def merge_status(parts: list[tuple[str, dict]]) -> dict:
    """One status over every target shard's (a Reshard); a single part is returned as it is."""
    if len(parts) == 1:
        return parts[0][1]
    streams = []
    for shard, status in parts:
        streams += [{**s, "target_shard": shard} for s in status["streams"]]
    states = {s["state"] for s in streams}
    state = st.ERROR if st.ERROR in states else (states.pop() if len(states) == 1 else "Mixed")
    message = next((f"stream {s['id']} (target shard {s['target_shard']}): {s['message']}"
                    for s in streams if s["message"]), "")
    first = parts[0][1]
    return {"workflow": first["workflow"], "kind": first["kind"], "state": state, "message": message,
            "streams": streams}

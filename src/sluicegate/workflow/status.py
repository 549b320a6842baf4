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
            "source": redact(wf.source_url),
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

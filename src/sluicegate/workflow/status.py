"""A workflow's status as plain data: what `status --json` prints and the progress display reads.

Whether a driver runs comes from its heartbeat (heartbeat.py); how much WAL each stream's slot holds on its
source from the source itself (`slot_facts`), when the caller asks for it.
"""

from __future__ import annotations

from datetime import datetime, timezone

from ..errors import SluicegateError
from ..position import format_lsn
from ..postgres import capture
from ..postgres.connect import connect, describe, describe_conn, first_line, has_password, redact
from ..sizes import format_size
from . import state as st
from .heartbeat import is_running
from .passwords import stored_urls

WAL_WARNING = 1 << 30  # bytes of WAL a slot may hold before status warns (--wal-warning)
_ACTIVE = (st.INIT, st.COPYING, st.RUNNING)


def slot_facts(wf: st.Workflow) -> dict[int, dict]:
    """Stream id -> {"retained_wal_bytes", "wal_status", "source_host", "reading"} read from each stream's
    source, or {"source_error"} when the source cannot be asked (status goes on without it). `source_host`:
    the server reached (of a URL that lists several hosts: the primary, as the stream's own sessions reach it,
    connect.primary_only); `reading`: the stream's slot has a reader there now."""

    facts: dict[int, dict] = {}
    by_source: dict[str, list[st.Stream]] = {}
    for s in wf.streams:
        by_source.setdefault(s.source_url, []).append(s)
    for url, streams in by_source.items():
        try:
            with connect(url, role="source", autocommit=True, connect_timeout=3) as src:
                host = describe_conn(src).rpartition("/")[0]
                for s in streams:
                    held, wal_status = capture.retained_wal(src, s.slot_name)
                    info = capture.slot_info(src, s.slot_name)
                    facts[s.id] = {"retained_wal_bytes": held, "wal_status": wal_status, "source_host": host,
                                   "reading": bool(info and info.active_pid)}
        except SluicegateError as exc:
            facts.update({s.id: {"source_error": str(exc)} for s in streams})
        except Exception as exc:  # noqa: BLE001 - e.g. no right to read pg_replication_slots: say so, go on
            facts.update({s.id: {"source_error": f"source {describe(url)}: {first_line(exc)}"} for s in streams})
    return facts


def workflow_status(wf: st.Workflow, now: datetime | None = None, slots: dict[int, dict] | None = None,
                    wal_warning: int = WAL_WARNING) -> dict:
    """`slots`: slot_facts(wf), or None to leave the source alone (retained_wal_bytes and wal_status are then
    null)."""
    now = now or datetime.now(timezone.utc)
    d = wf.driver
    seen = round(d.seen_seconds_ago, 1) if d.seen_seconds_ago is not None else None
    driver = {"running": is_running(d), "last_seen_seconds": seen, "pid": d.pid, "host": d.host}
    warnings = []
    streams = []
    for s in wf.streams:
        lag = None
        if s.caught_up_at is not None and s.state == st.RUNNING:
            lag = max(0.0, (now - s.caught_up_at).total_seconds())
        tables = []
        for t in s.tables:
            # The estimate is of the source's rows: a copied table shows what it has (a rule filters rows).
            total = t.rows_copied if t.done else max(t.table.estimated_rows, t.rows_copied)
            tables.append({
                "table": t.table.qualified,
                "state": "Copied" if t.done else ("Copying" if t.lastpk is not None else "Pending"),
                "rows_copied": t.rows_copied,
                "rows_total": total,
                "lastpk": t.lastpk,
            })
        streams.append({
            "id": s.id,
            "copy": copy_summary(tables),
            "source": redact(s.source_url),
            "source_shard": s.source_shard,
            "state": s.state,
            "message": s.message,
            "position": format_lsn(s.position) if s.position is not None else None,
            "lag_seconds": round(lag, 3) if lag is not None else None,
            "transaction_time": s.transaction_time.isoformat() if s.transaction_time else None,
            "updated_at": s.updated_at.isoformat(),
            "slot": s.slot_name,
            "retained_wal_bytes": None,
            "wal_status": None,
            "source_host": None,
            "reading": None,
            "tables": tables,
        })
        facts = (slots or {}).get(s.id, {})
        streams[-1].update(facts)
        held = facts.get("retained_wal_bytes")
        if held is not None and held > wal_warning:
            warnings.append(f"stream {s.id}: replication slot {s.slot_name} holds {format_size(held)} of WAL on "
                            f"its source (over {format_size(wal_warning)}), and more while the stream "
                            f"{'lags' if driver['running'] else 'does not run'}; run the workflow, or delete it "
                            f"to free the WAL (max_slot_wal_keep_size caps it)")
        if facts.get("wal_status") in ("unreserved", "lost"):
            warnings.append(f"stream {s.id}: replication slot {s.slot_name} has wal_status "
                            f"{facts['wal_status']}: the source "
                            f"{'has removed' if facts['wal_status'] == 'lost' else 'is about to remove'} WAL it "
                            f"still needs")
        if facts.get("source_error"):
            warnings.append(f"stream {s.id}: {facts['source_error']}")
    states = {s["state"] for s in streams}
    state = st.ERROR if st.ERROR in states else (states.pop() if len(states) == 1 else "Mixed")
    message = next((s["message"] for s in streams if s["message"]), "")
    if not driver["running"] and any(s["state"] in _ACTIVE for s in streams):
        seen = driver["last_seen_seconds"]
        warnings.insert(0, f"no driver running ({f'last seen {seen:.0f} s ago' if seen is not None else 'never seen'}):"
                           f" nothing is copied or replicated, and the lag grows with every source write; start "
                           f"one with `sluicegate workflow run {wf.name}`")
    if any(has_password(u) for u in stored_urls(wf)):
        warnings.append("a source password is stored on the target (by an older Sluicegate): put it in a pgpass "
                        "file (PGPASSFILE) and the next `workflow run` removes it")
    return {"workflow": wf.name, "kind": wf.kind, "state": state, "message": message, "driver": driver,
            "warnings": warnings, "streams": streams}



def copy_summary(tables: list[dict]) -> dict:
    """A stream's copy in one line's worth of figures (status of thousands of tables): how many tables are
    copied, copying and pending, and the rows."""
    states = [t["state"] for t in tables]
    return {"tables": len(tables), "copied": states.count("Copied"), "copying": states.count("Copying"),
            "pending": states.count("Pending"), "rows_copied": sum(t["rows_copied"] for t in tables),
            "rows_total": sum(t["rows_total"] for t in tables)}


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
    drivers = [status["driver"] for _, status in parts]
    running = [d for d in drivers if d["running"]]
    # A warning of some target shards only (a driver that no longer updates one of them) says which.
    every = set.intersection(*(set(status["warnings"]) for _, status in parts))
    warnings = list(dict.fromkeys(w if w in every else f"target shard {shard}: {w}"
                                  for shard, status in parts for w in status["warnings"]))
    return {"workflow": first["workflow"], "kind": first["kind"], "state": state, "message": message,
            "driver": (running or drivers)[0], "warnings": warnings, "streams": streams}


def workflow_summary(wf: st.Workflow) -> dict:
    """One line of `workflow list`: kind, state, the largest lag, the driver."""
    status = workflow_status(wf)
    lags = [s["lag_seconds"] for s in status["streams"] if s["lag_seconds"] is not None]
    return {"workflow": wf.name, "kind": wf.kind, "state": status["state"], "message": status["message"],
            "lag_seconds": max(lags) if lags else None, "driver": status["driver"]}

"""What `workflow status` adds for a Replicate sink: its safe time, and every sink's slot on the source."""

from __future__ import annotations

from ..postgres.connect import connect, describe, first_line, redact
from ..sizes import format_size
from ..workflow import state as st
from . import governor
from .model import Cluster
from .safetime import safe_time_fields


def cluster_status(wf: st.Workflow, target_url: str) -> dict:
    """{"safe_time", "safe_time_lag_seconds", "sink", "sinks": [...], "warnings": [...]}; the source may be
    unreachable (the sinks' slots are then unknown, and the lag is by the sink's clock)."""
    cluster = Cluster.of(wf)
    warnings = []
    holds, source_now = [], None
    with connect(target_url, role="target") as conn:
        try:
            with connect(cluster.source_url, role="source", autocommit=True, connect_timeout=3) as src:
                source_now = src.execute("SELECT clock_timestamp()").fetchone()[0]
                holds = governor.holds(src, conn, cluster)
        except Exception as exc:  # noqa: BLE001 - status goes on without the source
            warnings.append(f"source {describe(cluster.source_url)}: {first_line(exc)}")
        fields = safe_time_fields(wf, conn, source_now)
    sinks = []
    for sink, url in cluster.sinks.items():
        hold = next((h for h in holds if h.sink == sink), None)
        entry = {"sink": sink, "url": redact(url), "this": sink == cluster.sink, "slot": cluster.slot(sink)}
        if hold is not None:
            entry.update(hold.to_json())
            if not hold.exists and hold.released:
                warnings.append(f"sink {sink}: its replication slot {hold.slot} is gone from the source "
                                f"({hold.released}); `{cluster.bootstrap_command(sink)}` brings it back")
            elif not hold.exists and sink == cluster.sink and all(s.position is None for s in wf.streams):
                pass  # not made yet: this sink's consumer makes it on its first run
            elif not hold.exists and sink == cluster.sink:
                warnings.append(f"sink {sink}: its replication slot {hold.slot} is gone from the source; "
                                f"`{cluster.bootstrap_command(sink)}` brings it back")
            elif not hold.exists:  # another sink: whether it ever had a slot is in its own state
                warnings.append(f"sink {sink}: no replication slot {hold.slot} on the source: its consumer has "
                                f"not run yet, or the slot was dropped (then `{cluster.bootstrap_command(sink)}` "
                                f"brings it back)")
            elif (cap := governor.over_cap(hold, cluster)) is not None:
                warnings.append(f"sink {sink}: {cap.replace('it held', 'its slot holds')}: the retention governor "
                                f"releases it once no consumer reads it")
        sinks.append(entry)
    caps = {"max_retained_wal": format_size(cluster.max_retained_wal) if cluster.max_retained_wal else None,
            "max_retention_age_seconds": cluster.max_retention_age}
    return {**fields, "sink": cluster.sink, "caps": caps, "sinks": sinks, "warnings": warnings}



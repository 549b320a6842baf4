"""What `workflow status` adds for a Replicate sink: its safe time, and every sink's slot on the source."""

from __future__ import annotations

from ..appliers import lww
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
    holds, source_now, published = [], None, set()
    with connect(target_url, role="target") as conn:
        try:
            for shard, url in cluster.sources.items():  # a keyspace source: each shard's slots, on it
                shard = shard if cluster.source_shards else None
                with connect(url, role="source", autocommit=True, connect_timeout=3) as src:
                    now = src.execute("SELECT clock_timestamp()").fetchone()[0]
                    source_now = now if source_now is None else max(source_now, now)  # the larger lag
                    holds += governor.holds(src, governor.PgSamples(conn, cluster.workflow), cluster, shard)
                    # A sink whose consumer never ran has neither slot nor publication yet: not a lost slot
                    published |= {r[0] for r in src.execute(
                        "SELECT pubname FROM pg_publication WHERE pubname = ANY(%s)",
                        ([cluster.slot(s, shard) for s in cluster.sinks],))}
        except Exception as exc:  # noqa: BLE001 - status goes on without the source
            warnings.append(f"source {describe(url)}: {first_line(exc)}")
        fields = safe_time_fields(wf, conn, source_now)
        if cluster.bidirectional:  # conflicts this side resolved by last-writer-wins, per type
            fields["conflicts"] = lww.conflict_counts(conn)
    sinks = []
    for sink, url in cluster.sinks.items():
        for hold in [h for h in holds if h.sink == sink] or [None]:  # one per source shard of a keyspace
            entry = {"sink": sink, "url": redact(url), "this": sink == cluster.sink,
                     "slot": hold.slot if hold is not None else cluster.slot(sink)}
            if hold is not None:
                entry.update(hold.to_json())
                entry["not_yet_run"] = not hold.exists and hold.slot not in published
                if not hold.exists and hold.released:
                    warnings.append(f"sink {sink}: its replication slot {hold.slot} is gone from the source "
                                    f"({hold.released}); `{cluster.bootstrap_command(sink)}` brings it back")
                elif entry["not_yet_run"]:
                    pass  # not made yet (or dropped with its publication by a bootstrap): the consumer makes it
                elif not hold.exists:
                    warnings.append(f"sink {sink}: its replication slot {hold.slot} is gone from the source; "
                                    f"`{cluster.bootstrap_command(sink)}` brings it back")
                elif (cap := governor.over_cap(hold, cluster)) is not None:
                    warnings.append(f"sink {sink}: {cap.replace('it held', 'its slot holds')}: the retention governor "
                                    f"releases it once no consumer reads it")
            sinks.append(entry)
    caps = {"max_retained_wal": format_size(cluster.max_retained_wal) if cluster.max_retained_wal else None,
            "max_retention_age_seconds": cluster.max_retention_age}
    return {**fields, "sink": cluster.sink, "caps": caps, "sinks": sinks, "warnings": warnings}



"""A Replicate sink deleted (`workflow delete W --target SINK`) is taken off the other sinks' lists, so their
governors stop looking for its slot and their status stops showing it. Best effort: a sink that cannot be
reached now keeps the entry, and its status shows the deleted sink's slot as not made."""

from __future__ import annotations

import logging

from ..postgres.connect import connect, describe
from ..workflow import state as st
from .model import Cluster
from .sinks import kind_of

log = logging.getLogger("sluicegate")


def forget_sink(cluster: Cluster) -> list[str]:
    """Remove `cluster.sink` from every other sink's workflow row; the sinks that could not be told."""
    missed = []
    for sink, url in cluster.sinks.items():
        if sink == cluster.sink:
            continue
        try:
            kind = kind_of(url)
            if kind is not None:  # a Delta sink (targets/delta/sink.py)
                kind.forget(url, cluster.workflow, cluster.sink)
                continue
            with connect(url, role="target", connect_timeout=5) as conn:
                if st.has_schema(conn):
                    conn.execute("""UPDATE sluicegate.workflows
                                    SET options = options #- ARRAY['cluster', 'sinks', %s]
                                    WHERE name = %s AND kind = 'Replicate'""", (cluster.sink, cluster.workflow))
        except Exception as exc:  # noqa: BLE001 - reported: that sink keeps listing the deleted one
            log.info("could not update sink %s (%s): %s", sink, describe(url), exc)
            missed.append(f"{sink} ({describe(url)})")
    return missed

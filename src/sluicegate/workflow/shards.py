"""Which target shards a workflow has, and each one's copy of the workflow: light (no rules, no Spark), for
whatever reads a Reshard's state (status, metrics, traffic, the engines' fan-out in reshard.py)."""

from __future__ import annotations

from ..postgres.connect import connect
from ..sharding.keyrange import KeyRange
from . import state as st

KIND = "Reshard"


def target_shards(wf: st.Workflow, target_url: str) -> dict[str, str]:
    """Target shard name -> URL for a Reshard; {'': target_url} for any other workflow."""
    if wf.kind != KIND:
        return {"": target_url}
    # in key order (jsonb keeps object keys in its own order: shortest first)
    return dict(sorted(wf.options["keyspace"]["target_shards"].items(), key=lambda kv: KeyRange.parse(kv[0])))


def load_all(name: str, target_url: str) -> list[tuple[str, str, st.Workflow]]:
    """(shard, URL, workflow as that target shard holds it) for every target shard of the workflow."""
    with connect(target_url, role="target") as conn:
        wf = st.load_workflow(conn, name)
    out = []
    for shard, url in target_shards(wf, target_url).items():
        if url == target_url:
            out.append((shard, url, wf))
            continue
        with connect(url, role="target") as conn:
            out.append((shard, url, st.load_workflow(conn, name)))
    return out

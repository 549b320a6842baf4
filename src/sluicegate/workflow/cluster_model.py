"""What every sink of a Replicate workflow records about the whole workflow (its `options["cluster"]`).

Each sink's workflow row lists all the sinks, so any sink's consumer can govern the others' slots and any
sink's URL finds the rest. A sink is named `s1`, `s2`, … in the order `create` was given them; its slot and
publication on the source are derived from the workflow's name and the sink's, and never shared.

A bidirectional workflow (active-active) is two one-way directions under one name: A->B, whose state is on
B (sink "b"), and B->A, whose state is on A (sink "a"). Each side records both clusters' fixed ids (a = 1,
b = 2: the tie-break of last-writer-wins) and which one it is; the writes of each direction carry a
replication origin named for it (postgres/origins.py), and each direction's capture drops writes that
have one.
"""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass, field

from ..errors import UsageError
from ..postgres.connect import describe, redact
from . import state as st

KIND = "Replicate"


@dataclass(frozen=True)
class Cluster:
    workflow: str
    source_url: str
    sinks: dict[str, str]  # sink name -> URL (without password), in creation order
    sink: str  # the sink whose state this is
    max_retained_wal: int | None = None  # bytes
    max_retention_age: float | None = None  # seconds
    bidirectional: bool = False
    # Bidirectional: cluster name -> its fixed id ({"a": 1, "b": 2}); this side is `sink`
    cluster_ids: dict[str, int] = field(default_factory=dict)
    tombstone_retention: float | None = None  # seconds (bidirectional): None is the default, 7 days
    # A keyspace source: shard key range -> URL (without password); empty for a single source database
    source_shards: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, wf: st.Workflow) -> Cluster:
        if wf.kind != KIND:
            raise UsageError(f"workflow {wf.name!r} is a {wf.kind}, not a Replicate workflow")
        c = wf.options["cluster"]
        return cls(wf.name, wf.source_url, dict(c["sinks"]), c["sink"], c.get("max_retained_wal"),
                   c.get("max_retention_age"), bool(c.get("bidirectional")), dict(c.get("cluster_ids") or {}),
                   c.get("tombstone_retention"), dict(c.get("source_shards") or {}))

    def to_json(self) -> dict:
        out = {"sinks": self.sinks, "sink": self.sink, "max_retained_wal": self.max_retained_wal,
               "max_retention_age": self.max_retention_age}
        if self.bidirectional:
            out |= {"bidirectional": True, "cluster_ids": self.cluster_ids, "cluster_id": self.local_id,
                    "tombstone_retention": self.tombstone_retention}
        if self.source_shards:
            out["source_shards"] = self.source_shards
        return out

    @property
    def sources(self) -> dict[str, str]:
        """Source shard -> URL: the keyspace's shards, or {"0": the source} for a single database."""
        return dict(self.source_shards) or {"0": self.source_url}

    def pairs(self) -> list[tuple[str, str, str, str]]:
        """(sink, source shard, source URL, slot) for every stream of every sink."""
        return [(sink, shard, url, self.slot(sink, None if shard == "0" and not self.source_shards else shard))
                for sink in self.sinks for shard, url in self.sources.items()]

    @property
    def local_id(self) -> int | None:
        """This side's fixed cluster id (bidirectional only)."""
        return self.cluster_ids.get(self.sink)

    @property
    def peer(self) -> str | None:
        """The other cluster's name: the source of the direction whose sink this is (bidirectional only)."""
        return next((c for c in self.cluster_ids if c != self.sink), None)

    @property
    def origin(self) -> str | None:
        """The replication origin this side's writes of the workflow carry (bidirectional only)."""
        return origin_name(self.workflow, self.sinks[self.sink], self.peer) if self.bidirectional else None

    def slot(self, sink: str | None = None, shard: str | None = None) -> str:
        """The sink's slot and publication on the source (one name for both); on that source shard's, for a
        keyspace source."""
        return slot_name(self.workflow, f"{sink or self.sink}/{shard}" if shard else sink or self.sink)

    def bootstrap_command(self, sink: str | None = None, tables: list[str] | None = None) -> str:
        url = redact(self.sinks[sink or self.sink])
        extra = f" --tables {','.join(tables)}" if tables else ""
        return f"sluicegate replicate bootstrap {shlex.quote(self.workflow)} --sink {shlex.quote(url)}{extra}"

    def way_out(self, sink: str | None = None) -> str:
        """The end of every error that means this sink cannot resume from its checkpoint."""
        return (f"sink {sink or self.sink} ({describe(self.sinks[sink or self.sink])}) cannot resume without losing "
                f"changes: re-bootstrap it with `{self.bootstrap_command(sink)}`")


def slot_name(workflow: str, sink: str) -> str:
    return st.object_name("sg", f"{workflow}/{sink}")


def origin_name(workflow: str, sink_url: str, source: str) -> str:
    """The origin of the direction from cluster `source` into the sink at `sink_url` (as created): origins are
    server-wide, and a workflow's name is unique only per database. `sg_<hash>_from_<source>`."""
    digest = hashlib.sha1(f"{workflow}\0{sink_url}".encode()).hexdigest()[:12]
    return f"sg_{digest}_from_{source}"


def direction(wf: st.Workflow) -> tuple[str, bool]:
    """(origin the sink's writes carry, whether the capture drops transactions that have an origin): ("",
    False) for a one-way workflow, whose sink may itself be a source of others that want its writes."""
    if wf.kind != KIND:
        return "", False
    cluster = Cluster.of(wf)
    return (cluster.origin, True) if cluster.bidirectional else ("", False)


def cluster_ids(wf: st.Workflow) -> tuple[int, int]:
    """(this side's id, the peer's) of a bidirectional sink, whose changes apply by last-writer-wins; (0, 0)
    for every other workflow."""
    if wf.kind != KIND:
        return 0, 0
    cluster = Cluster.of(wf)
    if not cluster.bidirectional:
        return 0, 0
    return cluster.local_id, cluster.cluster_ids[cluster.peer]


def way_out(wf: st.Workflow) -> str | None:
    """A Replicate sink's way out of a lost slot; None for other kinds (they keep their own)."""
    return Cluster.of(wf).way_out() if wf.kind == KIND else None

"""What every sink of a Replicate workflow records about the whole workflow (its `options["cluster"]`).

Each sink's workflow row lists all the sinks, so any sink's consumer can govern the others' slots and any
sink's URL finds the rest. A sink is named `s1`, `s2`, … in the order `create` was given them; its slot and
publication on the source are derived from the workflow's name and the sink's, and never shared.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from ..errors import UsageError
from ..postgres.connect import describe, redact
from ..workflow import state as st

KIND = "Replicate"


@dataclass(frozen=True)
class Cluster:
    workflow: str
    source_url: str
    sinks: dict[str, str]  # sink name -> URL (without password), in creation order
    sink: str  # the sink whose state this is
    max_retained_wal: int | None = None  # bytes
    max_retention_age: float | None = None  # seconds

    @classmethod
    def of(cls, wf: st.Workflow) -> Cluster:
        if wf.kind != KIND:
            raise UsageError(f"workflow {wf.name!r} is a {wf.kind}, not a Replicate workflow")
        c = wf.options["cluster"]
        return cls(wf.name, wf.source_url, dict(c["sinks"]), c["sink"], c.get("max_retained_wal"),
                   c.get("max_retention_age"))

    def to_json(self) -> dict:
        return {"sinks": self.sinks, "sink": self.sink, "max_retained_wal": self.max_retained_wal,
                "max_retention_age": self.max_retention_age}

    def slot(self, sink: str | None = None) -> str:
        """The sink's slot and publication on the source (one name for both)."""
        return slot_name(self.workflow, sink or self.sink)

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


def way_out(wf: st.Workflow) -> str | None:
    """A Replicate sink's way out of a lost slot; None for other kinds (they keep their own)."""
    return Cluster.of(wf).way_out() if wf.kind == KIND else None

"""Where a workflow writes, behind one interface (base.py): one folder per kind of target.

    postgres/   a PostgreSQL database: the state in its `sluicegate` schema (workflow/), the appliers, vdiff/
    delta/      Delta tables under a path or URI: the state beside them, its engine, player, copy and vdiff

The --target (or --sink) URL is resolved here, once: commands call what the Target it gives them offers, and
nothing outside a kind's folder (and the packages it composes) asks which kind a URL is. cluster/ reaches
sinks that are not PostgreSQL databases through its registry (cluster/sinks.py): `register_sink_kinds`
registers the kinds this program knows, called by the program that composes them (cli/).
"""

from __future__ import annotations

from .base import ProgressGroup, Target
from .delta import DeltaTarget
from .delta import register_sink_kind as register_sink_kinds

__all__ = ["ProgressGroup", "Target", "register_sink_kinds", "resolve"]


def resolve(url: str) -> Target:
    """The target `url` names: the first kind that claims it (a libpq URL is PostgreSQL's)."""
    from .postgres import PostgresTarget

    for kind in (DeltaTarget, PostgresTarget):
        if kind.claims(url):
            return kind(url)
    raise AssertionError("PostgresTarget claims every URL")  # pragma: no cover

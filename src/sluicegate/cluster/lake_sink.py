"""`replicate bootstrap` of a sink that is not a PostgreSQL database (cli/replicate.py names it here): the Delta
sink's code is targets/delta/sink.py, reached through the sink interface (sinks.py)."""

from __future__ import annotations

from ..errors import UsageError
from .sinks import kind_of


def bootstrap(workflow: str, target: str, tables: list[str] | None) -> list[str]:
    kind = kind_of(target)
    if kind is None:
        raise UsageError(f"{target} is not a sink of a kind this program knows")
    return kind.bootstrap(workflow, target, tables)

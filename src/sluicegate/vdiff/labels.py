"""A vdiff's name for what it compares: a table's qualified name ('public.t') and, when a workflow has a
stream per source shard, that shard after it ('public.t <- -80'). Built and taken apart here only."""

from __future__ import annotations

_SHARD = " <- "


def label(table: str, shard: str | None = None) -> str:
    """`table` (qualified), with `shard` after it when there is one."""
    return f"{table}{_SHARD}{shard}" if shard is not None else table


def parts(name: str) -> tuple[str, str | None]:
    """(qualified table, source shard or None) of a `label`."""
    table, sep, shard = name.partition(_SHARD)
    return table, shard if sep else None

"""A vdiff's name for what it compares: a table's qualified name ('public.t') and, when a workflow has a
stream per source shard, that shard after it ('public.t <- -80'). Built and taken apart here only."""

from __future__ import annotations

from ..errors import UsageError, did_you_mean

_SHARD = " <- "


def label(table: str, shard: str | None = None) -> str:
    """`table` (qualified), with `shard` after it when there is one."""
    return f"{table}{_SHARD}{shard}" if shard is not None else table


def parts(name: str) -> tuple[str, str | None]:
    """(qualified table, source shard or None) of a `label`."""
    table, sep, shard = name.partition(_SHARD)
    return table, shard if sep else None


def choose(known: list[str], names: list[str] | None, workflow: str) -> list[str]:
    """The labels of `known` that `names` name (a table qualified or bare, with or without its shard), in the
    order named; all of them without `names`."""
    if not names:
        return list(known)
    chosen = []
    for name in names:
        match = [q for q in known
                 if name in (q, q.split(".", 1)[1], parts(q)[0], parts(q)[0].split(".", 1)[1])]
        if not match:
            bare = [q.split(".", 1)[1] for q in known]
            hint = did_you_mean(name, known + bare) or f"; it has {', '.join(known)}"
            raise UsageError(f"table {name!r} is not in workflow {workflow}{hint}")
        chosen += [q for q in match if q not in chosen]
    return chosen

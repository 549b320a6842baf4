"""Which tables a captured statement touches (pure): one answer for every reader of the capture — the player's
replay (replay.py), the Delta target (targets/delta/ddl.py), the change model (changes/ddl.py).

- the tables its objects are or belong to (a column's, an index's table);
- a dropped table by its own name (sql_drop names no table for it);
- ALTER TABLE … RENAME TO by the table's old name: the message names it by its new one.

A dropped index names no table once it is gone: a reader with a target may ask the target whose it was.
"""

from __future__ import annotations

from collections.abc import Callable

from .message import DdlMessage
from .statement import NotReplayable, read

Known = Callable[[str, str], bool]  # (schema, name) -> the reader has that table


def touched(ddl: DdlMessage, known: Known) -> set[tuple[str, str]]:
    """The known tables the statement touches; a renamed table by its old name."""
    found = {t for t in ddl.tables() if known(*t)}
    for o in ddl.objects:
        if o.table is None and o.object_type == "table" and o.schema and o.name and known(o.schema, o.name):
            found.add((o.schema, o.name))
    renamed = renames(ddl)
    if renamed is not None:
        (schema, old), new = renamed
        if known(schema, old):
            found.discard(new)
            found.add((schema, old))
    return found


def renames(ddl: DdlMessage) -> tuple[tuple[str, str], tuple[str, str]] | None:
    """((schema, old name), (schema, new name)) of an ALTER TABLE … RENAME TO, else None."""
    if ddl.tag != "ALTER TABLE":
        return None
    try:
        renamed = read(ddl.statement, ddl.tag).renames_table
    except NotReplayable:
        return None
    if renamed is None:
        return None
    schema_given, old, new = renamed
    for s, n in ddl.tables():
        if n == new and schema_given in (None, s):
            return (s, old), (s, n)
    return None

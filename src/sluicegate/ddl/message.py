"""The logical message the source's event trigger (capture.py) emits for a DDL statement: its JSON, read.

Pure: bytes in, a DdlMessage out. The trigger writes `{"format": 1, "event", "tag", "statement",
"search_path", "objects": [...]}`; each object: `object_type`, `schema`, `identity` (object_identity), and
`table` ([schema, name] of the table the object is or belongs to: a column's or an index's table; null
when the source could not tell, as for a dropped index).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..position import format_lsn

PREFIX = "sluicegate.ddl"
FORMAT = 1  # what this reader understands; a trigger of a newer Sluicegate writes a higher one


class BadDdlMessage(ValueError):
    """A message under our prefix that this version cannot read."""


@dataclass(frozen=True)
class DdlObject:
    object_type: str  # 'table', 'table column', 'index', ... (pg_event_trigger_ddl_commands' names)
    schema: str | None
    identity: str  # object_identity: quoted where needed, 'public.items', 'public.items.note'
    table: tuple[str, str] | None  # (schema, name) of the table the object is or belongs to
    name: str | None = None  # a dropped object's own name (sql_drop's object_name)


@dataclass(frozen=True)
class DdlMessage:
    lsn: int  # where the message sits in the source's WAL (inside its transaction)
    event: str  # 'ddl_command_end' or 'sql_drop'
    tag: str  # the statement's command tag: 'ALTER TABLE', 'CREATE INDEX', 'DROP INDEX', ...
    statement: str  # current_query(): the whole query string the client sent
    search_path: str
    objects: tuple[DdlObject, ...]

    def tables(self) -> set[tuple[str, str]]:
        return {o.table for o in self.objects if o.table is not None}


def parse(content: bytes, lsn: int) -> DdlMessage:
    try:
        doc = json.loads(content)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadDdlMessage(f"the DDL message at {format_lsn(lsn)} is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise BadDdlMessage(f"the DDL message at {format_lsn(lsn)} is not a JSON object")
    version = doc.get("format")
    if version != FORMAT:
        raise BadDdlMessage(f"the DDL message at {format_lsn(lsn)} has format {version!r}; this Sluicegate reads format "
                            f"{FORMAT}: install the event trigger of this version (`sluicegate ddl install`)")
    try:
        objects = tuple(
            DdlObject(str(o["object_type"]), o.get("schema"), str(o.get("identity") or ""),
                      tuple(o["table"]) if o.get("table") else None, o.get("name"))
            for o in doc.get("objects") or ())
        return DdlMessage(lsn, str(doc["event"]), str(doc["tag"]), str(doc["statement"]),
                          str(doc.get("search_path") or ""), objects)
    except (KeyError, TypeError, ValueError) as exc:
        raise BadDdlMessage(f"the DDL message at {format_lsn(lsn)} lacks {exc}") from None

"""A captured DDL statement (ddl/message.py) as a DDL Statement of the change model, for the tables a reader streams.

Pure: a DdlMessage and what the reader streams in, a Statement (or None: the statement touches nothing the
reader streams) out. Which streamed tables a statement touches, as the player's replay decides it
(workflow/ddl_replay.py), without a target to ask:

- the tables its objects are or belong to (a column's, an index's table);
- a dropped table by its own name (sql_drop names no table for it);
- ALTER TABLE … RENAME TO: the message names the table by its new name; the reader streams it by the old one,
  which the statement lists (and the reader streams the table on under its new name: `renamed`);
- CREATE TABLE in a schema the reader streams whole (`schemas`): a table it may publish next.

A dropped index names no table once it is gone (the source's catalog no longer says whose it was): passed over.
"""

from __future__ import annotations

from collections.abc import Callable

from ..ddl.message import DdlMessage
from ..ddl.touched import touched as ddl_touched
from . import model as m

Streams = Callable[[str, str], bool]  # (schema, name) -> the reader streams that table


def touched(ddl: DdlMessage, streams: Streams, schemas: frozenset[str] | set[str] = frozenset()
            ) -> list[tuple[str, str]]:
    """The streamed tables the statement touches (ddl/touched.py), sorted; a renamed table by its old name; a
    CREATE TABLE in a schema the reader streams whole."""
    found = ddl_touched(ddl, streams)
    if ddl.tag == "CREATE TABLE":
        found |= {o.table for o in ddl.objects
                  if o.object_type == "table" and o.table is not None and o.table[0] in schemas}
    return sorted(found)


def statement(ddl: DdlMessage, tables: list[tuple[str, str]], statement_id: int,
              subtransaction_id: int) -> m.Statement:
    """The DDL Statement: one segment, at the message's place (start_position)."""
    st = m.Statement(type=m.DDL, statement_id=statement_id, segment_id=1, end_segment=True,
                     subtransaction_id=subtransaction_id, start_position=ddl.lsn)
    st.ddl.tag, st.ddl.sql, st.ddl.search_path = ddl.tag, ddl.statement, ddl.search_path
    st.ddl.tables.extend(m.TableName(schema=s, name=n) for s, n in tables)
    return st

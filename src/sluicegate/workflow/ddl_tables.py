"""What a replayed statement does to the stream's set of tables and to their descriptions (`--on-ddl exec`).

Everything here runs in the batch's target transaction, after the statement itself ran there, so the target
table, its copy_state row (description, name, membership) and the stream's position commit together:

- ALTER TABLE: the table's description (copy_state spec) is read back from the target table, which now has
  the source's shape at that point of the stream. A copy cycle that comes later reads the columns it names
  (the source's shape at its snapshot, which the stream has replayed up to by then: catchup and fast-forward
  come first), and the applier stages the rows after the statement in it.
- ALTER TABLE … RENAME TO: the copy_state row takes the new name (the publication follows the table itself).
- DROP TABLE: its copy_state row goes (the source's DROP took it out of the publication).
- CREATE TABLE in a schema the workflow moves whole: the table joins as `replicate add-tables` joins one
  (cluster/add_tables.py): (1) it is added to the publication on the source; (2) it is recorded as not yet
  copied and the stream goes (back) to Copying; (3) the engine copies it from its own snapshot, taken after
  (1), and replays what follows. Its changes between the CREATE and (1) are not decoded (pgoutput reads
  membership as of each change): the snapshot has them.

Descriptions read from the target carry the source's type oids (what Relation messages are compared with):
a user type's oid is looked up on the source by its name.
"""

from __future__ import annotations

from dataclasses import replace

import psycopg
from psycopg import sql

from ..errors import SluicegateError
from ..postgres import capture, catalog
from ..postgres.catalog import Column, Table
from ..postgres.types import FIRST_USER_OID
from . import state as st


class CannotJoin(ValueError):
    """A table that cannot join the workflow; the text says why and the way out."""


_COLUMNS = """
SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.atttypid::int, a.attnotnull,
       CASE WHEN a.attcollation <> 0 AND a.attcollation <> t.typcollation THEN co.collname END, a.atttypmod
FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid LEFT JOIN pg_collation co ON co.oid = a.attcollation
WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
ORDER BY a.attnum"""

# The primary key of the table named by %s, its columns in order (also schema_changes.py); NULL: none.
PRIMARY_KEY = """
SELECT array_agg(a.attname ORDER BY k.ord) FROM pg_index i
CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indrelid = to_regclass(%s) AND i.indisprimary AND k.ord <= i.indnkeyatts"""


def described(src: psycopg.Connection, dst: psycopg.Connection, schema: str, name: str,
              old: Table | None = None) -> Table:
    """The target table's description, with the source's oids for its columns' types. Given the `old`
    description, only columns and key are read (the key stays when the target has no primary key: its first
    copy cycle may have deferred it); else in full."""
    if old is None:
        try:
            table = catalog.describe_table(dst, schema, name)
        except SluicegateError as exc:  # e.g. no key: the source table has none either
            raise CannotJoin(exc.message) from None
        raw = table.columns
    else:
        ident = sql.Identifier(schema, name).as_string(dst)
        raw = tuple(Column(*r) for r in dst.execute(_COLUMNS, (ident,)).fetchall())
        key = dst.execute(PRIMARY_KEY, (ident,)).fetchone()[0]
        table = replace(old, schema=schema, name=name, key=tuple(key) if key and not old.keyless else old.key)
    previous = {c.name: c for c in old.columns} if old is not None else {}
    user = sorted({c.type_sql for c in raw if c.type_oid >= FIRST_USER_OID})
    oids = dict(src.execute("SELECT t, to_regtype(t)::oid::int FROM unnest(%s::text[]) AS t", (user,)).fetchall()) \
        if user else {}
    columns = []
    for c in raw:
        oid = c.type_oid
        if oid >= FIRST_USER_OID:
            was = previous.get(c.name)
            oid = oids.get(c.type_sql) or (was.type_oid if was is not None and was.type_sql == c.type_sql else oid)
        columns.append(Column(c.name, c.type_sql, oid, c.not_null, c.collation, c.typmod))
    return replace(table, columns=tuple(columns))


def refresh(src, dst, stream_id: int, table: Table) -> Table:
    """After an ALTER TABLE: the description read back and stored."""
    new = described(src, dst, table.schema, table.name, table)
    st.save_table_spec(dst, stream_id, new)
    return new


def rename(src, dst, stream_id: int, table: Table, new_name: str) -> Table:
    renamed = described(src, dst, table.schema, new_name, replace(table, name=new_name))
    dst.execute("UPDATE sluicegate.copy_state SET table_name = %s WHERE stream_id = %s AND table_name = %s",
                (renamed.qualified, stream_id, table.qualified))
    st.save_table_spec(dst, stream_id, renamed)
    return renamed


def drop(dst, stream_id: int, table: Table) -> None:
    dst.execute("DELETE FROM sluicegate.copy_state WHERE stream_id = %s AND table_name = %s",
                (stream_id, table.qualified))


def join(src, dst, stream_id: int, publication: str, schema: str, name: str) -> Table:
    """The table made on the target joins the stream: published on the source, recorded as not copied, the
    stream in Copying. CannotJoin when the source has no table of that name now (dropped or renamed since:
    the stream would wait for a copy it cannot take)."""
    if src.execute("SELECT to_regclass(format('%%I.%%I', %s::text, %s::text))", (schema, name)).fetchone()[0] is None:
        raise CannotJoin(f"the source has no table {catalog.quote_name(schema, name)} any more (dropped or renamed "
                         f"since)")
    table = described(src, dst, schema, name)
    try:
        capture.ensure_publication(src, publication, [table], add_only=True)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise CannotJoin(f"the source user may not add it to publication {publication} ({exc.sqlstate}: it "
                         f"takes the table's owner): ALTER TABLE {table.qualified} OWNER TO the workflow's "
                         f"source user, or add it with `ALTER PUBLICATION {publication} ADD TABLE "
                         f"{table.qualified}` as its owner") from None
    st.append_tables(dst, stream_id, [table])
    state, _ = st.read_stream(dst, stream_id)
    if state == st.RUNNING:
        st.set_state(dst, stream_id, st.COPYING, "")
    return table

"""Schema changes of replicated tables met in the stream: added columns follow, anything else stops it.

pgoutput sends a Relation message before the first change of a table after its shape changed (and at the
start of each decoding session). `classify` (postgres/relation_changes.py) compares one with the stream's
description of the table (its Table json in copy_state) — pure, no IO. `SchemaFollower` is what the player's applier calls with a Relation
that differs: it adds columns the source added to the target table (same type, collation and default, the
source's catalog read through the play task's control connection) and stores the table's new description,
all in the batch's target transaction — so table shape, rows, description and position commit together, and
a batch that fails leaves none of them changed. Any other change (a dropped, renamed or retyped column, a
changed key) stops the stream in Error naming it and the way out; once the target table is made to match the
source by hand, the next run adopts the source's shape (`workflow start`, then `workflow run`).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import psycopg
from psycopg import sql

from ..errors import SluicegateError, is_retryable
from ..postgres import catalog, locks
from ..postgres import types as pgtypes
from ..postgres.catalog import FIRST_USER_OID, Column, Table
from ..postgres.connect import first_line
from ..postgres.pgoutput import Relation
from ..postgres.relation_changes import (  # noqa: F401 - (classify & co. are also named here)
    ColumnChanges,
    SchemaStop,
    SourceColumn,
    builtin_type_name,
    by_hand_way_out,
    classify,
    older_rows_default,
    older_rows_text,
    rule_input,
    source_columns,
)
from . import state as st
from .ddl_tables import PRIMARY_KEY

log = logging.getLogger("sluicegate")

_TARGET_COLUMNS = """
SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
       CASE WHEN a.attcollation <> 0 AND a.attcollation <> t.typcollation THEN co.collname END
FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid LEFT JOIN pg_collation co ON co.oid = a.attcollation
WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum"""


class SchemaFollower:
    """Called by the player's applier with a Relation message whose columns differ from the table's
    description, once every row staged before it is written: returns the table's new description after
    bringing the target table to it, or raises TerminalError. Works in the target's open (batch)
    transaction; `changed` holds what this batch adopted, which the player keeps once the batch commits."""

    def __init__(self, src: psycopg.Connection, dst: psycopg.Connection, stream_id: int, workflow: str):
        self.src, self.dst, self.stream_id, self.workflow = src, dst, stream_id, workflow
        self.changed: dict[str, Table] = {}
        self._names: dict[tuple[int, int], str] = {}  # (type oid, typmod) -> format_type() on the source

    def __call__(self, rel: Relation, table: Table) -> Table:
        change = classify(rel, table)
        if change.unchanged:
            return table
        types = self._type_names(rel)
        if change.only_added:
            new = self._add_columns(rel, table, change, types)
        else:
            new = self._adopt_fixed_target(rel, table, change, types)
        st.save_table_spec(self.dst, self.stream_id, new)
        self.changed[new.qualified] = new
        return new

    # -- added columns ------------------------------------------------------------------------------------
    def _add_columns(self, rel: Relation, table: Table, change: ColumnChanges, types: list[str]) -> Table:
        target = self._target_columns(table)
        source = source_columns(self.src, rel.oid)
        type_of = dict(zip((c.name for c in rel.columns), types))
        columns = list(table.columns)
        enums, user_types, extensions = list(table.enums), list(table.types), list(table.extensions)
        for c in change.added:
            type_sql = type_of[c.name]
            have = target.get(c.name)
            if have is not None:  # added before (by a batch that committed, or by hand): the same type?
                if have[1] != type_sql:
                    raise SchemaStop(
                        f"column {c.name} was added to source table {table.qualified} as {type_sql}; target "
                        f"table {table.qualified} already has a column {c.name} of type {have[1]}: make the "
                        f"types equal, then `sluicegate workflow start {self.workflow}`, or re-create the "
                        f"workflow")
                columns.append(Column(c.name, type_sql, c.type_oid, have[2], have[3], c.typmod))
                continue
            col = source.get(c.name)
            if col is None or (col.type_oid, col.typmod) != (c.type_oid, c.typmod):
                now = "is gone" if col is None else f"is {col.type_sql} now"
                raise SchemaStop(
                    f"column {c.name} ({type_sql}) was added to source table {table.qualified} and changed "
                    f"again since (it {now} on the source): add it to target table {table.qualified} by hand "
                    f"as the changes carry it ({type_sql}), then `sluicegate workflow start "
                    f"{self.workflow}`; or "
                    f"re-create the workflow")
            needs = self._user_types(col)
            enums += [e for e in needs.enums if e not in enums]
            user_types += [t for t in needs.types if t not in user_types]
            extensions += [e for e in needs.extensions if e not in extensions]
            self._alter_add(table, col)
            columns.append(Column(c.name, col.type_sql, c.type_oid, col.not_null, col.collation, c.typmod))
        log.info("columns %s added to %s", ", ".join(c.name for c in change.added), table.qualified)
        return replace(table, columns=tuple(columns), enums=tuple(enums), types=tuple(user_types),
                       extensions=tuple(extensions))

    def _alter_add(self, table: Table, col: SourceColumn) -> None:
        parts = [sql.Identifier(col.name), sql.SQL(col.type_sql)]  # format_type() output is valid, quoted SQL
        if col.collation:
            parts.append(sql.SQL("COLLATE {}").format(sql.Identifier(col.collation)))
        # the rows the target already has get in it what they have on the source
        initial = older_rows_default(self.src, table.qualified, col, by_hand_way_out(
            f"target table {table.qualified}", self.workflow))
        if initial is not None:
            parts.append(sql.SQL("DEFAULT {}").format(initial))
        if col.not_null:
            parts.append(sql.SQL("NOT NULL"))
        statements = [sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {}").format(
            table.ident, sql.SQL(" ").join(parts))]
        if col.has_missing:  # older rows took the recorded value: from now on, the source's own default
            column = sql.SQL("ALTER TABLE {} ALTER COLUMN {}").format(table.ident, sql.Identifier(col.name))
            statements.append(column + (sql.SQL(" SET DEFAULT {}").format(sql.SQL(col.default))
                                        if col.default is not None else sql.SQL(" DROP DEFAULT")))
        ident = table.ident.as_string(self.dst)
        try:
            with locks.guard(self.dst, f"adding column {col.name} to {table.qualified}", [ident]):
                for s in statements:
                    self.dst.execute(s)
        except psycopg.Error as exc:
            if is_retryable(exc):
                raise
            raise SchemaStop(
                f"could not add column {col.name} ({col.type_sql}, default {col.default}) to target table "
                f"{table.qualified}: {first_line(exc)}; add it by hand, then `sluicegate workflow start "
                f"{self.workflow}`", getattr(exc, "sqlstate", None)) from None

    def _user_types(self, col: SourceColumn) -> pgtypes.TypeNeeds:
        """The user types (enums, composites, domains, extensions' types) of a new column, made on the target
        if missing (the copy does it for the others)."""
        if col.type_oid < FIRST_USER_OID:
            return pgtypes.TypeNeeds()
        try:
            needs = pgtypes.discover(self.src, [col.type_oid])
            pgtypes.ensure(self.dst, needs, catalog._ensure_enum)
        except SluicegateError as exc:
            if exc.retryable:
                raise
            raise SchemaStop(f"{exc.message}; or re-create the workflow") from None
        return needs

    # -- anything else: stop, unless the target table already matches the source -------------------------
    def _adopt_fixed_target(self, rel: Relation, table: Table, change: ColumnChanges,
                            types: list[str]) -> Table:
        target = self._target_columns(table)
        new_key = tuple(c.name for c in rel.columns if c.flags & 1) if rel.replica_identity in ("d", "i") \
            else table.key
        key = self.dst.execute(PRIMARY_KEY, (table.ident.as_string(self.dst),)).fetchone()[0] or new_key
        # A column dropped and added again looks the same on a target that was never changed: never adopted.
        matches = (not change.readded and set(target) == {c.name for c in rel.columns}
                   and all(target[c.name][1] == t for c, t in zip(rel.columns, types))
                   and set(key) == set(new_key))
        if not matches:
            said = "; ".join(change.describe(self._type_name))
            what = f"columns of source table {table.qualified} changed: {said}"
            if change.readded:
                raise SchemaStop(f"{what}. Sluicegate follows added columns only, and a target table cannot "
                                 f"show that its column was replaced: re-create the workflow")
            hints = self._hints(table, change, types)
            raise SchemaStop(
                f"{what}. Sluicegate follows added columns only: make target table {table.qualified} match "
                f"the source{' (' + '; '.join(hints) + ')' if hints else ''}, then "
                f"`sluicegate workflow start "
                f"{self.workflow}`; or re-create the workflow")
        columns = []
        for c, type_sql in zip(rel.columns, types):
            _, _, not_null, collation = target[c.name]
            columns.append(Column(c.name, type_sql, c.type_oid, not_null, collation, c.typmod))
        needs = pgtypes.discover(self.src, [c.type_oid for c in columns])
        log.warning("target table %s matches the source's new columns (%s): following them",
                    table.qualified, "; ".join(change.describe(self._type_name)))
        return replace(table, columns=tuple(columns), key=tuple(key),
                       enums=needs.enums, types=needs.types, extensions=needs.extensions,
                       existing_types=needs.existing)

    def _hints(self, table: Table, change: ColumnChanges, types: list[str]) -> list[str]:
        """The statements that make the target table match (as far as they can be written down), with names
        quoted only where they need it, as a person would type them."""
        names = [table.schema, table.name, *(n for pair in change.renamed for n in pair), *change.dropped,
                 *(c for c, _, _, _ in change.retyped)]
        quoted = dict(self.dst.execute("SELECT n, quote_ident(n) FROM unnest(%s::text[]) AS n",
                                       (names,)).fetchall())
        alter = f"ALTER TABLE {quoted[table.schema]}.{quoted[table.name]}"
        out = [f"{alter} RENAME COLUMN {quoted[o]} TO {quoted[n]}" for o, n in change.renamed]
        out += [f"{alter} DROP COLUMN {quoted[c]}" for c in change.dropped]
        out += [f"{alter} ALTER COLUMN {quoted[c]} TYPE {self._type_name(o, m)}"
                for c, _, o, m in change.retyped]
        return out

    def _type_names(self, rel: Relation) -> list[str]:
        """format_type() of each column of the message, on the source."""
        rows = self.src.execute(
            "SELECT format_type(o, m) FROM unnest(%s::oid[], %s::int[]) WITH ORDINALITY AS t(o, m, i) "
            "ORDER BY i",
            ([c.type_oid for c in rel.columns], [c.typmod for c in rel.columns])).fetchall()
        self._names = {(c.type_oid, c.typmod): r[0] for c, r in zip(rel.columns, rows)}
        return [r[0] for r in rows]

    def _type_name(self, oid: int, typmod: int) -> str:
        return self._names.get((oid, typmod)) or builtin_type_name(oid, typmod)

    def _target_columns(self, table: Table) -> dict[str, tuple]:
        """name -> (name, type_sql, not_null, collation) of the target table's columns."""
        rows = self.dst.execute(_TARGET_COLUMNS, (table.ident.as_string(self.dst),)).fetchall()
        if not rows:
            raise SchemaStop(f"target table {table.qualified} is gone: re-create the workflow")
        return {r[0]: r for r in rows}

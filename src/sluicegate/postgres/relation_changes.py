"""How a table's shape in a Relation message differs from the stream's description of it, and what the source
says about a column it added: pure comparison (`classify`) and catalog reads, no state of any workflow.

Below the appliers (a PostgreSQL applier checks a Relation's columns with `classify`) and the players
(workflow/schema_changes.py follows added columns; targets/delta/ adds them to Delta tables).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..errors import TerminalError
from .catalog import Table
from .pgoutput import Column as RelColumn
from .pgoutput import Relation

# format_type() of common built-in types, for messages made without a catalog at hand (typmods left out).
_BUILTIN_TYPES = {16: "boolean", 17: "bytea", 20: "bigint", 21: "smallint", 23: "integer", 25: "text",
                  114: "json", 700: "real", 701: "double precision", 1042: "character",
                  1043: "character varying", 1082: "date", 1083: "time without time zone",
                  1114: "timestamp without time zone",
                  1184: "timestamp with time zone", 1700: "numeric", 2950: "uuid", 3802: "jsonb"}


def builtin_type_name(oid: int, typmod: int) -> str:
    return _BUILTIN_TYPES.get(oid, f"type {oid}")


class SchemaStop(TerminalError):
    """A schema change the stream does not follow. `before`: the commit position of the source transaction
    that met it (set by the player), before which everything can still be applied."""

    before: int | None = None


@dataclass(frozen=True)
class ColumnChanges:
    """How a Relation message's columns differ from a table's description."""

    table: str  # qualified name
    added: tuple[RelColumn, ...] = ()  # columns after the known ones (alone: what Sluicegate follows)
    dropped: tuple[str, ...] = ()
    renamed: tuple[tuple[str, str], ...] = ()  # (old name, new name)
    retyped: tuple[tuple[str, str, int, int], ...] = ()  # (column, old type_sql, new type oid, new typmod)
    readded: tuple[str, ...] = ()  # dropped and added again under the same name: a new, later column
    key: tuple[tuple[str, ...], tuple[str, ...]] | None = None  # (old key, new key)

    @property
    def unchanged(self) -> bool:
        return not (self.added or self.incompatible)

    @property
    def incompatible(self) -> bool:
        """Anything but added columns."""
        return bool(self.dropped or self.renamed or self.retyped or self.readded or self.key)

    @property
    def only_added(self) -> bool:
        return bool(self.added) and not self.incompatible

    def describe(self, type_name: Callable[[int, int], str] = builtin_type_name,
                 all_added: bool = False) -> list[str]:
        """What changed, one phrase each: 'column note was dropped'. Added columns only beside other changes
        (alone they are no news: they follow), or with `all_added`."""
        out = [f"column {old} was renamed to {new}" for old, new in self.renamed]
        out += [f"column {c} was dropped" for c in self.dropped]
        out += [f"column {c} changed type from {old} to {type_name(oid, typmod)}"
                for c, old, oid, typmod in self.retyped]
        out += [f"column {c} was dropped and added again" for c in self.readded]
        if self.key:
            out.append(f"the key changed from ({', '.join(self.key[0])}) to ({', '.join(self.key[1])})")
        if self.incompatible or all_added:
            out += [f"column {c.name} was added" for c in self.added]
        return out


def classify(rel: Relation, table: Table) -> ColumnChanges:
    """Compare a Relation message (the columns the source's changes now carry, in attnum order) with the
    stream's description of the table. PostgreSQL keeps a column's place through a rename or a type change
    and adds columns at the end, so columns are matched by name, then left-over ones by place (a rename).
    A column dropped and one added in its place with a new name read as a rename: the message cannot tell
    the two apart, and either stops the stream."""
    old = table.columns
    new = rel.columns
    old_names = [c.name for c in old]
    new_names = [c.name for c in new]
    renamed = []
    for i in range(min(len(old), len(new))):
        if old_names[i] != new_names[i] and old_names[i] not in new_names and new_names[i] not in old_names:
            renamed.append((old_names[i], new_names[i]))
    renamed_old = {o for o, _ in renamed}
    renamed_new = {n for _, n in renamed}
    dropped = tuple(n for n in old_names if n not in new_names and n not in renamed_old)
    added = tuple(c for c in new if c.name not in old_names and c.name not in renamed_new)
    # Known columns must keep their order; one met out of it was dropped and added again (at the end).
    readded, last = [], -1
    for name in new_names:
        if name in old_names:
            place = old_names.index(name)
            if place < last:
                readded.append(name)
            else:
                last = place
    by_name = {c.name: c for c in old}
    by_name.update((n, by_name[o]) for o, n in renamed)
    retyped = []
    for c in new:
        was = by_name.get(c.name)
        if was is None or c.name in readded:
            continue
        if was.type_oid != c.type_oid or (was.typmod is not None and was.typmod != c.typmod):
            retyped.append((c.name, was.type_sql, c.type_oid, c.typmod))
    key = None
    if rel.replica_identity in ("d", "i"):  # under FULL every column is flagged: no key to compare
        new_key = tuple(c.name for c in new if c.flags & 1)
        renames = dict(renamed)
        if sorted(renames.get(k, k) for k in table.key) != sorted(new_key):
            key = (tuple(table.key), new_key)
    return ColumnChanges(table.qualified, added, dropped, tuple(renamed), tuple(retyped), tuple(readded), key)


def rule_input(rel: Relation, table: Table, reads: set[int], reader: str) -> tuple[int | None, ...] | None:
    """A table a rule reads (`table`: the source's description it was made for; `reads`: the indices of the
    columns it reads) met in a new shape: where each of its columns now is in the Relation's rows, None for a
    column the rule does not read that was dropped, renamed or retyped (it reads NULL); None when nothing
    changed. Added columns are not read (the rule's output is what it was made with). A change of a column the
    rule reads, or of the key, raises SchemaStop naming it: the rule depends on it."""
    changes = classify(rel, table)
    if changes.unchanged:
        return None
    back = {new: old for old, new in changes.renamed}
    lost = ({*changes.dropped, *changes.readded, *back.values()}
            | {back.get(name, name) for name, *_ in changes.retyped})
    hit = [c.name for i, c in enumerate(table.columns) if i in reads and c.name in lost]
    if hit or changes.key:
        what = "; ".join(changes.describe(all_added=True))
        read = f"reads column{'s' if len(hit) > 1 else ''} {', '.join(hit)}" if hit else "finds rows by the key"
        raise SchemaStop(f"source table {table.qualified} changed ({what}), and {reader} {read}: re-create the "
                         f"workflow with a rule for the new columns")
    names = [c.name for c in rel.columns]
    return tuple(None if c.name in lost else names.index(c.name) for c in table.columns)


# -- IO: the source's catalog ---------------------------------------------------------------------------------------------------------
_SOURCE_COLUMNS = """
SELECT a.attname, a.atttypid::int, a.atttypmod, format_type(a.atttypid, a.atttypmod), a.attnotnull,
       CASE WHEN a.attcollation <> 0 AND a.attcollation <> t.typcollation THEN co.collname END,
       pg_get_expr(d.adbin, d.adrelid), d.adbin::text, a.atthasmissing,
       CASE WHEN a.atthasmissing THEN (a.attmissingval::text::text[])[1] END
FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_collation co ON co.oid = a.attcollation
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
ORDER BY a.attnum"""



@dataclass(frozen=True)
class SourceColumn:
    name: str
    type_oid: int
    typmod: int
    type_sql: str
    not_null: bool
    collation: str | None
    default: str | None  # pg_get_expr(): the expression as SQL
    default_tree: str | None  # the expression's node tree: the functions it calls
    has_missing: bool  # rows older than the column hold `missing` (PostgreSQL's "fast default")
    missing: str | None  # that value's text


def source_columns(src: psycopg.Connection, rel_oid: int) -> dict[str, SourceColumn]:
    """The table's columns in the source's catalog (as of `src`'s snapshot), in attnum order."""
    return {c.name: c for c in (SourceColumn(*r) for r in src.execute(_SOURCE_COLUMNS, (rel_oid,)).fetchall())}


def by_hand_way_out(target: str, workflow: str) -> str:
    return (f"add it to {target} by hand with the source's values, then "
            f"`sluicegate workflow start {workflow}`; or re-create the workflow")


def older_rows_default(src: psycopg.Connection, qualified: str, col: SourceColumn,
                       way_out: str) -> sql.Composable | None:
    """The expression giving what rows older than column `col` of source table `qualified` hold there
    (None: NULL), or SchemaStop when the source does not say it (`way_out` ends the message)."""
    if col.has_missing:  # the value the source gave every older row, kept as it was computed then
        return sql.SQL("NULL") if col.missing is None else \
            sql.SQL("{}::{}").format(sql.Literal(col.missing), sql.SQL(col.type_sql))
    if col.default is None:
        return None  # older rows hold NULL
    # No value recorded: the source wrote one into each row, computing the default for each (a volatile
    # default rewrote the table), or a later rewrite dropped the record. Only an immutable default then
    # says what the rows hold. Its calls are read from the expression's node tree (functions and the
    # functions behind operators); special nodes whose value is not fixed count as not immutable.
    calls = src.execute(
        r"""SELECT p.proname, p.provolatile FROM regexp_matches(%s, ':(?:funcid|opfuncid) (\d+)', 'g') m
            JOIN pg_proc p ON p.oid = m[1]::oid""", (col.default_tree,)).fetchall()
    tree = col.default_tree or ""
    volatile = sorted({name for name, v in calls if v == "v"})
    if "NEXTVALUEEXPR" in tree:  # an identity column's sequence
        volatile.append("nextval")
    if volatile:
        raise SchemaStop(
            f"column {col.name} was added to source table {qualified} with the volatile default "
            f"{col.default} (it calls {', '.join(volatile)}): the source gave each existing row its own "
            f"value, which the stream does not carry; {way_out}")
    if any(v != "i" for _, v in calls) or re.search(r"\{(SQLVALUEFUNCTION|COERCEVIAIO)\b", tree):
        raise SchemaStop(
            f"column {col.name} of source table {qualified} has the default {col.default}, whose "
            f"value changes over time, and the source no longer records the one its existing rows got; "
            f"{way_out}")
    return sql.SQL(col.default)


def older_rows_text(src: psycopg.Connection, qualified: str, col: SourceColumn, way_out: str) -> str | None:
    """`older_rows_default`'s value as the source's text (the stream's form; None for NULL)."""
    if col.has_missing:
        return col.missing
    expr = older_rows_default(src, qualified, col, way_out)
    if expr is None:
        return None
    return src.execute(sql.SQL("SELECT (({})::{})::text").format(expr, sql.SQL(col.type_sql))).fetchone()[0]

"""Changes to a table without a key (REPLICA IDENTITY FULL), set-based, as native logical replication applies
them: an update or a delete changes exactly one target row equal to the old row; duplicates stay duplicates.

A chunk's net effect on such a table is a multiset delta: per distinct row value, +1 for each row inserted,
-1 for each old row deleted (an update is -old +new; an unchanged TOAST value of the new row comes from the
old row, which REPLICA IDENTITY FULL always carries whole). Rows are equal or not as a whole, so the order
of changes within a chunk cannot change the outcome; chunks flush in order as for keyed tables. A flush
stages the delta with COPY, deletes |d| physical rows (chosen by ctid) for each value with a negative d, and
inserts d copies of each value with a positive one. Rows match by their columns' text forms, both sides
rendered by the target's session, so types without an equality operator (json, point, xml) match too; as a
text[] (array equality takes NULL elements as equal, and hashes), the join is a hash join: one scan of the
target table per chunk that deletes, where native logical replication (before PostgreSQL 16, or without an
index) scans it once per row.

An old row the target does not have means the target is out of step with the source: a TerminalError, never
a silent skip.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from ..errors import TerminalError
from ..postgres.catalog import Table
from ..postgres.pgoutput import UNCHANGED
from .identity import overriding_clause

ESCAPE = str.maketrans({"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"})
_LINES_PER_WRITE = 1000
_HASH_JOIN = "SET LOCAL enable_mergejoin = off; SET LOCAL jit = off"
_PLANNER_DEFAULTS = "SET LOCAL enable_mergejoin TO DEFAULT; SET LOCAL jit TO DEFAULT"


class KeylessRows:
    """A chunk's net effect on one keyless table: row values (text or None each) -> count delta. Not a dict,
    so the C fast path (postgres/_pgoutput_rows.c), which stages only into a dict by key, declines it."""

    __slots__ = ("delta",)

    def __init__(self):
        self.delta: dict[tuple, int] = {}

    def __bool__(self) -> bool:
        return bool(self.delta)

    def __len__(self) -> int:
        return len(self.delta)

    def _add(self, values: tuple, n: int) -> None:
        left = self.delta.get(values, 0) + n
        if left:
            self.delta[values] = left
        else:
            self.delta.pop(values, None)

    def stage(self, table: Table, kind: str, old: tuple | None, new: tuple | None) -> None:
        if kind == "I":
            self._add(tuple(new), 1)
            return
        if old is None:
            raise TerminalError(
                f"a change to {table.qualified}, which has no key, carries no old row: its source table must "
                f"keep REPLICA IDENTITY FULL (ALTER TABLE {table.qualified} REPLICA IDENTITY FULL on the source), "
                f"then re-create the workflow")
        if UNCHANGED in old:
            raise TerminalError(f"a change to {table.qualified} carries an incomplete old row: its source table "
                                f"must keep REPLICA IDENTITY FULL; re-create the workflow")
        self._add(tuple(old), -1)
        if kind == "U":
            if UNCHANGED in new:  # an unchanged TOAST value: the old row has it
                new = tuple(o if v is UNCHANGED else v for v, o in zip(new, old))
            self._add(tuple(new), 1)


def compose_plan(table: Table, stage: sql.Identifier, *, always: bool = False) -> dict:
    """plan's statements (pure). `always`: the target has an identity column GENERATED ALWAYS among those
    written (writes_always_identity)."""
    cols = [sql.Identifier(c) for c in table.column_names]
    col_list = sql.SQL(", ").join(cols)
    overriding = overriding_clause(always)

    def row_text(alias: str) -> sql.Composable:
        return sql.SQL("ARRAY[{}]::text[]").format(
            sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(alias, c)) for c in table.column_names))

    return {
        # kept across transactions, emptied by each commit, as a keyed table's (postgres.compose_plan)
        "create": sql.SQL("DROP TABLE IF EXISTS pg_temp.{}; CREATE TEMP TABLE {} ON COMMIT DELETE ROWS AS "
                          "SELECT NULL::int AS _sg_n, {} FROM {} WITH NO DATA").format(
            stage, stage, col_list, table.ident),
        "copy": sql.SQL("COPY {} (_sg_n, {}) FROM STDIN").format(stage, col_list),
        # The k-th equal row (by ctid) is deleted while k <= the value's count of deletes (staged values that
        # render alike counted together); the rows are then fetched by a TID scan of the chunk's ctids, not
        # joined with a second scan of the table.
        "delete": sql.SQL(
            """DELETE FROM {} WHERE ctid = ANY(ARRAY(
                 WITH s AS (SELECT sum(-s._sg_n) AS n, {} AS r FROM {} AS s WHERE s._sg_n < 0 GROUP BY 2)
                 SELECT tid FROM (SELECT d.ctid AS tid, s.n, row_number() OVER (PARTITION BY s.r ORDER BY d.ctid) AS k
                                  FROM {} AS d JOIN s ON {} = s.r) m
                 WHERE k <= n))""").format(table.ident, row_text("s"), stage, table.ident, row_text("d")),
        "insert": sql.SQL("INSERT INTO {} ({}){} SELECT {} FROM {} AS s CROSS JOIN generate_series(1, s._sg_n) "
                          "WHERE s._sg_n > 0").format(
            table.ident, col_list, overriding, sql.SQL(", ").join(sql.Identifier("s", c) for c in table.column_names), stage),
        "clear": sql.SQL("TRUNCATE {}").format(stage),
    }


def flush(cur: psycopg.Cursor, table: Table, plan: dict, rows: KeylessRows) -> int:
    """Apply one chunk's delta; the rows it changed. A deleted (or updated) old row the target lacks stops it."""
    items = list(rows.delta.items())
    with cur.copy(plan["copy"]) as copy:
        for start in range(0, len(items), _LINES_PER_WRITE):
            copy.write("".join(_line(n, v) for v, n in items[start:start + _LINES_PER_WRITE]))
    wanted = -sum(n for _, n in items if n < 0)
    if wanted:
        # The planner cannot estimate the text[] join (it guesses millions of rows): it would sort the whole
        # table for a merge join and compile it with JIT. A hash of the staged rows, probed by one scan, is
        # the plan. Back to the defaults right after.
        cur.execute(_HASH_JOIN)
        deleted = cur.execute(plan["delete"]).rowcount
        cur.execute(_PLANNER_DEFAULTS)
        if deleted != wanted:
            raise TerminalError(
                f"{wanted - deleted} of {wanted} rows that changes to {table.qualified} update or delete are not "
                f"on the target (a table without a key: rows match by value): the target is out of step with the "
                f"source; see `sluicegate vdiff`, then re-create the workflow to copy the table again")
    inserted = sum(n for _, n in items if n > 0)
    if inserted:
        cur.execute(plan["insert"])
    return wanted + inserted  # the caller empties the staging table before the next chunk (plan["clear"])


def _line(n: int, values: tuple) -> str:
    return f"{n}\t" + "\t".join("\\N" if v is None else v.translate(ESCAPE) for v in values) + "\n"

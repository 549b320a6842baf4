"""Schemas that active-active replication cannot keep consistent (the seed's "Impact on Application Design").

Both clusters take writes, and neither sees the other's before committing its own. So:
- a secondary UNIQUE constraint or unique index (other than the table's key) can be satisfied on each side
  alone and violated by the two together: replication then fails, or the clusters diverge;
- a key drawn from a sequence gives both sides the same new keys, unless each side's sequence draws from its
  own residue class (the same INCREMENT BY n >= 2, a different START modulo n): then the keys never meet.
`create --bidirectional` refuses both, naming the table and the fix, unless --allow-unsafe-schema.
It warns (`toast_notes`) about tables whose updates may leave large unchanged values out: such an update that
must recreate a row deleted on the other cluster stops the direction, naming REPLICA IDENTITY FULL.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..postgres.catalog import Table
from ..preflight.probes import table_exists


@dataclass(frozen=True)
class KeySequence:
    column: str
    sequence: str
    increment: int
    next_class: int  # the residue (mod increment) of every value it will give
    identity: bool = False  # an identity column's own sequence (ALTER TABLE … ALTER COLUMN changes it)
    high: int = 0  # no key this side has or its sequence gives next is above it

    def fix(self, table: Table, conn: psycopg.Connection, increment: int, start: int) -> str:
        """The statement that makes this sequence give start, start + increment, … from now on."""
        if self.identity:
            return sql.SQL("ALTER TABLE {} ALTER COLUMN {} SET INCREMENT BY {} RESTART WITH {}").format(
                table.ident, sql.Identifier(self.column), sql.Literal(increment), sql.Literal(start)).as_string(conn)
        return f"ALTER SEQUENCE {self.sequence} INCREMENT BY {increment} RESTART WITH {start}"


def unique_indexes(conn: psycopg.Connection, table: Table) -> list[tuple[str, str]]:
    """(index name, its columns) of every unique index of the table other than one on exactly its key."""
    rows = conn.execute(
        """SELECT i.indexrelid::regclass::text, array_agg(COALESCE(a.attname, '(expression)') ORDER BY k.ord),
                  i.indpred IS NOT NULL
           FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace
           CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
           LEFT JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum AND k.attnum > 0
           WHERE n.nspname = %s AND c.relname = %s AND i.indisunique AND k.ord <= i.indnkeyatts
           GROUP BY i.indexrelid, i.indpred ORDER BY 1""", (table.schema, table.name)).fetchall()
    return [(name, ", ".join(cols)) for name, cols, partial in rows
            if partial or sorted(cols) != sorted(table.key)]


def key_sequences(conn: psycopg.Connection, table: Table) -> list[KeySequence]:
    """The table's key columns whose default draws from a sequence (serial, identity, a nextval default)."""
    rows = conn.execute(
        """SELECT a.attname, a.attidentity <> '',
                  COALESCE(
                    pg_get_serial_sequence(format('%%I.%%I', n.nspname, c.relname), a.attname)::regclass,
                    (SELECT d.refobjid::regclass FROM pg_depend d JOIN pg_class s ON s.oid = d.refobjid
                     WHERE d.classid = 'pg_attrdef'::regclass AND d.objid = ad.oid
                       AND d.refclassid = 'pg_class'::regclass AND s.relkind = 'S' LIMIT 1))::oid
           FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
           JOIN pg_namespace n ON n.oid = c.relnamespace
           LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
           WHERE n.nspname = %s AND c.relname = %s AND a.attname = ANY(%s) AND NOT a.attisdropped
           ORDER BY a.attnum""", (table.schema, table.name, list(table.key))).fetchall()
    out = []
    for column, identity, seq in rows:
        if seq is None:
            continue
        name, schema, rel, increment = conn.execute(
            """SELECT s.seqrelid::regclass::text, n.nspname, c.relname, s.seqincrement
               FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid
               JOIN pg_namespace n ON n.oid = c.relnamespace
               WHERE s.seqrelid = %s""", (seq,)).fetchone()
        # Its next value is last_value (not yet called, e.g. after RESTART) or last_value + increment: the
        # residue is last_value's either way.
        query = sql.SQL("SELECT last_value FROM {}").format(sql.Identifier(schema, rel))
        last = conn.execute(query).fetchone()[0]
        # The keys already there (rows copied in, or written with explicit values) may be above the sequence:
        # a restart must clear them too. The key's index makes this cheap when the column leads it.
        top = conn.execute(sql.SQL("SELECT max({}) FROM {}").format(sql.Identifier(column), table.ident)).fetchone()[0]
        step = abs(increment)
        out.append(KeySequence(column, name, step, last % step if step else 0, identity,
                               max(last, top) if isinstance(top, int) else last))
    return out


def problems(a: psycopg.Connection, b: psycopg.Connection, names: tuple[str, str],
             tables: list[Table]) -> list[str]:
    """One line per unsafe table, with the fix; `names` says how to call the two sides in it."""
    out = []
    for t in tables:
        seqs, missing = {}, set()
        for side, conn in zip(names, (a, b), strict=True):
            if not table_exists(conn, t):
                seqs[side] = {}
                missing.add(side)
                continue
            for index, cols in unique_indexes(conn, t):
                out.append(f"table {t.qualified} has unique index {index} ({cols}) on {side} besides its "
                           f"key ({', '.join(t.key)}): each cluster can accept the same value and "
                           f"replication would then fail or diverge; drop it (or make it the key), or pass "
                           f"--allow-unsafe-schema")
            seqs[side] = {s.column: s for s in key_sequences(conn, t)}
        for column in t.key:
            sa, sb = (seqs[side].get(column) for side in names)
            if sa is None and sb is None:
                continue
            if sa is not None and sb is not None and sa.increment == sb.increment >= 2 \
                    and sa.next_class != sb.next_class:
                continue  # interleaved: each side draws from its own residue class
            which = "; ".join(f"{s.sequence} on {side} (INCREMENT BY {s.increment})"
                              for side, s in zip(names, (sa, sb), strict=True) if s is not None)
            out.append(f"table {t.qualified}: key column {column} draws from a sequence ({which}): both "
                       f"clusters would make the same keys; use UUID keys, or give the sequence on each side "
                       f"the same INCREMENT BY n >= 2 and a different START modulo n, above every key either "
                       f"side has: {interleave(t, a, names, (sa, sb), missing)}; or pass --allow-unsafe-schema")
    return out


def restarts(high: int, increment: int, sides: int = 2) -> list[int]:
    """RESTART values, one per side, above `high` and in distinct residue classes mod `increment` (side i
    gets residue i + 1)."""
    base = high + 1
    base += -base % increment  # the next multiple of increment: base + i + 1 then has residue i + 1
    return [base + i for i in range(1, sides + 1)]


def interleave(t: Table, conn: psycopg.Connection, names: tuple[str, str],
               seqs: tuple[KeySequence | None, KeySequence | None], missing: set[str] = frozenset()) -> str:
    """The statements that put each side's sequence in its own residue class, as `on SIDE: SQL`. A side without
    one gets the other side's statement: to run once `create` made the table there (`missing`), or once its
    column draws from a sequence too."""
    known = [s for s in seqs if s is not None]
    same = {s.increment for s in known}
    increment = same.pop() if len(same) == 1 and known[0].increment >= 2 else 2
    starts = restarts(max(s.high for s in known), increment)
    out = []
    for side, s, start in zip(names, seqs, starts, strict=True):
        stmt = (s or known[0]).fix(t, conn, increment, start)
        when = "" if s else " (once the table exists there)" if side in missing else " (with a sequence like it)"
        out.append(f"on {side}{when}: {stmt}")
    return "; ".join(out)


def toast_notes(conn: psycopg.Connection, side: str, tables: list[Table]) -> list[str]:
    """One line per table with columns PostgreSQL may store out of line (TOAST) and a replica identity other
    than FULL: an update sends such a value only if it changed, and a row must sometimes be recreated from an
    update alone (a newer update of a row the other cluster deleted earlier). REPLICA IDENTITY FULL sends the
    whole old row, and the applier completes the new one from it."""
    out = []
    for t in tables:
        row = conn.execute(
            """SELECT c.relreplident, array_agg(a.attname::text ORDER BY a.attnum)
                        FILTER (WHERE a.attlen = -1 AND a.attstorage IN ('x', 'e'))
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
               JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
               WHERE n.nspname = %s AND c.relname = %s GROUP BY c.relreplident""",
            (t.schema, t.name)).fetchone()
        if row is None or row[0] == "f" or not row[1]:
            continue
        alter = sql.SQL("ALTER TABLE {} REPLICA IDENTITY FULL").format(t.ident).as_string(conn)
        out.append(f"table {t.qualified} on {side}: an update that leaves a large value of {', '.join(row[1])} "
                   f"unchanged does not carry it, and cannot recreate a row the other cluster deleted "
                   f"earlier (the direction then stops); {alter} on both clusters sends whole rows")
    return out

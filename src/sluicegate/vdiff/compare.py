"""Comparing one key range of a table, source snapshot against target snapshot — runs in a Spark task.

Both sides first reduce the range to (row count, XOR of 64-bit row hashes) in SQL, concurrently, each in
its own imported snapshot: no rows travel. Values hash with their types' own hash functions, which agree
with the types' equality. A range that differs is split and summarized again, down to parts of a few
thousand rows (a Merkle tree built on demand); a hash that differs only means "look closer": the
row-by-row step decides. Only a part whose counts or hashes
differ is compared row by row: the source part is piped (COPY) into a temporary table in the target's
snapshot transaction and joined to the target range by key, with PostgreSQL's own equality for each
column type (text equality for types without a btree ordering, such as json or point). So a value
differs exactly when PostgreSQL says it does, and "equal" never rests on Python's idea of a value.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..faults import fault_point
from ..postgres import keyrange
from ..postgres import types as pgtypes
from ..postgres.catalog import FIRST_USER_OID, Table
from ..postgres.connect import connect
from . import store

SIDE = "_sg_vdiff_side"  # marks which side of the full join a row came from
ROW_COMPARE_ROWS = 5_000  # a differing range this small is compared row by row
FANOUT = 8  # a larger differing range is split into this many parts, each summarized again


@dataclass(frozen=True)
class RangeTask:
    source_url: str
    target_url: str
    vdiff_id: int
    table: dict  # Table.to_json()
    generation: int
    idx: int
    lo: list[str] | None
    hi: list[str] | None
    source_snapshot: str
    target_snapshot: str
    text_columns: tuple[str, ...] = ()  # compared by their text form: no equality PostgreSQL could order by
    hash_text_columns: tuple[str, ...] = ()  # hashed by their text form (see summary_query)
    sample_size: int = 10


def compare_range(task: RangeTask) -> dict:
    """Runs in a Spark task: compare one range and record the result on the target. Returns the counts."""
    table = Table.from_json(task.table)
    with connect(task.source_url, role="source") as src, connect(task.target_url, role="target") as dst:
        _import_snapshot(src, task.source_snapshot, read_only=True)
        _import_snapshot(dst, task.target_snapshot, read_only=False)  # the row step writes a temp table
        with ThreadPoolExecutor(1) as pool:  # the source side's queries run while the target's do
            counts, samples = _compare(pool, src, dst, table, task)
        src.rollback()
        dst.rollback()  # leaves the snapshot: the result is recorded in a transaction of its own
        fault_point(f"vdiff.range.{task.idx}")
        store.finish_range(dst, task.vdiff_id, table.qualified, task.generation, task.idx, counts, samples)
        dst.commit()
    return counts


def _compare(pool: ThreadPoolExecutor, src, dst, table: Table, task: RangeTask) -> tuple[dict, list]:
    hashed_as_text = task.hash_text_columns
    source_side = pool.submit(_summary, src, table, task.lo, task.hi, hashed_as_text)
    target_side = _summary(dst, table, task.lo, task.hi, hashed_as_text)
    source_side = source_side.result()
    counts = {"compared": source_side[0], "missing": 0, "extra": 0, "mismatched": 0}
    samples: list = []
    if source_side == target_side:
        return counts, samples
    for lo, hi in _differing(pool, src, dst, table, hashed_as_text, task.lo, task.hi, source_side[0],
                             target_side[0]):
        found, some = _compare_rows(src, dst, table, task, lo, hi, task.sample_size - len(samples))
        for k in ("missing", "extra", "mismatched"):
            counts[k] += found[k]
        counts["compared"] += found["extra"]  # keys only the target has were compared too
        samples += some
    return counts, samples


def _differing(pool: ThreadPoolExecutor, src, dst, table: Table, hashed_as_text: tuple[str, ...], lo, hi,
               source_rows: int, target_rows: int):
    """The sub-ranges of a differing range that differ, small enough to compare row by row, in key order.

    Like a Merkle tree walked on demand: split at every (rows / FANOUT)-th source key, compare the parts'
    summaries, descend into those that differ. A few differing rows cost little more than one scan, not a copy.
    """
    if max(source_rows, target_rows) <= ROW_COMPARE_ROWS or table.keyless:  # keyless: no key to split by
        yield lo, hi
        return
    bounds = _split_keys(src, table, lo, hi, max(1, source_rows // FANOUT))
    if not bounds:  # (nearly) all rows are the target's: nothing to split by
        yield lo, hi
        return
    edges = [lo, *bounds, hi]
    parts = list(itertools.pairwise(edges))
    source_sides = pool.submit(lambda: [_summary(src, table, a, b, hashed_as_text) for a, b in parts])
    target_sides = [_summary(dst, table, a, b, hashed_as_text) for a, b in parts]
    for (a, b), s, t in zip(parts, source_sides.result(), target_sides):
        if s != t:
            yield from _differing(pool, src, dst, table, hashed_as_text, a, b, s[0], t[0])


def _split_keys(conn: psycopg.Connection, table: Table, lo, hi, step: int) -> list[list[str]]:
    rows = conn.execute(sql.SQL(
        """SELECT {names} FROM (SELECT {keys}, row_number() OVER (ORDER BY {order}) AS _sg_rn FROM {table}
                                WHERE {range}) s
           WHERE mod(_sg_rn, {step}) = 0 ORDER BY _sg_rn""").format(
        names=keyrange.key_text_names(table), keys=keyrange.key_texts(table), order=keyrange.key_order(table),
        table=table.scan, range=keyrange.in_range(table, lo, hi),
        step=sql.Literal(step))).fetchall()
    return [list(r) for r in rows]


def _import_snapshot(conn: psycopg.Connection, name: str, *, read_only: bool) -> None:
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    conn.read_only = read_only
    conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(name)))
    # Ranges are the parallelism: a parallel scan per range costs far more CPU than a plain one; and a
    # bitmap scan reads a range's heap pages in order, cheaper than walking the index.
    conn.execute("SET LOCAL max_parallel_workers_per_gather = 0")
    conn.execute("SET LOCAL enable_indexscan = off")


def summary_query(table: Table, lo, hi, text_columns: tuple[str, ...] = ()) -> sql.Composable:
    """(count, XOR of each row's 64-bit hash) over lo < key <= hi.

    hash_record_extended hashes each value with its type's hash function, which agrees with the type's
    equality (1.50 and 1.5, -0 and 0, '30 days' and '1 mon' hash alike). `text_columns` (types with no hash
    function, and user types such as enums, whose hash depends on OIDs that differ between servers) are
    hashed by their text form instead.
    """
    row = sql.SQL(", ").join(
        sql.SQL("{}::text").format(sql.Identifier(c.name)) if c.name in text_columns else sql.Identifier(c.name)
        for c in table.columns)
    if table.keyless:  # a multiset: equal rows would cancel in a XOR, never in a sum
        return sql.SQL("SELECT count(*), sum(hash_record_extended(ROW({}), 0)::numeric) FROM {}").format(
            row, table.scan)
    return sql.SQL("SELECT count(*), bit_xor(hash_record_extended(ROW({}), 0)) FROM {} WHERE {}").format(
        row, table.scan, keyrange.in_range(table, lo, hi))


def _summary(conn: psycopg.Connection, table: Table, lo, hi, text_columns: tuple[str, ...]) -> tuple[int, int | None]:
    return tuple(conn.execute(summary_query(table, lo, hi, text_columns)).fetchone())


def _compare_rows(src: psycopg.Connection, dst: psycopg.Connection, table: Table, task: RangeTask, lo, hi,
                  sample_size: int):
    """Row by row: the source's rows of lo < key <= hi, copied into the target's session, joined by key."""
    stage = new_stage(dst, table)
    cols = sql.SQL(", ").join(map(sql.Identifier, table.column_names))
    fmt = sql.SQL("binary" if table.binary_copy_safe else "text")
    read = sql.SQL("COPY (SELECT {} FROM {} WHERE {}) TO STDOUT (FORMAT {})").format(
        cols, table.scan, keyrange.in_range(table, lo, hi), fmt)
    write = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT {})").format(stage, cols, fmt)
    with src.cursor() as rcur, dst.cursor() as wcur, rcur.copy(read) as reader, wcur.copy(write) as writer:
        for data in reader:
            writer.write(data)
    return join_compare(dst, table, stage, lo, hi, task.text_columns, sample_size)


def new_stage(dst: psycopg.Connection, table: Table) -> sql.Identifier:
    """An empty temporary twin of the target table, in the target's snapshot transaction: the source side."""
    stage = sql.Identifier("_sg_vdiff_source")
    dst.execute(sql.SQL("CREATE TEMP TABLE IF NOT EXISTS {} (LIKE {}) ON COMMIT DROP").format(stage, table.ident))
    dst.execute(sql.SQL("TRUNCATE {}").format(stage))
    return stage


def join_compare(dst: psycopg.Connection, table: Table, stage: sql.Identifier, lo, hi,
                 text_columns: tuple[str, ...], sample_size: int, mine: sql.Composable | None = None):
    """The source side (in `stage`) FULL JOINed by key to the target's rows of lo < key <= hi (and `mine`):
    counts of compared/missing/extra/mismatched rows, and the first differing rows as samples."""
    if table.keyless:
        return multiset_compare(dst, table, stage, sample_size)
    joined = _joined(table, stage, lo, hi, mine)
    side = sql.Identifier(SIDE)
    s_side, t_side = sql.SQL("s.{}").format(side), sql.SQL("t.{}").format(side)
    differs = _differs(table, text_columns)
    compared, missing, extra, mismatched = dst.execute(
        sql.SQL("""SELECT count(*), count(*) FILTER (WHERE {t} IS NULL), count(*) FILTER (WHERE {s} IS NULL),
                          count(*) FILTER (WHERE {s} AND {t} AND ({differs}))
                   FROM {joined}""").format(s=s_side, t=t_side, differs=differs, joined=joined)
    ).fetchone()
    samples = []
    if (missing or extra or mismatched) and sample_size > 0:
        order = sql.SQL(", ").join(sql.SQL("COALESCE(s.{k}, t.{k})").format(k=sql.Identifier(k)) for k in table.key)
        key_text = sql.SQL(", ").join(sql.SQL("COALESCE(s.{k}, t.{k})::text").format(k=sql.Identifier(k))
                                      for k in table.key)
        for kind, key, source_row, target_row in dst.execute(
            sql.SQL("""SELECT CASE WHEN {t} IS NULL THEN 'missing' WHEN {s} IS NULL THEN 'extra'
                                   ELSE 'mismatched' END,
                              ARRAY[{key_text}], CASE WHEN {s} THEN {s_json} END, CASE WHEN {t} THEN {t_json} END
                       FROM {joined}
                       WHERE {t} IS NULL OR {s} IS NULL OR ({differs})
                       ORDER BY {order} LIMIT {n}""").format(
                s=s_side, t=t_side, key_text=key_text, s_json=_as_json(table, "s"), t_json=_as_json(table, "t"),
                joined=joined, differs=differs, order=order, n=sql.Literal(sample_size))
        ):
            samples.append({"kind": kind, "key": key, "source": source_row, "target": target_row})
    return {"compared": compared, "missing": missing, "extra": extra, "mismatched": mismatched}, samples


def multiset_compare(dst: psycopg.Connection, table: Table, stage: sql.Identifier, sample_size: int):
    """A table without a key, whole: the source's rows (in `stage`) and the target's as multisets of row values,
    each row as the text[] of its columns' text forms (both rendered by this session, so types without an
    equality compare too), counted per value. Missing: copies the source has more of; extra: the target's."""
    def counted(alias: str, rel: sql.Composable) -> sql.Composable:
        cols = sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(alias, c)) for c in table.column_names)
        return sql.SQL("SELECT ARRAY[{}]::text[] AS r, count(*) AS n FROM {} AS {} GROUP BY 1").format(
            cols, rel, sql.Identifier(alias))

    names = sql.SQL("ARRAY[{}]::text[]").format(sql.SQL(", ").join(map(sql.Literal, table.column_names)))
    diff = sql.SQL("""(SELECT r, COALESCE(s.n, 0) AS sn, COALESCE(t.n, 0) AS tn
                       FROM ({}) s FULL JOIN ({}) t USING (r) WHERE s.n IS DISTINCT FROM t.n) x""").format(
        counted("s", stage), counted("t", table.scan))
    source_rows, missing, extra = dst.execute(sql.SQL(
        """SELECT (SELECT count(*) FROM {}), COALESCE(sum(GREATEST(sn - tn, 0)), 0),
                  COALESCE(sum(GREATEST(tn - sn, 0)), 0) FROM {}""").format(stage, diff)).fetchone()
    samples = []
    if (missing or extra) and sample_size > 0:
        for kind, n, row in dst.execute(sql.SQL(
                """SELECT CASE WHEN sn > tn THEN 'missing' ELSE 'extra' END, abs(sn - tn), jsonb_object({}, r)
                   FROM {} ORDER BY r LIMIT {}""").format(names, diff, sql.Literal(sample_size))):
            samples.append({"kind": kind, "key": [], "rows": int(n),
                            "source": row if kind == "missing" else None, "target": row if kind == "extra" else None})
    return {"compared": source_rows, "missing": int(missing), "extra": int(extra), "mismatched": 0}, samples


def _joined(table: Table, stage: sql.Identifier, lo, hi, mine: sql.Composable | None = None) -> sql.Composable:
    cols = sql.SQL(", ").join(map(sql.Identifier, table.column_names))
    where = keyrange.in_range(table, lo, hi)
    if mine is not None:
        where = sql.SQL("{} AND {}").format(where, mine)
    on = sql.SQL(" AND ").join(sql.SQL("s.{k} = t.{k}").format(k=sql.Identifier(k)) for k in table.key)
    return sql.SQL("""(SELECT true AS {side}, {cols} FROM {stage}) s
                      FULL JOIN (SELECT true AS {side}, {cols} FROM {table} WHERE {range}) t ON {on}""").format(
        side=sql.Identifier(SIDE), cols=cols, stage=stage, table=table.ident, range=where, on=on)


def _differs(table: Table, text_columns: tuple[str, ...]) -> sql.Composable:
    parts = []
    for name in table.column_names:
        if name in table.key:
            continue  # equal by the join
        col = sql.Identifier(name)
        if name in text_columns:
            parts.append(sql.SQL("s.{c}::text IS DISTINCT FROM t.{c}::text").format(c=col))
        else:
            parts.append(sql.SQL("s.{c} IS DISTINCT FROM t.{c}").format(c=col))
    return sql.SQL(" OR ").join(parts) if parts else sql.SQL("false")


def _as_json(table: Table, alias: str) -> sql.Composable:
    """The row as {column: PostgreSQL text form}: exact digits, whatever JSON could not hold."""
    pieces = []
    names = table.column_names
    for start in range(0, len(names), 50):  # jsonb_build_object takes at most 100 arguments
        pieces.append(sql.SQL("jsonb_build_object({})").format(sql.SQL(", ").join(
            sql.SQL("{}, {}.{}::text").format(sql.Literal(n), sql.Identifier(alias), sql.Identifier(n))
            for n in names[start:start + 50])))
    return sql.SQL(" || ").join(pieces)


def text_hashed_columns(conns: list[psycopg.Connection], table: Table) -> tuple[str, ...]:
    """Columns of user types, or of a type with no extended hash function on either side."""
    out = []
    for c in table.columns:
        if c.type_oid >= FIRST_USER_OID or not all(_probe(conn, sql.SQL("SELECT hash_record_extended(ROW(NULL::{}), 0)"
                                                                        ).format(sql.SQL(c.type_sql))) for conn in conns):
            out.append(c.name)
    return tuple(out)


def _probe(conn: psycopg.Connection, query: sql.Composable) -> bool:
    """Does the server resolve this (an operator or function for a type)? Evaluated on NULLs only."""
    try:
        with conn.transaction():
            conn.execute(query)
        return True
    except psycopg.errors.UndefinedFunction:
        return False


def text_compared_columns(conn: psycopg.Connection, table: Table,
                          source: psycopg.Connection | None = None) -> tuple[str, ...]:
    """Columns compared as text: those whose type has no default btree ordering (json, xml, point, box…, and
    arrays, composites and domains of them: the server's type cache looks through those, as it would to
    compare values), and, given the `source` the table's type OIDs are from, those whose type's equality is
    not equality of values (citext, PostGIS: pgtypes.TEXT_EQUALITY_*)."""
    # a NULL of the column's own type (NULL::type would fail for a NOT NULL domain), no value compared
    query = "SELECT t.{} FROM (SELECT) one LEFT JOIN {} t ON false ORDER BY 1"
    return tuple(c.name for c in table.columns
                 if not _probe(conn, sql.SQL(query).format(sql.Identifier(c.name), table.ident))
                 or source is not None and c.type_oid and pgtypes.equality_is_not_value(source, c.type_oid))

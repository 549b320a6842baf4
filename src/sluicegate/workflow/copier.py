"""The copy phase: cycles of (snapshot, fast-forward, copy rows above lastpk) — VReplication's vcopier.

A cycle plans its key ranges inside the snapshot, then Spark tasks copy the ranges in parallel: each task
imports the exported snapshot and pipes `COPY (SELECT …) TO STDOUT` straight into `COPY … FROM STDIN` on
the target (raw passthrough, binary when the types allow). Target rows above lastpk are by definition not
yet copied, so a cycle first deletes them: a cycle killed halfway is simply redone.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..postgres import keyrange
from ..postgres.catalog import Table
from ..postgres.connect import connect
from .faults import fault_point


@dataclass(frozen=True)
class CopyRange:
    """One Spark task's share of a cycle: rows with lo < key <= hi, read in `snapshot`."""

    source_url: str
    target_url: str
    table: dict  # Table.to_json(): plain data pickles small
    snapshot: str
    lo: list[str] | None
    hi: list[str]


@dataclass(frozen=True)
class CyclePlan:
    ranges: list[tuple[list[str] | None, list[str]]]
    new_lastpk: list[str] | None
    rows: int
    done: bool  # the table has no rows left after new_lastpk in this snapshot


def plan_cycle(snap_conn: psycopg.Connection, table: Table, lastpk: list[str] | None, cycle_rows: int,
               chunk_rows: int) -> CyclePlan:
    """Split the next `cycle_rows` keys above lastpk into ranges of `chunk_rows`, inside the snapshot.

    One index-ordered scan of keys only: every chunk_rows-th key and the last one bound the ranges.
    """
    keys = sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(k)) for k in table.key)
    order = sql.SQL(", ").join(map(sql.Identifier, table.key))
    where = keyrange.in_range(table, lastpk, None)
    query = sql.SQL(
        """SELECT * FROM (
               SELECT {keys}, row_number() OVER (ORDER BY {order}) AS rn, count(*) OVER () AS n
               FROM (SELECT {order} FROM {table} WHERE {where} ORDER BY {order} LIMIT {limit}) s
           ) w WHERE rn % {chunk} = 0 OR rn = n ORDER BY rn"""
    ).format(keys=keys, order=order, table=table.ident, where=where, limit=sql.Literal(cycle_rows),
             chunk=sql.Literal(chunk_rows))
    bounds = snap_conn.execute(query).fetchall()
    if not bounds:
        return CyclePlan([], lastpk, 0, True)
    nkey = len(table.key)
    ranges, lo = [], lastpk
    for row in bounds:
        hi = list(row[:nkey])
        ranges.append((lo, hi))
        lo = hi
    total = bounds[-1][-1]
    return CyclePlan(ranges, lo, total, total < cycle_rows)


def clear_above(target: psycopg.Connection, table: Table, lastpk: list[str] | None) -> int:
    """Delete target rows above lastpk: leftovers of a cycle that did not finish."""
    if lastpk is None:
        cur = target.execute(sql.SQL("DELETE FROM {}").format(table.ident))
    else:
        cur = target.execute(
            sql.SQL("DELETE FROM {} WHERE {}").format(table.ident, keyrange.compare(table, ">", lastpk))
        )
    return cur.rowcount


def copy_range(task: CopyRange) -> int:
    """Runs in a Spark task: pipe one key range from the snapshot into the target. Returns rows copied."""
    table = Table.from_json(task.table)
    fmt = sql.SQL("binary" if table.binary_copy_safe else "text")
    cols = sql.SQL(", ").join(map(sql.Identifier, table.column_names))
    select = sql.SQL("COPY (SELECT {} FROM {} WHERE {}) TO STDOUT (FORMAT {})").format(
        cols, table.ident, keyrange.in_range(table, task.lo, task.hi), fmt
    )
    insert = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT {})").format(table.ident, cols, fmt)
    with connect(task.source_url, role="source") as src, connect(task.target_url, role="target") as dst:
        src.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        src.read_only = True
        src.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(task.snapshot)))
        with src.cursor() as rcur, dst.cursor() as wcur:
            with rcur.copy(select) as reader, wcur.copy(insert) as writer:
                for data in reader:
                    writer.write(data)
            fault_point("copy.before_commit")
            rows = wcur.rowcount
        dst.commit()
        src.rollback()
    return rows

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

    Each bound is the chunk_rows-th key above the previous one (`ORDER BY key OFFSET n-1 LIMIT 1`, an
    index-only walk); only the table's last, shorter chunk is counted.
    """
    keys, order, order_desc = keyrange.key_texts(table), keyrange.key_order(table), keyrange.key_order(table, "DESC")
    ranges: list[tuple[list[str] | None, list[str]]] = []
    lo, total, done = lastpk, 0, False
    while total < cycle_rows:
        step = min(chunk_rows, cycle_rows - total)
        where = keyrange.in_range(table, lo, None)
        row = snap_conn.execute(
            sql.SQL("SELECT {} FROM {} WHERE {} ORDER BY {} OFFSET {} LIMIT 1").format(
                keys, table.ident, where, order, sql.Literal(step - 1))
        ).fetchone()
        if row is not None:
            n = step
        else:  # fewer than `step` rows left: the last one ends the table
            row = snap_conn.execute(
                sql.SQL("SELECT {}, count(*) OVER () FROM (SELECT {} FROM {} WHERE {} ORDER BY {} LIMIT {}) s "
                        "ORDER BY {} LIMIT 1").format(
                    keys, order, table.ident, where, order, sql.Literal(step), order_desc)
            ).fetchone()
            done = True
            if row is None:
                break
            n, row = row[-1], row[:-1]
        hi = list(row)
        ranges.append((lo, hi))
        lo, total = hi, total + n
        if done:
            break
    return CyclePlan(ranges, lo, total, done)


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

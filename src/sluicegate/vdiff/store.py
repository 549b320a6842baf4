"""VDiff state in the target's `sluicegate` schema (tables in workflow/state.py), like Vitess's VDiff2.

A vdiff is a request (pending) that one executor claims (running) — the workflow's driver when one is
running, else the `sluicegate vdiff` command itself — and finishes (completed or error). Its ranges are
rows of vdiff_ranges, written by the Spark task that compared them. Whoever executes holds a session
advisory lock on the vdiff, so two processes never compare the same vdiff at once.

Resuming keeps, per table, the finished ranges in key order up to the first unfinished one; the rest is
compared again from a new consistent point (a new generation of ranges).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import psycopg

from ..errors import UsageError
from ..position import format_lsn, parse_lsn

PENDING, RUNNING, COMPLETED, ERROR = "pending", "running", "completed", "error"
_LOCK_CLASS = "sluicegate-vdiff"


@dataclass
class VDiff:
    id: int
    workflow: str
    state: str
    tables: list[str]
    options: dict
    source_position: int | None
    message: str


@dataclass
class TableProgress:
    table: str
    generation: int  # the next generation to plan
    lastpk: list[str] | None  # every key <= lastpk is compared
    done: bool


def create(conn: psycopg.Connection, workflow: str, tables: list[str], options: dict) -> int:
    return conn.execute(
        "INSERT INTO sluicegate.vdiffs (workflow, state, tables, options) VALUES (%s, %s, %s, %s) RETURNING id",
        (workflow, PENDING, json.dumps(tables), json.dumps(options)),
    ).fetchone()[0]


def load(conn: psycopg.Connection, vdiff_id: int) -> VDiff:
    row = conn.execute(
        """SELECT id, workflow, state, tables, options, source_position::text, message
           FROM sluicegate.vdiffs WHERE id = %s""",
        (vdiff_id,),
    ).fetchone()
    if row is None:
        raise UsageError(f"vdiff {vdiff_id} no longer exists (its workflow was deleted?)")
    return VDiff(*row[:5], parse_lsn(row[5]) if row[5] else None, row[6])


def latest_unfinished(conn: psycopg.Connection, workflow: str) -> int:
    row = conn.execute(
        "SELECT id FROM sluicegate.vdiffs WHERE workflow = %s AND state <> %s ORDER BY id DESC LIMIT 1",
        (workflow, COMPLETED),
    ).fetchone()
    if row is None:
        raise UsageError(f"no unfinished vdiff of workflow {workflow!r} to resume: run `sluicegate vdiff {workflow}`")
    return row[0]


def next_pending(conn: psycopg.Connection, workflow: str) -> int | None:
    row = conn.execute(
        "SELECT id FROM sluicegate.vdiffs WHERE workflow = %s AND state = %s ORDER BY id LIMIT 1",
        (workflow, PENDING),
    ).fetchone()
    return row[0] if row else None


def has_table(conn: psycopg.Connection) -> bool:
    """False on targets set up by a Sluicegate older than vdiff (until a vdiff creates the tables)."""
    return conn.execute("SELECT to_regclass('sluicegate.vdiffs') IS NOT NULL").fetchone()[0]


def try_lock(conn: psycopg.Connection, vdiff_id: int) -> bool:
    """Session lock (autocommit conn) marking its holder as this vdiff's one executor."""
    return conn.execute("SELECT pg_try_advisory_lock(hashtext(%s), %s::int)", (_LOCK_CLASS, vdiff_id)).fetchone()[0]


def set_state(conn: psycopg.Connection, vdiff_id: int, state: str, message: str | None = "", *,
              source_position: int | None = None) -> None:
    """message None keeps the current one (who compared it)."""
    conn.execute(
        """UPDATE sluicegate.vdiffs SET state = %s, message = COALESCE(%s, message),
             source_position = COALESCE(%s::pg_lsn, source_position),
             started_at = CASE WHEN %s = 'running' THEN now() ELSE started_at END,
             completed_at = CASE WHEN %s IN ('completed', 'error') THEN now() END
           WHERE id = %s""",
        (state, None if message is None else message[:2000], format_lsn(source_position) if source_position is not None else None,
         state, state, vdiff_id),
    )


def resume_progress(conn: psycopg.Connection, vdiff_id: int, table: str) -> TableProgress:
    """Drop the ranges after a table's first unfinished one; where the comparison stands."""
    gen = conn.execute(
        "SELECT max(generation) FROM sluicegate.vdiff_ranges WHERE vdiff_id = %s AND table_name = %s",
        (vdiff_id, table),
    ).fetchone()[0]
    if gen is None:
        return TableProgress(table, 0, None, False)
    conn.execute(
        """DELETE FROM sluicegate.vdiff_ranges WHERE vdiff_id = %s AND table_name = %s AND generation = %s
             AND idx >= (SELECT COALESCE(min(idx), 2147483647) FROM sluicegate.vdiff_ranges
                         WHERE vdiff_id = %s AND table_name = %s AND generation = %s AND NOT done)""",
        (vdiff_id, table, gen, vdiff_id, table, gen),
    )
    last = conn.execute(
        """SELECT hi FROM sluicegate.vdiff_ranges WHERE vdiff_id = %s AND table_name = %s
           ORDER BY generation DESC, idx DESC LIMIT 1""",
        (vdiff_id, table),
    ).fetchone()
    if last is None:
        return TableProgress(table, gen + 1, None, False)
    return TableProgress(table, gen + 1, last[0], last[0] is None)


def add_ranges(conn: psycopg.Connection, vdiff_id: int, table: str, generation: int,
               ranges: list[tuple[list[str] | None, list[str] | None]]) -> None:
    with conn.cursor() as cur:
        cur.executemany(
            """INSERT INTO sluicegate.vdiff_ranges (vdiff_id, table_name, generation, idx, lo, hi)
               VALUES (%s, %s, %s, %s, %s, %s)""",
            [(vdiff_id, table, generation, i, _js(lo), _js(hi)) for i, (lo, hi) in enumerate(ranges)],
        )


def finish_range(conn: psycopg.Connection, vdiff_id: int, table: str, generation: int, idx: int,
                 counts: dict, samples: list) -> None:
    conn.execute(
        """UPDATE sluicegate.vdiff_ranges SET done = true, compared = %s, missing = %s, extra = %s,
             mismatched = %s, samples = %s
           WHERE vdiff_id = %s AND table_name = %s AND generation = %s AND idx = %s""",
        (counts["compared"], counts["missing"], counts["extra"], counts["mismatched"], json.dumps(samples),
         vdiff_id, table, generation, idx),
    )


def table_totals(conn: psycopg.Connection, vdiff_id: int, sample_limit: int) -> dict[str, dict]:
    """Per table: rows compared, missing, extra, mismatched, and the first differing keys in key order."""
    totals: dict[str, dict] = {}
    for table, ranges, done, compared, missing, extra, mismatched in conn.execute(
        """SELECT table_name, count(*), count(*) FILTER (WHERE done), sum(compared), sum(missing), sum(extra),
                  sum(mismatched)
           FROM sluicegate.vdiff_ranges WHERE vdiff_id = %s GROUP BY table_name""",
        (vdiff_id,),
    ):
        totals[table] = {"rows_compared": int(compared), "missing": int(missing), "extra": int(extra),
                         "mismatched": int(mismatched), "ranges": ranges, "ranges_done": done, "samples": []}
    for table, samples in conn.execute(
        """SELECT table_name, samples FROM sluicegate.vdiff_ranges
           WHERE vdiff_id = %s AND samples <> '[]' ORDER BY table_name, generation, idx""",
        (vdiff_id,),
    ):
        kept = totals[table]["samples"]
        kept.extend(samples[: max(0, sample_limit - len(kept))])
    return totals


def _js(value) -> str | None:
    return None if value is None else json.dumps(value)

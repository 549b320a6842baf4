"""A copy task as a Python worker runs it: one share of a cycle, piped from the snapshot into the target.

copier.py plans the cycle and writes each task's two COPY statements on the driver; this module only runs
them (postgres/passthrough.py, on psycopg2). A worker imports it, psycopg2 and PySpark's own modules, not
psycopg 3 or the planner, so the first task of a `workflow run` starts sooner.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg2.errors

from ..errors import RetryableError
from ..faults import fault_point
from ..postgres import origins, passthrough
from ..postgres.connect import describe_conn

COPY_LOCK_TIMEOUT_MS = 2000


@dataclass(frozen=True)
class CopyTask:
    source_url: str
    target_url: str
    snapshot: str
    select: str  # COPY (SELECT …) TO STDOUT
    insert: str  # COPY … FROM STDIN
    origin: str = ""  # a bidirectional sink's: the rows carry it, and the direction back drops them
    label: str = ""  # the target session's application_name: the progress view finds its COPY by it (live.py)


def copy_range(task: CopyTask) -> int:
    """Runs in a Spark task: pipe one range, read in the cycle's snapshot, into the target and commit it.
    Returns the rows copied."""
    return sum(n for _, n in _copy(task, [("", task.select, task.insert)]))


@dataclass(frozen=True)
class TablesTask:
    """Several whole small tables, one after another in one task's two sessions (copier.group_tasks)."""

    source_url: str
    target_url: str
    snapshot: str
    copies: tuple[tuple[str, str, str], ...]  # (qualified name, COPY … TO STDOUT, COPY … FROM STDIN) each
    origin: str = ""
    label: str = ""


def copy_tables(task: TablesTask) -> list[tuple[str, int]]:
    """Runs in a Spark task: copy each table of `task` whole, read in the cycle's snapshot, into the target in
    one transaction: the tables' start-up costs (sessions, the snapshot's import, a commit) are paid once.
    Returns (table, rows copied) of each."""
    return _copy(task, task.copies)


def rows_of(result: list[tuple[str, int]]) -> int:
    """A copy_tables result's rows, for the progress counter."""
    return sum(n for _, n in result)


def _copy(task: CopyTask | TablesTask, copies) -> list[tuple[str, int]]:
    src = passthrough.connect(task.source_url, "source")
    try:
        dst = passthrough.connect(task.target_url, "target", task.label)
        try:
            if task.origin:
                origins.acquire(dst, task.origin)
                # the denial of the application's writes during the copy (cluster/create.py) lets this through
                dst.cursor().execute("SELECT set_config('sluicegate.applying', %s, false)", (task.origin,))
            src.set_session(isolation_level="REPEATABLE READ", readonly=True)
            try:
                src.cursor().execute("SET TRANSACTION SNAPSHOT %s", (task.snapshot,))
            except psycopg2.errors.InvalidParameterValue:
                raise snapshot_gone(task.snapshot, describe_conn(src)) from None
            # A schema change of the table waits for the cycle's snapshot (it holds the table's share lock),
            # and this read would queue behind it: a wait nobody detects, with the application's writes queued
            # too. A lock timeout (55P03, retryable) fails the cycle instead, which lets the change through;
            # the cycle is redone with the new shape.
            src.cursor().execute("SELECT set_config('lock_timeout', %s, true)", (f"{COPY_LOCK_TIMEOUT_MS}ms",))
            out = [(name, passthrough.pipe(src, select, dst, insert)) for name, select, insert in copies]
            fault_point("copy.before_commit")
            dst.commit()
        finally:
            dst.close()  # uncommitted (an error): rolled back with the session
    finally:
        src.close()
    return out


def snapshot_gone(name: str, where: str) -> RetryableError:
    """A task could not import its cycle's snapshot: the session that exported it ended (the source restarted
    or failed over, and the task reached the new primary, which never had it). Nothing of the cycle is
    recorded until every task has committed: the engine takes a new snapshot and copies the cycle again."""
    return RetryableError(f"the copy's snapshot {name} is gone from the source {where} (the session holding it "
                          f"ended: a restart or failover of the source); the copy cycle is redone")

"""Copy progress inside a cycle, for the progress views of the driver that runs it (cli/progress.py).

copy_state's rows_copied moves only when a cycle is recorded (with its lastpk): a table that fits in one cycle
would show 0 rows until it is done. The views add the cycle's rows so far: its finished Spark tasks' (an
accumulator, which reaches the driver from executors on any host) and its running tasks', as the server
counts their COPYs (`pg_stat_progress_copy`, sessions found by application_name): on a PostgreSQL target
what they wrote, into Delta what they read (plus the rows their source session's name, `label N`, says).
Advisory only: the engine never reads it back; copy_state stays the truth.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

APP_PREFIX = "sluicegate copy "


@dataclass
class TableCopy:
    """One table's copy as this driver runs it: its first cycle's start, the current cycle's counters."""

    started: float  # time.monotonic() when this driver started the table's first cycle
    base: int  # rows_copied (copy_state) then: the rate counts only what this driver moved
    cycle_base: int  # rows_copied when the current cycle started
    finished: Any = None  # rows of the current cycle's finished tasks (a Spark accumulator, or None)
    label: str = ""  # application_name of the cycle's target sessions: their running COPYs' rows
    ended: float | None = None  # when the table's last cycle was recorded
    recorded: int = 0  # rows_copied as that cycle recorded it
    peak: int = 0  # the most rows shown in this cycle (a task's rows are in neither count for a moment)

    def rows(self, in_flight: int = 0) -> int:
        """Rows copied as of now: copy_state's as of the cycle's start, plus the cycle's; once the cycle is
        recorded, what it recorded."""
        if self.ended is not None:
            return self.recorded
        done = int(self.finished.value) if self.finished is not None else 0
        self.peak = max(self.peak, self.cycle_base + done + in_flight)
        return self.peak

    def rate(self, rows: int, now: float) -> float:
        """Rows this driver copied over the wall time since it started the table (to the end when done)."""
        return copy_rate(rows - self.base, self.started, self.ended, now)


def copy_rate(moved: int, started: float, ended: float | None, now: float) -> float:
    """Rows per second over wall time from `started` to `ended` (or `now` while the copy runs)."""
    seconds = (ended if ended is not None else now) - started
    return moved / seconds if seconds > 0 and moved > 0 else 0.0


_lock = threading.Lock()
_tables: dict[tuple[str, str, int, str], TableCopy] = {}


def cycle_started(target_url: str, workflow: str, stream_id: int, table: str, rows_copied: int,
                  finished: Any = None) -> TableCopy:
    """A copy cycle of `table` begins: `rows_copied` as copy_state has it, `finished` its tasks' counter.
    The entry's `label` is the application_name its target sessions should use."""
    key = (target_url, workflow, stream_id, table)
    label = APP_PREFIX + uuid.uuid4().hex[:12]
    with _lock:
        entry = _tables.get(key)
        if entry is None or rows_copied < entry.cycle_base:  # (fewer: the table's copy was reset)
            entry = _tables[key] = TableCopy(time.monotonic(), rows_copied, rows_copied)
        entry.cycle_base, entry.finished, entry.label, entry.ended, entry.peak = (
            rows_copied, finished, label, None, rows_copied)
    return entry


def cycle_recorded(entry: TableCopy, rows_copied: int) -> None:
    """The cycle is in copy_state, which now says `rows_copied`: the entry keeps that and its end (the rate)."""
    entry.recorded, entry.ended = rows_copied, time.monotonic()


def table_copy(target_url: str, workflow: str, stream_id: int, table: str) -> TableCopy | None:
    with _lock:
        return _tables.get((target_url, workflow, stream_id, table))


def in_flight(conn) -> dict[str, int]:
    """application_name -> rows written so far by the running COPYs of copy cycles, on this target."""
    rows = conn.execute(
        """SELECT a.application_name, sum(p.tuples_processed)::bigint
           FROM pg_stat_progress_copy p JOIN pg_stat_activity a USING (pid)
           WHERE p.command = 'COPY FROM' AND a.application_name LIKE %s GROUP BY 1""",
        (APP_PREFIX + "%",)).fetchall()
    return {name: int(n) for name, n in rows}


def source_label(label: str, rows: int) -> str:
    """The application_name of a running task's source session: its cycle's label and the rows it has read."""
    return f"{label} {rows}"


def in_flight_reads(conn) -> dict[str, int]:
    """label -> rows read so far by the running tasks of copy cycles on this source: what a session's
    application_name says (`source_label`) plus what its running COPY has sent (a task's session cannot
    rename itself during a COPY; the server counts its rows)."""
    return reads(conn.execute(
        """SELECT a.application_name, coalesce(p.tuples_processed, 0)::bigint
           FROM pg_stat_activity a LEFT JOIN pg_stat_progress_copy p ON p.pid = a.pid AND p.command = 'COPY TO'
           WHERE a.application_name LIKE %s""", (APP_PREFIX + "%",)).fetchall())


def reads(sessions: list[tuple[str, int]]) -> dict[str, int]:
    """label -> rows, from the (application_name, rows its COPY sent) of running tasks' source sessions
    (`source_label`)."""
    out: dict[str, int] = {}
    for name, copied in sessions:
        label, _, rows = name.rpartition(" ")
        if label.startswith(APP_PREFIX) and rows.isdigit():
            out[label] = out.get(label, 0) + int(rows) + int(copied)
    return out

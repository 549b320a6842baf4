"""Running Sluicegate's tasks (copy ranges, play batches) as Spark jobs, errors and all.

A task returns ("ok", value) or ("err", SluicegateError): our error types cross the executor boundary
intact, with the terminal/retryable decision made where the error happened.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..errors import RetryableError, SluicegateError, TerminalError, is_retryable
from ..postgres.connect import first_line


def _import_task_modules(_) -> int:
    from ..workflow import copier, player  # noqa: F401 - imported for the worker's later tasks

    return 0


def guarded(fn: Callable, arg: Any):
    try:
        return ("ok", fn(arg))
    except SluicegateError as exc:
        return ("err", exc)
    except Exception as exc:  # noqa: BLE001 - classified, then re-raised on the driver
        cls = RetryableError if is_retryable(exc) else TerminalError
        return ("err", cls(f"{type(exc).__name__}: {first_line(exc)}"))


def unwrap(results: list) -> list:
    errors = [r[1] for r in results if r[0] == "err"]
    if errors:
        terminal = [e for e in errors if not e.retryable]
        raise (terminal or errors)[0]
    return [r[1] for r in results]


class SparkRunner:
    """Each call is one Spark job with one task per item."""

    def __init__(self, spark):
        self.spark = spark
        self.sc = spark.sparkContext

    def map(self, fn: Callable, items: list, description: str = "", tag: str | None = None) -> list:
        """`tag`: what `cancel(tag)` cancels (an engine tags its own jobs: several share one application)."""
        if not items:
            return []
        if description:
            self.sc.setJobDescription(description)
        if tag:
            self.sc.addJobTag(tag)
        try:
            rdd = self.sc.parallelize(items, len(items))
            return unwrap(rdd.map(lambda item: guarded(fn, item)).collect())
        finally:
            if tag:
                self.sc.removeJobTag(tag)

    def warm_up(self) -> threading.Thread:
        """Start a Python worker per slot in the background, with Sluicegate's task modules imported: the
        ~1.5 s a first job would otherwise spend on it overlaps the driver's own start (slot, snapshot, plan)."""
        def run() -> None:
            try:
                n = self.parallelism()
                self.sc.setJobDescription("start Python workers")
                self.sc.parallelize(range(n), n).map(_import_task_modules).collect()
            except Exception:  # noqa: BLE001 - only an optimization; the real job starts them anyway
                pass

        thread = threading.Thread(target=run, name="sg-spark-warm-up", daemon=True)
        thread.start()
        return thread

    def parallelism(self) -> int:
        """How many tasks can run at once (local[N]: N; a cluster: its executor cores)."""
        return self.sc.defaultParallelism

    def cancel(self, tag: str | None = None) -> None:
        """Cancel the jobs tagged `tag`, or every job. A cancelled task's worker is killed: whatever it had
        not committed on the target is rolled back with its connection."""
        if tag:
            self.sc.cancelJobsWithTag(tag)
        else:
            self.sc.cancelAllJobs()

"""Running Sluicegate's tasks (copy ranges, play batches) as Spark jobs, errors and all.

A task returns ("ok", value) or ("err", SluicegateError): our error types cross the executor boundary
intact, with the terminal/retryable decision made where the error happened.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..errors import SluicegateError, UsageError, from_exception
from ..postgres.connect import first_line


def guarded(fn: Callable, arg: Any):
    try:
        return ("ok", fn(arg))
    except Exception as exc:  # noqa: BLE001 - classified, then re-raised on the driver
        return ("err", from_exception(exc))


def counted(result, counter, count: Callable[[Any], int]):
    """Add a finished task's rows to `counter` (a Spark accumulator: the driver sees it as the task ends)."""
    if counter is not None and result[0] == "ok":
        counter.add(count(result[1]))
    return result


def unwrap(results: list) -> list:
    errors = [r[1] for r in results if r[0] == "err"]
    if errors:
        terminal = [e for e in errors if not e.retryable]
        raise (terminal or errors)[0]
    return [r[1] for r in results]


class SparkUnavailable(UsageError):
    """Spark did not start (no usable Java, a JVM that exited): the machine's to fix, not the workflow's, so
    the engine raises it rather than record it on a stream."""


class SparkRunner:
    """Each call is one Spark job with one task per item."""

    def __init__(self, spark):
        """`spark`: a SparkSession, or a SparkContext alone (session.get_spark_context); a session is then
        made the first time one is asked for (a rule's Spark SQL). Or a Future of either
        (session.start_in_background): waited for when Spark is first needed."""
        self._pending: Future | None = None
        self._spark = self._sc = None
        self._checked = False
        if isinstance(spark, Future):
            self._pending = spark
        else:
            self._use(spark)

    def _use(self, spark) -> None:
        if hasattr(spark, "sparkContext"):
            self._spark, self._sc = spark, spark.sparkContext
        else:
            self._spark, self._sc = None, spark

    @property
    def sc(self):
        """The SparkContext, once its executors are known to run this Sluicegate (executors.check)."""
        sc = self._context()
        if not self._checked:
            from .executors import check

            check(sc)
            self._checked = True
        return sc

    def _context(self):
        if self._sc is None:
            try:
                spark = self._pending.result()
            except SluicegateError:
                raise
            except Exception as exc:
                raise SparkUnavailable(f"Spark did not start: {first_line(exc)} (check that `java -version` "
                                       "shows Java 17+, or JAVA_HOME, and SPARK_HOME if it is set)") from exc
            self._use(spark)
        return self._sc

    @property
    def spark(self):
        self.sc  # noqa: B018 - Spark still starting is waited for, never started twice
        if self._spark is None:
            from .session import get_spark

            self._spark = get_spark()  # on the running context
        return self._spark

    def map(self, fn: Callable, items: list, description: str = "", tag: str | None = None, counter=None,
            count: Callable[[Any], int] = int) -> list:
        """`tag`: what `cancel(tag)` cancels (an engine tags its own jobs: several share one application).
        `counter` (from `counter()`): each finished task adds `count(its result)` to it (copy progress)."""
        if not items:
            return []
        if description:
            self.sc.setJobDescription(description)
        if tag:
            self.sc.addJobTag(tag)
        try:
            rdd = self.sc.parallelize(items, len(items))
            return unwrap(rdd.map(lambda item: counted(guarded(fn, item), counter, count)).collect())
        finally:
            if tag:
                self.sc.removeJobTag(tag)

    def counter(self):
        """A counter tasks add to and the driver reads while the job runs (a Spark accumulator)."""
        return self.sc.accumulator(0)

    def parallelism(self) -> int:
        """How many tasks can run at once (local[N]: N; a cluster: its executor cores)."""
        return self.sc.defaultParallelism

    def cancel(self, tag: str | None = None) -> None:
        """Cancel the jobs tagged `tag`, or every job. A cancelled task's worker is killed: whatever it had
        not committed on the target is rolled back with its connection."""
        if self._sc is None and not (self._pending.done() and self._pending.exception() is None):
            return  # Spark still starting (or it failed): no job to cancel
        sc = self._context()  # (not `sc`: a cancel runs no check job)
        if tag:
            sc.cancelJobsWithTag(tag)
        else:
            sc.cancelAllJobs()

"""The run loop's decision after a failure (no server, no Spark): Error at once, retry with backoff, or retry
once and then Error — by the error's class (errors.classify)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import psycopg
import pytest

from sluicegate.workflow import state as st
from sluicegate.workflow.loop import StreamLoop


class _SparkError(Exception):
    __module__ = "pyspark.errors.exceptions.captured"

    def __init__(self, condition=None, sqlstate=None):
        super().__init__(f"[{condition}] failed")
        self._c, self._s = condition, sqlstate

    def getCondition(self):
        return self._c

    def getSqlState(self):
        return self._s


class _Loop(StreamLoop):
    """The driver's loop (workflow/loop.py) over a step that raises the given errors in turn, then stops."""

    def __init__(self, errors):
        self.stop, self.max_backoff = threading.Event(), 0.0
        self.errors, self.recorded, self.steps = list(errors), [], 0

    down = None

    def unreachable(self):
        return self.down

    def load(self):
        return SimpleNamespace(state=st.RUNNING, stop_reason="")

    def step(self, turn):
        self.steps += 1
        if not self.errors:
            self.stop.set()
            return
        err = self.errors.pop(0)
        if err is not None:
            raise err

    def record(self, state, message):
        self.recorded.append((state, message))


def test_a_data_error_ends_in_error_without_a_retry():
    loop = _Loop([_SparkError("CAST_INVALID_INPUT", "22018")])
    assert loop._loop() == st.ERROR and loop.steps == 1
    assert loop.recorded == [(st.ERROR, "[CAST_INVALID_INPUT] failed.")]


@pytest.mark.parametrize("err", [psycopg.errors.UniqueViolation("dup"), psycopg.errors.InsufficientPrivilege("no")])
def test_constraint_and_privilege_errors_end_at_once(err):
    loop = _Loop([err])
    assert loop._loop() == st.ERROR and loop.steps == 1


def test_passing_faults_are_retried_however_often():
    lost = _SparkError()  # no class: a lost executor, a crashed worker
    loop = _Loop([psycopg.OperationalError("gone"), lost, lost, psycopg.errors.LockNotAvailable("lock"), None])
    assert loop._loop() == "stopping" and loop.steps == 6
    assert sum(1 for state, m in loop.recorded if m.startswith("retrying")) == 4


def test_an_unclassified_task_exception_is_retried_once_then_ends():
    loop = _Loop([_SparkError("PYTHON_EXCEPTION", "38000"), _SparkError("PYTHON_EXCEPTION", "38000")])
    assert loop._loop() == st.ERROR and loop.steps == 2
    assert [s for s, _ in loop.recorded] == [None, st.ERROR]


def test_once_means_once_in_a_row():
    # a success between two such failures: each gets its retry
    py = _SparkError("PYTHON_EXCEPTION", "38000")
    loop = _Loop([py, None, py, None])
    assert loop._loop() == "stopping" and loop.steps == 5


def test_the_retry_message_names_what_the_stream_waits_for_and_since_when():
    loop = _Loop([psycopg.OperationalError("timeout"), psycopg.OperationalError("timeout"), None])
    loop.down = "source 10.213.0.2:5432/shop"
    loop._loop()
    first, second = (m for _, m in loop.recorded[:2])
    assert first.startswith("waiting for source 10.213.0.2:5432/shop since ") and "(attempt 1," in first
    assert "(attempt 2," in second and second.endswith(": timeout")
    since = first.split(" since ")[1].split(" (")[0]
    assert second.split(" since ")[1].split(" (")[0] == since  # the first failure's time, kept

"""Errors raised in Spark tasks come back to the driver typed: terminal vs retryable (no Spark needed)."""

from __future__ import annotations

import pickle

import psycopg
import pytest

from sluicegate.errors import (
    ONCE,
    RETRYABLE,
    TERMINAL,
    RetryableError,
    TerminalError,
    UsageError,
    classify,
    classify_state,
    describe_error,
    is_retryable,
)
from sluicegate.spark.runner import guarded, unwrap


def boom(exc):
    raise exc


def test_values_pass_through():
    assert unwrap([guarded(lambda x: x * 2, 21)]) == [42]


@pytest.mark.parametrize("raised,expected", [
    (psycopg.OperationalError("server closed the connection unexpectedly"), RetryableError),
    (psycopg.errors.UndefinedTable("relation \"x\" does not exist"), TerminalError),
    (ValueError("bad"), TerminalError),
    (UsageError("unknown table 'x'"), UsageError),
])
def test_errors_are_classified_where_they_happen(raised, expected):
    result = pickle.loads(pickle.dumps(guarded(boom, raised)))  # as Spark ships it
    with pytest.raises(expected) as info:
        unwrap([result])
    assert "\n" not in str(info.value)


def test_a_terminal_error_wins_over_retryable_ones():
    results = [guarded(boom, RetryableError("a restart")), guarded(boom, TerminalError("slot lost"))]
    with pytest.raises(TerminalError, match="slot lost"):
        unwrap(results)


def test_retryable_by_type():
    assert is_retryable(RetryableError("x")) and not is_retryable(TerminalError("x"))
    assert is_retryable(psycopg.errors.LockNotAvailable("lock timeout"))
    assert not is_retryable(psycopg.errors.SyntaxError("syntax"))


def test_a_database_error_keeps_its_sqlstate_across_the_boundary():
    result = pickle.loads(pickle.dumps(guarded(boom, psycopg.errors.UndefinedTable('relation "x" does not exist'))))
    with pytest.raises(TerminalError) as info:
        unwrap([result])
    assert info.value.sqlstate == "42P01" and "SQLSTATE 42P01" in str(info.value)
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is TerminalError and again.sqlstate == "42P01"


class _SparkError(Exception):
    """What PySpark's captured exceptions answer (getCondition, getSqlState, getMessageParameters)."""

    __module__ = "pyspark.errors.exceptions.captured"

    def __init__(self, message, condition=None, sqlstate=None, parameters=None):
        super().__init__(message)
        self._c, self._s, self._p = condition, sqlstate, parameters or {}

    def getCondition(self):
        return self._c

    def getSqlState(self):
        return self._s

    def getMessageParameters(self):
        return self._p


class _JavaThrowable:
    """A Java exception as py4j shows it: methods, and a cause."""

    def __init__(self, condition=None, sqlstate=None, cause=None):
        self._c, self._s, self._cause = condition, sqlstate, cause

    def getCondition(self):
        return self._c

    def getSqlState(self):
        return self._s

    def getMessageParameters(self):
        return {"expression": "'x'"} if self._c else {}

    def getMessage(self):
        return f"[{self._c}] The value 'x' cannot be cast. SQLSTATE: {self._s}\n== SQL ==" if self._c else \
            "Job aborted due to stage failure: ExecutorLostFailure (executor 1 exited)"

    def getCause(self):
        return self._cause


class Py4JJavaError(Exception):
    __module__ = "py4j.protocol"

    def __init__(self, java):
        super().__init__("An error occurred while calling o95.collectToPython.")
        self.java_exception = java


CAST = _SparkError("[CAST_INVALID_INPUT] The value 'x' of the type \"STRING\" cannot be cast to \"INT\" because "
                   "it is malformed. SQLSTATE: 22018\n== SQL ==", "CAST_INVALID_INPUT", "22018",
                   {"expression": "'x'", "sourceType": '"STRING"', "targetType": '"INT"'})


@pytest.mark.parametrize("err,kind", [
    (CAST, TERMINAL),
    (_SparkError("overflow", "CAST_OVERFLOW", None), TERMINAL),  # by class alone
    (_SparkError("mismatch", "DATATYPE_MISMATCH.BINARY_OP_DIFF_TYPES", "42K09"), TERMINAL),
    (_SparkError("divide", "DIVIDE_BY_ZERO", "22012"), TERMINAL),
    (_SparkError("python", "PYTHON_EXCEPTION", "38000"), ONCE),  # a UDF, or our task code: the retry tells
    (_SparkError("no class at all"), RETRYABLE),
    # a job aborted by a task's data error: the class is on the task's exception, the abort's cause
    (Py4JJavaError(_JavaThrowable(cause=_JavaThrowable("CAST_INVALID_INPUT", "22018"))), TERMINAL),
    # a lost executor, a crashed worker: Spark names no class for them
    (Py4JJavaError(_JavaThrowable(cause=_JavaThrowable())), RETRYABLE),
    (psycopg.errors.UniqueViolation("dup"), TERMINAL),
    (psycopg.errors.InsufficientPrivilege("permission denied"), TERMINAL),
    (psycopg.errors.InvalidTextRepresentation("invalid input syntax for type bigint"), TERMINAL),
    (psycopg.errors.SerializationFailure("could not serialize"), RETRYABLE),
    (psycopg.errors.LockNotAvailable("lock timeout"), RETRYABLE),
    (psycopg.OperationalError("server closed the connection unexpectedly"), RETRYABLE),
    (ConnectionResetError("reset"), RETRYABLE),
    (KeyError("a bug"), TERMINAL),
])
def test_classified_by_sqlstate_and_spark_error_class(err, kind):
    assert classify(err) == kind


@pytest.mark.parametrize("state,kind", [
    ("22018", TERMINAL), ("22003", TERMINAL), ("23505", TERMINAL), ("23503", TERMINAL), ("42501", TERMINAL),
    ("428C9", TERMINAL), ("42804", TERMINAL), ("08006", RETRYABLE), ("40001", RETRYABLE), ("40P01", RETRYABLE),
    ("55P03", RETRYABLE), ("57014", RETRYABLE), ("57P01", RETRYABLE), ("53300", RETRYABLE), ("XX000", None),
    (None, None),
])
def test_sqlstates(state, kind):
    assert classify_state(state) == kind


def test_the_decision_never_reads_the_message():
    # the same text without a class decides nothing; a class with any text decides
    assert classify(_SparkError(str(CAST))) == RETRYABLE
    assert classify(_SparkError("whatever it says", "CAST_INVALID_INPUT")) == TERMINAL


def test_spark_errors_read_as_one_line_with_their_value():
    from sluicegate.spark import errors as spark_errors

    assert spark_errors.is_data_error(CAST) and spark_errors.value(CAST) == "'x'"
    assert spark_errors.message(CAST).startswith("[CAST_INVALID_INPUT] The value 'x'")
    assert "SQLSTATE" not in spark_errors.message(CAST) and "\n" not in describe_error(CAST)
    wrapped = Py4JJavaError(_JavaThrowable(cause=_JavaThrowable("CAST_INVALID_INPUT", "22018")))
    assert spark_errors.value(wrapped) == "'x'" and describe_error(wrapped).startswith("[CAST_INVALID_INPUT]")
    lost = Py4JJavaError(_JavaThrowable(cause=_JavaThrowable()))
    assert not spark_errors.is_data_error(lost)
    assert describe_error(lost).startswith("Job aborted due to stage failure")  # not "An error occurred..."


def test_a_python_exception_of_a_task_reads_as_what_was_raised():
    tb = ("An exception was thrown from the Python worker: Traceback (most recent call last):\n"
          '  File "worker.py", line 1, in <module>\n    import psycopg2\n'
          "ModuleNotFoundError: No module named 'psycopg2'\n SQLSTATE: 38000")
    err = _SparkError(tb, "PYTHON_EXCEPTION", "38000")
    assert describe_error(err) == "[PYTHON_EXCEPTION] ModuleNotFoundError: No module named 'psycopg2'."

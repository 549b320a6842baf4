"""Errors raised in Spark tasks come back to the driver typed: terminal vs retryable (no Spark needed)."""

from __future__ import annotations

import pickle

import psycopg
import pytest

from sluicegate.errors import RetryableError, TerminalError, UsageError, is_retryable
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


def test_spark_data_errors_are_terminal_by_sqlstate():
    from sluicegate.spark import errors as spark_errors

    cast = Exception('[CAST_INVALID_INPUT] The value \'x\' of the type "STRING" cannot be cast to "INT" because '
                     "it is malformed. SQLSTATE: 22018")
    lost = Exception("Job aborted due to stage failure: ExecutorLostFailure (executor 1 exited)")
    assert spark_errors.is_data_error(cast) and not spark_errors.is_data_error(lost)
    assert spark_errors.message(cast).startswith("[CAST_INVALID_INPUT] The value 'x'")
    assert "SQLSTATE" not in spark_errors.message(cast)

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

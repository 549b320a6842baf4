"""The stream source's pure parts: options to a WAL bound, errors to our types and back from Spark's text."""

from __future__ import annotations

import pickle

import psycopg
import pytest

from sluicegate.errors import ConnectError, RetryableError, TerminalError, UsageError
from sluicegate.spark import stream_source
from sluicegate.spark.stream_source import BYTES_PER_CHANGE, DEFAULT_MAX_BYTES, Settings


def bound(**options) -> int:
    return Settings.parse({"source": "postgresql://x", "slot": "s", **options}).max_bytes


def test_batch_bound_from_options():
    assert bound() == DEFAULT_MAX_BYTES
    assert bound(maxBytesPerBatch="16MiB") == 16 << 20
    assert bound(maxbytesperbatch="4096") == 4096  # Spark lower-cases option names
    assert bound(maxChangesPerBatch="1000") == 1000 * BYTES_PER_CHANGE
    assert bound(maxChangesPerBatch="1000", maxBytesPerBatch="10000") == 10000  # both: the smaller
    assert bound(maxChangesPerBatch="10", maxBytesPerBatch="1MiB") == 10 * BYTES_PER_CHANGE
    for size in ("0", "lots", "-1", "1.5MiB"):
        with pytest.raises(UsageError, match=r"'maxBytesPerBatch' must be a positive size .* not '"):
            bound(maxBytesPerBatch=size)
    with pytest.raises(UsageError, match=r"did you mean 'maxBytesPerBatch'"):
        bound(maxBytesPerBtach="1MiB")


def test_errors_become_ours_with_sqlstate():
    doing = "reading changes [0/1, 0/2) of slot s"
    gone = stream_source._as_error(psycopg.errors.UndefinedObject('publication "p" does not exist'), doing)
    assert type(gone) is TerminalError and not gone.retryable
    assert str(gone) == 'reading changes [0/1, 0/2) of slot s failed: publication "p" does not exist ' \
                       '(SQLSTATE 42704)'
    busy = stream_source._as_error(psycopg.errors.ObjectInUse('replication slot "s" is active for PID 7'),
                                   doing)
    assert type(busy) is RetryableError and busy.message.endswith("(SQLSTATE 55006)")
    lost = stream_source._as_error(psycopg.OperationalError("consuming input failed: server closed the "
                                                            "connection unexpectedly\n\tThis probably means"),
                                   doing)
    assert type(lost) is RetryableError and "\n" not in str(lost) and "SQLSTATE" not in str(lost)
    ours = ConnectError("cannot connect to source 127.0.0.1:1/x: connection refused")
    assert stream_source._as_error(ours, doing) is ours
    assert stream_source._as_error(KeyError("a bug"), doing) is None
    assert pickle.loads(pickle.dumps(gone)).message == gone.message  # Spark ships it from executors


def test_terminal_errors_are_not_retried(monkeypatch):
    calls = []

    def fail(exc):
        def fn():
            calls.append(exc)
            raise exc
        return fn

    monkeypatch.setattr(stream_source, "RETRY_SECONDS", 0.5)
    with pytest.raises(TerminalError, match=r"^planning failed: .*\(SQLSTATE 42704\)$"):
        stream_source._retrying("planning", fail(psycopg.errors.UndefinedObject("gone")))
    assert len(calls) == 1
    calls.clear()
    with pytest.raises(RetryableError, match=r"^planning failed: busy \(SQLSTATE 55006\)$"):
        stream_source._retrying("planning", fail(psycopg.errors.ObjectInUse("busy")))
    assert 2 <= len(calls) <= 6  # 0.1 + 0.2 s of backoff, then the deadline
    with pytest.raises(KeyError):  # a bug goes up as it is
        stream_source._retrying("planning", fail(KeyError("x")))


def test_query_error_rebuilds_our_error():
    text = ("[STREAM_FAILED] Query [id = 1] terminated with exception: [PYTHON_EXCEPTION] An exception was "
            "thrown from the Python worker: Traceback (most recent call last):\n"
            "  File \"x.py\", line 3, in read\n"
            "sluicegate.errors.TerminalError: replication slot s is gone from the source; start again\n"
            " SQLSTATE: 38000\n=== Streaming Query ===\n")
    err = stream_source.query_error(RuntimeError(text))
    assert type(err) is TerminalError
    assert err.message == "replication slot s is gone from the source; start again"
    retry = stream_source.query_error(RuntimeError("x\nsluicegate.errors.RetryableError: restarting\n"))
    assert type(retry) is RetryableError and retry.retryable
    assert stream_source.query_error(RuntimeError("java.lang.OutOfMemoryError")) is None
    assert stream_source.query_error(RuntimeError("sluicegate.errors.did_you_mean: not a class")) is None
    assert stream_source.query_error(None) is None

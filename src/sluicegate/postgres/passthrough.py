"""Raw COPY passthrough: `COPY … TO STDOUT` on one server straight into `COPY … FROM STDIN` on another.

psycopg 3 hands every row of a COPY to Python (one CopyData message each): ~1.6 µs of interpreter time per
row on the copy's hot path, on machines where the two servers need the CPU. psycopg2's `copy_expert` runs the
loop in C against a file object, so the rows go libpq → an OS pipe → libpq with no Python per row (a 2M-row
pipe: 0.6 s of the worker's CPU instead of 3.2 s). This module is the one place that copies that way; every
other connection is psycopg 3. Errors come out as Sluicegate's own (terminal or retryable), named by side.
"""

from __future__ import annotations

import os
import threading

import psycopg2

from ..errors import ConnectError, RetryableError, TerminalError, is_retryable
from .connect import SESSION_OPTIONS, describe, first_line

_PIPE_BUFFER = 1 << 20
_BLOCK = 1 << 16


def connect(url: str, role: str):
    """A psycopg2 session with Sluicegate's settings, in a transaction (commit/rollback are the caller's)."""
    try:
        return psycopg2.connect(url, options=SESSION_OPTIONS, application_name="sluicegate", connect_timeout=10)
    except psycopg2.OperationalError as exc:
        raise ConnectError(f"cannot connect to {role} {describe(url)}: {first_line(exc)}") from None


def pipe(source, select: str, target, insert: str) -> int:
    """Run `select` (a COPY TO STDOUT) on `source` into `insert` (a COPY FROM STDIN) on `target`; the rows
    copied. Neither side is committed here. A source that fails part way raises: the target's COPY may have
    taken what came before it, so the caller must roll the target back (it never commits after an error)."""
    read_end, write_end = os.pipe()
    produced: list[BaseException] = []

    def produce() -> None:
        try:
            with os.fdopen(write_end, "wb", buffering=_PIPE_BUFFER) as out:
                source.cursor().copy_expert(select, out, size=_BLOCK)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller's thread
            produced.append(exc)

    producer = threading.Thread(target=produce, name="sg-copy-source", daemon=True)
    producer.start()
    consumed: BaseException | None = None
    rows = 0
    try:
        with os.fdopen(read_end, "rb", buffering=_PIPE_BUFFER) as inp:
            cur = target.cursor()
            cur.copy_expert(insert, inp, size=_BLOCK)
            rows = cur.rowcount
    except BaseException as exc:  # noqa: BLE001 - the pipe's read end is closed: the producer stops (EPIPE)
        consumed = exc
    producer.join()
    source_error = next((e for e in produced if not isinstance(e, BrokenPipeError)), None)
    if source_error is not None:  # the source's failure comes first: the target only saw its effect
        raise _translate(source_error, "source", source.dsn)
    if consumed is not None:
        raise _translate(consumed, "target", target.dsn)
    return rows


def _translate(exc: BaseException, role: str, dsn: str) -> BaseException:
    if not isinstance(exc, psycopg2.Error):
        return exc
    where = f"{role} {describe(dsn)}"
    if is_retryable(exc):
        return RetryableError(f"copy from/to {where} failed: {first_line(exc)}; will retry")
    return TerminalError(f"copy from/to {where} failed: {first_line(exc)}")

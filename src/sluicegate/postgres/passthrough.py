"""Raw COPY passthrough: `COPY … TO STDOUT` on one server straight into `COPY … FROM STDIN` on another.

psycopg 3 hands every row of a COPY to Python (one CopyData message each): interpreter time for every
row on the copy's hot path, on machines where the two servers need the CPU. psycopg2's `copy_expert` runs the
loop in C against a file object, so the rows go libpq → an OS pipe → libpq, though still as one Python bytes object and one write() per row. When the C
pump (_copy_pump.c) is built and psycopg2's libpq can be found, the rows go from libpq to libpq with no
Python at all, on the connections psycopg2 opened; SLUICEGATE_COPY_PUMP=python keeps the pipe. This module
is the one place that copies that way; every other connection is psycopg 3. Errors come out as Sluicegate's
own (terminal or retryable), named by side. `copy_blocks` reads a COPY's output into blocks the same way, for
the copy into Delta (targets/delta/copy.py), which parses them with Arrow.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import queue
import threading
from collections.abc import Iterator

import psycopg2
import psycopg2.errors
import psycopg2.extensions

from .. import config
from ..errors import RetryableError, TerminalError, is_retryable
from .connect import connect_failure, describe, first_line, primary_only, session_options

_PIPE_BUFFER = 1 << 20
_BLOCK = 1 << 16


def connect(url: str, role: str, application_name: str = ""):
    """A psycopg2 session with Sluicegate's settings, in a transaction (commit/rollback are the caller's)."""
    try:
        return psycopg2.connect(url, **session_options(url), application_name=application_name or "sluicegate",
                                connect_timeout=10, **primary_only(url))
    except psycopg2.OperationalError as exc:
        raise connect_failure(role, url, first_line(exc)) from None


def pipe(source, select: str, target, insert: str) -> int:
    """Run `select` (a COPY TO STDOUT) on `source` into `insert` (a COPY FROM STDIN) on `target`; the rows
    copied. Neither side is committed here. A source that fails part way raises: the target's COPY may have
    taken what came before it, so the caller must roll the target back (it never commits after an error)."""
    pump, libpq = _c_pump()
    if pump is not None:
        idle = psycopg2.extensions.TRANSACTION_STATUS_IDLE
        for conn in (source, target):  # psycopg2 opens the transaction, and later commits or rolls it back
            if conn.get_transaction_status() == idle and not conn.autocommit:
                conn.cursor().execute("SELECT 1")
        ok, side, sqlstate, message, rows = pump(source.pgconn_ptr, target.pgconn_ptr, libpq, select, insert)
        if ok:
            return rows
        message = message.strip().removeprefix("ERROR:").strip() or "connection lost"
        try:
            cls = psycopg2.errors.lookup(sqlstate) if sqlstate else psycopg2.OperationalError
        except KeyError:
            cls = psycopg2.DatabaseError
        conn = source if side == "source" else target
        raise _translate(cls(message), side, conn.dsn)
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


def copy_blocks(conn, select: str, size: int, on_end=None) -> Iterator[bytes]:
    """Run `select` (a COPY … TO STDOUT) on `conn` and yield its output in blocks of about `size` bytes, each
    ending where a row ends (PostgreSQL sends one CopyData message a row; psycopg2 one write() each).
    psycopg2 runs the COPY's loop in C, while psycopg 3 runs several Python frames a row (twice the client's
    CPU on narrow rows): the loop runs in a thread that hands whole blocks over through a queue of one, so at
    most three blocks are held whatever the COPY's size, and a consumer that stops early cancels the COPY.
    The source's errors come out as raised (psycopg2's, with their SQLSTATE). `on_end(rows)`: called on `conn`'s
    thread as soon as the COPY has ended, with the rows it sent, before its last blocks are handed over."""
    handed: queue.Queue = queue.Queue(maxsize=1)
    sink = _BlockSink(handed, size, on_end)
    producer = threading.Thread(target=sink.run, args=(conn, select), name="sg-copy-out", daemon=True)
    producer.start()
    ended = False
    try:
        while (block := handed.get()) is not None:
            if isinstance(block, BaseException):
                ended = True
                raise block
            yield block
        ended = True
    finally:
        if not ended:  # the consumer stopped early or failed: the COPY is cancelled, the thread drained
            sink.stopped.set()
            conn.cancel()
            while producer.is_alive():
                with contextlib.suppress(queue.Empty):
                    handed.get(timeout=0.05)
        producer.join()


class _Stopped(Exception):
    """Ends a COPY whose blocks nobody reads any more (copy_blocks)."""


class _BlockSink:
    """The file object copy_expert writes the COPY's rows to: whole blocks go to `handed`, then None."""

    def __init__(self, handed: queue.Queue, size: int, on_end=None):
        self.handed, self.size, self.on_end = handed, size, on_end
        self.stopped = threading.Event()
        self.block = io.BytesIO()

    def write(self, row: bytes) -> None:
        self.block.write(row)
        if self.block.tell() >= self.size:
            self._hand_over()

    def _hand_over(self) -> None:
        if self.stopped.is_set():
            raise _Stopped
        self.handed.put(self.block.getvalue())
        self.block = io.BytesIO()

    def run(self, conn, select: str) -> None:
        try:
            cur = conn.cursor()
            cur.copy_expert(select, self, size=_BLOCK)
            if self.on_end is not None:
                self.on_end(cur.rowcount)
            if self.block.tell():
                self._hand_over()
            self.handed.put(None)
        except BaseException as exc:  # noqa: BLE001 - raised by the consumer's thread
            if not self.stopped.is_set():
                self.handed.put(exc)


def _translate(exc: BaseException, role: str, dsn: str) -> BaseException:
    if not isinstance(exc, psycopg2.Error):
        return exc
    where = f"{role} {describe(dsn)}"
    if is_retryable(exc):
        return RetryableError(f"copy from/to {where} failed: {first_line(exc)}; will retry")
    return TerminalError(f"copy from/to {where} failed: {first_line(exc)}")


@functools.cache
def _c_pump():
    """(the C pump, the path of the libpq psycopg2 runs on), or (None, None): not built, turned off, or no
    libpq that is surely psycopg2's own (the pump must call the very library its connections belong to)."""
    if config.from_env("copy_pump").lower() == "python":
        return None, None
    try:
        from ._copy_pump import pump
    except ImportError:
        return None, None
    try:
        with open("/proc/self/maps") as maps:  # address perms offset dev inode [path]
            rows = (line.split(None, 5) for line in maps)
            mapped = {fields[5].strip() for fields in rows if len(fields) == 6}
    except OSError:
        return None, None
    libpqs = {p for p in mapped if os.path.basename(p).startswith("libpq")}
    # psycopg2-binary brings its own libpq beside the package; psycopg (3)'s binary wheel brings another.
    bundled = os.path.dirname(os.path.dirname(psycopg2.__file__)) + os.sep + "psycopg2_binary.libs" + os.sep
    own = [p for p in libpqs if p.startswith(bundled)]
    others = [p for p in libpqs if os.sep + "psycopg_binary.libs" + os.sep not in p]
    path = own[0] if len(own) == 1 else (others[0] if not own and len(others) == 1 else None)
    return (pump, path) if path else (None, None)

"""One error hierarchy: terminal errors stop a stream in Error, retryable ones are retried with backoff.

Errors are picklable (Spark ships them from executors back to the driver) and read as one line.
"""

from __future__ import annotations


class SluicegateError(Exception):
    """Base class. `str(err)` is a one-line message that names the object and the way out."""

    retryable = False

    def __init__(self, message: str, sqlstate: str | None = None):
        super().__init__(message)
        self.message = message
        self.sqlstate = sqlstate  # the server's SQLSTATE when a database error caused it

    def __reduce__(self):
        return (type(self), (self.message, self.sqlstate))

    def __str__(self) -> str:
        return self.message


class UsageError(SluicegateError):
    """Bad input from the user (unknown table, existing workflow, ...): nothing was created."""


class ConnectError(SluicegateError):
    """A database could not be reached or refused us. Retryable while a workflow runs."""

    retryable = True


class TerminalError(SluicegateError):
    """The stream cannot go on without the user (slot lost, schema incompatible)."""


class RetryableError(SluicegateError):
    """A passing fault (server restart, lock timeout); the step is retried."""

    retryable = True


def is_retryable(err: BaseException) -> bool:
    """Terminal vs transient, decided by type: our own flag, else psycopg's class of error."""
    if isinstance(err, SluicegateError):
        return err.retryable
    try:
        import psycopg
    except ImportError:  # pragma: no cover
        return False
    # Connection loss, admin shutdown, serialization/lock failures are passing; everything else
    # (syntax, undefined table, constraint violation) needs a person.
    if isinstance(err, (psycopg.OperationalError, psycopg.errors.SerializationFailure,
                        psycopg.errors.DeadlockDetected, psycopg.errors.LockNotAvailable,
                        psycopg.errors.ObjectInUse, psycopg.errors.QueryCanceled)):
        return True
    # psycopg2 carries the replication stream and the copy's passthrough: the same classes, its own types.
    import psycopg2
    import psycopg2.errors

    if isinstance(err, (psycopg2.OperationalError, psycopg2.errors.SerializationFailure,
                        psycopg2.errors.DeadlockDetected, psycopg2.errors.LockNotAvailable,
                        psycopg2.errors.ObjectInUse, psycopg2.errors.QueryCanceled)):
        return True
    return isinstance(err, (ConnectionError, TimeoutError, EOFError))


def from_exception(exc: BaseException) -> SluicegateError:
    """Any error as one of ours, as a task reports it across the executor boundary: ours unchanged; others
    terminal or retryable by their class (is_retryable), one line, with the database's SQLSTATE kept."""
    if isinstance(exc, SluicegateError):
        return exc
    from .postgres.connect import first_line  # (psycopg: only once there is an error to describe)

    state = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)  # psycopg 3, psycopg2
    text = f"{type(exc).__name__}: {first_line(exc)}"
    if state:
        text += f" (SQLSTATE {state})"
    cls = RetryableError if is_retryable(exc) else TerminalError
    return cls(text, sqlstate=state)


def did_you_mean(name: str, choices: list[str], *, cutoff: float = 0.6) -> str:
    """': did you mean 'x'?' for the closest of `choices`, or '' — the tail of an unknown-name error."""
    import difflib

    close = difflib.get_close_matches(name, choices, n=1, cutoff=cutoff)
    return f": did you mean {close[0]!r}?" if close else ""

"""One error hierarchy: terminal errors stop a stream in Error, retryable ones are retried with backoff.

Errors are picklable (Spark ships them from executors back to the driver) and read as one line.
"""

from __future__ import annotations

import base64
import pickle
import re
from dataclasses import dataclass, field

from .redact import first_line, redact


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


# -- terminal or retryable: by SQLSTATE and Spark's error class, never by message text -----------------------
TERMINAL, RETRYABLE, ONCE = "terminal", "retryable", "once"

# SQLSTATE classes a retry cannot fix: 22 data exception (a malformed cast, an overflow, a division by zero),
# 23 integrity constraint, 42 syntax error or access rule violation (42501 privilege, 428C9 a GENERATED
# ALWAYS column, 42804 a type mismatch).
_TERMINAL_CLASSES = ("22", "23", "42")
# Passing faults: 08 connection, 40001 serialization, 40P01 deadlock, 55P03 lock timeout, 55006 object in use,
# 57014 statement cancelled (a timeout), 57P01-57P03 a server shutting down or starting, 53 resources.
_RETRYABLE_STATES = ("40001", "40P01", "55P03", "55006", "57014", "57P01", "57P02", "57P03")
_RETRYABLE_CLASSES = ("08", "53")
# Spark's error classes (conditions) of a row that fails the same way however often it is retried.
_TERMINAL_CONDITIONS = ("CAST_INVALID_INPUT", "CAST_OVERFLOW", "CAST_OVERFLOW_IN_TABLE_INSERT",
                        "NUMERIC_VALUE_OUT_OF_RANGE", "DIVIDE_BY_ZERO", "ARITHMETIC_OVERFLOW",
                        "DATATYPE_MISMATCH", "INVALID_ARRAY_INDEX", "INVALID_FORMAT")


def classify_state(sqlstate: str | None, condition: str | None = None) -> str | None:
    """TERMINAL or RETRYABLE for a SQLSTATE and/or a Spark error class, None when neither decides."""
    if condition and condition.split(".", 1)[0] in _TERMINAL_CONDITIONS:
        return TERMINAL
    if not sqlstate:
        return None
    if sqlstate in _RETRYABLE_STATES or sqlstate[:2] in _RETRYABLE_CLASSES:
        return RETRYABLE
    if sqlstate[:2] in _TERMINAL_CLASSES:
        return TERMINAL
    return None


def classify(err: BaseException) -> str:
    """TERMINAL: the stream stops in Error now. RETRYABLE: retried with backoff, however often. ONCE: a
    failure whose class does not tell (a Python exception in a Spark task: a rule's function that raises, or
    a connection lost in our task code): retried once, and in Error if the retry fails too — that retry is
    how we find out."""
    if isinstance(err, SluicegateError):
        return RETRYABLE if err.retryable else TERMINAL
    import psycopg
    import psycopg2
    import psycopg2.errors

    # psycopg2 carries the copy's passthrough (Spark copy tasks): the same classes, its own types.
    for driver, state in ((psycopg, "sqlstate"), (psycopg2, "pgcode")):
        if isinstance(err, driver.Error):
            return RETRYABLE if _passing(err, driver) else classify_state(getattr(err, state)) or TERMINAL
    if isinstance(err, (ConnectionError, TimeoutError, EOFError)):
        return RETRYABLE
    if type(err).__module__.startswith(("py4j", "pyspark")):
        info = spark_error_info(err)
        if info.condition == "PYTHON_EXCEPTION":
            return ONCE
        # Spark names no class for a lost executor, a crashed Python worker or a cancelled job: passing faults.
        return classify_state(info.sqlstate, info.condition) or (RETRYABLE if not info.condition else ONCE)
    return TERMINAL  # a bug of ours (ValueError, KeyError...): retrying runs the same code again


def _passing(err, driver) -> bool:
    # Connection loss, admin shutdown, serialization/lock failures are passing; everything else
    # (syntax, undefined table, constraint violation) needs a person.
    e = driver.errors
    return isinstance(err, (driver.OperationalError, e.SerializationFailure, e.DeadlockDetected,
                            e.LockNotAvailable, e.ObjectInUse, e.QueryCanceled))


def is_retryable(err: BaseException) -> bool:
    """Terminal vs transient (classify): only RETRYABLE counts."""
    return classify(err) == RETRYABLE


@dataclass(frozen=True)
class SparkErrorInfo:
    """What a Spark error says about itself: its error class (condition), SQLSTATE and message parameters
    (e.g. CAST_INVALID_INPUT's `expression`, the value that failed), from the first exception of its cause
    chain that has them."""

    condition: str | None = None
    sqlstate: str | None = None
    parameters: dict = field(default_factory=dict)
    message: str = ""


def spark_error_info(err: BaseException) -> SparkErrorInfo:
    """PySpark's own exceptions answer getCondition/getSqlState; a Py4JJavaError wraps a Java exception whose
    causes may be SparkThrowables (a task's failure is the job abort's cause): asked through py4j."""
    info = _ask(err)
    if info.condition or info.sqlstate:
        return info
    java = getattr(err, "java_exception", None)
    seen = 0
    while java is not None and seen < 10:
        try:
            info = _ask(java)
            if info.condition or info.sqlstate:
                return info
            java = java.getCause()
        except Exception:  # noqa: BLE001 - a JVM that is gone, a cause that is not a Java object
            break
        seen += 1
    return SparkErrorInfo()


def _ask(obj) -> SparkErrorInfo:
    def call(name):
        fn = getattr(obj, name, None)
        if not callable(fn):
            return None
        try:
            return fn()
        except Exception:  # noqa: BLE001 - not a SparkThrowable (py4j raises for an unknown method)
            return None

    condition = call("getCondition")
    state = call("getSqlState")
    params = call("getMessageParameters")
    message = call("getMessage") if not isinstance(obj, BaseException) else None
    try:
        params = dict(params) if params else {}
    except Exception:  # noqa: BLE001
        params = {}
    return SparkErrorInfo(str(condition) if condition else None, str(state) if state else None, params,
                          str(message or obj))


def from_exception(exc: BaseException) -> SluicegateError:
    """Any error as one of ours, as a task reports it across the executor boundary: ours unchanged; others
    terminal or retryable by their class (classify), one line, with the database's SQLSTATE kept."""
    if isinstance(exc, SluicegateError):
        return exc
    state = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)  # psycopg 3, psycopg2
    if not isinstance(state, str):
        state = None  # (a PySpark error's sqlstate is a method)
    text = f"{type(exc).__name__}: {first_line(exc)}"
    detail = _detail(exc) if state and state[:2] in ("22", "23") else None
    if detail:  # which row, which value: "Failing row contains (7, -1)", "Key (id)=(7) already exists."
        text += f" ({detail})"
    if state:
        text += f" (SQLSTATE {state})"
    cls = RetryableError if is_retryable(exc) else TerminalError
    if cls is TerminalError and state and (fix := _WAY_OUT.get(state) or _WAY_OUT.get(state[:2])):
        text += f": {fix}"
    return cls(text, sqlstate=state)


def pack(exc: BaseException) -> str:
    """An error as text, for a Spark task's result row (which carries no exception): from_exception's, so its
    type, SQLSTATE and retryability reach the driver, which raises `unpack(text)`."""
    return base64.b64encode(pickle.dumps(from_exception(exc))).decode()


def unpack(text: str) -> SluicegateError:
    return pickle.loads(base64.b64decode(text))


_WAY_OUT = {  # the way out of a terminal database error, by SQLSTATE or its class
    "22": "the target column cannot hold the value: ALTER its type on the target, or CAST it in a rule; "
          "then `sluicegate workflow start`",
    "23": "a constraint of the target refuses the row: fix the row on the source, or drop or change the "
          "constraint on the target; then `sluicegate workflow start`",
    "42501": "grant the privilege it names to the user of that database; then `sluicegate workflow start`",
}


def _detail(exc: BaseException) -> str | None:
    """The server's DETAIL line (one line, short), e.g. the failing row or key."""
    diag = getattr(exc, "diag", None)
    detail = getattr(diag, "message_detail", None) if diag is not None else None
    if not detail:
        return None
    line = " ".join(str(detail).split())
    return redact(line if len(line) <= 200 else line[:199] + "…")


def describe_error(exc: BaseException) -> str:
    """Any error on one line, for a stream's message and the log: ours as they read; Spark's as its error
    class and message (a Py4JJavaError's own text is "An error occurred while calling o95.collectToPython")."""
    if isinstance(exc, SluicegateError):
        return str(exc)
    if type(exc).__module__.startswith(("py4j", "pyspark")):
        return spark_message(exc)
    return first_line(exc)


_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\w*: ")


def spark_message(exc: BaseException) -> str:
    """Spark's message on one line, without its SQLSTATE tail, query context and stack (formatting only)."""
    info = spark_error_info(exc)
    text = (info.message or _java_message(exc) or str(exc)).strip().splitlines()
    if info.condition == "PYTHON_EXCEPTION":  # a traceback: its last line says what was raised
        raised = next((ln.strip() for ln in reversed(text) if _RAISED.match(ln)), None)
        if raised:
            return f"[PYTHON_EXCEPTION] {raised.rstrip(' .')}."
    first = next((ln.strip() for ln in text if "[" in ln and "]" in ln), text[0] if text else type(exc).__name__)
    first = re.sub(r"^.*?(\[[A-Z_.]+\])", r"\1", first)
    return re.sub(r"\s*SQLSTATE: [0-9A-Z]{5}", "", first).rstrip(" .;") + "."


def _java_message(exc: BaseException) -> str | None:
    java = getattr(exc, "java_exception", None)
    if java is None:
        return None
    try:
        return str(java.getMessage())
    except Exception:  # noqa: BLE001 - the JVM is gone
        return None


def did_you_mean(name: str, choices: list[str], *, cutoff: float = 0.6) -> str:
    """': did you mean 'x'?' for the closest of `choices`, or '' — the tail of an unknown-name error."""
    import difflib

    close = difflib.get_close_matches(name, choices, n=1, cutoff=cutoff)
    return f": did you mean {close[0]!r}?" if close else ""

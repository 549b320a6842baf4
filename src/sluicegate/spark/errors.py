"""Spark's errors in Sluicegate's terms: a job that failed because of the data is terminal, one that failed
because a worker or a connection went away is worth retrying. Decided by the error class and SQLSTATE Spark
attaches to its exceptions (errors.spark_error_info), as for PostgreSQL, never by the message's text."""

from __future__ import annotations

import re

from ..errors import TERMINAL, classify_state, spark_error_info

# 22: data exception (a cast of malformed input, an overflow, a division by zero); 38: a function the rule
# calls raised (a Python UDF). Both fail again on the same row, however often they are retried.
_DATA_CLASSES = ("22", "38")
# The message parameter that holds the offending value, by error class.
_VALUE_PARAMETERS = ("expression", "value", "input", "str")
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\w*: ")


def sql_state(exc: BaseException) -> str | None:
    """The SQLSTATE of a Spark error (PySpark's own, or of the first Java exception in its causes)."""
    return spark_error_info(exc).sqlstate


def is_data_error(exc: BaseException) -> bool:
    info = spark_error_info(exc)
    return (info.sqlstate is not None and info.sqlstate[:2] in _DATA_CLASSES) or \
        classify_state(info.sqlstate, info.condition) == TERMINAL


def value(exc: BaseException) -> str | None:
    """The value a row failed on, as Spark quotes it ('12.50'), when the error class carries it."""
    params = spark_error_info(exc).parameters
    return next((str(params[k]) for k in _VALUE_PARAMETERS if params.get(k)), None)


def message(exc: BaseException) -> str:
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

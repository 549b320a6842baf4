"""Spark's errors in Sluicegate's terms: a job that failed because of the data is terminal, one that failed
because a worker or a connection went away is worth retrying. Decided by SQLSTATE, as for PostgreSQL."""

from __future__ import annotations

import re

_SQLSTATE = re.compile(r"SQLSTATE: ([0-9A-Z]{5})")
# 22: data exception (a cast of malformed input, an overflow, a division by zero); 38: a function the rule
# calls raised (a Python UDF). Both fail again on the same row, however often they are retried.
_DATA_CLASSES = ("22", "38")


def sql_state(exc: BaseException) -> str | None:
    """The SQLSTATE of a Spark error (PySpark's own, or the first one its message names)."""
    getter = getattr(exc, "getSqlState", None)
    if callable(getter):
        try:
            state = getter()
            if state:
                return str(state)
        except Exception:  # noqa: BLE001, S110 - a py4j error whose JVM side is gone: read the message
            pass
    m = _SQLSTATE.search(str(exc))
    return m.group(1) if m else None


def is_data_error(exc: BaseException) -> bool:
    state = sql_state(exc)
    return state is not None and state[:2] in _DATA_CLASSES


def message(exc: BaseException) -> str:
    """Spark's message on one line, without its SQLSTATE tail and stack."""
    text = str(exc).strip().splitlines()
    first = next((ln.strip() for ln in text if "[" in ln and "]" in ln), text[0] if text else type(exc).__name__)
    first = re.sub(r"^.*?(\[[A-Z_.]+\])", r"\1", first)
    return _SQLSTATE.sub("", first).rstrip(" .;") + "."

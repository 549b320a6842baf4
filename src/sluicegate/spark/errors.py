"""Spark's errors in Sluicegate's terms: a job that failed because of the data is terminal, one that failed
because a worker or a connection went away is worth retrying. Decided by the error class and SQLSTATE Spark
attaches to its exceptions (errors.spark_error_info), as for PostgreSQL, never by the message's text."""

from __future__ import annotations

from ..errors import TERMINAL, classify_state, spark_error_info
from ..errors import spark_message as message  # noqa: F401 - (re-exported: spark_errors.message)

# 22: data exception (a cast of malformed input, an overflow, a division by zero); 38: a function the rule
# calls raised (a Python UDF). Both fail again on the same row, however often they are retried.
_DATA_CLASSES = ("22", "38")
# The message parameter that holds the offending value, by error class.
_VALUE_PARAMETERS = ("expression", "value", "input", "str")


def is_data_error(exc: BaseException) -> bool:
    info = spark_error_info(exc)
    return (info.sqlstate is not None and info.sqlstate[:2] in _DATA_CLASSES) or \
        classify_state(info.sqlstate, info.condition) == TERMINAL


def value(exc: BaseException) -> str | None:
    """The value a row failed on, as Spark quotes it ('12.50'), when the error class carries it."""
    params = spark_error_info(exc).parameters
    return next((str(params[k]) for k in _VALUE_PARAMETERS if params.get(k)), None)

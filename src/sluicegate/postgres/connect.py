"""Connections to source and target: one session setup, one way to report connection failures.

Every Sluicegate session uses the same output settings, so the text form of a value read on one side
(COPY text, pgoutput text) is parsed identically on the other (UTC times, ISO dates, exact floats).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

import psycopg

from ..errors import ConnectError

SESSION_OPTIONS = (
    "-c TimeZone=UTC -c DateStyle=ISO,YMD -c IntervalStyle=postgres "
    "-c extra_float_digits=3 -c bytea_output=hex -c client_encoding=UTF8"
)


def redact(url: str) -> str:
    """The URL without its password, fit for output and logs."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if parts.password is None:
        return re.sub(r"(password=)[^\s&]*", r"\1***", url)
    netloc = parts.netloc.replace(":" + parts.password + "@", ":***@", 1)
    query = re.sub(r"(password=)[^&]*", r"\1***", parts.query)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def describe(url: str) -> str:
    """'host:port/dbname' for messages."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return redact(url)
    host = info.get("host") or "localhost"
    port = info.get("port") or "5432"
    return f"{host}:{port}/{info.get('dbname') or info.get('user') or ''}"


def connect(url: str, *, role: str, autocommit: bool = False, **kwargs) -> psycopg.Connection:
    """Open a session with Sluicegate's settings. `role` ('source' or 'target') only names the side in errors."""
    try:
        return psycopg.connect(
            url, autocommit=autocommit, options=SESSION_OPTIONS, application_name="sluicegate",
            connect_timeout=kwargs.pop("connect_timeout", 10), **kwargs,
        )
    except psycopg.OperationalError as exc:
        raise ConnectError(f"cannot connect to {role} {describe(url)}: {first_line(exc)}") from None
    except psycopg.ProgrammingError as exc:  # malformed URL
        raise ConnectError(f"bad {role} URL {redact(url)}: {first_line(exc)}") from None


def first_line(exc: BaseException) -> str:
    """The server's message without libpq's multi-line detail (and never a password)."""
    text = str(exc).strip().splitlines()
    msg = text[0] if text else type(exc).__name__
    # libpq prefixes 'connection failed: connection to server at "127.0.0.1", port 5: ...'; keep the cause
    msg = re.sub(r'^connection failed: connection to server at "[^"]*", port \d+ failed: ', "", msg)
    msg = re.sub(r"^connection failed: ", "", msg)
    return redact(msg)

"""Connections to source and target: one session setup, one way to report connection failures.

Every Sluicegate session uses the same output settings, so the text form of a value read on one side
(COPY text, pgoutput text) is parsed identically on the other (UTC times, ISO dates, exact floats).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..errors import ConnectError

if TYPE_CHECKING:
    import psycopg

SESSION_OPTIONS = (
    "-c TimeZone=UTC -c DateStyle=ISO,YMD -c IntervalStyle=postgres "
    "-c extra_float_digits=3 -c bytea_output=hex -c client_encoding=UTF8 -c lc_monetary=C "
    # Like pg_dump: a snapshot holder sits idle in its transaction while Spark tasks read, and a copy's COPY
    # runs as long as the table is big; a server default meant for applications must not cut them off.
    "-c statement_timeout=0 -c idle_in_transaction_session_timeout=0"
)


# user:password@ in any URL, and password=... as a keyword (quoted or not) or URL query parameter
_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/\s:@\"']*:)[^/\s@\"']*@", re.IGNORECASE)
_KEYWORD_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'?|[^\s&\"]*)", re.IGNORECASE)


def redact(text: str) -> str:
    """The URL (or any text quoting one, such as a libpq error) without its password, fit for output and logs."""
    return _KEYWORD_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", text))


def describe(url: str) -> str:
    """'host:port/dbname' for messages."""
    import psycopg  # here, not at the top: a Spark copy task imports this module and never needs psycopg 3

    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return redact(url)
    host = info.get("host") or "localhost"
    port = info.get("port") or "5432"
    return f"{host}:{port}/{info.get('dbname') or info.get('user') or ''}"


# The way out for the usual reasons a connection is refused (matched on libpq's message).
_CONNECT_HINTS = (
    ("password authentication failed", "check the user and password in the {role} URL"),
    ("no password supplied", "put the password in the {role} URL (or PGPASSWORD / ~/.pgpass)"),
    ("no pg_hba.conf entry", "allow this client in the {role} server's pg_hba.conf"),
    ("connection refused", "is PostgreSQL running and listening on that host and port?"),
    ("timeout expired", "is the host reachable (address, firewall)?"),
    ("could not translate host name", "check the host name in the {role} URL"),
    ("failed to resolve host", "check the host name in the {role} URL"),
)


def connect(url: str, *, role: str, autocommit: bool = False, **kwargs) -> psycopg.Connection:
    """Open a session with Sluicegate's settings. `role` ('source' or 'target') only names the side in errors."""
    import psycopg

    try:
        return psycopg.connect(
            url, autocommit=autocommit, options=SESSION_OPTIONS, application_name="sluicegate",
            connect_timeout=kwargs.pop("connect_timeout", 10), **kwargs,
        )
    except psycopg.OperationalError as exc:
        msg = first_line(exc)
        hint = next((h for needle, h in _CONNECT_HINTS if needle in msg.lower()), None)
        msg += f": {hint.format(role=role)}" if hint else ""
        raise ConnectError(f"cannot connect to {role} {describe(url)}: {msg}") from None
    except psycopg.ProgrammingError as exc:  # malformed URL
        raise ConnectError(f"bad {role} URL {redact(url)}: {first_line(exc)}") from None


def first_line(exc: BaseException) -> str:
    """The server's message without libpq's multi-line detail (and never a password)."""
    text = str(exc).strip().splitlines()
    msg = text[0].strip() if text else type(exc).__name__
    # libpq prefixes 'connection failed: connection to server at "127.0.0.1", port 5: ...'; keep the cause
    msg = re.sub(r'^connection failed: connection to server at "[^"]*", port \d+ failed: ', "", msg)
    msg = re.sub(r"^(connection failed|connection is bad): ", "", msg)
    msg = re.sub(r"^(FATAL|ERROR):\s+", "", msg)
    return redact(msg)

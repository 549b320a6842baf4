"""Text fit for output and logs: without a password, and an error on one line.

Pure text, below every other module, so that errors.py and postgres/connect.py can both use it."""

from __future__ import annotations

import re

# user:password@ in any URL, and password=... (or a client key's sslpassword=...) as a keyword (quoted or not)
# or URL query parameter
_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/\s:@\"']*:)[^/\s@\"']*@", re.IGNORECASE)
_KEYWORD_PASSWORD = re.compile(r"(\b(?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'?|[^\s&\"]*)", re.IGNORECASE)


def redact(text: str) -> str:
    """The URL (or any text quoting one, such as a libpq error) without its password, fit for output and logs."""
    return _KEYWORD_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", text))


def first_line(exc: BaseException) -> str:
    """The server's message without libpq's multi-line detail (and never a password)."""
    text = str(exc).strip().splitlines()
    msg = text[0].strip() if text else type(exc).__name__
    # libpq prefixes 'connection failed: connection to server at "127.0.0.1", port 5: ...'; keep the cause
    msg = re.sub(r'^connection failed: connection to server at "[^"]*", port \d+ failed: ', "", msg)
    msg = re.sub(r"^(connection failed|connection is bad): ", "", msg)
    msg = re.sub(r"^(FATAL|ERROR):\s+", "", msg)
    return redact(msg)

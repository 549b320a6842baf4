"""Where log lines go (`--log-level`, `--log-file`, `-v`) and what they look like.

One format for every line: time, level, the logger's name, the message, with any password in it redacted.
Libraries that talk a lot (py4j on every call to the JVM, pyspark, urllib3) are held at WARNING unless the
level is debug. Progress lines (cli/progress.py, logger `sluicegate.progress`) go to stdout, and to the log
file when there is one, whatever the level.
"""

from __future__ import annotations

import logging
import sys

from ..postgres.connect import redact

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
NOISY = ("py4j", "pyspark", "urllib3", "grpc")
PROGRESS = "sluicegate.progress"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Redact(logging.Filter):
    """Passwords never reach a log line, whatever a message or an exception's text held."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


def _handler(handler: logging.Handler) -> logging.Handler:
    formatter = logging.Formatter(FORMAT)
    formatter.default_msec_format = "%s.%03d"
    handler.setFormatter(formatter)
    handler.addFilter(_Redact())
    handler._sluicegate = True  # ours: replaced when the options are read again
    return handler


def configure(level: int = logging.WARNING, log_file: str | None = None) -> None:
    """(Re)configure logging; called again as options after the subcommand are read."""
    root = logging.getLogger()
    progress = logging.getLogger(PROGRESS)
    for logger in (root, progress):
        for h in [h for h in logger.handlers if getattr(h, "_sluicegate", False)]:
            logger.removeHandler(h)
            h.close()
    file_handler = _handler(logging.FileHandler(log_file, encoding="utf-8")) if log_file else None
    root.addHandler(file_handler or _handler(logging.StreamHandler(sys.stderr)))
    root.setLevel(level)
    for name in NOISY:
        logging.getLogger(name).setLevel(logging.NOTSET if level <= logging.DEBUG else logging.WARNING)
    progress.propagate = False
    progress.setLevel(logging.INFO)
    progress.addHandler(_handler(logging.StreamHandler(sys.stdout)))
    if file_handler is not None:
        progress.addHandler(file_handler)

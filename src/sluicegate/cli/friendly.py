"""One-line errors for every command (`friendly`), below main.py and the command groups it registers, which
all wrap their commands in it."""

from __future__ import annotations

import sys
from functools import wraps

import click
import psycopg

from ..errors import SluicegateError
from ..postgres.connect import first_line, redact

VERBOSE = "sluicegate.verbose"  # the root context's meta key that -v sets (main.py)


def fail(message: str, code: int = 1) -> None:
    # One line whatever the message holds (libpq details, server text), and never a password.
    click.echo("error: " + redact(" ".join(message.split())), err=True)
    sys.exit(code)


def friendly(fn):
    """One-line errors, exit 1, no traceback: for everything the user can fix."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SluicegateError as exc:
            fail(str(exc))
        except psycopg.Error as exc:
            fail(first_line(exc))
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise  # click reports these itself (usage errors exit 2)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            sys.exit(130)
        except Exception as exc:  # a bug, not bad input: still one line, the traceback on request
            ctx = click.get_current_context(silent=True)
            if ctx is not None and ctx.find_root().meta.get(VERBOSE):
                raise
            fail(f"unexpected {type(exc).__name__}: {first_line(exc)} (run with -v for the traceback)")

    return wrapper

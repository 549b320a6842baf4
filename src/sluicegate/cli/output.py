"""What a command shows: its result (plain data, keys in the order built) as one JSON document under --json or
for people (`emit`), and whatever it raises as one line on stderr with an exit status, --json or not (`friendly`).
Rich loads only in the renderers: `workflow run` starts Spark before anything prints."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from typing import TYPE_CHECKING, Any

import click
import psycopg

from ..errors import SluicegateError
from ..names import shown
from ..postgres.connect import first_line, redact
from ..sizes import format_size

if TYPE_CHECKING:
    from rich.console import Console

VERBOSE = "sluicegate.verbose"  # the root context's meta key that -v sets (main.py)
JSON = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def document(result: Any) -> str:
    """One JSON document, indented by two, keys in the order the result was built. What JSON has no type for
    (a datetime, a Decimal, a UUID) is its str(), as `status --json` has always printed it; positions are
    already text (`0/16B3748`, position.format_lsn) in every result."""
    return json.dumps(result, indent=2, default=str)


def line(result: Any) -> str:
    """One JSON document on one line: for commands that print one per event (log dump, vstream)."""
    return json.dumps(result, separators=(",", ":"), default=str)


def emit(result: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    """Print a command's result: as one JSON document on stdout under --json, else as `human` shows it."""
    if as_json:
        click.echo(document(result))
    else:
        human(result)


def fail(message: str, code: int = 1) -> None:
    # One line whatever the message holds (libpq details, server text), and never a password.
    click.echo("error: " + redact(" ".join(message.split())), err=True)
    sys.exit(code)


def friendly(fn=None, *, code: int = 1):
    """One-line errors with exit status `code` (1; vdiff's 2), no traceback: for everything the user can fix.
    `@friendly` or `@friendly(code=2)`."""
    if fn is None:
        return lambda f: friendly(f, code=code)

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SluicegateError as exc:
            fail(str(exc), code)
        except psycopg.Error as exc:
            fail(first_line(exc), code)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise  # click reports these itself (usage errors exit 2)
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except Exception as exc:  # a bug, not bad input: still one line, the traceback on request
            if code != 1:  # raised, it would exit 1: vdiff's "differences"
                fail(f"unexpected {type(exc).__name__}: {first_line(exc)}", code)
            ctx = click.get_current_context(silent=True)
            if ctx is not None and ctx.find_root().meta.get(VERBOSE):
                raise
            fail(f"unexpected {type(exc).__name__}: {first_line(exc)} (run with -v for the traceback)")

    return wrapper


def make_console() -> Console:
    """A console on stdout that wraps nothing when it is not a terminal (a file, a pipe, a log collector):
    one line per line, whatever the width rich would guess."""
    from rich.console import Console

    if sys.stdout.isatty():
        return Console(highlight=False)
    return Console(highlight=False, soft_wrap=True, width=10_000)


# Streams of more tables than this show a summary line and the tables being copied; `status --tables` lists all.
TABLES_SHOWN = 20


def print_status(console: Console, status: dict, every_table: bool = False) -> None:
    from rich.markup import escape
    from rich.table import Table

    console.print(f"workflow [bold]{escape(status['workflow'])}[/] ({status['kind']}): [bold]{status['state']}[/]"
                  + (f"  {escape(status['message'])}" if status["message"] else ""))
    driver = status.get("driver")
    if driver:
        console.print(f"driver: {driver_text(driver)}")
    running = driver is None or driver["running"]
    for s in status["streams"]:
        lag = f"{s['lag_seconds']:.2f}s" if s["lag_seconds"] is not None else "-"
        if s["lag_seconds"] is not None and not running:
            lag += " and growing (no driver)"
        shards = (f" (source shard {s['source_shard']} -> target shard {s['target_shard']})"
                  if "target_shard" in s else "")
        slot = ""
        if s.get("retained_wal_bytes") is not None:
            slot = f"; slot {s['slot']} holds {format_size(s['retained_wal_bytes'])} of WAL ({s['wal_status']})"
        if s.get("source_host") and "," in s["source"]:  # several hosts listed: which one it reads
            slot += f"; {'reading from' if s.get('reading') else 'primary'} {s['source_host']}"
        console.print(f"stream {s['id']} from {escape(s['source'])}{shards}: {s['state']} at {s['position'] or '-'}, "
                      f"lag {lag}{escape(slot)}")
        tables = s["tables"]
        if len(tables) > TABLES_SHOWN:
            c = s.get("copy") or {}
            console.print(f"tables: {c.get('copied', 0):,} copied, {c.get('copying', 0):,} copying, "
                          f"{c.get('pending', 0):,} pending of {len(tables):,}; rows {c.get('rows_copied', 0):,} "
                          f"of about {c.get('rows_total', 0):,}"
                          + ("" if every_table else " (every table: --tables)"))
            if not every_table:
                tables = [t for t in tables if t["state"] == "Copying"]
        if not tables:
            continue
        grid = Table(show_edge=False)
        for col in ("table", "state", "rows copied", "of about"):
            grid.add_column(col, justify="right" if "rows" in col or "about" in col else "left")
        for t in tables:
            grid.add_row(escape(shown(t["table"])), t["state"], f"{t['rows_copied']:,}", f"{t['rows_total']:,}")
        console.print(grid)
    if "traffic" in status:
        _print_traffic(console, status["traffic"])
    if "sinks" in status:
        _print_sinks(console, status)
    for w in status.get("warnings", []):
        console.print(f"[yellow]warning:[/] {escape(w)}")


def _print_traffic(console: Console, traffic: dict) -> None:
    """A MoveTables' traffic: which side takes writes, and the reverse stream once switched."""
    from rich.markup import escape

    console.print(f"traffic: {traffic['state']}")
    rev = traffic.get("reverse")
    if rev and traffic["state"] == "switched":
        lag = f"{rev['lag_seconds']:.2f}s" if rev["lag_seconds"] is not None else "-"
        console.print(f"reverse workflow {escape(rev['workflow'])}: {rev['state']} at {rev['position'] or '-'}, "
                      f"lag {lag}" + (f"  {escape(rev['message'])}" if rev["message"] else ""))
    for key in ("interrupted", "error"):
        if traffic.get(key):
            console.print(f"[yellow]warning:[/] {escape(traffic[key])}")


def _print_sinks(console: Console, status: dict) -> None:
    """A Replicate sink: its safe time, and what every sink's slot holds on the source."""
    from rich.markup import escape
    from rich.table import Table

    lag = status.get("safe_time_lag_seconds")
    console.print(f"safe time (sink {status['sink']}): {status.get('safe_time') or '-'}"
                  + (f" ({lag:.1f} s behind the source)" if lag is not None else ""))
    grid = Table(show_edge=False)
    for col in ("sink", "slot", "holds", "age", "reader"):
        grid.add_column(col)
    for s in status["sinks"]:
        if s.get("exists") is None:
            held = age = reader = "?"
        elif s.get("not_yet_run"):
            held, age, reader = "not yet created (its consumer has not run)", "-", "-"
        elif not s["exists"]:
            held, age, reader = "slot gone", "-", "-"
        else:
            held = format_size(s["retained_wal_bytes"] or 0)
            age = f"{s['retained_age_seconds']:.0f} s" if s["retained_age_seconds"] is not None else "-"
            reader = "active" if s["active"] else "none"
        name = f"{s['sink']} (this)" if s["this"] else s["sink"]
        grid.add_row(escape(f"{name} {s['url']}"), s["slot"], held, age, reader)
    console.print(grid)


def driver_text(driver: dict) -> str:
    seen = driver["last_seen_seconds"]
    if driver["running"]:
        return f"running (pid {driver['pid']} on {driver['host']}, seen {seen:.0f} s ago)"
    if seen is None:
        return "no driver running (never seen)"
    return f"no driver running (last seen {seen:.0f} s ago)"


def print_workflows(console: Console, rows: list[dict]) -> None:
    from rich.markup import escape
    from rich.table import Table

    if not rows:
        console.print("no workflows on this target")
        return
    grid = Table(show_edge=False)
    for col in ("workflow", "kind", "state", "lag", "driver"):
        grid.add_column(col, justify="right" if col == "lag" else "left")
    for r in rows:
        lag = f"{r['lag_seconds']:.2f}s" if r["lag_seconds"] is not None else "-"
        grid.add_row(escape(r["workflow"]), r["kind"], r["state"], lag, driver_text(r["driver"]))
    console.print(grid)

"""Progress of `workflow run`: on a terminal a live table (rows copied per table with rate and ETA, then the
lag); otherwise a line per interval (rows copied and the rate per table, then lag and rows applied). The same
for every target kind (PostgreSQL, its target shards, Delta) and for whichever workflow the driver runs (a
MoveTables' reverse workflow after switch-traffic: `follow`).

A background thread re-reads the status from the target (the truth), so what is shown never depends on
what the driver happens to be doing; a copy cycle in flight in this driver adds what it has moved so far
(workflow/live.py). Rates are rows over wall time since the driver started the table's copy, never the jump
between two reads.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.live import Live
from rich.table import Table as RichTable

from .. import targets
from ..postgres.connect import connect
from ..workflow import live
from ..workflow import state as st


def percent(copied: int, total: int, done: bool) -> float:
    """A table's copy, in percent: a copied table is 100% whatever the estimate of its source rows said (a
    rule may filter rows out); one being copied stays below 100 until it is."""
    if done or total <= 0:
        return 100.0 if done or copied else 0.0
    return min(99.0 if copied < total else 100.0, 100.0 * copied / total)


def with_live(table: dict, entry: live.TableCopy | None, in_flight: dict[str, int], now: float) -> dict:
    """A status table (workflow/status.py) with what this driver's copy cycle moved since copy_state last
    said (`entry`, live.py; `in_flight`: rows of running COPYs by session label) and the copy's rate."""
    if entry is None:
        return table
    rows = max(table["rows_copied"], entry.rows(in_flight.get(entry.label, 0)))
    out = {**table, "rows_copied": rows, "rate": entry.rate(rows, now)}
    if table["state"] != "Copied":
        out["rows_total"] = max(table["rows_total"], rows)
        if entry.ended is None:
            out["state"] = "Copying"  # (a first cycle has no lastpk yet: status says Pending)
    return out


def read_streams(target_url: str, workflow: str) -> list[dict]:
    """Every stream of the workflow as the views show it: status streams (workflow/status.py) with "label",
    "rows_applied" (None: not counted) and, per table, this driver's copy in flight (`with_live`)."""
    now = time.monotonic()
    streams = []
    for group in targets.resolve(target_url).progress_groups(workflow):
        entries = {(s["id"], t["table"]): live.table_copy(group.key_url, workflow, s["id"], t["table"])
                   for s in group.streams for t in s["tables"]}
        flights = _ask(group.ask_url, group.in_flight, entries.values())
        for s in group.streams:
            tables = [with_live(t, entries[s["id"], t["table"]], flights, now) for t in s["tables"]]
            streams.append({**s, "tables": tables})
    return streams


def _ask(url: str, query, entries) -> dict[str, int]:
    """query(a connection to `url`) when one of `entries` (live.py) is a cycle in flight; else, or when the
    server cannot be asked, nothing (advisory: rows then move as the cycle's tasks end)."""
    if not any(e is not None and e.ended is None for e in entries):
        return {}
    try:
        with connect(url, role="server", autocommit=True, connect_timeout=3) as conn:
            return query(conn)
    except Exception:  # noqa: BLE001 - see above
        return {}


def overall_state(streams: list[dict]) -> str:
    states = {s["state"] for s in streams}
    return st.ERROR if st.ERROR in states else (states.pop() if len(states) == 1 else "Mixed")


class ProgressView(threading.Thread):
    def __init__(self, target_url: str, workflow: str, console: Console, interval: float = 0.5):
        super().__init__(daemon=True, name="sluicegate-progress")
        self.target_url, self.workflow, self.console, self.interval = target_url, workflow, console, interval
        self.done = threading.Event()
        self.seen = LineState()

    def follow(self, workflow: str, target_url: str) -> None:
        """Show another workflow from now on (the reverse workflow the driver runs after switch-traffic)."""
        if (workflow, target_url) != (self.workflow, self.target_url):
            self.workflow, self.target_url, self.seen = workflow, target_url, LineState()

    def run(self) -> None:
        with Live(console=self.console, refresh_per_second=4, transient=False) as live_view:
            while True:
                try:
                    live_view.update(self.render(self.workflow, read_streams(self.target_url, self.workflow)))
                except Exception as exc:  # noqa: BLE001 - the target may be restarting
                    live_view.update(f"[yellow]waiting for target: {exc}")
                if self.done.is_set():
                    return
                self.done.wait(self.interval)  # (then once more: the table ends as the run did)

    def render(self, workflow: str, streams: list[dict]) -> RichTable:
        now = time.monotonic()
        grid = RichTable(title=f"workflow {workflow}: {overall_state(streams)}", title_justify="left")
        for col in ("table", "state", "rows", "%", "rows/s", "ETA"):
            grid.add_column(col, justify="left" if col in ("table", "state") else "right")
        for s in streams:
            for t in s["tables"]:
                rate = table_rate(t, (s["label"], t["table"]), now, self.seen)
                done = t["state"] == "Copied"
                left = max(0, t["rows_total"] - t["rows_copied"])
                eta = f"{left / rate:.0f}s" if rate > 0 and not done else "-"
                grid.add_row(t["table"], t["state"], f"{t['rows_copied']:,}/{t['rows_total']:,}",
                             f"{percent(t['rows_copied'], t['rows_total'], done):.0f}",
                             f"{rate:,.0f}" if rate else "-", eta)
            lag = s["lag_seconds"]
            grid.caption = (f"position {s['position']}  lag {lag:.2f}s" if lag is not None else f"position {s['position']}") + (
                f"  [yellow]{s['message']}" if s["message"] else "")
        return grid

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=5)


@dataclass
class LineState:
    """What the previous progress line saw: "since the last line" is measured from it."""

    at: float | None = None
    copied: dict[tuple[str, str], int] = field(default_factory=dict)  # (stream, table) -> rows copied
    first: dict[tuple[str, str], tuple[float, int]] = field(default_factory=dict)  # -> (when, rows) first moving
    finished: set[tuple[str, str]] = field(default_factory=set)  # tables seen copied
    applied: dict[str, int] = field(default_factory=dict)  # stream -> rows applied
    states: dict[str, str] = field(default_factory=dict)  # stream -> state


def table_rate(t: dict, key: tuple[str, str], now: float, seen: LineState) -> float:
    """Rows per second of a table's copy: this driver's own (t["rate"], live.py), else rows over the time
    since this view first saw the table's copy under way."""
    if "rate" in t:
        return t["rate"]
    if t["state"] != "Copying" and key not in seen.first:
        return 0.0
    since, rows = seen.first.setdefault(key, (now, t["rows_copied"]))
    return live.copy_rate(t["rows_copied"] - rows, since, None, now)


def progress_lines(streams: list[dict], now: float, seen: LineState) -> list[str]:
    """The lines for one interval, and `seen` updated. `streams`: as `read_streams` gives them: status
    streams (workflow/status.py), each with "label" (e.g. 'stream 1') and "rows_applied" (None: not
    counted), tables with their "rate" when this driver copies them."""
    lines = []
    elapsed = now - seen.at if seen.at is not None else None

    for s in streams:
        label, state = s["label"], s["state"]
        before = seen.states.get(label)
        if before != state:
            lines.append(f"{label}: {state}" + (f" (was {before})" if before else "")
                         + (f": {s['message']}" if s["message"] else ""))
        seen.states[label] = state
        current = next((t["table"] for t in s["tables"] if t["state"] != "Copied"), None)
        for t in s["tables"]:
            key = (label, t["table"])
            previous = seen.copied.get(key)
            seen.copied[key] = t["rows_copied"]
            rate = table_rate(t, key, now, seen)
            done = t["state"] == "Copied"
            finished = previous is not None and done and key not in seen.finished
            if done:
                seen.finished.add(key)
            if not (finished or (state == "Copying" and t["table"] == current)):
                continue
            total = t["rows_total"]
            pct = "" if done else f" ({percent(t['rows_copied'], total, done):.0f}%)"
            shown = f", {rate:,.0f} rows/s" if "rate" in t or previous is not None else ""
            lines.append(f"{'copied' if done else 'copy'} {t['table']}: {t['rows_copied']:,}/{total:,} rows"
                         f"{pct}{shown}")
        applied = s.get("rows_applied")
        previous = seen.applied.get(label)
        if applied is not None:
            seen.applied[label] = applied
        if state == "Running":
            lag = f"lag {s['lag_seconds']:.1f}s" if s["lag_seconds"] is not None else "lag unknown"
            if applied is None:
                since = ""
            elif previous is None:
                since = f", {applied:,} rows applied so far"
            else:
                per_second = f", {(applied - previous) / elapsed:,.0f} rows/s" if elapsed else ""
                since = f", {applied - previous:,} rows applied since the last line{per_second}"
            lines.append(f"replicate {label}: {lag}, position {s['position']}{since}")
    seen.at = now
    return lines


class ProgressLines(threading.Thread):
    """A progress line per interval, for a file or a pipe (logger sluicegate.progress: stdout, log file)."""

    def __init__(self, target_url: str, workflow: str, interval: float = 10.0):
        super().__init__(daemon=True, name="sluicegate-progress")
        self.target_url, self.workflow, self.interval = target_url, workflow, interval
        self.done = threading.Event()
        self.seen = LineState()
        self.log = logging.getLogger("sluicegate.progress")

    def follow(self, workflow: str, target_url: str) -> None:
        """Report another workflow from now on (the reverse workflow the driver runs after switch-traffic)."""
        if (workflow, target_url) != (self.workflow, self.target_url):
            self.workflow, self.target_url, self.seen = workflow, target_url, LineState()
            self.log.info("running workflow %s", workflow)

    def run(self) -> None:
        while not self.done.wait(self.interval):
            self.tick()

    def tick(self) -> None:
        try:
            streams = read_streams(self.target_url, self.workflow)
        except Exception as exc:  # noqa: BLE001 - the target may be restarting
            self.log.warning("waiting for the target: %s", exc)
            return
        for line in progress_lines(streams, time.monotonic(), self.seen):
            self.log.info(line)

    def stop(self) -> None:
        """Stop, with a last line: how the run ends."""
        self.done.set()
        self.join(timeout=5)
        self.tick()

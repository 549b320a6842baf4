"""Progress of `workflow run`: on a terminal a live table (rows copied per table with rate and ETA, then the
lag); otherwise a line per interval (rows copied and the rate per table, then lag and rows applied).

A background thread re-reads the status from the target (the truth), so what is shown never depends on
what the driver happens to be doing.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.live import Live
from rich.table import Table as RichTable

from ..postgres.connect import connect
from ..workflow import state as st
from ..workflow.status import workflow_status


class ProgressView(threading.Thread):
    def __init__(self, target_url: str, workflow: str, console: Console, interval: float = 0.5):
        super().__init__(daemon=True, name="sluicegate-progress")
        self.target_url, self.workflow, self.console, self.interval = target_url, workflow, console, interval
        self.done = threading.Event()
        self.samples: dict[str, list[tuple[float, int]]] = {}

    def run(self) -> None:
        with Live(console=self.console, refresh_per_second=4, transient=False) as live:
            while not self.done.is_set():
                try:
                    with connect(self.target_url, role="target", connect_timeout=3) as conn:
                        status = workflow_status(st.load_workflow(conn, self.workflow))
                    live.update(self.render(status))
                except Exception as exc:  # noqa: BLE001 - the target may be restarting
                    live.update(f"[yellow]waiting for target: {exc}")
                self.done.wait(self.interval)

    def render(self, status: dict) -> RichTable:
        now = time.monotonic()
        grid = RichTable(title=f"workflow {status['workflow']}: {status['state']}", title_justify="left")
        for col in ("table", "state", "rows", "%", "rows/s", "ETA"):
            grid.add_column(col, justify="left" if col in ("table", "state") else "right")
        for s in status["streams"]:
            for t in s["tables"]:
                hist = self.samples.setdefault(t["table"], [])
                hist.append((now, t["rows_copied"]))
                while len(hist) > 2 and (now - hist[0][0] > 10 or hist[1][1] == hist[0][1]):  # recent, moving samples
                    hist.pop(0)
                rate = (hist[-1][1] - hist[0][1]) / (hist[-1][0] - hist[0][0]) if len(hist) > 1 and hist[-1][0] > hist[0][0] else 0.0
                left = max(0, t["rows_total"] - t["rows_copied"])
                eta = f"{left / rate:.0f}s" if rate > 0 and t["state"] != "Copied" else "-"
                pct = 100.0 * t["rows_copied"] / t["rows_total"] if t["rows_total"] else 100.0
                grid.add_row(t["table"], t["state"], f"{t['rows_copied']:,}/{t['rows_total']:,}", f"{pct:.0f}",
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
    """What the previous progress line saw: rates and "since the last line" are measured from it."""

    at: float | None = None
    copied: dict[tuple[str, str], int] = field(default_factory=dict)  # (stream, table) -> rows copied
    applied: dict[str, int] = field(default_factory=dict)  # stream -> rows applied
    states: dict[str, str] = field(default_factory=dict)  # stream -> state


def progress_lines(streams: list[dict], now: float, seen: LineState) -> list[str]:
    """The lines for one interval, and `seen` updated. `streams`: status streams (workflow/status.py), each
    with "label" (e.g. 'stream 1') and "rows_applied"."""
    lines = []
    elapsed = now - seen.at if seen.at is not None else None

    def rate(delta: int) -> str:
        return f", {delta / elapsed:,.0f} rows/s" if elapsed else ""

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
            finished = previous is not None and t["state"] == "Copied" and previous < t["rows_copied"]
            if not (finished or (state == "Copying" and t["table"] == current)):
                continue
            total = t["rows_total"]
            pct = f" ({100.0 * t['rows_copied'] / total:.0f}%)" if total and t["state"] != "Copied" else ""
            what = "copied" if t["state"] == "Copied" else "copy"
            lines.append(f"{what} {t['table']}: {t['rows_copied']:,}/{total:,} rows{pct}"
                         f"{rate(t['rows_copied'] - previous) if previous is not None else ''}")
        applied = s.get("rows_applied", 0)
        previous = seen.applied.get(label)
        seen.applied[label] = applied
        if state == "Running":
            lag = f"lag {s['lag_seconds']:.1f}s" if s["lag_seconds"] is not None else "lag unknown"
            since = (f", {applied - previous:,} rows applied since the last line{rate(applied - previous)}"
                     if previous is not None else f", {applied:,} rows applied so far")
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

    def run(self) -> None:
        while not self.done.wait(self.interval):
            self.tick()

    def tick(self) -> None:
        try:
            streams = self.read()
        except Exception as exc:  # noqa: BLE001 - the target may be restarting
            self.log.warning("waiting for the target: %s", exc)
            return
        for line in progress_lines(streams, time.monotonic(), self.seen):
            self.log.info(line)

    def read(self) -> list[dict]:
        from ..workflow.reshard import load_all

        streams = []
        for shard, _, wf in load_all(self.workflow, self.target_url):
            applied = {s.id: s.rows_applied for s in wf.streams}
            for s in workflow_status(wf)["streams"]:
                label = f"stream {s['id']}" + (f" (target shard {shard})" if shard else "")
                streams.append({**s, "label": label, "rows_applied": applied[s["id"]]})
        return streams

    def stop(self) -> None:
        """Stop, with a last line: how the run ends."""
        self.done.set()
        self.join(timeout=5)
        self.tick()

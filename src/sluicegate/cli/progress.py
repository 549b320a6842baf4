"""Live progress for `workflow run`: rows copied per table with rate and ETA, then the lag.

A background thread re-reads the status from the target (the truth), so the display never depends on
what the driver happens to be doing.
"""

from __future__ import annotations

import threading
import time

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

"""Text rendering of status for people (JSON goes straight out)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def print_status(console: Console, status: dict) -> None:
    console.print(f"workflow [bold]{status['workflow']}[/] ({status['kind']}): [bold]{status['state']}[/]"
                  + (f"  {status['message']}" if status["message"] else ""))
    for s in status["streams"]:
        lag = f"{s['lag_seconds']:.2f}s" if s["lag_seconds"] is not None else "-"
        shards = (f" (source shard {s['source_shard']} -> target shard {s['target_shard']})"
                  if "target_shard" in s else "")
        console.print(f"stream {s['id']} from {s['source']}{shards}: {s['state']} at {s['position'] or '-'}, lag {lag}")
        grid = Table(show_edge=False)
        for col in ("table", "state", "rows copied", "of about"):
            grid.add_column(col, justify="right" if "rows" in col or "about" in col else "left")
        for t in s["tables"]:
            grid.add_row(t["table"], t["state"], f"{t['rows_copied']:,}", f"{t['rows_total']:,}")
        console.print(grid)

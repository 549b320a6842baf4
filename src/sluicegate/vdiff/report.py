"""A vdiff's result: one dict (--json prints it through cli/output.py), a readable table for people."""

from __future__ import annotations

import psycopg
from rich.console import Console
from rich.markup import escape
from rich.table import Table as RichTable

from ..names import shown
from ..position import format_lsn
from . import store
from .labels import label, parts


def build(conn: psycopg.Connection, vdiff_id: int) -> dict:
    vd = store.load(conn, vdiff_id)
    sample = int(vd.options.get("sample", 10))
    totals = store.table_totals(conn, vdiff_id, sample)
    tables = {name: totals.get(name) or {"rows_compared": 0, "missing": 0, "extra": 0, "mismatched": 0,
                                         "ranges": 0, "ranges_done": 0, "samples": []} for name in vd.tables}
    differences = sum(t["missing"] + t["extra"] + t["mismatched"] for t in tables.values())
    return {
        "vdiff_id": vd.id,
        "workflow": vd.workflow,
        "state": vd.state,
        "message": vd.message,
        "source_position": format_lsn(vd.source_position) if vd.source_position is not None else None,
        "equal": vd.state == store.COMPLETED and differences == 0,
        "differences": differences,
        "tables": tables,
    }


def render(console: Console, report: dict, *, verdict: bool = True) -> None:
    grid = RichTable(title=f"vdiff {report['vdiff_id']} of workflow {escape(report['workflow'])} "
                           f"at source position {report['source_position']}", title_justify="left")
    for col in ("table", "rows compared", "missing", "extra", "mismatched"):
        grid.add_column(col, justify="left" if col == "table" else "right")
    for name, t in report["tables"].items():
        marks = [f"[red]{t[k]:,}[/]" if t[k] else "0" for k in ("missing", "extra", "mismatched")]
        grid.add_row(escape(shown_name(name)), f"{t['rows_compared']:,}", *marks)
    console.print(grid)
    for name, t in report["tables"].items():
        if not t["samples"]:
            continue
        count = len(t["samples"])
        total = t["missing"] + t["extra"] + t["mismatched"]
        console.print(f"{escape(shown_name(name))}: first {count} of {total:,} differing rows")
        for s in t["samples"]:
            if s["key"]:
                console.print(f"  {s['kind']:<10} key ({escape(', '.join(s['key']))})")
            else:  # a table without a key: rows match by value, and this one differs in count
                console.print(f"  {s['kind']:<10} {s.get('rows', 1)} row(s) equal to")
            source, target = s["source"], s["target"]
            if source is not None and target is not None:  # a mismatch: just the columns that differ
                cols = [c for c in source if source[c] != target.get(c)] or list(source)
                source, target = {c: source[c] for c in cols}, {c: target.get(c) for c in cols}
            if source is not None:
                console.print(f"    source: {escape(_row(source))}")
            if target is not None:
                console.print(f"    target: {escape(_row(target))}")
    if not verdict:
        return
    if report["state"] != store.COMPLETED:
        console.print(f"vdiff {report['state']}: {escape(report['message'])}")
    elif report["equal"]:
        console.print("[green]source and target are equal[/]")
    else:
        console.print(f"[red]{report['differences']:,} differing rows[/]")


def shown_name(name: str) -> str:
    """A report's table as SQL writes its name; a keyspace source's shard after it ('public.t <- -80')."""
    table, shard = parts(name)
    return label(shown(table), shard)


def _row(values: dict) -> str:
    return ", ".join(f"{k}={'NULL' if v is None else _short(v)}" for k, v in values.items())


def _short(v: str, limit: int = 60) -> str:
    return v if len(v) <= limit else v[: limit - 1] + "…"

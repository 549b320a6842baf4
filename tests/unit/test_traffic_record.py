"""A MoveTables' traffic record (workflow/state.py Traffic): the columns, else what an older version kept in
the workflow's options. Pure, no server."""

from __future__ import annotations

from sluicegate.workflow.state import Traffic


def test_columns_win():
    t = Traffic.from_row("switched", 3, "0/1A2B", "mt", {"traffic": "reversed", "epoch": 2})
    assert t == Traffic("switched", 3, "0/1A2B", "mt")


def test_older_options_load():
    t = Traffic.from_row(None, None, None, None, {"traffic": "reversed", "epoch": "2", "position": "0/10"})
    assert t == Traffic("reversed", 2, "0/10", None)


def test_never_switched():
    t = Traffic.from_row(None, None, None, None, {"cycle_rows": 5})
    assert t == Traffic() and t.epoch is None and t.state == "source"

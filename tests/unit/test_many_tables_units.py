"""Many small tables in one copy cycle (workflow/copier.py small_group, group_tasks) and the status summary."""

from __future__ import annotations

import io

from rich.console import Console

from sluicegate.cli.output import print_status
from sluicegate.postgres.catalog import Column, Table
from sluicegate.workflow import copier
from sluicegate.workflow.state import TableState
from sluicegate.workflow.status import copy_summary


def table(name: str, rows: int, *, keyless: bool = False) -> Table:
    return Table("s", name, (Column("id", "bigint", 20, True, None), Column("note", "text", 25, False, None)),
                 () if keyless else ("id",), estimated_rows=rows, keyless=keyless)


def state(name: str, rows: int, **kw) -> TableState:
    return TableState(table(name, rows, keyless=kw.pop("keyless", False)), kw.pop("lastpk", None), 0,
                      kw.pop("done", False), **kw)


def test_a_group_takes_the_small_pending_tables_up_to_its_rows():
    tables = [state("done", 10, done=True), state("a", 100), state("big", 600), state("b", 200),
              state("ruled", 10, rule={"x": 1}), state("keyless", 10, keyless=True),
              state("started", 10, lastpk=["5"]), state("left", 10, deferred_indexes=[{"name": "i"}]),
              state("c", 250), state("d", 250), state("e", 250)]
    group = copier.small_group(tables, chunk_rows=1000)  # small: <= 250 rows; up to 1000 rows in all
    assert [t.table.name for t in group] == ["a", "b", "c", "d"]


def test_no_group_when_the_first_pending_table_is_large_or_alone():
    assert copier.small_group([state("big", 600), state("a", 10), state("b", 10)], chunk_rows=1000) == []
    assert copier.small_group([state("a", 10), state("big", 600)], chunk_rows=1000) == []


def test_a_group_has_at_most_max_group_tables():
    tables = [state(f"t{i}", 0) for i in range(copier.MAX_GROUP_TABLES + 10)]
    assert len(copier.small_group(tables, chunk_rows=1000)) == copier.MAX_GROUP_TABLES


def test_group_tasks_deal_the_tables_out_by_rows_and_copy_each_whole():
    tables = [table("a", 300), table("b", 100), table("c", 100), table("d", 100)]
    tasks = copier.group_tasks("src", "dst", tables, "snap-1", slots=2, origin="o", label="l")
    assert [[name for name, _, _ in t.copies] for t in tasks] == [["s.a"], ["s.b", "s.c", "s.d"]]
    _, select, insert = tasks[0].copies[0]
    assert select == 'COPY (SELECT "id", "note" FROM "s"."a") TO STDOUT (FORMAT binary)'
    assert insert == 'COPY "s"."a" ("id", "note") FROM STDIN (FORMAT binary)'
    assert {(t.snapshot, t.origin, t.label) for t in tasks} == {("snap-1", "o", "l")}
    assert len(copier.group_tasks("src", "dst", tables[:1], "snap-1", slots=4)) == 1


def status_of(n: int, copying: int = 1) -> dict:
    tables = [{"table": f"s.t{i}", "state": "Copying" if i < copying else "Pending", "rows_copied": 5,
               "rows_total": 10, "lastpk": None} for i in range(n)]
    stream = {"id": 1, "source": "host=x", "state": "Copying", "message": "", "position": None, "lag_seconds": None,
              "slot": "sl", "tables": tables, "copy": copy_summary(tables)}
    return {"workflow": "w", "kind": "MoveTables", "state": "Copying", "message": "", "driver": None,
            "warnings": [], "streams": [stream]}


def printed(status: dict, every: bool = False) -> str:
    out = io.StringIO()
    print_status(Console(file=out, width=10_000, highlight=False), status, every)
    return out.getvalue()


def test_status_of_many_tables_is_a_summary_and_the_tables_being_copied():
    status = status_of(2000)
    assert status["streams"][0]["copy"] == {"tables": 2000, "copied": 0, "copying": 1, "pending": 1999,
                                            "rows_copied": 10000, "rows_total": 20000}
    text = printed(status)
    assert "tables: 0 copied, 1 copying, 1,999 pending of 2,000; rows 10,000 of about 20,000" in text
    assert "s.t0 " in text and "s.t1 " not in text
    assert "s.t1999" in printed(status, every=True)
    assert "pending of" not in printed(status_of(3)) and "s.t2" in printed(status_of(3))

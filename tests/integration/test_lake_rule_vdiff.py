"""`sluicegate vdiff W --target delta:PATH` of a Materialize written through a rule (rename, computed columns, a
WHERE): the source's snapshot goes through the rule as the copy's rows do and is compared with the Delta table on
the rule's target key. Beside a running driver (its rule player stops at the vdiff's point) it finds the two
equal after inserts, an update moving a row out of the filter, an update of a computed column's input and a
delete; the driver stopped (the vdiff plays the stream through the rule player itself), it finds exactly the
row deleted, the row added and the row changed by direct writes to the Delta table."""

from __future__ import annotations

import re
from decimal import Decimal

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from sluicegate.position import parse_lsn
from sluicegate.spark.runner import SparkRunner
from sluicegate.targets import resolve
from sluicegate.targets.delta import vdiff as lake_vdiff
from sluicegate.targets.delta.state import Store

from ..conftest import wait_for
from .test_lake_movetables import delta_rows
from .test_lake_rules import EXPECTED, RULE, LakeEngineThread, caught_up, make_orders

pytestmark = pytest.mark.spark


def no_control(wf) -> bool:
    return (wf.stop_position, wf.stop_reason, wf.pins) == (None, "", {})


def test_vdiff_of_a_delta_table_written_through_a_rule(pair, spark, tmp_path, caplog):
    make_orders(pair, 400)
    root = tmp_path / "lake"
    target = f"delta:{root}"
    resolve(target).create_materialize("rv", pair.source, [RULE], {}, {}, [])
    store = Store(root)
    runner = SparkRunner(spark)

    with LakeEngineThread(spark, target, "rv"):
        wait_for(lambda: store.load("rv").first_point, timeout=120, what="the copy and the first consistent point")
        pair.src("INSERT INTO orders VALUES (1001, 'fresh', 3, 2.50, 'new'), (1002, 'gone', 1, 1.00, 'void')")
        pair.src("UPDATE orders SET status = 'void' WHERE id = 3")  # out of the filter: its row goes
        pair.src("UPDATE orders SET qty = qty + 10 WHERE id = 5")  # its computed total changes
        pair.src("DELETE FROM orders WHERE id = 9")
        caught_up(pair, store, "rv")
        pair.src("UPDATE orders SET name = 'late' WHERE id = 13")  # after the catch-up: the point takes it
        with caplog.at_level("INFO", logger="sluicegate"):
            report = lake_vdiff.run("rv", target, runner)
        assert "from the running driver" in caplog.text
        wf = store.load("rv")
        assert wf.state == "Running" and no_control(wf), (wf.state, wf.message, wf.stop_reason)
    want = pair.src(EXPECTED)
    assert report["equal"] and report["differences"] == 0, report
    table = report["tables"]["public.orders"]  # the workflow's name for it (its source table)
    assert table["rows_compared"] == len(want) and len(want) > 250
    assert {r[0] for r in want} >= {1001, 5, 13} and not {3, 9, 1002} & {r[0] for r in want}

    # The driver stopped: direct writes to the Delta table, and a source write for the vdiff's own play.
    dt = DeltaTable(str(root / "public" / "orders_out"))
    dt.delete("order_id = 1")
    dt.update(predicate="order_id = 5", new_values={"name_uc": "TAMPERED"})
    schema = pa.schema(dt.schema().to_arrow())
    write_deltalake(dt, pa.Table.from_pylist([{"order_id": -1, "name_uc": "EXTRA", "total": Decimal("1.00"),
                                               "status": "new"}], schema=schema), mode="append")
    pair.src("UPDATE orders SET qty = qty + 1 WHERE id = 7")  # total 0.00 -> 7.99 (qty 0 -> 1)
    caplog.clear()
    with caplog.at_level("INFO", logger="sluicegate"):
        report = lake_vdiff.run("rv", target, runner)
    assert re.search(r"from the vdiff's own play", caplog.text), caplog.text[-2000:]
    table = report["tables"]["public.orders"]
    assert not report["equal"] and report["differences"] == 3, report
    assert (table["missing"], table["extra"], table["mismatched"]) == (1, 1, 1), table
    assert [(s["kind"], s["key"]) for s in table["samples"]] == [("extra", ["-1"]), ("missing", ["1"]),
                                                                ("mismatched", ["5"])]
    changed = table["samples"][2]
    assert changed["source"]["name_uc"] == "ITEM5" and changed["target"]["name_uc"] == "TAMPERED"
    assert table["rows_compared"] == len(pair.src(EXPECTED)) + 1  # the extra row
    wf = store.load("rv")
    assert wf.state == "Running" and not store.is_running("rv") and no_control(wf)
    # It played the stream through the rule to its point, and left it there: the source write is applied.
    assert wf.position == parse_lsn(report["source_position"])
    assert [r["total"] for r in delta_rows(root, "public.orders_out") if r["order_id"] == 7] == [Decimal("7.99")]

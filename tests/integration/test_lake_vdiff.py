"""`sluicegate vdiff W --target delta:PATH`: equal while the source takes writes during it, and an injected
difference (a row changed and another deleted by a direct delta-rs write) found with its keys; no driver runs,
so the vdiff plays the stream to its point itself (test_lake_vdiff_driver.py: beside a driver)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sluicegate.position import parse_lsn
from sluicegate.spark.runner import SparkRunner
from sluicegate.targets.delta import cli as lake
from sluicegate.targets.delta.engine import LakeEngine
from sluicegate.targets.delta.state import Store

from ..conftest import wait_for
from .helpers import Writer

pytestmark = pytest.mark.spark


def vdiff(target: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluicegate.cli.main", "vdiff", "vd", "--target", target,
                           "--spark-master", "local[2]", *args], capture_output=True, text=True, timeout=120,
                          check=False)


# Slow: test_lake_vdiff_driver.py runs both paths (beside a driver, and alone) in the default set.
@pytest.mark.slow
def test_vdiff_of_a_delta_target(pair, spark, tmp_path):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("INSERT INTO items SELECT g, 0, md5(g::text) FROM generate_series(1, 2000) g")
    pair.src("""CREATE TABLE prices (id int PRIMARY KEY, price numeric(10,2), at timestamptz, doc jsonb,
                amount numeric)""")
    pair.src("""INSERT INTO prices SELECT g, g / 7.0, '2024-01-01 00:00:00+00'::timestamptz + g * interval '1 hour',
                jsonb_build_object('g', g), g * 1.000001 FROM generate_series(1, 2000) g""")
    root = tmp_path / "lake"
    target = f"delta:{root}"
    lake.create("vd", pair.source, target, None, None, [], {"slice_seconds": 1})
    store = Store(root)

    # Copy, then replicate until the first consistent point, with the engine's own steps on this Spark.
    engine = LakeEngine(target, "vd", SparkRunner(spark))
    pair.src("UPDATE prices SET price = price + 1 WHERE id <= 10")
    wait_for(lambda: store.load("vd").first_point or engine.step(store.load("vd")), timeout=60,
             what="the copy and the first consistent point")
    assert store.load("vd").state == "Running"

    # Writes on the source before and during the vdiff: equal at its point all the same.
    writer = Writer(pair.source, 2000, pause=0.005)
    writer.start()
    try:
        wait_for(lambda: writer.commits > 20, what="writes before the vdiff")
        before = writer.commits
        equal = vdiff(target, "--json")
        during = writer.commits - before
    finally:
        writer.stop_event.set()
        writer.join()
    assert writer.error is None
    assert equal.returncode == 0, equal.stderr[-2000:]
    report = json.loads(equal.stdout)
    assert report["equal"] and report["differences"] == 0
    assert report["tables"]["public.items"]["rows_compared"] > 1500
    assert report["tables"]["public.prices"]["rows_compared"] == 2000
    assert during > 0  # the source took writes during the vdiff
    wf = store.load("vd")
    assert wf.state == "Running" and wf.position == parse_lsn(report["source_position"])  # left at the point

    # An injected difference: one row's value changed, another row deleted, by delta-rs directly.
    from deltalake import DeltaTable

    dt = DeltaTable(str(root / "public" / "prices"))
    dt.update(predicate="id = 7", new_values={"doc": '{"g": 700}'})  # a value, not SQL
    dt.delete("id = 11")
    differs = vdiff(target, "--json")
    assert differs.returncode == 1, differs.stderr[-2000:]
    report = json.loads(differs.stdout)
    prices = report["tables"]["public.prices"]
    assert (prices["mismatched"], prices["missing"], prices["extra"]) == (1, 1, 0), prices
    assert sorted((s["kind"], s["key"]) for s in prices["samples"]) == [("mismatched", ["7"]), ("missing", ["11"])]
    mismatch = next(s for s in prices["samples"] if s["kind"] == "mismatched")
    assert mismatch["target"]["doc"] == '{"g": 700}' and mismatch["source"]["doc"] == '{"g": 7}'
    items = report["tables"]["public.items"]
    assert (items["mismatched"], items["missing"], items["extra"]) == (0, 0, 0)
    assert not report["equal"] and report["differences"] == 2

    # The text report names the table and the keys.
    text = vdiff(target, "--tables", "prices")
    assert text.returncode == 1
    assert "public.prices" in text.stdout and "mismatched key (7)" in text.stdout, text.stdout

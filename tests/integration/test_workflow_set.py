"""`workflow set W KEY=VALUE`: a size an existing workflow works in (config.tuned's) lands in its options on
either target, the next run works to it, and a key it may not change is refused naming the way."""

from __future__ import annotations

import logging

import pytest

from sluicegate.config import Settings
from sluicegate.targets.delta.state import Store
from sluicegate.workflow.create import create_movetables

from ..conftest import EngineThread, wait_for
from .helpers import assert_same, stream_row
from .test_ddl_flow import cli

pytestmark = pytest.mark.spark


def test_a_postgres_workflows_copy_follows_a_cycle_size_set_after_create(pair, spark, caplog):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, v text)")
    pair.src("INSERT INTO items SELECT g, md5(g::text) FROM generate_series(1, 1000) g")
    create_movetables("tune", pair.source, pair.target, None, [], {})  # 10M-row cycles: one would do it all
    out = cli("workflow", "set", "tune", "cycle_rows=200", "chunk_rows=100", "batch_changes=500",
              "--target", pair.target)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "workflow tune: cycle_rows 200, chunk_rows 100, batch_changes 500"
    options = pair.dst("SELECT options FROM sluicegate.workflows WHERE name = 'tune'")[0][0]
    assert {k: options[k] for k in ("cycle_rows", "chunk_rows", "batch_changes")} == \
        {"cycle_rows": 200, "chunk_rows": 100, "batch_changes": 500}
    for bad, says in ((["cycle_row=5"], "did you mean 'cycle_rows'"),
                      (["defer_indexes=off"], "defer_indexes is chosen at create only"),
                      (["batch_changes=0"], "batch_changes=0: must be above zero"),
                      (["idle_poll=nan"], "idle_poll=nan: must be above zero, and finite"),
                      (["stage_rows=10"], "stage_rows is a Delta target's setting; this target is PostgreSQL"),
                      (["batch_changes"], "'batch_changes' is not KEY=VALUE")):
        out = cli("workflow", "set", "tune", *bad, "--target", pair.target)
        assert out.returncode == 1 and says in out.stderr, (bad, out.stderr)
    assert pair.dst("SELECT options FROM sluicegate.workflows WHERE name = 'tune'")[0][0] == options
    out = cli("workflow", "set", "tune", "slice_seconds=5", "--target", pair.target)
    assert out.returncode == 0 and out.stdout.strip() == "workflow tune: slice_seconds 5.0", out.stderr
    out = cli("workflow", "set", "tune", "slice_seconds=default", "--target", pair.target)
    assert out.returncode == 0 and out.stdout.strip() == "workflow tune: slice_seconds default", out.stderr
    assert pair.dst("SELECT options FROM sluicegate.workflows WHERE name = 'tune'")[0][0] == options

    caplog.set_level(logging.INFO, logger="sluicegate")
    with EngineThread(spark, pair.target, "tune"):
        wait_for(lambda: stream_row(pair, "tune")["state"] == "Running", timeout=300, what="Running")
    copied = [r.args[0] for r in caplog.records if r.msg.startswith("copied %s rows of %s") and r.args[0]]
    assert copied == [200] * 5, copied  # 1000 rows in cycles of 200 (then one that finds no more)
    assert assert_same(pair, "public.items", ["id"]) == 1000


def test_a_delta_workflows_staging_sizes_are_set_in_its_state(pair, tmp_path):
    pair.src("CREATE TABLE items (id int PRIMARY KEY, v text)")
    target = f"delta:{tmp_path / 'lake'}"
    out = cli("movetables", "create", "--workflow", "dt", "--source", pair.source, "--target", target)
    assert out.returncode == 0, out.stderr
    out = cli("workflow", "set", "dt", "stage_rows=1000", "stage_bytes=8MB", "--on-ddl", "ignore",
              "--target", target)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "workflow dt: on-ddl ignore, stage_rows 1000, stage_bytes 8388608"
    options = Store(tmp_path / "lake").load("dt").options
    settings = Settings.from_options(options, "workflow dt")  # as the Delta engine reads them each play task
    assert (settings.stage_rows, settings.stage_bytes, options["on_ddl"]) == (1000, 8 << 20, "ignore")
    for bad, says in ((["stage_bytes=0"], "stage_bytes=0: must be above zero"),
                      (["idle_poll=1"], "idle_poll is a PostgreSQL target's setting; this target is Delta")):
        out = cli("workflow", "set", "dt", *bad, "--target", target)
        assert out.returncode == 1 and says in out.stderr, (bad, out.stderr)
    out = cli("workflow", "set", "dt", "stage_rows=default", "--target", target)
    assert out.returncode == 0 and out.stdout.strip() == "workflow dt: stage_rows default", out.stderr
    assert "stage_rows" not in Store(tmp_path / "lake").load("dt").options
    assert Store(tmp_path / "lake").load("dt").options["stage_bytes"] == 8 << 20

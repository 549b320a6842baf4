"""`materialize cancel`, `reshard cancel` and `workflow delete --drop-target-tables`: a workflow of any kind
stopped and deleted everywhere, with the target tables it writes (and only those) dropped unless kept."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from sluicegate.workflow.create import create_materialize, create_movetables
from sluicegate.workflow.reshard import create_reshard, parse_shards

from ..conftest import EngineThread, wait_for
from .helpers import (
    EU_RULE,
    caught_up,
    load_priced_items,
    load_shard,
    reap_group,
    reshard_keyspace,
    reshard_streams,
    run_sql,
    sluicegate_objects,
    stream_row,
)

pytestmark = pytest.mark.spark

# a second Materialize filling the same target table as EU_RULE
US_RULE = ("items_eu: SELECT id AS item_id, upper(name) AS uname, price * qty AS total FROM items "
           "WHERE region = 'us' AND qty > 0")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "sluicegate.cli.main", *args], capture_output=True, text=True,
                          timeout=120, check=False)


NONE = {"schema": 0, "slots": 0, "publications": 0, "triggers": 0, "functions": 0}


@pytest.mark.slow  # ~20 s; reshard cancel covers the cancel path in the default set
def test_materialize_cancel_drops_its_table_slot_publication_and_state(pair, tmp_path):
    load_priced_items(pair, 1000)
    pair.dst("CREATE TABLE items (id int PRIMARY KEY)")  # the source table's name, not the rule's target
    create_materialize("mat", pair.source, pair.target, [EU_RULE], {})
    log = tmp_path / "driver.log"
    driver = subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", "mat", "--target",
                               pair.target, "--no-progress"], stdout=log.open("ab"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        wait_for(lambda: stream_row(pair, "mat")["state"] == "Running", what="copied",
                 describe=lambda: log.read_text()[-2000:])
        assert pair.dst("SELECT count(*) FROM items_eu")[0][0] > 0
        slot = stream_row(pair, "mat")["slot"]

        # movetables cancel names the command that cancels a Materialize, and changes nothing
        out = _cli("movetables", "cancel", "mat", "--target", pair.target)
        assert out.returncode != 0 and "workflow mat is a Materialize: `sluicegate materialize cancel mat`" \
            in out.stderr, out.stdout + out.stderr
        assert "only a MoveTables" not in out.stderr
        assert pair.dst("SELECT count(*) FROM sluicegate.workflows") == [(1,)]

        # while its driver runs: the stream stopped first, then everything goes; the driver ends cleanly
        out = _cli("materialize", "cancel", "mat", "--target", pair.target)
        assert out.returncode == 0, out.stdout + out.stderr
        assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]
    finally:
        if driver.poll() is None:
            reap_group(driver)
    lines = out.stdout.splitlines()
    assert lines[0] == "cancelled workflow mat: dropped"
    assert sorted(lines[1:]) == sorted([f"  replication slot {slot}", f"  publication {slot}",
                                        "  target table public.items_eu", "  schema sluicegate on the target"])
    assert sluicegate_objects(pair.source) == NONE and sluicegate_objects(pair.target) == NONE
    assert pair.dst("SELECT to_regclass('public.items_eu')") == [(None,)]
    assert pair.dst("SELECT to_regclass('public.items')::text") == [("items",)]  # never another table
    assert pair.src("SELECT count(*) FROM items") == [(1000,)]  # the source as it was


def test_keep_target_tables_and_a_table_another_workflow_fills(pair, spark):
    load_priced_items(pair, 200)
    create_materialize("m1", pair.source, pair.target, [EU_RULE], {})
    create_materialize("m2", pair.source, pair.target, [US_RULE], {})
    pair.dst("INSERT INTO items_eu VALUES (1, 'kept', 1)")

    # m2 fills items_eu too: refused, naming the table and the workflow, nothing changed
    for args in (("materialize", "cancel", "m1"), ("workflow", "delete", "m1", "--drop-target-tables")):
        out = _cli(*args, "--target", pair.target)
        assert out.returncode != 0, out.stdout
        assert "public.items_eu (workflow m2 writes it)" in out.stderr and "nothing was changed" in out.stderr
        assert pair.dst("SELECT name FROM sluicegate.workflows ORDER BY 1") == [("m1",), ("m2",)]

    # a Reshard's command does not cancel a Materialize
    out = _cli("reshard", "cancel", "m1", "--target", pair.target)
    assert out.returncode != 0 and "not a Reshard: `sluicegate materialize cancel m1`" in out.stderr, out.stderr

    out = _cli("materialize", "cancel", "m1", "--target", pair.target, "--keep-target-tables")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "target table" not in out.stdout
    assert pair.dst("SELECT name FROM sluicegate.workflows") == [("m2",)]
    assert pair.dst("SELECT count(*) FROM items_eu") == [(1,)]

    # the last one that fills it: `workflow delete --drop-target-tables` drops it
    out = _cli("workflow", "delete", "m2", "--target", pair.target, "--drop-target-tables")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "  target table public.items_eu" in out.stdout.splitlines()
    assert pair.dst("SELECT to_regclass('public.items_eu')") == [(None,)]
    assert sluicegate_objects(pair.source) == NONE and sluicegate_objects(pair.target) == NONE


def test_workflow_delete_drop_target_tables_on_a_movetables(pair, spark):
    pair.src("CREATE TABLE orders (id bigint PRIMARY KEY, qty int)")
    pair.src("INSERT INTO orders SELECT g, g % 5 FROM generate_series(1, 2000) g")
    pair.src("CREATE TABLE notes (id int PRIMARY KEY)")
    pair.dst("CREATE TABLE notes (id int PRIMARY KEY)")  # not moved: the target's own
    create_movetables("mt", pair.source, pair.target, ["orders"], [], {})
    with EngineThread(spark, pair.target, "mt") as run:
        wait_for(lambda: caught_up(pair, "mt"), what="copied", describe=lambda: stream_row(pair, "mt"))
        assert _cli("workflow", "stop", "mt", "--target", pair.target).returncode == 0
        run.thread.join(timeout=60)
    out = _cli("workflow", "delete", "mt", "--target", pair.target, "--drop-target-tables")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[0] == "deleted workflow mt: dropped"
    assert "  target table public.orders" in out.stdout.splitlines()
    assert sluicegate_objects(pair.source) == NONE and sluicegate_objects(pair.target) == NONE
    assert pair.dst("SELECT to_regclass('public.orders')") == [(None,)]
    assert pair.dst("SELECT to_regclass('public.notes')::text") == [("notes",)]
    assert pair.src("SELECT count(*) FROM orders") == [(2000,)]


def test_reshard_cancel_drops_every_target_shards_tables(source_server, target_server, spark):
    from sluicegate.spark.runner import SparkRunner
    from sluicegate.workflow.reshard import run_all

    with reshard_keyspace(source_server, target_server) as ks:
        for shard, url in ks["sources"].items():
            load_shard(url, shard, ids=300)
        create_reshard("rs", parse_shards("source", [f"{n}={u}" for n, u in ks["sources"].items()]),
                       parse_shards("target", [f"{n}={u}" for n, u in ks["targets"].items()]),
                       None, {"events": "account_id"}, [], {})
        stop, spark_runner = threading.Event(), SparkRunner(spark)
        runner = threading.Thread(target=run_all, args=("rs", ks["targets"]["-55"], spark_runner, stop),
                                  daemon=True)
        runner.start()
        try:
            # every stream past its start: its slot and publication made on its source shard
            wait_for(lambda: all(state in ("Copying", "Running") for _, _, state, _, _ in reshard_streams(ks)),
                     what="every stream copying",
                     describe=lambda: reshard_streams(ks))
        finally:
            stop.set()
            spark_runner.cancel()  # as `workflow run` does on SIGTERM: the copy's jobs end now
            runner.join(timeout=120)
        any_target = ks["targets"]["55-aa"]
        out = _cli("movetables", "cancel", "rs", "--target", any_target)
        assert out.returncode != 0 and "`sluicegate reshard cancel rs`" in out.stderr, out.stderr

        out = _cli("reshard", "cancel", "rs", "--target", any_target)
        assert out.returncode == 0, out.stdout + out.stderr
        lines = out.stdout.splitlines()
        for shard in ks["targets"]:
            for table in ("accounts", "events"):
                assert f"  target table public.{table} on target shard {shard}" in lines, lines
            assert f"  schema sluicegate on the target shard {shard}" in lines, lines
        assert sum(line.startswith("  replication slot ") for line in lines) == 4  # one per stream
        for url in [*ks["sources"].values(), *ks["targets"].values()]:
            assert sluicegate_objects(url) == NONE, url
        for url in ks["targets"].values():
            assert run_sql(url, "SELECT to_regclass('public.accounts'), to_regclass('public.events')") \
                == [(None, None)]
        for url in ks["sources"].values():
            assert run_sql(url, "SELECT count(*) > 0 FROM accounts") == [(True,)]

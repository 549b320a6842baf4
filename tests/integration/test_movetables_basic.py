"""MoveTables end to end on real PostgreSQL and real local Spark: copy, replicate, converge."""

from __future__ import annotations

import pytest

from sluicegate.workflow.create import create_movetables, delete_workflow

from ..conftest import EngineThread, wait_for
from .helpers import assert_same, caught_up, slot_confirmed, stream_row

pytestmark = pytest.mark.spark


def test_copy_then_replicate(pair, spark):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, name text, qty int)")
    pair.src("INSERT INTO items SELECT g, 'item ' || g, g % 7 FROM generate_series(1, 5000) g")
    create_movetables("wf", pair.source, pair.target, None, [], {"cycle_rows": 2000, "chunk_rows": 700})
    with EngineThread(spark, pair.target, "wf"):
        wait_for(lambda: stream_row(pair, "wf")["state"] == "Running", what="Running")
        pair.src("INSERT INTO items VALUES (6001, 'new', 1)")
        pair.src("UPDATE items SET qty = qty + 100 WHERE id % 10 = 0")
        pair.src("DELETE FROM items WHERE id BETWEEN 100 AND 199")
        pair.src("UPDATE items SET id = 7000 WHERE id = 5")  # the key changes
        wait_for(lambda: caught_up(pair, "wf"), what="caught up")
        assert assert_same(pair, "public.items", ["id"]) == 4901
        s = stream_row(pair, "wf")
        # the slot never passes what the target committed
        assert slot_confirmed(pair, s["slot"]) <= s["position"]
    dropped = delete_workflow("wf", pair.target)
    assert any("replication slot" in d for d in dropped)
    assert pair.src("SELECT count(*) FROM pg_replication_slots")[0][0] == 0

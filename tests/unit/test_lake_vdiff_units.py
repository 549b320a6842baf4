"""A Delta vdiff's checks before it starts, which tables a name picks; the stream control it uses (control.py:
the player's decision, hold and release) and its pins against vacuum."""

from __future__ import annotations

import json
import time

import pytest

from sluicegate.errors import RetryableError, UsageError
from sluicegate.targets.delta import control, pins
from sluicegate.targets.delta.state import COPYING, ERROR, RUNNING, STOPPED, LakeWorkflow, Store, TableState
from sluicegate.targets.delta.vdiff import check_comparable
from sluicegate.vdiff.labels import choose as select_tables


def make(tmp_path, state: str, done: bool = True) -> Store:
    store = Store(tmp_path)
    table = {"schema": "public", "name": "items", "columns": [], "key": ["id"]}
    store.create(LakeWorkflow(name="w", source_url="postgresql://x", slot="s", publication="p", state=state,
                              message="boom" if state == ERROR else "", position=1,
                              tables=[TableState(table, done=done)]))
    return store


@pytest.mark.parametrize("state", [RUNNING, STOPPED])
def test_running_or_stopped_without_driver_is_comparable(tmp_path, state):
    check_comparable(make(tmp_path, state), "w")


def test_a_workflow_written_through_rules_is_comparable(tmp_path):
    store = make(tmp_path, RUNNING)
    with store.update("w") as w:
        w.tables[0].rule = {"rule": "items_out: SELECT id FROM items"}  # (not compiled by the check)
    assert store.load("w").tables[0].rule
    check_comparable(store, "w")  # the rule runs over the source side (rule_vdiff.py)


@pytest.mark.parametrize("state, done, words", [
    (COPYING, False, "still copying (0 of 1 tables done)"),
    (ERROR, True, "is in Error (boom)"),
])
def test_copying_or_error_is_refused(tmp_path, state, done, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
        check_comparable(make(tmp_path, state, done), "w")


def test_a_driver_holding_the_run_lock_is_comparable(tmp_path):
    store = make(tmp_path, RUNNING)
    lock = store.hold_run_lock("w")
    try:
        check_comparable(store, "w")  # the vdiff asks the driver to stop at its point (control.py)
    finally:
        lock.close()


def test_a_hold_is_released_by_its_own_controller_only(tmp_path):
    store = make(tmp_path, RUNNING)
    control.hold(store, "w", "vdiff a")
    with pytest.raises(RetryableError, match="held by vdiff a"):
        control.hold(store, "w", "vdiff b")
    with store.update("w") as w:  # the player stops at its batch boundary
        w.state, w.message = STOPPED, control.stopped_message(w.position, w.stop_reason)
    control.play_to(store, "w", "vdiff a", 300)
    wf = store.load("w")
    assert (wf.state, wf.stop_position, wf.stop_reason) == (RUNNING, 300, "vdiff a")
    assert not control.release(store, "w", "vdiff b")  # not b's: nothing changes
    assert store.load("w").stop_reason == "vdiff a"
    with store.update("w") as w:
        w.state, w.position = STOPPED, 300
    assert control.release(store, "w", "vdiff a")
    wf = store.load("w")
    assert (wf.state, wf.stop_position, wf.stop_reason, wf.message) == (RUNNING, None, "", "")
    # A user's `workflow stop` in between wins: the controller's release then changes nothing.
    control.hold(store, "w", "vdiff c", state=STOPPED)
    assert store.load("w").message == "stopped at 0/12C for vdiff c"
    with store.update("w") as w:
        w.stop_reason, w.stop_position, w.state = "", None, STOPPED
    with pytest.raises(RetryableError, match=r"hold \(vdiff c\) was released"):
        control.play_to(store, "w", "vdiff c", 400)
    assert not control.release(store, "w", "vdiff c") and store.load("w").state == STOPPED


def test_pins_expire_and_old_documents_load(tmp_path):
    store = make(tmp_path, RUNNING)
    pins.add(store, "w", "a", 300, {"public.items": 4})
    pins.add(store, "w", "b", 500, {"public.items": 9})
    pins.add(store, "w", "c", 500, {})  # pinned before its point is recorded: the position only
    current = store.load("w").pins
    assert pins.pinned(current) == ({300, 500}, {"public.items": {4, 9}})
    assert pins.pinned(current, now=time.time() + pins.PIN_SECONDS + 1) == (set(), {})
    pins.remove(store, "w", "a")
    assert set(store.load("w").pins) == {"b", "c"}
    # A document written before durable control (point requests, no stop fields) still loads.
    doc = json.loads((tmp_path / "_sluicegate/workflows/w/state.json").read_text())
    for key in ("stop_position", "stop_reason", "pins"):
        del doc[key]
    doc["point_requests"] = {"x": {"position": None, "held_at": None}}
    wf = LakeWorkflow.from_json(doc)
    assert (wf.stop_position, wf.stop_reason, wf.pins) == (None, "", {})


def test_select_tables_by_qualified_or_bare_name():
    known = ["public.items", "public.prices", "sales.items"]
    assert select_tables(known, None, "w") == known
    assert select_tables(known, ["prices"], "w") == ["public.prices"]
    assert select_tables(known, ["items"], "w") == ["public.items", "sales.items"]
    assert select_tables(known, ["sales.items", "public.prices"], "w") == ["sales.items", "public.prices"]
    with pytest.raises(UsageError, match="'prics' is not in workflow w.*prices"):
        select_tables(known, ["prics"], "w")

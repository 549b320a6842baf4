"""A Delta vdiff's checks before it starts: which workflows it compares, which tables a name picks."""

from __future__ import annotations

import time

import pytest

from sluicegate.errors import UsageError
from sluicegate.lake import pointreq
from sluicegate.lake.state import COPYING, ERROR, RUNNING, STOPPED, LakeWorkflow, Store, TableState
from sluicegate.lake.vdiff import check_comparable, select_tables


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
        check_comparable(store, "w")  # the vdiff asks the driver for a point (pointreq.py)
    finally:
        lock.close()


def add(store, request: dict) -> str:
    rid, fresh = pointreq.new_request()
    with store.update("w") as w:
        w.point_requests[rid] = {**fresh, **request}
    return rid


def test_the_driver_acknowledges_a_hold_and_plays_nothing_meanwhile(tmp_path):
    store = make(tmp_path, RUNNING)
    rid = add(store, {})
    recorded = []
    assert pointreq.serve(store, store.load("w"), 100, lambda: recorded.append(1)) == pointreq.HELD
    assert store.load("w").point_requests[rid]["held_at"] == 100 and not recorded
    # A hold a killed vdiff left lapses: the driver goes on.
    with store.update("w") as w:
        w.point_requests[rid]["at"] = time.time() - pointreq.HOLD_SECONDS - 1
    assert pointreq.serve(store, store.load("w"), 100, lambda: recorded.append(1)) is None


def test_the_driver_stops_at_a_request_ahead_answers_one_here_and_gives_up_one_behind(tmp_path):
    store = make(tmp_path, RUNNING)
    ahead = add(store, {"position": 300, "held_at": 100})
    later = add(store, {"position": 500, "held_at": 100})
    recorded = []
    assert pointreq.serve(store, store.load("w"), 100, lambda: recorded.append(100)) == 300
    assert not recorded
    with store.update("w") as w:
        pointreq.mark_done(w, 300, {"public.items": 4})  # the batch that ended at 300 records its point
    assert store.load("w").point_requests[ahead]["done"]
    assert pointreq.serve(store, store.load("w"), 300, lambda: recorded.append(300)) == 500
    here = add(store, {"position": 500, "held_at": 500})
    behind = add(store, {"position": 400, "held_at": 300})
    answer = {"public.items": 9}
    assert pointreq.serve(store, store.load("w"), 500, lambda: recorded.append(500) or answer) is None
    requests = store.load("w").point_requests
    assert recorded == [500] and requests[here]["done"] and requests[later]["done"]
    assert requests[here]["versions"] == answer and requests[ahead]["versions"] == {"public.items": 4}
    assert "already at 500" in requests[behind]["missed"] and not requests[behind]["done"]
    assert pointreq.pinned(requests) == ({300, 400, 500}, {"public.items": {4, 9}})
    assert pointreq.pinned(requests, now=time.time() + pointreq.REQUEST_SECONDS + 1) == (set(), {})


def test_select_tables_by_qualified_or_bare_name():
    known = ["public.items", "public.prices", "sales.items"]
    assert select_tables(known, None, "w") == known
    assert select_tables(known, ["prices"], "w") == ["public.prices"]
    assert select_tables(known, ["items"], "w") == ["public.items", "sales.items"]
    assert select_tables(known, ["sales.items", "public.prices"], "w") == ["sales.items", "public.prices"]
    with pytest.raises(UsageError, match="'prics' is not in workflow w.*prices"):
        select_tables(known, ["prics"], "w")

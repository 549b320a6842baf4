"""A Delta vdiff's checks before it starts: which workflows it compares, which tables a name picks."""

from __future__ import annotations

import pytest

from sluicegate.errors import UsageError
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


def test_a_driver_holding_the_run_lock_is_refused_unless_it_is_ours(tmp_path):
    store = make(tmp_path, RUNNING)
    lock = store.hold_run_lock("w")
    try:
        with pytest.raises(UsageError, match="being run by a driver.*workflow stop w"):
            check_comparable(store, "w")
        check_comparable(store, "w", driver=False)  # the vdiff's own hold
    finally:
        lock.close()


def test_select_tables_by_qualified_or_bare_name():
    known = ["public.items", "public.prices", "sales.items"]
    assert select_tables(known, None, "w") == known
    assert select_tables(known, ["prices"], "w") == ["public.prices"]
    assert select_tables(known, ["items"], "w") == ["public.items", "sales.items"]
    assert select_tables(known, ["sales.items", "public.prices"], "w") == ["sales.items", "public.prices"]
    with pytest.raises(UsageError, match="'prics' is not in workflow w.*prices"):
        select_tables(known, ["prics"], "w")

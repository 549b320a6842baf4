"""Where a Delta target lives (location.py) and the state store for URIs (state.DeltaStore), the latter on a
real Delta table in a local directory: its commits race as they do on an object store (put-if-absent)."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import time

import pytest

from sluicegate.errors import RetryableError, UsageError
from sluicegate.targets.delta import location, state
from sluicegate.targets.delta.location import Location, parse
from sluicegate.targets.delta.state import DeltaStore, LakeWorkflow, Store, TableState, open_store

TABLE = {"schema": "public", "name": "items"}


def test_parse_local_paths_and_file_uris(tmp_path):
    assert parse(f"delta:{tmp_path}/lake/").uri == f"{tmp_path}/lake"
    assert parse(f"delta:file://{tmp_path}/lake").uri == f"{tmp_path}/lake"
    assert parse(f"{tmp_path}/lake").local
    rel = parse("delta:lake")
    assert rel.local and rel.uri == os.path.join(os.getcwd(), "lake")
    assert isinstance(open_store(f"delta:{tmp_path}"), Store)


def test_parse_uris():
    loc = parse("delta:s3://bucket/some/lake/")
    assert loc.uri == "s3://bucket/some/lake" and not loc.local and loc.scheme == "s3"
    assert loc.table("public", "items") == "s3://bucket/some/lake/public/items"
    assert loc.join("_sluicegate", "points") == "s3://bucket/some/lake/_sluicegate/points"
    assert loc.target == "delta:s3://bucket/some/lake"
    assert parse("delta:ABFSS://c@acct.dfs.core.windows.net/lake").scheme == "abfss"
    assert parse("gs://b/l").uri == "gs://b/l"
    assert isinstance(open_store("delta:s3://bucket/lake"), DeltaStore)
    assert Location("/").table("public", "t") == "/public/t"


@pytest.mark.parametrize("target, words", [
    ("delta:", "names no directory"),
    ("delta:memory:///lake", "memory:// lives in one process"),
    ("delta:ftp://host/lake", "scheme ftp:// is not one"),
    ("delta:s3://", "names no bucket"),
])
def test_parse_refusals_are_one_line(target, words):
    with pytest.raises(UsageError, match=words) as err:
        parse(target)
    assert "\n" not in str(err.value)


def test_filesystem_paths():
    fs, paths = location.filesystem_paths(["/a/b.parquet", "/a/c.parquet"])
    assert paths == ["/a/b.parquet", "/a/c.parquet"] and fs.type_name == "local"
    with pytest.raises(UsageError, match="pyarrow cannot open nope://"):
        location.filesystem("nope://x/y")


def workflow(name="w") -> LakeWorkflow:
    return LakeWorkflow(name, "postgresql://x", "sg_w", "sg_w", [TableState(dict(TABLE))])


@pytest.fixture
def store(tmp_path):
    s = DeltaStore(Location(str(tmp_path)))
    s.create(workflow())
    return s


def test_delta_store_round_trip(store):
    assert store.names() == ["w"] and store.exists("w") and not store.exists("v")
    with pytest.raises(UsageError, match="already exists"):
        store.create(workflow())
    with store.update("w") as w:
        w.position = 42
        w.table("public.items").lastpk = ["7"]
    again = store.load("w")
    assert again.position == 42 and again.tables[0].lastpk == ["7"]
    with pytest.raises(UsageError, match=r"not found .*\(workflows there: w\)"):
        store.load("v")
    with pytest.raises(ValueError), store.update("w") as w:  # an exception: nothing written
        w.position = 99
        raise ValueError
    assert store.load("w").position == 42
    store.delete("w")
    assert store.names() == [] and not store.exists("w")


def test_delta_store_stays_small(store, tmp_path):
    for i in range(2 * state.MAINTAIN_EVERY + 5):
        with store.update("w") as w:
            w.position = i
    assert store.load("w").position == 2 * state.MAINTAIN_EVERY + 4
    table = tmp_path / "_sluicegate" / "workflows" / "w"
    assert len(list(table.glob("*.parquet"))) < state.MAINTAIN_EVERY + 5  # vacuumed: not one per version
    assert (table / "_delta_log" / "_last_checkpoint").exists()


def test_interleaved_updates_of_different_fields_both_land(store):
    first = store.update("w")
    a = first.__enter__()
    a.state = "Stopped"  # `workflow stop`, its commit beaten by the driver's
    with store.update("w") as b:
        b.position = 1000
        b.table("public.items").applied = 1000
    first.__exit__(None, None, None)
    wf = store.load("w")
    assert (wf.state, wf.position, wf.tables[0].applied) == ("Stopped", 1000, 1000)


def test_interleaved_updates_of_one_field_fail_not_lose(store):
    first = store.update("w")
    a = first.__enter__()
    a.position = 1
    with store.update("w") as b:
        b.position = 2
    with pytest.raises(RetryableError, match="position changed under this update"):
        first.__exit__(None, None, None)
    assert store.load("w").position == 2


def test_an_update_decided_on_a_field_another_commit_changed_fails(store):
    """The engine sets Running because every table is done (it read `tables`); add-tables appends one meanwhile:
    merging the two would mark Running a table never copied. With depends, the engine's update fails instead."""
    first = store.update("w", depends=(("tables",),))
    a = first.__enter__()
    a.state = "Running"
    with store.update("w") as b:
        b.tables.append(TableState(dict(TABLE, name="orders")))
    with pytest.raises(RetryableError, match="tables changed under this update"):
        first.__exit__(None, None, None)
    wf = store.load("w")
    assert wf.state != "Running" and len(wf.tables) == 2
    without = store.update("w")  # without depends, the same two changes merge (as before)
    a = without.__enter__()
    a.state = "Running"
    with store.update("w") as b:
        b.tables.append(TableState(dict(TABLE, name="lines")))
    without.__exit__(None, None, None)
    wf = store.load("w")
    assert wf.state == "Running" and len(wf.tables) == 3


def _bump(root: str, key: str, n: int) -> None:
    s = DeltaStore(Location(root))
    for i in range(n):
        with s.update("w") as w:
            w.options[key] = i + 1


def test_concurrent_processes_lose_no_update(store, tmp_path):
    """Three processes commit to the same document at once, each to its own field: every change lands."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_bump, args=(str(tmp_path), f"k{i}", 15)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert store.load("w").options == {"k0": 15, "k1": 15, "k2": 15}


def test_lease_one_holder(store):
    held = store.hold_run_lock("w")
    try:
        assert store.is_running("w")
        with pytest.raises(UsageError, match=f"already being run .*pid {os.getpid()}") as err:
            store.hold_run_lock("w")
        assert "\n" not in str(err.value)
    finally:
        held.close()
    assert not store.is_running("w")
    store.hold_run_lock("w").close()  # free again


def _lease(store, **fields) -> None:
    r = store._read("w")
    assert store._commit("w", r, r.doc, {"id": "other", "host": socket.gethostname(), "pid": os.getpid(),
                                         "expires": time.time() + 60} | fields)


def test_lease_of_dead_or_expired_driver_is_taken(store):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    _lease(store, pid=int(dead.stdout))  # a driver of this host killed -9
    assert not store.is_running("w")
    store.hold_run_lock("w").close()
    _lease(store, host="elsewhere", expires=time.time() - 1)  # another host's, not renewed
    assert not store.is_running("w")
    store.hold_run_lock("w").close()
    _lease(store, host="elsewhere")
    assert store.is_running("w")
    with pytest.raises(UsageError, match="on elsewhere"):
        store.hold_run_lock("w")


def test_driver_whose_lease_is_taken_is_told(store, monkeypatch):
    monkeypatch.setattr(state, "LEASE_SECONDS", 0.6)
    lost = multiprocessing.Event()
    held = store.hold_run_lock("w", on_lost=lost.set)
    try:
        _lease(store, host="elsewhere")  # another driver took it (ours had lapsed)
        assert lost.wait(10)
    finally:
        held.close()
    assert store._read("w").lease["id"] == "other"  # closing did not drop the other's lease


def test_engine_whose_lease_is_taken_stops_with_an_error(store, tmp_path, monkeypatch):
    from sluicegate.errors import TerminalError
    from sluicegate.targets.delta.engine import LakeEngine

    monkeypatch.setattr(state, "LEASE_SECONDS", 0.6)
    engine = LakeEngine(f"delta:{tmp_path}", "w", None)
    engine.store = store  # the object-store state, on a local directory
    engine.hold()
    _lease(store, host="elsewhere")
    assert engine.stop.wait(10)
    with pytest.raises(TerminalError, match="another driver took its lease"):
        engine.run()

"""A local Delta table's new versions are fsynced (files, log entries, directories) before the state moves."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from sluicegate.targets.delta import durable


@pytest.fixture
def synced(monkeypatch):
    """The paths fsync was called on."""
    paths: list[str] = []
    real = os.fsync

    def record(fd):
        paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return paths


def _added(root: Path, version: int) -> list[str]:
    entry = root / "_delta_log" / f"{version:020d}.json"
    return [str(root / json.loads(line)["add"]["path"]) for line in entry.read_text().splitlines()
            if '"add"' in line]


def test_new_versions_are_synced_and_older_ones_are_not(tmp_path, synced):
    root = tmp_path / "my table"  # a name delta-rs percent-encodes in its URIs
    write_deltalake(str(root), pa.table({"id": [1, 2], "v": ["a", "b"]}))
    dt = DeltaTable(str(root))
    versions = durable.Versions({"t": dt})
    dt.merge(pa.table({"id": [3], "v": ["c"]}), "t.id = s.id", source_alias="s", target_alias="t"
             ).when_not_matched_insert_all().execute()
    write_deltalake(dt, pa.table({"id": [4], "v": ["d"]}), mode="append")
    dt.update_incremental()
    versions.sync()

    new = _added(root, 1) + _added(root, 2)
    assert new and set(new) <= set(synced)
    log = root / "_delta_log"
    assert {str(log / f"{v:020d}.json") for v in (1, 2)} <= set(synced)
    assert {str(root), str(log)} <= set(synced)  # the new names survive a crash too
    assert not set(_added(root, 0)) & set(synced)
    assert str(log / f"{0:020d}.json") not in synced

    synced.clear()
    versions.sync()  # nothing new since
    assert synced == []


def test_an_object_store_table_is_left_alone(synced):
    durable.sync_versions("s3://bucket/lake/public/t", 0, 5)
    assert synced == []

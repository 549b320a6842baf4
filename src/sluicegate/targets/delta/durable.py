"""What a local Delta table's commits put on disk is flushed before the state or the slot moves past them.

delta-rs (object_store's local file system) writes data files and log entries without fsync: they sit in the
page cache, which survives a killed process but not a crashed machine. The slot must never be confirmed past
what the target can lose (guarantee 7), and the workflow state's position says where the stream resumes, so
after a batch's commits and before either moves: every file those versions added, their log entries and
the directories that name them are fsynced. On an object store a write is durable when it returns.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import unquote

LOG = "_delta_log"


def sync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_versions(table_uri: str, after: int | None, upto: int | None) -> None:
    """fsync what versions `after`+1 … `upto` of the table at `table_uri` added (data files, log entries,
    their directories). `after` None: from version 0. Nothing to do on an object store."""
    if table_uri.startswith("file://"):  # DeltaTable.table_uri of a local table
        table_uri = unquote(table_uri.removeprefix("file://"))
    if "://" in table_uri or upto is None:
        return
    root = Path(table_uri)
    log = root / LOG
    dirs = {root, log}
    first = 0 if after is None else after + 1
    for version in range(first, upto + 1):
        entry = log / f"{version:020d}.json"
        for line in entry.read_text().splitlines():
            if not line.strip():
                continue
            action = json.loads(line)
            added = action.get("add") or action.get("cdc")
            if added and "://" not in added["path"]:
                path = root / unquote(added["path"])
                sync_file(path)
                dirs.add(path.parent)
        sync_file(entry)
    last_checkpoint = log / "_last_checkpoint"
    if last_checkpoint.exists():  # a checkpoint made meanwhile: readers start from it
        checkpoint = json.loads(last_checkpoint.read_text()).get("version")
        if checkpoint is not None and first <= checkpoint <= upto:
            for part in log.glob(f"{checkpoint:020d}.checkpoint*.parquet"):
                sync_file(part)
            sync_file(last_checkpoint)
    # The directory entries (a new name, a rename) survive a crash.
    for d in sorted(dirs, key=lambda p: len(str(p)), reverse=True):  # deepest first
        sync_file(d)


class Versions:
    """The versions of several tables before a step, to sync what the step committed."""

    def __init__(self, tables: dict):
        """`tables`: name -> DeltaTable (their version now is the starting point)."""
        self.tables = tables
        self.before = {q: dt.version() for q, dt in tables.items()}

    def sync(self, names=None) -> None:
        """Flush what `names` (default: all) committed since; the next sync starts from here."""
        for q in self.tables if names is None else names:
            dt = self.tables[q]
            now = dt.version()
            if now != self.before[q]:
                sync_versions(dt.table_uri, self.before[q], now)
                self.before[q] = now

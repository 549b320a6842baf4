"""A batch's net effect on one table, spilled to Parquet files once it grows (guarantee 5: bounded memory).

A big source transaction cannot be cut (its commits to Delta are one per table), so the player folds its changes
into a `NetEffect` and, each time the batch holds `stage_rows` changes in memory, writes each table's net
effect so far as one *generation* of files under PATH/_sluicegate/staging/<W>/<table>/, split into partitions
by a hash of the key, then forgets it. Every change of a key lands in the same partition, in generation order.
At commit, the partitions are folded one at a time (a later generation's state of a key wins; a column the
later one kept from "before" takes the earlier generation's value) and streamed to delta-rs as the MERGE's
source: one commit per table, with memory bounded by a partition, not by the transaction. Staged files are
the batch's alone: a new batch (or a restart after kill -9) removes what a previous one left.

A lake on an object store (a URI root) stages in the task's local temporary directory instead: the task that
writes a batch's staged files is the one that reads them back, within that batch, so they need no store.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..postgres.catalog import Table
from .apply import NetEffect

PARTITIONS = 32
OP, KEEP = "_op", "_keep"


def staging_dir(root: Path | str, workflow: str) -> Path:
    if "://" in str(root):
        digest = hashlib.sha1(str(root).encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"sluicegate-staging-{digest}" / workflow
    return Path(root) / "_sluicegate" / "staging" / workflow


def clear(root: Path, workflow: str) -> None:
    shutil.rmtree(staging_dir(root, workflow), ignore_errors=True)


def _partition(key: tuple) -> int:
    return zlib.crc32("\x1f".join("\x00" if k is None else str(k) for k in key).encode()) % PARTITIONS


def _schema(n: int) -> pa.Schema:
    return pa.schema([*(pa.field(f"c{i}", pa.string()) for i in range(n)),
                      pa.field(OP, pa.string()), pa.field(KEEP, pa.list_(pa.int32()))])


class Spill:
    """The staged generations of one table's net effect in one batch."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.generations = 0
        self.kept: set[int] = set()  # columns some staged row keeps from the table
        # Columns added after a generation was staged: what its rows hold in them (player.py `_follow`:
        # they predate the column on the source), and those whose value is the Delta table's own.
        self.pads: dict[int, str | None] = {}
        self.pad_keep: set[int] = set()

    def write(self, effect: NetEffect) -> None:
        """Stage the effect's rows as the next generation, then empty it."""
        if not effect.rows:
            return
        n = len(effect.table.columns)
        parts: dict[int, list] = {}
        for key, (op, values, keep) in effect.rows.items():
            if values is None:  # a delete: the key alone
                row = [None] * n
                for i, k in zip(effect.table.key_indices, key):
                    row[i] = k
                values = row
            parts.setdefault(_partition(key), []).append((op, values, keep))
            self.kept.update(keep)
        self.dir.mkdir(parents=True, exist_ok=True)
        schema = _schema(n)
        for p, rows in parts.items():
            columns = [pa.array([r[1][i] for r in rows], pa.string()) for i in range(n)]
            columns.append(pa.array([r[0] for r in rows], pa.string()))
            columns.append(pa.array([sorted(r[2]) for r in rows], pa.list_(pa.int32())))
            pq.write_table(pa.Table.from_arrays(columns, schema=schema),
                           self.dir / f"p{p:03d}-g{self.generations:06d}.parquet", compression="zstd")
        self.generations += 1
        effect.rows.clear()

    def discard(self) -> None:
        """A TRUNCATE: nothing staged before it counts."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self.generations = 0
        self.kept.clear()

    def partitions(self, effect: NetEffect) -> Iterator[NetEffect]:
        """The whole net effect (staged generations, then the rows still in `effect`), one partition at a time."""
        table = effect.table
        n = len(table.columns)
        memory: dict[int, dict] = {}
        for key, row in effect.rows.items():
            memory.setdefault(_partition(key), {})[key] = row
        for p in range(PARTITIONS):
            part = NetEffect(table)
            for g in range(self.generations):
                path = self.dir / f"p{p:03d}-g{g:06d}.parquet"
                if path.exists():
                    _fold_file(part, table, path, n, self.pads, self.pad_keep)
            for key, row in memory.get(p, {}).items():
                _fold(part.rows, key, row)
            if part.rows:
                yield part


def _fold_file(part: NetEffect, table: Table, path: Path, n: int, pads: dict[int, str | None] | None = None,
               pad_keep: set[int] | None = None) -> None:
    data = pq.read_table(path)
    staged_n = data.num_columns - 2
    pads = pads or {}
    columns = [data.column(f"c{i}").to_pylist() for i in range(staged_n)]
    columns += [[pads.get(i)] * data.num_rows for i in range(staged_n, n)]  # columns added since
    added_keep = frozenset(i for i in (pad_keep or ()) if i >= staged_n)
    ops, keeps = data.column(OP).to_pylist(), data.column(KEEP).to_pylist()
    for j in range(data.num_rows):
        values = tuple(c[j] for c in columns)
        key = tuple(values[i] for i in table.key_indices)
        op = ops[j]
        keep = frozenset(keeps[j]) | added_keep if op == "U" else frozenset(keeps[j])
        _fold(part.rows, key, (op, values if op == "U" else None, keep))


def _fold(rows: dict, key: tuple, row: tuple) -> None:
    """A later state of `key` over what `rows` has: columns it keeps come from the earlier state if it has
    them (else they stay kept: the table's own value)."""
    op, values, keep = row
    prev = rows.get(key)
    if op == "U" and keep and prev is not None and prev[0] == "U":
        values = list(values)
        for i in keep:
            values[i] = prev[1][i]
        keep = frozenset(i for i in keep if i in prev[2])
        values = tuple(values)
    rows[key] = (op, values, keep)

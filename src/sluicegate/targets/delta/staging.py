"""A batch's net effect on one table, spilled to files once it grows (guarantee 5: bounded memory).

A big source transaction cannot be cut (its commits to Delta are one per table), so the player folds its changes
into a `NetEffect` and, each time the batch holds `stage_rows` changes (or `stage_bytes` of their messages) in
memory, writes each table's net effect so far as one *generation* of files under
PATH/_sluicegate/staging/<W>/<table>/, split into partitions by a hash of the key, then forgets it. Every change
of a key lands in the same partition, in generation order.
At commit, the partitions are folded one at a time (a later generation's state of a key wins; a column the
later one kept from "before" takes the earlier generation's value) and streamed to delta-rs as the MERGE's
source: one commit per table, the staged side held one partition at a time (delta-rs's MERGE itself holds more
of a larger source: bench/README.md, "staging by bytes"). Staged files are
the batch's alone: a new batch (or a restart after kill -9) removes what a previous one left. They are Arrow
IPC files compressed with LZ4: written once and read once by the same task, they need Arrow's own layout, not
Parquet's encodings (bench/README.md, "staging as Arrow IPC").

A lake on an object store (a URI root) stages in the task's local temporary directory instead: the task that
writes a batch's staged files is the one that reads them back, within that batch, so they need no store.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
from pyarrow import feather

from . import netframe
from .apply import NetEffect

PARTITIONS = 32


def staging_dir(root: Path | str, workflow: str) -> Path:
    if "://" in str(root):
        digest = hashlib.sha1(str(root).encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"sluicegate-staging-{digest}" / workflow
    return Path(root) / "_sluicegate" / "staging" / workflow


def clear(root: Path, workflow: str) -> None:
    shutil.rmtree(staging_dir(root, workflow), ignore_errors=True)


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
        # The least and greatest key staged (a key of one integer column: netframe.key_bounds), while known.
        self.bounds: tuple[int, int] | None = None
        self.bounded = True

    def write(self, effect: NetEffect) -> None:
        """Stage the effect's rows as the next generation, then empty it."""
        frame = effect.frame()
        if frame.num_rows == 0:
            return
        self.kept.update(netframe.kept(frame))
        bounds = netframe.key_bounds(effect.table, frame)
        self.bounded = self.bounded and bounds is not None
        self.bounds = bounds if self.bounds is None else netframe.widest(self.bounds, bounds)
        self.dir.mkdir(parents=True, exist_ok=True)
        for p, part in netframe.split(effect.table, frame, PARTITIONS).items():
            feather.write_feather(part, self._file(p, self.generations), compression="lz4")
        self.generations += 1
        effect.clear()

    def _file(self, partition: int, generation: int) -> Path:
        return self.dir / f"p{partition:03d}-g{generation:06d}.arrow"

    def discard(self) -> None:
        """A TRUNCATE: nothing staged before it counts."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self.generations = 0
        self.kept.clear()
        self.bounds, self.bounded = None, True

    def partitions(self, effect: NetEffect) -> Iterator[NetEffect]:
        """The whole net effect (staged generations, then the rows still in `effect`), one partition at a time."""
        table = effect.table
        n = len(table.columns)
        memory = netframe.split(table, effect.frame(), PARTITIONS)
        for p in range(PARTITIONS):
            pieces = []
            for g in range(self.generations):
                path = self._file(p, g)
                if path.exists():
                    pieces.append(_widened(feather.read_table(path, memory_map=False), n, self.pads, self.pad_keep))
            if p in memory:
                pieces.append(memory[p])
            if not pieces:
                continue
            if any(netframe.has_keep(piece) for piece in pieces):  # a later state may take from an earlier one
                part = NetEffect(table)
                rows = part.rows
                for piece in pieces:
                    for key, row in netframe.to_rows(table, piece):
                        _fold(rows, key, row)
            else:  # each later state of a key replaces the earlier whole
                part = NetEffect.from_frame(table, netframe.last_per_key(table, pa.concat_tables(pieces)))
            if part.nonempty:
                yield part


def _widened(data: pa.Table, n: int, pads: dict[int, str | None], pad_keep: set[int]) -> pa.Table:
    """A staged generation in the table's `n` columns: columns added since it was staged hold their pad, and
    an upsert keeps those of `pad_keep` (the Delta table's own)."""
    staged_n = data.num_columns - 2
    if staged_n == n:
        return data
    rows = data.num_rows
    columns = [data.column(f"c{i}") for i in range(staged_n)]
    columns += [pa.array([pads.get(i)] * rows, pa.string()) for i in range(staged_n, n)]
    keep = data.column(netframe.KEEP)
    added_keep = sorted(i for i in pad_keep if i >= staged_n)
    if added_keep:
        ops, keeps = data.column(netframe.OP).to_pylist(), keep.to_pylist()
        keep = pa.array([sorted(set(k or ()) | set(added_keep)) if op == "U" else k for op, k in zip(ops, keeps)],
                        netframe.KEEP_TYPE)
    return pa.Table.from_arrays([*columns, data.column(netframe.OP), keep], schema=netframe.schema(n))


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

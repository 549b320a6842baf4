"""A table's net effect as an Arrow table (a *frame*), computed with Arrow compute rather than row by row.

A frame has the table's columns as PostgreSQL text (`c0`…), `_op` ('U' upsert, 'D' delete: the key alone) and
`_keep` (the columns whose value is the Delta table's own: unchanged TOAST), one row per key. It is what
apply.NetEffect merges, what staging.py writes to files and reads back.

`log_frame` folds a log of changes in source order into a frame: the last change of each key wins, and an
update that changed the key deletes the old key first. That is NetEffect's per-row rule whenever no value is
an unchanged TOAST one (a row then takes nothing from earlier changes of its key); a log with one returns
None and NetEffect folds it row by row, as before.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...postgres.catalog import Table
from .types import arrow_type

OP, KEEP, ORDER = "_op", "_keep", "_order"
KEEP_TYPE = pa.list_(pa.int32())


def schema(n: int) -> pa.Schema:
    return pa.schema([*(pa.field(f"c{i}", pa.string()) for i in range(n)),
                      pa.field(OP, pa.string()), pa.field(KEEP, KEEP_TYPE)])


def from_rows(table: Table, rows: dict) -> pa.Table:
    """NetEffect.rows (key -> (op, values, keep)) as a frame; a delete's values are its key alone."""
    n = len(table.columns)
    if not rows:
        return schema(n).empty_table()
    key_indices = table.key_indices
    columns: list[list] = [[] for _ in range(n)]
    ops, keeps = [], []
    for key, (op, values, keep) in rows.items():
        if values is None:
            values = [None] * n
            for i, k in zip(key_indices, key):
                values[i] = k
        for i in range(n):
            columns[i].append(values[i])
        ops.append(op)
        keeps.append(sorted(keep))
    arrays = [pa.array(c, pa.string()) for c in columns]
    return pa.Table.from_arrays([*arrays, pa.array(ops, pa.string()), pa.array(keeps, KEEP_TYPE)], schema=schema(n))


def to_rows(table: Table, frame: pa.Table) -> Iterator[tuple[tuple, tuple]]:
    """A frame's rows as NetEffect.rows items, in the frame's order."""
    n = frame.num_columns - 2
    columns = [frame.column(f"c{i}").to_pylist() for i in range(n)]
    ops, keeps = frame.column(OP).to_pylist(), frame.column(KEEP).to_pylist()
    key_indices = table.key_indices
    for j in range(frame.num_rows):
        values = tuple(c[j] for c in columns)
        op = ops[j]
        yield tuple(values[i] for i in key_indices), (op, values if op == "U" else None, frozenset(keeps[j] or ()))


def has_keep(frame: pa.Table) -> bool:
    """Some row of the frame keeps a column of the Delta table's."""
    return frame.num_rows > 0 and (pc.max(pc.list_value_length(frame.column(KEEP))).as_py() or 0) > 0


def kept(frame: pa.Table) -> set[int]:
    """The columns some row of the frame keeps."""
    if not has_keep(frame):
        return set()
    return set(pc.unique(pc.list_flatten(frame.column(KEEP))).to_pylist())


def _distinct(a: pa.Array, b: pa.Array) -> pa.Array:
    """a[i] IS DISTINCT FROM b[i] (NULLs equal each other), never NULL."""
    ne = pc.fill_null(pc.not_equal(a, b), False)
    return pc.or_(ne, pc.not_equal(pc.is_null(a), pc.is_null(b)))


def _text_columns(rows: list[tuple], n: int) -> list[pa.Array] | None:
    """Rows of n text values (or None) as n string arrays; None when a row has another width or a value is
    not text. (Transposed by numpy: zip(*rows) makes tuples the size of the log, and the collector then walks
    the task's whole heap.)"""
    try:
        grid = np.array(rows, dtype=object)
        if grid.ndim != 2 or grid.shape[1] != n:
            return None
        return [pa.array(grid[:, i], pa.string()) for i in range(n)]
    except (pa.ArrowException, TypeError, ValueError):
        return None


def log_frame(table: Table, ops: list[str], values: list[tuple], old_at: list[int], olds: list[tuple]) -> pa.Table | None:
    """The net effect of a log of changes in source order: `ops[j]` 'I', 'U' or 'D'; `values[j]` the new row
    (the old one for a delete), in the table's column order; `olds` the old rows updates carried, at
    `old_at`. None when a value is not text (an unchanged TOAST one): NetEffect then folds the log per row."""
    n = len(table.columns)
    count = len(values)
    if count == 0:
        return schema(n).empty_table()
    arrays = _text_columns(values, n)
    if arrays is None:
        return None
    op = pa.array(ops, pa.string())
    deleted = pc.equal(op, "D")
    key_indices = table.key_indices
    nulls = pa.nulls(count, pa.string())
    # a delete's row is its key alone (the old row may carry every column: REPLICA IDENTITY FULL)
    arrays = [a if i in key_indices else pc.if_else(deleted, nulls, a) for i, a in enumerate(arrays)]
    out_op = pc.if_else(deleted, pa.scalar("D"), pa.scalar("U"))
    order = pa.array(np.arange(1, 2 * count, 2, dtype=np.int64))
    parts = [(arrays, out_op, order)]
    if olds:
        old_columns = _text_columns(olds, n)
        if old_columns is None:
            return None
        old_keys = {i: old_columns[i] for i in key_indices}
        at = pa.array(old_at, pa.int64())
        moved = None
        for i in key_indices:
            d = _distinct(old_keys[i], arrays[i].take(at))
            moved = d if moved is None else pc.or_(moved, d)
        if pc.any(moved).as_py():  # an update changed the key: the old key's row goes away, just before
            m = pc.sum(moved).as_py()
            extra = [old_keys[i].filter(moved) if i in key_indices else pa.nulls(m, pa.string()) for i in range(n)]
            extra_order = pc.multiply(at.filter(moved), 2)
            parts.append((extra, pa.array(["D"] * m, pa.string()), extra_order))
    if len(parts) > 1:
        arrays = [pa.concat_arrays([p[0][i] for p in parts]) for i in range(n)]
        out_op = pa.concat_arrays([p[1] for p in parts])
        order = pa.concat_arrays([p[2] for p in parts])
    keep = pa.ListArray.from_arrays(pa.array(np.zeros(len(out_op) + 1, dtype=np.int32)), pa.array([], pa.int32()),
                                    type=KEEP_TYPE)  # no row keeps a column
    frame = pa.Table.from_arrays([*arrays, out_op, keep], schema=schema(n))
    return last_per_key(table, frame, order)


def last_per_key(table: Table, frame: pa.Table, order: pa.Array | None = None) -> pa.Table:
    """The frame's last row of each key (by `order`, unique; else the frame's own order)."""
    if frame.num_rows == 0:
        return frame
    if order is None:
        order = pa.array(np.arange(frame.num_rows, dtype=np.int64))
    keys = [f"c{i}" for i in table.key_indices]
    probe = pa.table({**{k: frame.column(k) for k in keys}, ORDER: order})
    last = probe.group_by(keys, use_threads=False).aggregate([(ORDER, "max")]).column(f"{ORDER}_max")
    if len(last) == frame.num_rows:
        return frame
    return frame.filter(pc.is_in(order, value_set=last.combine_chunks()))


def key_bounds(table: Table, frame: pa.Table) -> tuple[int, int] | None:
    """The least and greatest key of a non-empty frame whose key is one integer column; else None."""
    if frame.num_rows == 0 or len(table.key_indices) != 1:
        return None
    i = table.key_indices[0]
    if not pa.types.is_integer(arrow_type(table.columns[i], table.type_tree)):
        return None
    try:
        bounds = pc.min_max(pc.cast(frame.column(f"c{i}"), pa.int64()))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    low, high = bounds["min"].as_py(), bounds["max"].as_py()
    return None if low is None else (low, high)


def widest(a: tuple[int, int] | None, b: tuple[int, int] | None) -> tuple[int, int] | None:
    """Bounds covering both (None, unknown, if either is)."""
    if a is None or b is None:
        return None
    return min(a[0], b[0]), max(a[1], b[1])


_WEIGHTS = np.random.default_rng(20261127).integers(1, 2**63, size=64, dtype=np.uint64) | np.uint64(1)


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every input bit moves the low bits too."""
    h = h ^ (h >> np.uint64(30))
    h = h * np.uint64(0xBF58476D1CE4E5B9)
    h = h ^ (h >> np.uint64(27))
    h = h * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def _text_hash(array: pa.Array) -> np.ndarray:
    """A 64-bit hash of each value of a string array (NULL its own value), computed over its buffers."""
    array = array.cast(pa.large_string())
    count = len(array)
    _, offsets, data = array.buffers()
    offsets = np.frombuffer(offsets, dtype=np.int64)[array.offset:array.offset + count + 1]
    lengths = np.diff(offsets)
    total = int(offsets[-1] - offsets[0])
    h = lengths.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    if total:
        raw = np.frombuffer(data, dtype=np.uint8)[offsets[0]:offsets[-1]].astype(np.uint64) + np.uint64(1)
        starts = (offsets[:-1] - offsets[0])
        position = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
        contrib = raw * _WEIGHTS[position % 64]
        nonempty = lengths > 0
        sums = np.add.reduceat(contrib, starts[nonempty])
        h[nonempty] += sums
    if array.null_count:
        h[np.asarray(array.is_null(), dtype=bool)] = np.uint64(0x5A5A5A5A5A5A5A5A)
    return h


def partition_ids(table: Table, frame: pa.Table, partitions: int) -> np.ndarray:
    """Each row's partition (0 to partitions-1) by a hash of its key: a key's rows always share one."""
    h = np.zeros(frame.num_rows, dtype=np.uint64)
    for i in table.key_indices:
        h = _mix(h * np.uint64(0x100000001B3) + _text_hash(frame.column(f"c{i}").combine_chunks()))
    return (h % np.uint64(partitions)).astype(np.int64)


def split(table: Table, frame: pa.Table, partitions: int) -> dict[int, pa.Table]:
    """The frame's rows by partition (each in the frame's order), non-empty ones only."""
    if frame.num_rows == 0:
        return {}
    ids = partition_ids(table, frame, partitions)
    index = np.argsort(ids, kind="stable")
    counts = np.bincount(ids, minlength=partitions)
    ordered = frame.take(pa.array(index))
    out, start = {}, 0
    for p in range(partitions):
        c = int(counts[p])
        if c:
            out[p] = ordered.slice(start, c)
        start += c
    return out

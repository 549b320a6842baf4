"""The net effect folded with Arrow (lake/netframe.py, NetEffect.frame) is the per-row fold's (NetEffect.rows),
on generated change sequences: inserts, updates (some moving the key, some with the old row as REPLICA
IDENTITY FULL sends it, some with unchanged TOAST values), deletes, deletes of keys not present; in memory and
staged to files (staging.Spill); and its merge source is what the per-value conversion gives."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from sluicegate.postgres.catalog import Column, Table
from sluicegate.postgres.pgoutput import UNCHANGED
from sluicegate.targets.delta import netframe
from sluicegate.targets.delta.apply import NetEffect
from sluicegate.targets.delta.staging import Spill
from sluicegate.targets.delta.types import arrow_schema, convert_columns, convert_text_arrays


def table(two_keys=False):
    columns = (Column("id", "bigint", 20, True, None, -1), Column("region", "text", 25, True, None, -1),
               Column("qty", "integer", 23, False, None, -1), Column("note", "text", 25, False, None, -1),
               Column("ok", "boolean", 16, False, None, -1))
    return Table("public", "items", columns, ("id", "region") if two_keys else ("id",))


def changes(seed, n=2000, toast=False, full=False, keys=150, two_keys=False):
    """A change sequence (as (kind, old, new)) a source could send over `keys` keys (by id and region, or by id
    alone): half of them exist before it (in the Delta table only), and some deletes name keys that exist
    nowhere."""
    rnd = random.Random(seed)
    out = []

    def key(k):
        return (k, rnd.choice(["eu", "us"]) if two_keys else ("eu" if k % 2 else "us"))

    live: dict[tuple, tuple] = {}
    for k in range(1, keys + 1, 2):
        kk = key(k)
        live[kk] = (str(k), kk[1], "0", f"before{k}", "t")

    def row(k, i):
        return (str(k[0]), k[1], str(i) if rnd.random() < 0.9 else None,
                rnd.choice([f"n{i}", "", None, "a,b\"c"]), rnd.choice(["t", "f", None]))

    for i in range(n):
        k = key(rnd.randint(1, keys))
        r = rnd.random()
        if r < 0.15:
            old = live.pop(k, None) or (str(k[0]), k[1], None, None, None)
            out.append(("D", old if full else (old[0], old[1], None, None, None), None))
        elif r < 0.25 and k in live:  # the key moves
            to = key(rnd.randint(1, keys))
            if to in live:  # (a key is unique)
                continue
            new = row(to, i)
            if toast and live[k][3] is not None and rnd.random() < 0.3:  # (a NULL is never unchanged TOAST)
                new = new[:3] + (UNCHANGED,) + new[4:]
                old = live[k]  # the old row carries the value (REPLICA IDENTITY FULL)
            else:
                old = live[k] if full else (live[k][0], live[k][1], None, None, None)
            out.append(("U", old, new))
            del live[k]
            live[to] = tuple(o if v is UNCHANGED else v for v, o in zip(new, old))
        elif r < 0.6 and k in live:
            new = row(k, i)
            if toast and live[k][3] is not None and rnd.random() < 0.4:
                new = new[:3] + (UNCHANGED,) + new[4:]
            out.append(("U", live[k] if full else None, new))
            live[k] = tuple(o if v is UNCHANGED else v for v, o in zip(new, live[k]))
        else:
            new = row(k, i)
            out.append(("I", None, new))
            live[k] = new
    return out


def per_row(t, seq):
    """The reference: every change folded row by row (NetEffect.rows)."""
    e = NetEffect(t)
    for kind, old, new in seq:
        e.add(kind, old, new)
        e.rows  # noqa: B018 (folds each change at once, as the player did)
    return e.rows


def vectorized(t, seq, flush_every=None):
    e = NetEffect(t)
    for j, (kind, old, new) in enumerate(seq):
        e.add(kind, old, new)
        if flush_every and j % flush_every == flush_every - 1:
            e.frame()  # a frame so far, then more changes logged after it
    return dict(netframe.to_rows(t, e.frame()))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("two_keys", [False, True])
@pytest.mark.parametrize("full", [False, True])
def test_frame_is_the_per_row_net_effect(seed, two_keys, full):
    t = table(two_keys)
    seq = changes(seed, full=full, two_keys=two_keys)
    expected = per_row(t, seq)
    assert vectorized(t, seq) == expected
    assert vectorized(t, seq, flush_every=97) == expected
    assert any(v[0] == "D" for v in expected.values()) and any(v[0] == "U" for v in expected.values())


@pytest.mark.parametrize("seed", range(4))
def test_unchanged_toast_values_fold_as_per_row(seed):
    t = table()
    seq = changes(seed, toast=True, full=seed % 2 == 1, keys=1000)
    expected = per_row(t, seq)
    assert vectorized(t, seq) == expected
    assert vectorized(t, seq, flush_every=50) == expected
    # some row keeps the table's value, unless every update carried its old row (REPLICA IDENTITY FULL)
    assert any(keep for _, _, keep in expected.values()) == (seed % 2 == 0)


@pytest.mark.parametrize("seed", range(4))
def test_staged_generations_fold_as_per_row(tmp_path, seed):
    """Every 300 changes the effect so far is staged (a generation); the partitions read back hold, together,
    the per-row net effect of the whole sequence, each key once."""
    t = table(two_keys=seed % 2 == 1)
    seq = changes(seed, n=2500, toast=seed >= 2, two_keys=seed % 2 == 1, keys=600)
    expected = per_row(t, seq)
    e, spill = NetEffect(t), Spill(tmp_path / "s")
    for j, (kind, old, new) in enumerate(seq):
        e.add(kind, old, new)
        if j % 300 == 299:
            spill.write(e)
            assert not e.nonempty
    assert spill.generations == len(seq) // 300
    got: dict = {}
    for part in spill.partitions(e):
        for key, row in part.rows.items():
            assert key not in got
            got[key] = row
    assert got == expected


def test_merge_source_converts_as_per_value():
    t = table(two_keys=True)
    seq = changes(7, two_keys=True)
    e = NetEffect(t)
    for kind, old, new in seq:
        e.add(kind, old, new)
    frame = e.frame()
    src = e.merge_source()
    columns = [frame.column(f"c{i}").to_pylist() for i in range(len(t.columns))]
    expected = pa.Table.from_arrays(convert_columns(t, columns), schema=arrow_schema(t))
    assert src.select(expected.column_names).to_pylist() == expected.to_pylist()
    assert src.column("_op").to_pylist() == frame.column("_op").to_pylist()


def test_text_arrays_fall_back_per_value_for_what_arrow_does_not_parse():
    """A numeric column goes value by value: NaN in numeric(8,2) is NULL there and kept in _sg_special."""
    cols = (Column("id", "integer", 23, True, None, -1), Column("price", "numeric(8,2)", 1700, False, None,
                                                                ((8 << 16) | 2) + 4))
    t = Table("public", "p", cols, ("id",), type_tree={"oids": {}, "dims": {}, "columns": ["id", "price"]})
    texts = [["1", "2", "-3"], ["1.50", "NaN", None]]
    got = convert_text_arrays(t, [pa.array(c, pa.string()) for c in texts])
    assert [a.to_pylist() for a in got] == [a.to_pylist() for a in convert_columns(t, texts)]
    assert got[2].to_pylist()[1] == [("price", "NaN")]


def test_partitions_keep_a_key_together():
    t = table(two_keys=True)
    rows = [(str(i % 50), "eu" if i % 3 else "us", str(i), None, None) for i in range(1000)]
    frame = pa.Table.from_arrays([*(pa.array([r[i] for r in rows], pa.string()) for i in range(5)),
                                  pa.array(["U"] * 1000), pa.array([[]] * 1000, netframe.KEEP_TYPE)],
                                 schema=netframe.schema(5))
    parts = netframe.split(t, frame, 32)
    assert sum(p.num_rows for p in parts.values()) == 1000 and len(parts) > 16
    where = {}
    for p, part in parts.items():
        for a, b in zip(part.column("c0").to_pylist(), part.column("c1").to_pylist()):
            assert where.setdefault((a, b), p) == p


def test_key_bounds_of_one_integer_key_only():
    frame = netframe.from_rows(table(), {("7",): ("U", ("7", "eu", "1", None, "t"), frozenset()),
                                         ("-3",): ("D", None, frozenset())})
    assert netframe.key_bounds(table(), frame) == (-3, 7)  # as integers, not as text
    assert netframe.key_bounds(table(two_keys=True), netframe.from_rows(table(two_keys=True), {})) is None
    two = netframe.from_rows(table(two_keys=True), {("7", "eu"): ("D", None, frozenset())})
    assert netframe.key_bounds(table(two_keys=True), two) is None
    assert netframe.widest((1, 5), (-2, 3)) == (-2, 5) and netframe.widest((1, 5), None) is None

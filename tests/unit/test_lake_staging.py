"""A batch's net effect staged to files (lake/staging.py) merges to the same rows as the same effect held in
memory, in one Delta commit."""

from __future__ import annotations

import random

import pyarrow.dataset as ds

from sluicegate.postgres.catalog import Column, Table
from sluicegate.postgres.pgoutput import UNCHANGED
from sluicegate.targets.delta.apply import NetEffect, merge, merge_staged
from sluicegate.targets.delta.staging import Spill
from sluicegate.targets.delta.types import arrow_schema


def table():
    return Table("public", "items", (Column("id", "bigint", 20, True, None, -1),
                                     Column("qty", "integer", 23, False, None, -1),
                                     Column("note", "text", 25, False, None, -1)), ("id",))


def rows(path):
    from deltalake import DeltaTable

    files = DeltaTable(path).file_uris()
    return sorted(ds.dataset(files).to_table().to_pylist(), key=lambda r: r["id"]) if files else []


def changes(seed, n=3000):
    """Inserts, updates (some leaving the text column out, as unchanged TOAST; keys 1-10 always), deletes over
    300 keys."""
    rnd = random.Random(seed)
    live = set(range(1, 101))
    out = []
    for i in range(n):
        k = rnd.randint(1, 300)
        if k in live and k > 10 and rnd.random() < 0.2:
            out.append(("D", (str(k), None, None)))
            live.discard(k)
        elif k in live:
            note = UNCHANGED if k <= 10 or rnd.random() < 0.5 else f"n{i}"
            out.append(("U", (str(k), str(i), note)))
        else:
            out.append(("I", (str(k), str(i), f"i{i}")))
            live.add(k)
    return out


def fold(effect, change):
    op, values = change
    if op == "I":
        effect.add("I", None, values)
    elif op == "U":
        effect.add("U", None, values)
    else:
        effect.add("D", values, None)


def test_staged_effect_merges_like_the_effect_in_memory(tmp_path):
    from deltalake import DeltaTable

    t = table()
    base = NetEffect(t)
    for k in range(1, 101):
        base.add("I", None, (str(k), "0", f"base{k}"))
    for seed in range(3):
        plain, staged = str(tmp_path / f"plain{seed}"), str(tmp_path / f"staged{seed}")
        for path in (plain, staged):
            merge(DeltaTable.create(path, arrow_schema(t)), t, base, "sluicegate:w", 1)
        memory, effect = NetEffect(t), NetEffect(t)
        spill = Spill(tmp_path / f"staging{seed}")
        for i, change in enumerate(changes(seed)):
            fold(memory, change)
            fold(effect, change)
            if i % 400 == 399:
                spill.write(effect)  # a generation: the effect forgets its rows
                assert not effect.rows
        assert spill.generations == 7 and effect.rows  # the tail stays in memory
        merge(DeltaTable(plain), t, memory, "sluicegate:w", 2)
        merge_staged(DeltaTable(staged), t, effect, spill, "sluicegate:w", 2)
        dt = DeltaTable(staged)
        assert dt.version() == 2 and dt.transaction_version("sluicegate:w") == 2  # one commit
        assert rows(staged) == rows(plain) and len(rows(plain)) > 100
        # A value kept from before the batch (unchanged TOAST on a row the batch never wrote whole).
        assert any(r["note"].startswith("base") and r["qty"] != 0 for r in rows(staged))


def test_discard_forgets_what_was_staged(tmp_path):
    t = table()
    effect = NetEffect(t)
    effect.add("I", None, ("1", "1", "a"))
    spill = Spill(tmp_path / "s")
    spill.write(effect)
    spill.discard()
    effect.add("I", None, ("2", "2", "b"))
    assert [dict(p.rows) for p in spill.partitions(effect)] == [{("2",): ("U", ("2", "2", "b"), frozenset())}]

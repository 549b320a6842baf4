"""The Delta player's fast lane (targets/delta/player._RowLane): a batch read with it folds the same net
effect, stages the same rows and counts the same changes as the event path alone."""

from __future__ import annotations

import struct

import pytest

from sluicegate.errors import TerminalError
from sluicegate.postgres.assembler import Framing
from sluicegate.postgres.catalog import Table
from sluicegate.targets.delta import player

from .test_applier_net_effect import OTHER, T1, T2, U, _relation, _row, _transaction, table


def _truncate(*oids: int) -> bytes:
    return b"T" + struct.pack(">IB", len(oids), 0) + struct.pack(f">{len(oids)}I", *oids)


def _reordered(oid: int, name: str) -> bytes:
    """t's Relation with its columns in another order (c, a, b): a change a Delta target does not follow."""
    out = b"R" + struct.pack(">I", oid) + b"public\0" + name.encode() + b"\0d" + struct.pack(">H", 3)
    for n in ("c", "a", "b"):
        out += bytes([n == "a"]) + n.encode() + b"\0" + struct.pack(">Ii", 23 if n == "a" else 25, -1)
    return out


def _messages(more: list[bytes] = ()) -> list[bytes]:
    """Three transactions: the first below t's threshold (u only), a Relation sent again, a truncation,
    unchanged TOAST values, a key change, a table not replicated."""
    msgs = [_relation(T1, "t", ["a"]), _relation(T2, "u", ["a", "b"]), _relation(OTHER, "other", ["a"])]
    msgs += _transaction(700, 1000, [_row("I", T1, None, (str(i), "x", "below t's threshold")) for i in range(5)]
                         + [_row("I", T2, None, (str(i), "x", "u")) for i in range(6)])
    msgs += _transaction(701, 2000, [
        *(_row("I", T1, None, (str(i), "y", f"t{i}")) for i in range(30)),
        _row("I", OTHER, None, ("1", "x", "not replicated")),
        _row("U", T1, None, ("3", "y", U)),  # unchanged TOAST: taken from the insert before it
        _row("U", T1, ("9", None, None), ("40", "y", "moved")),  # a key change
        *(_row("U", T2, None, (str(i), "x", "u again")) for i in range(6)),
        _row("D", T1, ("5", None, None), None),
    ])
    msgs += [_relation(T1, "t", ["a"])]  # sent again
    msgs += _transaction(702, 3000, [
        *(_row("U", T1, None, (str(i), "z", "after")) for i in range(0, 30, 2)),
        _truncate(T2),
        *(_row("I", T2, None, (str(i), "x", "after the truncation")) for i in range(3)),
        _row("D", T1, ("7", "z", "full"), None),
    ])
    return msgs + list(more)


class _Stream:
    """What _read_batch asks of a ChangeStream, over recorded messages."""

    ended_by = "reached"

    def __init__(self, msgs: list[bytes]):
        self.msgs, self.sent_upto = msgs, 10_000

    def messages(self, *args, until=None):
        yield from enumerate(self.msgs, 1)


class _Tables:
    """What _read_batch asks of the workflow's Delta tables: t has transaction 700 already."""

    def __init__(self, root: str):
        u = Table.from_json({"schema": "public", "name": "u", "key": ["a", "b"], "columns": [
            ["a", "integer", 23, True, None], ["b", "text", 25, True, None], ["c", "text", 25, False, None]]})
        self.root, self.workflow, self.src = root, "w", None
        self.specs = {"public.t": table(["a"]), "public.u": u}
        self.threshold = {"public.t": 1500, "public.u": 0}
        self.markers, self.fills = {}, {}


def _read(tmp_path, fast: bool, stage_rows: int = 1_000, stage_bytes: int = 1 << 20, more: list[bytes] = ()):
    root = tmp_path / ("fast" if fast else "events")
    task = player.LakePlayTask(f"delta:{root}", "w", 0, stage_rows=stage_rows, stage_bytes=stage_bytes)
    batch = player._read_batch(task, _Stream(_messages(more)), Framing(), _Tables(str(root)), 0, 10_000, fast=fast)
    state = {}
    for q, effect in batch.effects.items():
        spill = batch.spills.get(q)
        parts = spill.partitions(effect) if spill is not None and spill.generations else [effect]
        rows = {k: v for part in parts for k, v in part.rows.items()}
        state[q] = (rows, effect.changes, effect.truncated, spill.generations if spill else 0)
    return batch, state


@pytest.mark.parametrize(("stage_rows", "stage_bytes"), [(1_000, 1 << 20), (7, 1 << 20), (1_000, 400)])
def test_the_lane_folds_stages_and_counts_as_the_event_path(tmp_path, monkeypatch, stage_rows, stage_bytes):
    """In memory; staged every 7 changes; staged every 400 bytes of messages (~15 changes)."""
    taken = []
    take = player._RowLane.take
    monkeypatch.setattr(player._RowLane, "take", lambda lane, data: taken.append(take(lane, data)) or taken[-1])
    fast, fast_state = _read(tmp_path, True, stage_rows, stage_bytes)
    slow, slow_state = _read(tmp_path, False, stage_rows, stage_bytes)
    assert fast_state == slow_state
    assert (fast.rows, fast.position, fast.limited) == (slow.rows, slow.position, slow.limited)
    assert fast.rows == 6 + (30 + 2 + 6 + 1) + (15 + 3 + 1)  # t's five of transaction 700 are skipped
    # The lane took most rows: all but each table's first in the batch and those after the Relation was sent
    # again or the truncation (the TOAST and key-change updates it takes: NetEffect.add sorts them out).
    assert sum(taken) >= 50 and taken.count(False) >= 4, (sum(taken), taken.count(False))
    t_rows, _, _, generations = fast_state["public.t"]
    assert (generations > 0) == (stage_rows == 7 or stage_bytes == 400)
    assert t_rows[("3",)] == ("U", ("3", "y", "t3"), frozenset())  # the TOAST value from the insert
    assert t_rows[("9",)][0] == t_rows[("5",)][0] == "D" and t_rows[("40",)][1] == ("40", "y", "moved")
    assert ("0",) in t_rows and t_rows[("0",)][1] == ("0", "z", "after")
    u_rows, _, truncated, _ = fast_state["public.u"]
    assert truncated and sorted(u_rows) == [("0", "x"), ("1", "x"), ("2", "x")]


def test_a_relation_sent_again_changed_reaches_the_event_path(tmp_path):
    """A table in the lane whose Relation comes again with its columns in another order: its next row goes
    the event path, which stops the stream (a Delta target follows added columns only), lane or not."""
    more = [_reordered(T1, "t"), *_transaction(703, 4000, [_row("U", T1, None, ("c", "50", "w"))])]
    for fast in (True, False):
        with pytest.raises(TerminalError, match="column a was dropped and added again"):
            _read(tmp_path, fast, more=more)


def test_the_lane_takes_rows_only_after_the_event_path_met_their_table(tmp_path):
    root = tmp_path / "lane"
    task = player.LakePlayTask(f"delta:{root}", "w", 0)
    framing = Framing()
    batch = player._Batch(0, {}, reshaped={}, spills={})
    lane = player._RowLane(task, _Tables(str(root)), batch, framing)
    insert = _row("I", T1, None, ("1", "x", "one"))
    assert lane.take(insert) is False  # no change of t met yet
    lane.ready[T1] = (object(), None)
    assert lane.take(insert) is False  # a Relation other than the one it was met under
    assert lane.take(b"I\0\0") is False  # too short to name a relation: the event path's decoder says so

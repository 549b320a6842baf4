"""A Delta copy file's add-action statistics (lake/copy.py): its integer key columns' bounds, by which a MERGE
skips files it does not touch. Pure, no server."""

from __future__ import annotations

import json

import pyarrow as pa

from sluicegate.targets.delta.copy import KeyBounds, _stats


def _batch(ids, names):
    return pa.record_batch([pa.array(ids, pa.int64()), pa.array(names, pa.string())], names=["id", "name"])


def test_bounds_span_every_batch_of_a_file_then_start_again():
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("name", pa.string())])
    bounds = KeyBounds(schema, ["id", "name"])
    assert bounds.columns == ["id"]  # text orders by collation in PostgreSQL: no bounds for it
    bounds.add(_batch([5, 3, 9], ["a", "b", "c"]))
    bounds.add(_batch([12, 4], ["d", "e"]))
    assert bounds.take() == {"min": {"id": 3}, "max": {"id": 12}}
    bounds.add(_batch([20], ["f"]))
    assert bounds.take() == {"min": {"id": 20}, "max": {"id": 20}}
    assert bounds.take() == {}


def test_stats_of_a_file_with_and_without_bounds():
    with_bounds = _stats({"rows": 3, "min": {"id": 1}, "max": {"id": 7}})
    assert with_bounds == {"numRecords": 3, "minValues": {"id": 1}, "maxValues": {"id": 7}, "nullCount": {"id": 0}}
    assert json.loads(json.dumps(with_bounds)) == with_bounds
    assert _stats({"rows": 0}) == {"numRecords": 0}

"""A Delta workflow's reading of captured ALTER TABLE statements (lake/ddl.py): pure, no server."""

from __future__ import annotations

import pyarrow as pa
import pytest

from sluicegate.targets.delta.ddl import actions, widens


def kinds(text: str) -> list[tuple]:
    return [(a.kind, a.column, a.new) for a in actions(text)]


@pytest.mark.parametrize("text, want", [
    ("ALTER TABLE items RENAME COLUMN name TO title", [("rename", "name", "title")]),
    ('ALTER TABLE ONLY public."Items" RENAME "Old Name" TO new_name', [("rename", "Old Name", "new_name")]),
    ("ALTER TABLE items DROP COLUMN legacy", [("drop", "legacy", None)]),
    ("ALTER TABLE IF EXISTS items DROP COLUMN IF EXISTS legacy CASCADE", [("drop", "legacy", None)]),
    ("ALTER TABLE items ALTER COLUMN qty TYPE bigint USING qty::bigint", [("type", "qty", None)]),
    ("ALTER TABLE items ALTER qty SET DATA TYPE bigint", [("type", "qty", None)]),
    ("ALTER TABLE items ADD COLUMN note text DEFAULT 'x', ALTER COLUMN note SET NOT NULL",
     [("add", "note", None), ("keep", "note", None)]),
    ("ALTER TABLE items ADD CONSTRAINT qty_pos CHECK (qty > 0), DROP CONSTRAINT other",
     [("keep", None, None), ("keep", None, None)]),
    ("ALTER TABLE items ALTER COLUMN qty SET DEFAULT 0", [("keep", "qty", None)]),
    ("ALTER TABLE items REPLICA IDENTITY FULL", [("keep", None, None)]),
    ("ALTER TABLE items RENAME TO things", [("other", None, None)]),
    ("ALTER TABLE items SET SCHEMA archive", [("other", None, None)]),
    ("ALTER TABLE items ALTER COLUMN total DROP EXPRESSION", [("other", "total", None)]),
])
def test_actions(text, want):
    assert kinds(text) == want


def test_widens_where_delta_does():
    assert widens(pa.int32(), pa.int64()) and widens(pa.int16(), pa.int32())
    assert widens(pa.float32(), pa.float64())
    assert widens(pa.string(), pa.string())  # varchar(n) -> text: the same Delta type
    assert widens(pa.decimal128(10, 2), pa.decimal128(12, 2))
    assert not widens(pa.int64(), pa.int32())
    assert not widens(pa.int32(), pa.string())
    assert not widens(pa.decimal128(10, 2), pa.decimal128(12, 3))
    assert not widens(pa.int32(), pa.float64())

"""Reading a Delta target's tables at one consistent point: the public names of targets/delta/read.py."""

from __future__ import annotations

from ..targets.delta.read import Point, arrow_tables_as_of, latest_point, point_for, points, tables_as_of

__all__ = ["Point", "arrow_tables_as_of", "latest_point", "point_for", "points", "tables_as_of"]

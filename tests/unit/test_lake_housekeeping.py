"""Which consistent points a vacuum keeps, and the lake CLI's input checks (no Delta table needed)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner

from sluicegate.cli.main import cli
from sluicegate.errors import UsageError
from sluicegate.targets.delta.housekeeping import _kept_points, vacuum
from sluicegate.targets.delta.read import Point, as_position, lake_path, table_uri

NOW = datetime(2026, 3, 1, tzinfo=timezone.utc)


def pt(position, age_hours=None):
    when = None if age_hours is None else NOW - timedelta(hours=age_hours)
    return Point("w", position, str(position), when, {"public.t": position})


def kept(points, hours):
    return [p.position for p in _kept_points(points, NOW - timedelta(hours=hours))]


def test_kept_points():
    assert kept([pt(1, 100), pt(2, 50), pt(3, 10), pt(4, 1)], 24) == [3, 4]
    assert kept([pt(1, 100), pt(2, 50)], 24) == [2]  # the newest stays, however old
    # The copy's point has no commit time: it is no later than the next point, and goes with it.
    assert kept([pt(1), pt(2, 50), pt(3, 1)], 24) == [3]
    assert kept([pt(1), pt(2, 10), pt(3, 1)], 24) == [1, 2, 3]
    assert kept([pt(1)], 0) == [1]


def test_paths_and_positions():
    assert lake_path("delta:/data/lake/") == "/data/lake"
    assert table_uri("delta:s3://b/lake", "public.orders") == "s3://b/lake/public/orders"
    assert as_position("0/16B3748") == 0x16B3748 and as_position(5) == 5
    with pytest.raises(UsageError, match="not a position"):
        as_position("16B3748")


def test_short_retention_refused(tmp_path):
    with pytest.raises(UsageError, match="allow-short-retention"):
        vacuum(str(tmp_path), "w", timedelta(minutes=10))


def test_cli_input_errors(tmp_path):
    runner = CliRunner()
    out = runner.invoke(cli, ["lake", "optimize", "w", "--target", str(tmp_path)])
    assert out.exit_code == 1 and "write delta:PATH" in out.output
    out = runner.invoke(cli, ["lake", "vacuum", "w", "--target", f"delta:{tmp_path}", "--retention", "7 days"])
    assert out.exit_code == 1 and "--retention duration '7 days' not understood" in out.output
    out = runner.invoke(cli, ["lake", "vacuum", "w", "--target", f"delta:{tmp_path}"])
    assert out.exit_code == 1 and "no consistent point yet: the copy has not finished" in out.output


def test_vacuum_summary_lines():
    from sluicegate.targets.delta.housekeeping import format_vacuum

    report = {"dry_run": True, "points_dropped": 300, "points_kept": 2, "oldest_kept_point": "0/16B3748",
              "tables": [{"table": "public.t", "files_removed": 2, "bytes_removed": 2_500_000,
                          "removed": ["a.parquet", "b.parquet"], "kept_versions": list(range(400))},
                         {"table": "(points)", "files_removed": 0, "bytes_removed": 0, "removed": [],
                          "kept_versions": []}]}
    lines = format_vacuum(report)
    assert lines == ["points: would drop 300 older than the retention, kept 2 (oldest 0/16B3748)",
                     "public.t: would remove 2 files, 2.5 MB; keeps 400 versions of kept points",
                     "(points): would remove 0 files, 0 bytes",
                     "total: would remove 2 files, 2.5 MB (-v lists them)"]
    verbose = format_vacuum(report | {"dry_run": False}, verbose=True)
    assert verbose[1] == "public.t: removed 2 files, 2.5 MB; keeps 400 versions of kept points"
    assert verbose[2].startswith("  kept versions: 0, 1, 2,") and verbose[3:5] == ["  a.parquet", "  b.parquet"]
    assert verbose[-1] == "total: removed 2 files, 2.5 MB"

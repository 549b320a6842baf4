"""The retention governor's caps: which one a slot is past, in words, and how the caps are written."""

from __future__ import annotations

import pytest

from sluicegate.cluster.governor import SlotHold, over_cap, releasable
from sluicegate.cluster.model import Cluster
from sluicegate.errors import UsageError
from sluicegate.sizes import parse_duration, parse_size

MB = 1 << 20


def _cluster(wal=None, age=None) -> Cluster:
    return Cluster("rp", "postgresql://src/db", {"s1": "postgresql://a/db", "s2": "postgresql://b/db"}, "s2",
                   max_retained_wal=wal, max_retention_age=age)


def _hold(held=None, age=None) -> SlotHold:
    return SlotHold("s1", "sg_rp_s1", True, retained_bytes=held, age_seconds=age, wal_status="extended")


def test_no_caps_never_releases():
    assert over_cap(_hold(10**15, 10**9), _cluster()) is None


def test_wal_cap_is_strictly_over():
    c = _cluster(wal=64 * MB)
    assert over_cap(_hold(64 * MB), c) is None
    why = over_cap(_hold(64 * MB + 1), c)
    assert why is not None and "--max-retained-wal 64.0 MB" in why and "64.0 MB of WAL" in why


def test_age_cap_says_how_old():
    c = _cluster(age=20.0)
    assert over_cap(_hold(1, 20.0), c) is None
    why = over_cap(_hold(1, 95.0), c)
    assert why is not None and "--max-retention-age 20 s" in why and "1.6 min ago" in why
    assert "--max-retention-age 1.5 d" in over_cap(_hold(1, 3 * 86400), _cluster(age=36 * 3600))


def test_unknown_measures_are_within_the_caps():
    # A slot whose retained WAL or age cannot be measured (no restart_lsn yet, no samples) is never released.
    assert over_cap(_hold(None, None), _cluster(wal=1, age=1.0)) is None


def test_either_cap_releases():
    c = _cluster(wal=64 * MB, age=60.0)
    assert "--max-retained-wal" in over_cap(_hold(65 * MB, 1.0), c)
    assert "--max-retention-age" in over_cap(_hold(1 * MB, 61.0), c)


def test_only_an_idle_slot_of_another_sink_whose_consumer_is_gone_is_released():
    c = _cluster(wal=64 * MB)  # this consumer is s2's
    idle, over = {"active": False}, {"retained_bytes": 65 * MB}
    gone, beats = (lambda sink: False), (lambda sink: True)
    assert "--max-retained-wal" in releasable(SlotHold("s1", "sg_rp_s1", True, **over, **idle), c, gone)
    assert releasable(SlotHold("s1", "sg_rp_s1", True, **over, **idle), c, beats) is None  # between catchups
    assert releasable(SlotHold("s1", "sg_rp_s1", True, **over, active=True), c, gone) is None
    assert releasable(SlotHold("s1", "sg_rp_s1", False, **over, **idle), c, gone) is None
    # Its own slot, idle during its own long copy: this consumer is alive (max_slot_wal_keep_size governs it)
    assert releasable(SlotHold("s2", "sg_rp_s2", True, **over, **idle), c, gone) is None


@pytest.mark.parametrize(("text", "seconds"), [
    ("30s", 30), ("3600", 3600), ("90min", 5400), ("90m", 5400), ("36h", 36 * 3600), ("7d", 7 * 86400),
    ("1w", 7 * 86400), (" 1.5 h ", 5400), ("20 sec", 20), ("2D", 2 * 86400),
])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "7 days", "-5s", "1h30m", "5 fortnights", "1e3s"])
def test_parse_duration_refuses(text):
    with pytest.raises(UsageError, match="duration .* not understood: write e.g. 36h"):
        parse_duration(text)


@pytest.mark.parametrize(("text", "size"), [("64MB", 64 * MB), ("1GB", 1 << 30), ("512 kb", 512 << 10),
                                            ("1048576", MB), ("1.5GiB", 3 << 29)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "64 MiBs", "-1MB", "lots"])
def test_parse_size_refuses(text):
    with pytest.raises(UsageError, match="size .* not understood"):
        parse_size(text)

"""Pure helpers of a Replicate workflow's Delta sink (lake/sink.py, cluster/sinks.py, cluster/safetime.py)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sluicegate.cluster.safetime import advance_safe_time, lake_safe_time_fields
from sluicegate.cluster.sinks import kind_of
from sluicegate.cluster.sinks import split as split_sinks
from sluicegate.targets.delta.sink import DELTA, LakeSamples, _reset, tell_sink
from sluicegate.targets.delta.state import LakeWorkflow, Store, TableState

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def test_safe_time_only_grows():
    assert advance_safe_time(None, None, None) is None
    first = advance_safe_time(None, T0, None)
    assert first == "2026-01-02T03:04:05Z"
    # an older commit time (a batch of earlier transactions after a restart) does not move it back
    assert advance_safe_time(first, T0 - timedelta(seconds=5), None) == first
    # caught up: the source's clock moves it on an idle source
    assert advance_safe_time(first, None, T0 + timedelta(seconds=3)) == "2026-01-02T03:04:08Z"
    other_zone = (T0 + timedelta(seconds=1)).astimezone(timezone(timedelta(hours=2)))
    assert advance_safe_time(first, other_zone, None) == "2026-01-02T03:04:06Z"


def test_safe_time_fields():
    assert lake_safe_time_fields(None, T0) == {"safe_time": None, "safe_time_lag_seconds": None}
    out = lake_safe_time_fields("2026-01-02T03:04:05Z", T0 + timedelta(seconds=2.5))
    assert out == {"safe_time": "2026-01-02T03:04:05Z", "safe_time_lag_seconds": 2.5}


def test_split_sinks_keeps_order():
    pg, delta = split_sinks({"s1": "postgresql://a/db", "s2": "delta:/x", "s3": "postgresql://b/db"})
    assert list(pg) == ["s1", "s3"] and delta == {"s2": "delta:/x"}
    # cluster/ finds the Delta sink's code through the kind lake/sink.py registered, not by importing lake/
    assert kind_of("delta:/x") is DELTA and kind_of("postgresql://a/db") is None


def _workflow(tmp_path) -> Store:
    store = Store(tmp_path)
    store.create(LakeWorkflow(name="w", source_url="postgresql://s/db", slot="sg_w_s2", publication="sg_w_s2",
                              tables=[TableState({"schema": "public", "name": "a"}, lastpk=[5], done=True,
                                                 rows_copied=9, cycles=3, copy_from=10, copied_to=20)],
                              kind="Replicate", position=30, state="Running"))
    return store


def test_samples_date_the_wal(tmp_path):
    store = _workflow(tmp_path)
    samples = LakeSamples(store, "w")
    every, keep = timedelta(seconds=10), timedelta(days=1)
    samples.add(100, T0, every, keep)
    samples.add(150, T0 + timedelta(seconds=5), every, keep)  # too soon: not kept
    samples.add(200, T0 + timedelta(seconds=10), every, keep)
    assert [s[0] for s in store.load("w").wal_samples] == [100, 200]
    now = T0 + timedelta(seconds=60)
    assert samples.age(50, now) == 60.0  # written before the first sample past it
    assert samples.age(150, now) == 50.0
    assert samples.age(300, now) == 0.0
    samples.add(300, T0 + timedelta(days=1, seconds=5), every, keep)  # the old ones age out
    assert [s[0] for s in store.load("w").wal_samples] == [200, 300]


def test_release_marks_only_the_slots_reader(tmp_path):
    store = _workflow(tmp_path)
    tell_sink(f"delta:{tmp_path}", "w", "sg_other", "released")
    assert store.load("w").state == "Running"
    tell_sink(f"delta:{tmp_path}", "w", "sg_w_s2", "released; way out")
    wf = store.load("w")
    assert (wf.state, wf.message) == ("Error", "released; way out")


def test_recopy_keeps_counting_cycles(tmp_path):
    wf = _workflow(tmp_path).load("w")
    wf.first_point = True
    _reset(wf, {"public.a"})
    t = wf.tables[0]
    assert (t.lastpk, t.done, t.rows_copied, t.copy_from, t.copied_to) == (None, False, 0, None, None)
    assert t.cycles == 3 and not wf.first_point  # the next cycle is 4: its copy app version was never used

"""Consistent reads across Delta tables (lake/read.py) and housekeeping (lake/housekeeping.py, `sluicegate lake`).

The tables and the consistent-read log are written with delta-rs directly, as the applier writes them
(lake_points.py); Spark, pyarrow and DuckDB read them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from sluicegate.errors import RetryableError, TerminalError, UsageError
from sluicegate.position import format_lsn
from sluicegate.targets.delta import housekeeping
from sluicegate.targets.delta.read import arrow_tables_as_of, latest_point, tables_as_of

from .lake_points import (
    apply,
    arrow_rows,
    create,
    duckdb_rows,
    norm_rows,
    parquet_files,
    record_point,
    spark_rows,
    uri,
)

pytestmark = pytest.mark.spark
W = "lakew"
T0 = datetime(2026, 1, 5, 12, 0, tzinfo=timezone.utc)
ORDERS = pa.schema([pa.field("id", pa.int64(), nullable=False), ("amount", pa.decimal128(10, 2)),
                    ("note", pa.string()), ("at", pa.timestamp("us", tz="UTC"))])
ITEMS = pa.schema([pa.field("id", pa.int64(), nullable=False), ("order_id", pa.int64()), ("qty", pa.int32())])


def order(i, amount, note=None, **extra):
    return {"id": i, "amount": Decimal(amount), "note": note, "at": T0 + timedelta(minutes=i), **extra}


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    """Two tables in several batches, a point after each: (path, {position: {table: expected rows}})."""
    path = str(tmp_path_factory.mktemp("lake"))
    v = {"public.orders": create(path, "public.orders", ORDERS), "public.items": create(path, "public.items", ITEMS)}
    orders, items = {}, {}
    expected = {}

    def point(position, committed_at=None):
        record_point(path, W, position, dict(v), committed_at)
        expected[position] = {"public.orders": norm_rows(list(orders.values())),
                              "public.items": norm_rows(list(items.values()))}

    point(100)  # the copy's point: both tables empty
    new = [order(i, f"{i}.50", f"n{i}") for i in range(1, 6)]
    orders.update({r["id"]: r for r in new})
    v["public.orders"] = apply(path, "public.orders", W, 200, new)
    new = [{"id": i, "order_id": i, "qty": i * 10} for i in range(1, 4)]
    items.update({r["id"]: r for r in new})
    v["public.items"] = apply(path, "public.items", W, 200, new)
    point(200, T0)

    orders[2] = order(2, "99.99", "changed")  # items untouched: its version stays in the point
    del orders[3]
    v["public.orders"] = apply(path, "public.orders", W, 300, [orders[2]], [3])
    point(300, T0 + timedelta(seconds=1))

    # A column added to orders: older files lack it, every version's reader must see it as null there.
    wide = ORDERS.append(pa.field("tag", pa.string()))
    for r in orders.values():
        r["tag"] = None
    new = [order(i, "1.00", None, tag=f"t{i}") for i in (6, 7)]
    orders.update({r["id"]: r for r in new})
    v["public.orders"] = apply(path, "public.orders", W, 400, new, schema=wide)
    items[4] = {"id": 4, "order_id": 6, "qty": 1}
    del items[1]
    v["public.items"] = apply(path, "public.items", W, 400, [items[4]], [1])
    point(400, T0 + timedelta(seconds=2))

    orders[6] = {**orders[6], "tag": "retagged"}
    v["public.orders"] = apply(path, "public.orders", W, 500, [orders[6]])
    items[2] = {**items[2], "qty": 0}
    v["public.items"] = apply(path, "public.items", W, 500, [items[2]])
    point(500, T0 + timedelta(seconds=3))
    return path, expected


def test_each_point_reads_its_rows(spark, lake):
    path, expected = lake
    for position, tables in expected.items():
        dfs = tables_as_of(spark, path, W, position=position)
        arrow = arrow_tables_as_of(f"delta:{path}", W, position=format_lsn(position + 50))  # newest <= it
        assert set(dfs) == set(arrow) == set(tables)
        for name, rows in tables.items():
            assert spark_rows(dfs[name]) == rows, (position, name)
            assert arrow_rows(arrow[name]) == rows, (position, name)
            version = latest_point(path, W, position).versions[name]
            assert duckdb_rows(uri(path, name), version) == rows, (position, name)
    assert {n: df.schema.names for n, df in tables_as_of(spark, path, W, position=100).items()} == {
        "public.orders": ["id", "amount", "note", "at"], "public.items": ["id", "order_id", "qty"]}

    # The default is the newest point; DuckDB's delta_scan of each table's newest version agrees.
    newest = expected[max(expected)]
    assert latest_point(path, W).position == 500 and latest_point(path, W, 499).position == 400
    dfs = tables_as_of(spark, path, W, tables=["orders", "public.items"])
    assert spark_rows(dfs["orders"]) == newest["public.orders"]
    assert spark_rows(dfs["public.items"]) == newest["public.items"]
    for name in newest:
        assert duckdb_rows(uri(path, name)) == newest[name]

    # Reading the directory instead of the version's files brings back deleted and superseded rows.
    assert spark.read.parquet(uri(path, "public.orders")).count() > len(newest["public.orders"])


def test_errors_name_the_way_out(lake, tmp_path):
    path, _ = lake
    with pytest.raises(UsageError, match="table 'ordres' is not one .*did you mean 'orders'"):
        arrow_tables_as_of(path, W, tables=["ordres"])
    with pytest.raises(UsageError, match="no consistent point at or before 0/63: the oldest kept one is 0/64"):
        arrow_tables_as_of(path, W, position=99)
    with pytest.raises(UsageError, match="did you mean 'lakew'"):
        arrow_tables_as_of(path, "lakw")
    with pytest.raises(RetryableError, match="no consistent point yet: the copy has not finished"):
        arrow_tables_as_of(str(tmp_path), W)
    assert latest_point(str(tmp_path), W) is None

    # A version whose files a plain vacuum removed: an error, not a partial read.
    p = str(tmp_path / "v")
    create(p, "public.t", ITEMS)
    first = apply(p, "public.t", W, 10, [{"id": 1, "order_id": 1, "qty": 1}])
    record_point(p, W, 10, {"public.t": first})
    record_point(p, W, 20, {"public.t": apply(p, "public.t", W, 20, [], [1])})
    DeltaTable(uri(p, "public.t")).vacuum(retention_hours=0, dry_run=False, enforce_retention_duration=False)
    assert arrow_rows(arrow_tables_as_of(p, W)["public.t"]) == []
    with pytest.raises(TerminalError, match=f"version {first} .*was vacuumed away"):
        arrow_tables_as_of(p, W, position=10)


def test_two_table_transaction_is_never_half_read(spark, tmp_path):
    """A transaction on two tables lands as two Delta commits; until its point is recorded, readers see
    neither, and then both: at every step, and from a reader polling all along."""
    path = str(tmp_path)
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), ("v", pa.int64())])
    tables = ["public.a", "public.b"]
    versions = {t: create(path, t, schema) for t in tables}
    record_point(path, W, 1, versions)
    rows: dict[int, int] = {}
    stop = threading.Event()
    seen, torn = [], []

    def poll():
        while not stop.is_set():
            got = arrow_tables_as_of(path, W)
            a, b = (sorted(got[t]["v"].to_pylist()) for t in tables)
            seen.append(len(a))
            if a != b:
                torn.append((len(a), len(b)))

    def check(position):
        want = sorted(rows.values())
        for name, df in tables_as_of(spark, path, W).items():
            assert latest_point(path, W).position == position
            assert sorted(r.v for r in df.collect()) == want, name

    reader = threading.Thread(target=poll, daemon=True)
    reader.start()
    position = 1
    try:
        for batch in range(1, 6):
            before = position
            position += 100
            if batch < 5:  # inserts of 2000 rows into both
                new = {(batch - 1) * 2000 + i: batch for i in range(2000)}
            else:  # one transaction updating every row of both
                new = {k: v + 100 for k, v in rows.items()}
            upserts = [{"id": k, "v": v} for k, v in new.items()]
            old = dict(rows)
            versions["public.a"] = apply(path, "public.a", W, position, upserts)
            rows, applied = old, {**old, **new}
            check(before)  # a has the transaction, b not yet: readers see neither
            versions["public.b"] = apply(path, "public.b", W, position, upserts)
            check(before)
            record_point(path, W, position, dict(versions))
            rows = applied
            check(position)
    finally:
        stop.set()
        reader.join(timeout=60)
    assert not torn, torn[:3]
    assert len(seen) > 5 and max(seen) == 8000, (len(seen), max(seen, default=None))


def sluicegate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluicegate.cli.main", *args], check=False,
                          capture_output=True, text=True, timeout=120)


def test_optimize_then_vacuum(tmp_path):
    """Many small commits, then `lake optimize`: fewer files, same rows and app transaction; files a killed
    writer left, then `lake vacuum`: they go, and every file of a kept point's versions stays."""
    path = str(tmp_path)
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), ("v", pa.string())])
    t, other = "public.events", "public.users"
    versions = {t: create(path, t, schema), other: create(path, other, schema)}
    versions[other] = apply(path, other, W, 1, [{"id": 1, "v": "u"}])
    rows: dict[int, str] = {}
    snapshots = {}
    dt = DeltaTable(uri(path, t))
    for position in range(2, 302):  # each a small commit, as replicated batches are
        if position % 25 == 0:  # some batches delete: older versions then need files the newest lacks
            victim = min(rows)
            del rows[victim]
            dt.delete(f"id = {victim}", commit_properties=_txn(position))
        else:
            rows[position] = f"r{position}"
            write_deltalake(dt, pa.Table.from_pylist([{"id": position, "v": f"r{position}"}], schema=schema),
                            mode="append", commit_properties=_txn(position))
        if position % 50 == 0:
            versions[t] = dt.version()
            # The last two points' source times lie after any cutoff: they stay whatever the retention.
            late = position >= 250
            record_point(path, W, position, dict(versions),
                         datetime.now(timezone.utc) + timedelta(days=1) if late else T0)
            snapshots[position] = sorted(rows.items())
    small = len(dt.file_uris())
    assert small > 250

    out = sluicegate("lake", "optimize", W, "--target", f"delta:{path}")
    assert out.returncode == 0, out.stderr
    assert f"{t}: {small} files -> 1" in out.stdout, out.stdout
    dt = DeltaTable(uri(path, t))
    assert len(dt.file_uris()) == 1
    assert dt.transaction_version(f"sluicegate:{W}") == 301
    assert DeltaTable(uri(path, other)).transaction_version(f"sluicegate:{W}") == 1
    assert sorted(_rows(arrow_tables_as_of(path, W)[t])) == snapshots[300]  # the newest point: pre-optimize files
    assert sorted(_rows(_arrow_latest(uri(path, t)))) == sorted(rows.items())

    # A killed writer's files: in the table directory, in no version. Old enough for the retention.
    orphans = []
    for i in range(3):
        name = f"part-00000-killed-{i}-c000.snappy.parquet"
        pq.write_table(pa.table({"id": [10_000 + i], "v": ["orphan"]}), f"{uri(path, t)}/{name}")
        old = (datetime.now() - timedelta(days=3)).timestamp()
        os.utime(f"{uri(path, t)}/{name}", (old, old))
        orphans.append(name)
    out = sluicegate("lake", "vacuum", W, "--target", f"delta:{path}", "--retention", "2d")
    assert out.returncode == 0, out.stderr
    assert f"{t}: removed 3 files" in out.stdout, out.stdout
    assert "points: dropped 4 older than the retention, kept 2 (oldest 0/FA)" in out.stdout, out.stdout
    assert not set(orphans) & parquet_files(uri(path, t))

    # No retention at all (nothing writes now): only what the kept points and the newest version need stays.
    report = housekeeping.vacuum(path, W, timedelta(0), allow_short=True)
    assert report["points_dropped"] == 0 and report["oldest_kept_point"] == format_lsn(250)
    needed = set()
    for position in (250, 300):
        at = DeltaTable(uri(path, t), version=_version_at(path, position))
        needed |= {os.path.basename(f) for f in at.file_uris()}
    needed |= {os.path.basename(f) for f in DeltaTable(uri(path, t)).file_uris()}
    assert parquet_files(uri(path, t)) == needed
    for position in (250, 300):
        assert sorted(_rows(arrow_tables_as_of(path, W, position=position)[t])) == snapshots[position]
    with pytest.raises(UsageError, match="the oldest kept one is 0/FA"):
        arrow_tables_as_of(path, W, position=200)
    assert DeltaTable(uri(path, t)).transaction_version(f"sluicegate:{W}") == 301

    out = sluicegate("lake", "vacuum", W, "--target", f"delta:{path}", "--retention", "10min")
    assert out.returncode == 1 and "--allow-short-retention" in out.stderr, out.stderr
    out = sluicegate("lake", "optimize", W, "--target", path)
    assert out.returncode == 1 and "write delta:PATH" in out.stderr, out.stderr


def _txn(position):
    from .lake_points import txn

    return txn(W, position)


def _rows(table: pa.Table) -> list[tuple]:
    return list(zip(table["id"].to_pylist(), table["v"].to_pylist()))


def _arrow_latest(table_uri: str) -> pa.Table:
    import pyarrow.dataset as ds

    dt = DeltaTable(table_uri)
    return ds.dataset(dt.file_uris(), format="parquet").to_table()


def _version_at(path, position) -> int:
    return latest_point(path, W, position).versions["public.events"]


def test_vacuum_keeps_what_a_running_vdiff_compares_at(tmp_path):
    """A vdiff pins its point and versions (lake/pins.py): a vacuum with no retention keeps them, though old
    and not the newest; once the vdiff took its pin away, they go."""
    from sluicegate.targets.delta import pins
    from sluicegate.targets.delta.state import RUNNING, LakeWorkflow, Store, TableState

    path = str(tmp_path)
    t = "public.events"
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), ("v", pa.string())])
    create(path, t, schema)
    versions = {}
    for position in (10, 20, 30):  # every row deleted by the next batch: each point needs its own files
        versions[position] = apply(path, t, W, position, [{"id": position, "v": f"r{position}"}],
                                   deletes=[position - 10] if position > 10 else [])
        record_point(path, W, position, {t: versions[position]}, T0)
    store = Store(tmp_path)
    store.create(LakeWorkflow(name=W, source_url="postgresql://x", slot="s", publication="p", state=RUNNING,
                              position=30, tables=[TableState({"schema": "public", "name": "events",
                                                               "columns": [], "key": ["id"]}, done=True)]))
    pins.add(store, W, "v1", 20, {t: versions[20]})

    report = housekeeping.vacuum(path, W, timedelta(0), allow_short=True)
    assert report["points_dropped"] == 1  # 10 goes; 20 is pinned, 30 the newest
    assert [p.position for p in housekeeping.read.points(path, W)] == [20, 30]
    assert _rows(arrow_tables_as_of(path, W, position=20)[t]) == [(20, "r20")]

    pins.remove(store, W, "v1")
    report = housekeeping.vacuum(path, W, timedelta(0), allow_short=True)
    assert report["points_dropped"] == 1
    assert [p.position for p in housekeeping.read.points(path, W)] == [30]
    gone = housekeeping.read.Point(W, 20, format_lsn(20), None, {t: versions[20]})
    with pytest.raises(TerminalError, match="vacuumed away"):
        arrow_tables_as_of(path, W, position=gone)

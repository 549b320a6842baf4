"""A Delta copy task's read (copy.snapshot_batches: one COPY in CSV, cut into blocks, parsed and cast by Arrow)
against a real server gives the batches the per-value path gives over the same rows read as text tuples
through helpers.output_text: text with quotes, delimiters, newlines, carriage returns, backslashes, `\\.`,
unicode, '' and NULL; floats, numerics, dates and timestamps with their edge values; char(n), inet, a domain, an
enum, an array (the COPY writes bare columns: their output functions' text). Blocks cut anywhere. While the COPY
runs, the source session carries the cycle's label and the server counts its rows (live.in_flight_reads)."""

from __future__ import annotations

import threading

import psycopg
import pyarrow as pa
import pytest
from psycopg import sql

from sluicegate.errors import RetryableError
from sluicegate.postgres import passthrough
from sluicegate.postgres.catalog import describe_table
from sluicegate.postgres.connect import connect
from sluicegate.targets.delta import copy
from sluicegate.targets.delta.types import record_batch
from sluicegate.workflow import live

from ..conftest import wait_for
from .helpers import output_text

TEXTS = ["", " ", "a,b", 'say "hi"', '"', "line\nbreak", "cr\r\nlf", "back\\slash", "\\.", "\\N", "NULL",
         "ünïcødé ✓ 日本", "\t", "x" * 3000]


def test_blocks_equal_the_per_value_read_and_show_progress(pair, monkeypatch):
    pair.src("CREATE DOMAIN code5 AS char(5); CREATE TYPE mood AS ENUM ('ok', 'a \"b\", c')")
    pair.src("""CREATE TABLE quirks (id bigint PRIMARY KEY, t text, f4 real, f8 float8, n numeric(12,2),
                                      u numeric, d date, ts timestamp, tz timestamptz, b bytea, ok boolean,
                                      c5 char(5), ip inet, dc code5, m mood, a text[])""")
    pair.src("""INSERT INTO quirks SELECT g, (%s::text[])[1 + g %% %s],
                  CASE g %% 5 WHEN 0 THEN 'NaN' WHEN 1 THEN '-Infinity' WHEN 2 THEN NULL ELSE g / 7.0 END,
                  CASE g %% 4 WHEN 0 THEN '-0' WHEN 1 THEN 'Infinity' ELSE g * 1e300 / 3 END,
                  CASE g %% 6 WHEN 0 THEN 'NaN' WHEN 1 THEN NULL ELSE g / 3.0 END,
                  CASE g %% 3 WHEN 0 THEN 'NaN' ELSE g / 7.0 END,
                  CASE g %% 7 WHEN 0 THEN 'infinity' WHEN 1 THEN '0044-03-15 BC' WHEN 2 THEN '12000-06-30'
                              ELSE '2024-01-01'::date + g END,
                  CASE g %% 7 WHEN 0 THEN '-infinity' ELSE '2024-01-01'::timestamp + g * interval '1.000001 s' END,
                  CASE g %% 7 WHEN 0 THEN 'infinity' WHEN 1 THEN '0001-01-01 00:00:00+00 BC'
                              ELSE '2024-01-01 00:00:00+00'::timestamptz + g * interval '1 min' END,
                  CASE g %% 3 WHEN 0 THEN NULL WHEN 1 THEN ''::bytea ELSE '\\x0a2c22'::bytea END,
                  CASE g %% 3 WHEN 0 THEN NULL ELSE g %% 2 = 0 END,
                  CASE g %% 3 WHEN 0 THEN NULL WHEN 1 THEN '' ELSE 'ab' END,
                  ('10.0.' || (g %% 250) || '.1')::inet, 'x,y', CASE g %% 2 WHEN 0 THEN 'ok' ELSE 'a "b", c' END::mood,
                  ARRAY['a "q"', NULL, '', 'l
2']
                FROM generate_series(1, 5000) g""", (TEXTS + [None], len(TEXTS) + 1))
    pair.src("CREATE TABLE big (id int PRIMARY KEY, f text)")
    pair.src("INSERT INTO big SELECT g, repeat(md5(g::text), 32) FROM generate_series(1, 20000) g")
    with psycopg.connect(pair.source) as c:
        table, big = describe_table(c, "public", "quirks"), describe_table(c, "public", "big")
    holder = connect(pair.source, role="source")
    try:
        holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        snapshot = holder.execute("SELECT pg_export_snapshot()").fetchone()[0]
        pair.src("UPDATE quirks SET t = 'after the snapshot'")  # not seen by either read
        where = sql.SQL("id > 0")
        # the per-value path: the same text as tuples (the read before the COPY)
        cols = sql.SQL(", ").join(output_text(c) for c in table.columns)
        with connect(pair.source, role="source") as src:
            src.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            src.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
            rows = src.execute(sql.SQL("SELECT {} FROM {} WHERE {}").format(cols, table.scan, where)).fetchall()
        want = pa.Table.from_batches([record_batch(table, rows)])

        monkeypatch.setattr(copy, "BLOCK_BYTES", 20_000)  # many blocks, cut wherever a row ends
        got = pa.Table.from_batches(list(copy.snapshot_batches(pair.source, snapshot, table, where)))

        # ~20 MB, more than the socket buffers hold: mid-COPY, the label and the server's count of its rows
        label = live.APP_PREFIX + "0123456789ab"
        batches = copy.snapshot_batches(pair.source, snapshot, big, where, label)
        first = next(batches)
        with psycopg.connect(pair.source, autocommit=True) as watcher:
            during = live.in_flight_reads(watcher)
            assert sum(b.num_rows for b in batches) + first.num_rows == 20_000
            after = live.in_flight_reads(watcher)
            # a reader that stops early (an error in the task): the COPY cancelled, its thread and session gone
            stopped = copy.snapshot_batches(pair.source, snapshot, big, where, label + "x")
            next(stopped)
            stopped.close()
            assert not any(t.name == "sg-copy-out" for t in threading.enumerate())
            wait_for(lambda: label + "x" not in {n for (n,) in watcher.execute(
                "SELECT application_name FROM pg_stat_activity")}, timeout=10, what="the stopped reader's session")
    finally:
        holder.close()
    assert len(got.to_batches()) > 10
    assert got.num_rows == 5000 and "after the snapshot" not in got.column("t").to_pylist()
    assert got.schema == want.schema
    for name in got.column_names:  # floats by their text (NaN is NaN, -0.0 is not 0.0), the rest as Arrow values
        if pa.types.is_floating(got.schema.field(name).type):
            assert list(map(str, got.column(name).to_pylist())) == list(map(str, want.column(name).to_pylist()))
        else:
            assert got.column(name).equals(want.column(name)), name
    assert set(got.column("t").to_pylist()) == set(TEXTS) | {None}
    assert set(got.column("c5").to_pylist()) == {None, "     ", "ab   "}  # char(n) keeps its padding
    assert got.column("ip").to_pylist()[:2] == ["10.0.1.1", "10.0.2.1"]  # an inet host: no /32
    assert first.num_rows <= during.get(label, 0) < 20_000 and label not in after


def test_a_snapshot_gone_is_retryable(pair):
    pair.src("CREATE TABLE t (id int PRIMARY KEY)")
    with psycopg.connect(pair.source) as c:
        table = describe_table(c, "public", "t")
    with pytest.raises(RetryableError, match="snapshot 00000003-0000001B-1 is gone"):
        next(copy.snapshot_batches(pair.source, "00000003-0000001B-1", table, sql.SQL("true")))


def test_the_copy_s_rows_are_told_before_its_last_blocks_are_handed_over(pair):
    """A task's source session says its rows once its COPY has ended (the server no longer counts them) while
    the blocks read ahead are still to be written: copy_blocks calls `on_end` with the COPY's rows then."""
    calls: list[int] = []
    conn = passthrough.connect(pair.source, "source")
    try:
        seen = [(len(calls), block.count(b"\n")) for block in passthrough.copy_blocks(
            conn, "COPY (SELECT g, repeat('x', 100) FROM generate_series(1, 50000) g) TO STDOUT", 100_000,
            calls.append)]
    finally:
        conn.close()
    assert calls == [50_000]
    assert sum(rows for _, rows in seen) == 50_000 and len(seen) > 10
    assert seen[0][0] == 0 and seen[-1][0] == 1  # not before the first block (5 MB, 3 blocks read ahead), before the last

"""Delta columns of the types a Spark or DuckDB user expects (README, "Delta Lake target": the type table):
a table of arrays, composites, hstore, ranges, PostGIS, intervals, edge dates and numerics moved by MoveTables
into Delta, copied and then replicated (inserts, updates touching every column, deletes); read back with
DuckDB and Spark, the values equal the source's converted the documented way, and the Delta vdiff is equal.
A table named with spaces, in a schema named with spaces, holds a char(5) and an inet value copied and
another streamed spelled alike."""

from __future__ import annotations

import glob
import os
import threading
from datetime import date
from decimal import Decimal

import psycopg
import pytest
from psycopg import sql

from sluicegate.position import parse_lsn
from sluicegate.postgres.catalog import describe_table
from sluicegate.postgres.connect import connect
from sluicegate.spark.runner import SparkRunner
from sluicegate.targets.delta import cli as lake
from sluicegate.targets.delta import vdiff
from sluicegate.targets.delta.engine import LakeEngine
from sluicegate.targets.delta.pgtext import days_from_civil
from sluicegate.targets.delta.read import arrow_tables_as_of, tables_as_of
from sluicegate.targets.delta.state import Store
from sluicegate.targets.delta.types import DATE_INFINITY, SPECIAL, TS_INFINITY, record_batch

from ..conftest import wait_for
from .helpers import output_text

pytestmark = pytest.mark.spark

W = "ty"
ROWS = 300

SCHEMA = """
CREATE EXTENSION hstore;
CREATE EXTENSION postgis;
CREATE TYPE mood AS ENUM ('happy', 'sad');
CREATE TYPE inner_t AS (x text, n int);
CREATE TYPE outer_t AS (a int, inner_t inner_t, tags text[]);
CREATE DOMAIN posint AS int CHECK (VALUE > 0);
CREATE TABLE kinds (
  id int PRIMARY KEY,
  ints int[], texts text[], nums numeric(10,2)[], moods mood[], grid int[][],
  comp outer_t, comps inner_t[], pos posint,
  h hstore,
  r4 int4range, r8 int8range, rn numrange, rd daterange, rts tsrange, rtz tstzrange, mr int4multirange,
  geom geometry(Point, 4326), geog geography,
  j json, jb jsonb, x xml,
  iv interval,
  d date, ts timestamp, tz timestamptz,
  n numeric(10,2),
  c5 char(5), ip inet,
  gen int GENERATED ALWAYS AS (id * 2) STORED
);
CREATE SCHEMA "Sales Dept";
CREATE DOMAIN code5 AS char(5);
CREATE DOMAIN host AS inet;
CREATE TABLE "Sales Dept"."Order Items" (id int PRIMARY KEY, code char(5), addr inet, dcode code5, daddr host);
CREATE TABLE keyed (k inner_t PRIMARY KEY, tags text[], v int, big int[]);
ALTER TABLE keyed ALTER big SET STORAGE EXTERNAL;
"""

# Every nullable column NULL in some rows (a different residue per column), edge values in others.
FILL = f"""
INSERT INTO kinds (id, ints, texts, nums, moods, grid, comp, comps, pos, h, r4, r8, rn, rd, rts, rtz, mr, geom, geog,
                   j, jb, x, iv, d, ts, tz, n, c5, ip)
SELECT g,
  CASE WHEN g % 11 = 1 THEN NULL ELSE ARRAY[g, NULL, g * 2] END,
  CASE WHEN g % 11 = 2 THEN NULL ELSE ARRAY['a b', 'NULL', NULL, 'q"u\\o,te{{}}', '', g::text] END,
  CASE WHEN g % 11 = 3 THEN NULL ELSE ARRAY[g / 7.0, NULL]::numeric(10,2)[] END,
  CASE WHEN g % 11 = 4 THEN NULL ELSE ARRAY['happy', 'sad']::mood[] END,
  CASE WHEN g % 11 = 5 THEN NULL ELSE ARRAY[[g, 1], [NULL, 2]] END,
  CASE WHEN g % 11 = 6 THEN NULL
       ELSE ROW(g, ROW('x "' || g || '", (y)', CASE WHEN g % 2 = 0 THEN NULL ELSE g END)::inner_t,
                ARRAY['t', NULL])::outer_t END,
  CASE WHEN g % 11 = 7 THEN NULL ELSE ARRAY[ROW('a,b', 1)::inner_t, NULL, ROW(NULL, NULL)::inner_t] END,
  CASE WHEN g % 11 = 8 THEN NULL ELSE g END,
  CASE WHEN g % 11 = 9 THEN NULL ELSE hstore(ARRAY['k', 'n', 'q"'], ARRAY[g::text, NULL, 'v w']) END,
  CASE WHEN g % 13 = 1 THEN NULL WHEN g % 13 = 2 THEN 'empty' WHEN g % 13 = 3 THEN '(,5]'
       ELSE int4range(g, g + 10) END,
  CASE WHEN g % 13 = 4 THEN NULL ELSE int8range(g, NULL) END,
  CASE WHEN g % 13 = 5 THEN NULL ELSE numrange(g / 3.0, g) END,
  CASE WHEN g % 13 = 6 THEN NULL ELSE daterange('2024-01-01'::date + g, 'infinity') END,
  CASE WHEN g % 13 = 7 THEN NULL ELSE tsrange('2024-01-01'::timestamp + g * interval '1 s', NULL, '[]') END,
  CASE WHEN g % 13 = 8 THEN NULL ELSE tstzrange('-infinity', '2024-01-01 00:00:00+00'::timestamptz + g * interval '1 h') END,
  CASE WHEN g % 13 = 9 THEN NULL WHEN g % 13 = 10 THEN '{{}}'::int4multirange
       ELSE int4multirange(int4range(1, 3), int4range(g + 5, NULL)) END,
  CASE WHEN g % 13 = 11 THEN NULL ELSE ST_SetSRID(ST_MakePoint(g, -g), 4326) END,
  CASE WHEN g % 13 = 12 THEN NULL ELSE ST_GeogFromText('POINT(1 ' || (g % 80) || ')') END,
  CASE WHEN g % 17 = 1 THEN NULL ELSE json_build_object('g', g) END,
  CASE WHEN g % 17 = 2 THEN NULL ELSE jsonb_build_object('g', g, 'a', ARRAY[1, 2]) END,
  CASE WHEN g % 17 = 3 THEN NULL ELSE xmlelement(name e, g) END,
  CASE WHEN g % 17 = 4 THEN NULL ELSE make_interval(g, 2, 0, -g, 4, 5, g / 1000.0) END,
  CASE WHEN g % 17 = 5 THEN NULL WHEN g % 17 = 6 THEN 'infinity' WHEN g % 17 = 7 THEN '-infinity'
       WHEN g % 17 = 8 THEN '0044-03-15 BC' WHEN g % 17 = 9 THEN '12000-06-30' ELSE '2024-01-01'::date + g END,
  CASE WHEN g % 17 = 10 THEN NULL WHEN g % 17 = 11 THEN 'infinity'
       WHEN g % 17 = 12 THEN '0001-01-01 00:00:00 BC' ELSE '2024-01-01'::timestamp + g * interval '1 min' END,
  CASE WHEN g % 17 = 13 THEN NULL WHEN g % 17 = 14 THEN '-infinity'
       WHEN g % 17 = 15 THEN '10000-01-01 00:00:00+00' ELSE '2024-01-01 00:00:00+00'::timestamptz + g * interval '1 s' END,
  CASE WHEN g % 19 = 1 THEN NULL WHEN g % 19 = 2 THEN 'NaN' WHEN g % 19 = 3 THEN 99999999.99
       WHEN g % 19 = 4 THEN -0.01 ELSE g / 3.0 END,
  CASE WHEN g % 19 = 5 THEN NULL ELSE 'ab' END,
  CASE WHEN g % 19 = 6 THEN NULL ELSE ('10.0.' || (g % 250) || '.1')::inet END
FROM generate_series(1, {ROWS}) g;
UPDATE kinds SET ints = '[2:3]={{7,8}}', grid = '{{1,2}}' WHERE id = 20;
INSERT INTO "Sales Dept"."Order Items" VALUES (1, 'ab', '10.0.0.1', 'ab', '10.0.0.1'),
  (2, 'abcde', '10.0.0.0/24', 'abcde', '10.0.0.0/24');
INSERT INTO keyed SELECT ROW('k ' || g, g)::inner_t, ARRAY[g::text], g FROM generate_series(1, 50) g;
UPDATE keyed SET big = array_fill(7, ARRAY[3000], ARRAY[0]) WHERE (k).n <= 5;
UPDATE keyed SET big = array_fill(8, ARRAY[3000]) WHERE (k).n BETWEEN 6 AND 10;
"""

# Replicated: new rows, every column of some rows updated (to NULL, to edge values, and back), deletes.
CHANGES = f"""
INSERT INTO kinds (id, ints, texts, nums, moods, grid, comp, comps, pos, h, r4, r8, rn, rd, rts, rtz, mr, geom, geog,
                   j, jb, x, iv, d, ts, tz, n, c5, ip)
SELECT id + {ROWS}, ints, texts, nums, moods, grid, comp, comps, pos, h, r4, r8, rn, rd, rts, rtz, mr, geom, geog,
       j, jb, x, iv, d, ts, tz, n, c5, ip FROM kinds WHERE id <= 60;
UPDATE kinds SET ints = NULL, texts = NULL, nums = NULL, moods = NULL, grid = NULL, comp = NULL, comps = NULL,
  pos = NULL, h = NULL, r4 = NULL, r8 = NULL, rn = NULL, rd = NULL, rts = NULL, rtz = NULL, mr = NULL,
  geom = NULL, geog = NULL, j = NULL, jb = NULL, x = NULL, iv = NULL, d = NULL, ts = NULL, tz = NULL, n = NULL,
  c5 = NULL, ip = NULL WHERE id BETWEEN 61 AND 80;
UPDATE kinds SET ints = '{{1,NULL}}', texts = '{{"\\\\",NULL,"NULL"}}', nums = '{{NaN}}', moods = '{{}}',
  grid = '{{{{{{1}}}},{{{{NULL}}}}}}', comp = '(1,"(""a"",)",{{}})', comps = '{{}}', pos = 1, h = '"a"=>NULL',
  r4 = 'empty', r8 = '(,)', rn = '[1.5,2.5]', rd = '[-infinity,2024-01-01)', rts = '[2024-01-01,infinity]',
  rtz = 'empty', mr = '{{[1,2)}}', geom = 'SRID=4326;POINT(0 0)', geog = 'POINT(-1 -1)', j = '[]', jb = '{{}}',
  x = '<a/>', iv = '-1 years -2 mons +3 days -04:05:06.000007', d = '5874897-12-31', ts = '294276-12-31 23:59:59',
  tz = 'infinity', n = 'NaN', c5 = 'x', ip = '::1' WHERE id BETWEEN 81 AND 100;
UPDATE kinds SET ints = ints || 9, comp.a = -1, h = h || hstore('new', 'v'), n = 1.5, d = '2000-02-29',
  iv = interval '1 day' WHERE id BETWEEN 101 AND 160;
DELETE FROM kinds WHERE id BETWEEN 161 AND 180;
INSERT INTO "Sales Dept"."Order Items" VALUES (3, 'ab', '10.0.0.1', 'ab', '10.0.0.1'),
  (4, 'abcde', '10.0.0.0/24', 'abcde', '10.0.0.0/24');
UPDATE keyed SET v = -v, tags = tags || '{{x,NULL}}'::text[] WHERE (k).n <= 10;
UPDATE keyed SET k = ROW('moved', (k).n)::inner_t WHERE (k).n BETWEEN 11 AND 15;
DELETE FROM keyed WHERE (k).n > 45;
INSERT INTO keyed VALUES (ROW(NULL, 0)::inner_t, NULL, 0);
"""


def expected(url: str, schema: str, name: str):
    """The source table converted the documented way (lake/types.py, on the output functions' text), sorted by
    id: independent of what Delta holds."""
    import pyarrow as pa

    with connect(url, role="source") as c:
        table = describe_table(c, schema, name)
        cols = sql.SQL(", ").join(output_text(col) for col in table.columns)
        rows = c.execute(sql.SQL("SELECT {} FROM {}").format(cols, table.ident)).fetchall()
    out = pa.Table.from_batches([record_batch(table, rows)])
    return out.sort_by("id") if "id" in out.column_names else out


def duckdb_connect():
    import duckdb
    import duckdb_extension_delta

    ext = glob.glob(os.path.join(os.path.dirname(duckdb_extension_delta.__file__), "**", "delta.duckdb_extension"),
                    recursive=True)[0]
    con = duckdb.connect()
    con.execute(f"LOAD '{ext}'")
    return con


class KindsWriter(threading.Thread):
    """Writes while the copy runs (caught up between its cycles): updates of nested, range, interval and date
    columns of rows 200-300, and new rows (ids from 1001) copied from others."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.stop_event = threading.Event()
        self.commits = self.inserted = 0
        self.error = None

    def run(self):
        try:
            with psycopg.connect(self.url, autocommit=True) as c:
                n = 0
                while not self.stop_event.is_set():
                    n += 1
                    with c.transaction():
                        c.execute("""UPDATE kinds SET ints = ints || %(n)s, h = coalesce(h, '') || hstore('w', %(n)s::text),
                                     comp.a = %(n)s, iv = iv + interval '1 day 1 us', d = d + 1, r4 = int4range(%(n)s, NULL),
                                     n = CASE WHEN %(n)s %% 5 = 0 THEN 'NaN' ELSE %(n)s / 7.0 END
                                     WHERE id = 200 + %(n)s %% 101""", {"n": n})
                        c.execute("""INSERT INTO kinds (id, ints, texts, nums, moods, grid, comp, comps, pos, h, r4, r8, rn,
                                       rd, rts, rtz, mr, geom, geog, j, jb, x, iv, d, ts, tz, n, c5, ip)
                                     SELECT 1000 + %(n)s, ints, texts, nums, moods, grid, comp, comps, pos, h, r4, r8, rn,
                                       rd, rts, rtz, mr, geom, geog, j, jb, x, iv, d, ts, tz, n, c5, ip
                                     FROM kinds WHERE id = %(n)s %% 300 + 1""", {"n": n})
                    self.commits += 1
                    self.inserted += 1
                    self.stop_event.wait(0.01)  # an application's pace, not a bulk load
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def test_delta_types_copied_and_streamed(pair, spark, tmp_path):
    if not pair.src("SELECT 1 FROM pg_available_extensions WHERE name = 'postgis'"):
        if os.environ.get("CI"):
            pytest.fail("PostGIS is not installed: apt-get install postgresql-15-postgis-3")
        pytest.skip("PostGIS is not installed (apt-get install postgresql-15-postgis-3)")
    for stmt in SCHEMA.split(";\n"):
        if stmt.strip():
            pair.src(stmt)
    pair.src(FILL)
    root = tmp_path / "lake"
    target = f"delta:{root}"
    notes: list[str] = []
    moved, _ = lake.create(W, pair.source, target, ["kinds", "keyed", '"Sales Dept"."Order Items"'], None, [],
                           {"slice_seconds": 1, "cycle_rows": 100, "chunk_rows": 50}, notes)
    assert sorted(moved) == ["Sales Dept.Order Items", "public.keyed", "public.kinds"]
    assert any("public.kinds" in n and "gen" in n for n in notes), notes

    store = Store(root)
    engine = LakeEngine(target, W, SparkRunner(spark))
    writer = KindsWriter(pair.source)
    writer.start()
    try:
        wait_for(lambda: store.load(W).first_point or engine.step(store.load(W)), timeout=120,
                 what="the copy and the first consistent point")
    finally:
        writer.stop_event.set()
        writer.join()
    assert writer.error is None and writer.commits > 5, (writer.error, writer.commits)
    extra = writer.inserted
    pair.src(CHANGES)
    flushed = parse_lsn(pair.src("SELECT pg_current_wal_flush_lsn()::text")[0][0])
    wait_for(lambda: store.load(W).position >= flushed or engine.step(store.load(W)), timeout=90,
             what="the changes replicated")

    # pyarrow (the consistent-read API): every row equal to the source's, nested values included
    import pyarrow as pa

    got = arrow_tables_as_of(str(root), W)
    want = expected(pair.source, "public", "kinds")
    kinds = got["public.kinds"].sort_by("id")
    schema = kinds.schema
    assert schema.field("ints").type.value_type == pa.int32()
    assert schema.field("grid").type.value_type.value_type == pa.int32()
    assert schema.field("nums").type.value_type == pa.decimal128(10, 2)
    assert schema.field("comp").type.field("inner_t").type == pa.struct([("x", pa.string()), ("n", pa.int32())])
    assert pa.types.is_map(schema.field("h").type)
    assert schema.field("geom").type == pa.binary() and schema.field("pos").type == pa.int32()
    assert "gen" not in schema.names
    assert kinds.num_rows == want.num_rows == ROWS + 60 - 20 + extra
    same = kinds.select(want.schema.names).cast(want.schema)
    for name in want.schema.names:  # (dates and timestamps compared as stored: the sentinels have no Python form)
        assert same.column(name).equals(want.column(name)), name
    sentinel_cols = ["d", "ts", "tz", "rd", "rts", "rtz"]
    by_id = {r["id"]: r for r in same.drop_columns(sentinel_cols).to_pylist()}
    times = {r["id"]: r for r in same.select(["id", "d", "ts", "tz"]).cast(
        pa.schema([("id", pa.int32()), ("d", pa.int32()), ("ts", pa.int64()), ("tz", pa.int64())])).to_pylist()}
    # edge values precisely
    assert by_id[3]["texts"] == ["a b", "NULL", None, 'q"u\\o,te{}', "", "3"]
    assert by_id[3]["comps"] == [{"x": "a,b", "n": 1}, None, {"x": None, "n": None}]
    assert by_id[3]["comp"] == {"a": 3, "inner_t": {"x": 'x "3", (y)', "n": 3}, "tags": ["t", None]}
    assert by_id[3]["h"] == [("k", "3"), ("n", None), ('q"', "v w")]
    assert by_id[3]["nums"] is None and by_id[4]["nums"] == [Decimal("0.57"), None]
    assert by_id[3]["moods"] == ["happy", "sad"]
    assert by_id[3]["grid"] == [[3, 1], [None, 2]] and by_id[3]["pos"] == 3
    assert by_id[3]["rn"] == {"lower": "1.00000000000000000000", "upper": "3", "lower_inclusive": True,
                              "upper_inclusive": False, "empty": False}
    assert by_id[3]["mr"] == [{"lower": 1, "upper": 3, "lower_inclusive": True, "upper_inclusive": False,
                               "empty": False},
                              {"lower": 8, "upper": None, "lower_inclusive": True, "upper_inclusive": False,
                               "empty": False}]
    assert by_id[3]["iv"] == {"months": 3 * 12 + 2, "days": -3, "microseconds": (4 * 3600 + 5 * 60) * 10**6 + 3000}
    assert by_id[3]["jb"] == '{"a": [1, 2], "g": 3}' and by_id[4]["x"] == "<e>4</e>"
    assert by_id[3]["geog"] == bytes.fromhex("0101000020E6100000000000000000F03F0000000000000840")
    assert by_id[81]["ints"] == [1, None] and by_id[81]["texts"] == ["\\", None, "NULL"]
    assert by_id[81]["grid"] is None and ("grid", "{{{1}},{{NULL}}}") in by_id[81][SPECIAL]
    assert ("nums", "{NaN}") in by_id[81][SPECIAL] and ("n", "NaN") in by_id[81][SPECIAL]
    assert by_id[20]["ints"] is None and ("ints", "[2:3]={7,8}") in by_id[20][SPECIAL]
    assert by_id[2 + 19 * 2]["n"] is None and by_id[2 + 19 * 2][SPECIAL] == [("n", "NaN")]  # copied NaN
    assert by_id[81]["comp"] == {"a": 1, "inner_t": {"x": "a", "n": None}, "tags": []}
    assert by_id[81]["h"] == [("a", None)]
    assert by_id[81]["r4"]["empty"] and by_id[81]["r8"]["lower"] is None and by_id[81]["r8"]["upper"] is None
    assert by_id[81]["iv"] == {"months": -14, "days": 3, "microseconds": -(4 * 3600 + 5 * 60 + 6) * 10**6 - 7}
    assert by_id[81]["geom"] == bytes.fromhex("0101000020E610000000000000000000000000000000000000")
    assert times[81]["tz"] == TS_INFINITY and times[81]["d"] is None  # past the date range
    assert ("d", "5874897-12-31") in by_id[81][SPECIAL]
    assert times[6]["d"] == DATE_INFINITY and times[7]["d"] == -DATE_INFINITY
    assert times[8]["d"] == days_from_civil(-43, 3, 15) and times[9]["d"] == days_from_civil(12000, 6, 30)
    assert by_id[101]["ints"][-1] == 9 and by_id[101]["comp"]["a"] == -1 and ("new", "v") in by_id[101]["h"]

    # DuckDB: its own reader of the Delta log
    con = duckdb_connect()
    try:
        uri = str(root / "public" / "kinds")
        types = dict(con.execute("SELECT column_name, column_type FROM (DESCRIBE SELECT * FROM delta_scan(?))",
                                 [uri]).fetchall())
        assert types["ints"] == "INTEGER[]" and types["h"] == "MAP(VARCHAR, VARCHAR)"
        assert types["comp"].startswith("STRUCT(") and types["geom"] == "BLOB"
        assert con.execute("SELECT count(*) FROM delta_scan(?)", [uri]).fetchone()[0] == ROWS + 40 + extra
        assert con.execute("SELECT comp.inner_t.x, h['k'], ints[1], tz::varchar, d FROM delta_scan(?) "
                           "WHERE id = 3", [uri]).fetchone() == ('x "3", (y)', "3", 3, "2024-01-01 00:00:03+00",
                                                              date(2024, 1, 4))
        assert con.execute("SELECT isinf(tz) FROM delta_scan(?) WHERE id IN (81, 82)", [uri]).fetchall() == [
            (True,), (True,)]
        assert con.execute("SELECT sum(len(ints)) FROM delta_scan(?)", [uri]).fetchone()[0] == sum(
            len(r["ints"]) for r in by_id.values() if r["ints"] is not None)
    finally:
        con.close()

    # Spark: nested types as Spark's own
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    frames = tables_as_of(spark, str(root), W)
    df = frames["public.kinds"]
    fields = {f.name: f.dataType for f in df.schema.fields}
    assert isinstance(fields["ints"], T.ArrayType) and isinstance(fields["grid"].elementType, T.ArrayType)
    assert isinstance(fields["comp"], T.StructType) and isinstance(fields["h"], T.MapType)
    assert isinstance(fields["geom"], T.BinaryType) and isinstance(fields["iv"], T.StructType)
    assert isinstance(fields["mr"].elementType, T.StructType)
    exploded = df.select("id", F.explode("ints").alias("v")).where("id = 3").collect()
    assert [r["v"] for r in exploded] == [3, None, 6]
    row = df.where("id = 3").select("comp.inner_t.x", F.col("h")["k"].alias("k"), "r4.lower", "iv.months").first()
    assert tuple(row) == ('x "3", (y)', "3", None, 3 * 12 + 2)  # r4 (,5]: no lower bound
    assert tuple(df.where("id = 4").select("r4.lower", "r4.upper", "r4.upper_inclusive").first()) == (4, 14, False)
    assert df.where(F.col("d") > F.lit("2100-01-01").cast("date")).count() == sum(
        1 for r in times.values() if r["d"] is not None and r["d"] > days_from_civil(2100, 1, 1))

    # A composite key: updates, a key change and deletes merged by the struct
    keyed = sorted(got["public.keyed"].to_pylist(), key=lambda r: (r["k"]["n"], r["k"]["x"] or ""))
    want_keyed = expected(pair.source, "public", "keyed").to_pylist()
    assert keyed == sorted(want_keyed, key=lambda r: (r["k"]["n"], r["k"]["x"] or "")) and len(keyed) == 46
    assert keyed[0]["k"] == {"x": None, "n": 0} and keyed[1]["tags"] == ["1", "x", None]
    assert keyed[11]["k"] == {"x": "moved", "n": 11}
    # an update left these TOASTed arrays unchanged (not sent): kept, a list or its `_sg_special` text
    assert keyed[1]["v"] == -1 and keyed[1]["big"] is None
    assert [k for k, _ in keyed[1][SPECIAL]] == ["big"] and keyed[1][SPECIAL][0][1].startswith("[0:2999]={7,7,")
    assert keyed[6]["v"] == -6 and keyed[6]["big"] == [8] * 3000 and keyed[6][SPECIAL] is None

    # The table named with spaces: copied and streamed values spelled alike, read by arrow and by the vdiff
    items = sorted(got["Sales Dept.Order Items"].to_pylist(), key=lambda r: r["id"])
    assert [(r["code"], r["addr"]) for r in items] == [("ab   ", "10.0.0.1"), ("abcde", "10.0.0.0/24")] * 2
    assert [(r["dcode"], r["daddr"]) for r in items] == [("ab   ", "10.0.0.1"), ("abcde", "10.0.0.0/24")] * 2

    report = vdiff.run(W, target, SparkRunner(spark))
    assert report["equal"], report
    assert report["tables"]["public.kinds"]["rows_compared"] == ROWS + 40 + extra
    assert report["tables"]["Sales Dept.Order Items"]["rows_compared"] == 4
    assert report["tables"]["public.keyed"]["rows_compared"] == 46

    # Nested values that differ are found: a map and a struct changed behind the workflow's back
    from deltalake import DeltaTable

    dt = DeltaTable(str(root / "public" / "kinds"))
    dt.update(predicate="id = 5", updates={"h": "NULL"})
    dt.update(predicate="id = 10", updates={"comp": "NULL"})
    report = vdiff.run(W, target, SparkRunner(spark), tables=["kinds"])
    found = report["tables"]["public.kinds"]
    assert (found["mismatched"], found["missing"], found["extra"]) == (2, 0, 0), found
    assert sorted(s["key"] for s in found["samples"]) == [["10"], ["5"]]


"""Values and names survive MoveTables unchanged, in the copy (COPY binary and text) and in replication
(pgoutput text -> COPY text into staging): every built-in type family with its edge values, enums,
unchanged TOAST values, composite keys, quoted names and collation-sensitive keys.

Equality is PostgreSQL's own text form of each whole row (`assert_same`), so a value that comes back
merely "close" (a float rounded, a JSON reformatted, a time zone shifted) fails.
"""

from __future__ import annotations

import json

import psycopg
import pytest
from psycopg import sql

from sluicegate.postgres.catalog import Table
from sluicegate.workflow.create import create_movetables

from ..conftest import EngineThread, wait_for
from .helpers import assert_same, caught_up, stream_row

pytestmark = pytest.mark.spark


def _reach(pair, workflow: str, condition, what: str) -> None:
    """Wait for condition(), failing at once with the stream's message if it lands in Error instead."""
    wait_for(lambda: condition() or stream_row(pair, workflow)["state"] == "Error", what=f"{workflow} {what}")
    s = stream_row(pair, workflow)
    assert s["state"] != "Error", f"{workflow} is in Error: {s['message']}"


def running(pair, workflow: str) -> None:
    _reach(pair, workflow, lambda: stream_row(pair, workflow)["state"] == "Running", "Running")


def settled(pair, workflow: str) -> None:
    _reach(pair, workflow, lambda: caught_up(pair, workflow), "caught up")


def copy_progress(pair) -> list[tuple]:
    """(table, lastpk as JSON text, done) per table: changes whenever a copy cycle commits."""
    return pair.dst("SELECT table_name, lastpk::text, done FROM sluicegate.copy_state ORDER BY ordinal")


def race_copy(pair, workflow: str, round_) -> int:
    """While the stream copies: round_(progress) once per copy cycle (so changes land between cycles,
    on both sides of lastpk), until Running. The number of rounds."""
    _reach(pair, workflow, lambda: stream_row(pair, workflow)["state"] != "Init", "Copying")
    rounds = 0
    while stream_row(pair, workflow)["state"] == "Copying":
        progress = copy_progress(pair)
        round_(progress)
        rounds += 1
        wait_for(lambda p=progress: copy_progress(pair) != p or stream_row(pair, workflow)["state"] != "Copying",
                 what="the next copy cycle")
    running(pair, workflow)
    return rounds


# -- 1. every type -----------------------------------------------------------------------------------

TYPE_COLUMNS = """
    i2 smallint, i4 integer, i8 bigint,
    num numeric, num12 numeric(12,2),
    f4 real, f8 double precision,
    t text, vc varchar(20), ch char(5),
    b bytea, flag boolean,
    d date, tm time, tmtz timetz, ts timestamp, tstz timestamptz, iv interval,
    u uuid, j json, jb jsonb,
    ia integer[], ta text[]
"""
ENUM_COLUMNS = ', m "Ref Data"."Mood Type", ma "Ref Data"."Mood Type"[]'

COLUMNS = ["i2", "i4", "i8", "num", "num12", "f4", "f8", "t", "vc", "ch", "b", "flag", "d", "tm", "tmtz",
           "ts", "tstz", "iv", "u", "j", "jb", "ia", "ta"]

# Text forms (as PostgreSQL accepts them); each row stresses a different edge of every column.
SAMPLES = [
    ("-32768", "-2147483648", "-9223372036854775808",
     "NaN", "1234567890.12",
     "NaN", "NaN",
     "emoji 😀👍🏽 CJK 漢字かな한국어 combining e\u0301 a\u0308", "ñ漢😀e\u0301", "ab",
     "\\x00", "true",
     "infinity", "00:00:00", "12:34:56.789+05:30", "infinity", "infinity",
     "1 year 2 mons -3 days 04:05:06.789",
     "00000000-0000-0000-0000-000000000000", '{ "b" : 1,  "a" : [1, 2 ,3], "b": 2 }',
     '{"b": 1, "a": {"c": null}}',
     "{1,NULL,3}", '{"a b","c,d","NULL",NULL,"\\"q\\"","back\\\\slash","😀",""}'),
    ("32767", "2147483647", "9223372036854775807",
     "-12345678901234567890123456789012345678901234.567890123456789012345678901234567890", "-0.01",
     "Infinity", "Infinity",
     "tab\there\nnewline\r\nCRLF back\\slash \\N \\. end", "tab\t\\nl\n", "\u00e9\u6f22",
     "\\x00ff00fe0d0a090a5c00", "false",
     "-infinity", "23:59:59.999999", "00:00:00-15:59", "-infinity", "-infinity", "-178000000 years",
     "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", '[ ]', '[1, "x", {"z": [], "a": 1.50}]',
     "{}", "{}"),
    ("0", "0", "0",
     "0.000000000000000000000000000000000000000000001", "0",
     "-Infinity", "-Infinity",
     "", "", "",
     "\\x", "true",
     "4713-01-01 BC", "24:00:00", "24:00:00+15:59", "4713-01-01 00:00:00 BC", "4713-01-01 00:00:00+00 BC",
     "00:00:00.000001",
     "ffffffff-ffff-ffff-ffff-ffffffffffff", '  {"s": "\\u00e9\\n\\"", "n": 1e400}  ', '"\\u00e9"',
     "{{1,2},{3,NULL}}", '{{"a","b"},{"c",NULL}}'),
    ("1", "-1", "42",
     "-Infinity", "9999999999.99",
     "3.4028235e+38", "0.30000000000000004",
     "NULL", "\\", "\\",
     "\\x5c4e", "false",
     "5874897-12-31", "12:00:00.5", "06:00:00.000001+00", "294276-12-31 23:59:59.999999",
     "294276-12-31 23:59:59.999999+00", "-1 days +23:59:59.999999",
     "123e4567-e89b-12d3-a456-426614174000", "null", "[]",
     "[0:2]={7,8,9}", '[-1:0]={"x",y}'),
    ("-1", "7", "-42",
     "123456789012345678901234567890123456789012345678901234567890", "-9999999999.99",
     "1.17549435e-38", "1e-310",
     "control chars \x01\x7f\x1b", "  leading spaces", " ",
     "\\xdeadbeef", "true",
     "2000-02-29", "01:02:03", "01:02:03.456789-07", "2024-02-29 12:34:56.123456",
     "2024-06-01 12:00:00.000001+14",
     "1000000 days 1000000:00:00",
     "6ba7b810-9dad-11d1-80b4-00c04fd430c8", '{"a":1,"a":2}', '{"big": 12345678901234567890.123}',
     "{-2147483648,2147483647}", '{"{}","[]","\\t"}'),
    ("2", "3", "5",
     "0.1", "0.10",
     "0.1", "2.2250738585072014e-308",
     "ascii", "x", "abcde",
     "\\x01", "false",
     "1970-01-01", "13:00:00", "13:00:00+00", "1970-01-01 00:00:00", "1969-12-31 23:59:59.999999+00",
     "-00:00:00.000001",
     "00000000-0000-0000-0000-000000000001", '{"x": "tab\\tnewline\\n"}', '{"emoji": "😀", "e": "e\u0301"}',
     "{NULL}", "{NULL,NULL}"),
]
MOODS = [  # (enum, enum[]) for each sample row
    ("happy", '{happy,NULL,"with space"}'), ("it's, \"q\"", '{"it\'s, \\"q\\""}'),
    ("Ünïcode", "{Ünïcode,sad}"), ("sad", "{{sad,ok},{ok,sad}}"), ("ok", "{NULL}"), ("with space", '{"with space"}'),
]


def insert_samples(conn: psycopg.Connection, base: int) -> None:
    """Every sample row into both tables (ids base+1..), plus a row with NULL in every non-key column."""
    cols = sql.SQL(", ").join(map(sql.Identifier, ["id", *COLUMNS]))
    marks = sql.SQL(", ").join(sql.Placeholder() * (len(COLUMNS) + 1))
    for i, row in enumerate(SAMPLES, start=1):
        conn.execute(sql.SQL("INSERT INTO builtin ({}) VALUES ({})").format(cols, marks), (base + i, *row))
        conn.execute(sql.SQL("INSERT INTO everything ({}, m, ma) VALUES ({}, %s, %s)").format(cols, marks),
                     (base + i, *row, *MOODS[i - 1]))
    conn.execute("INSERT INTO builtin (id) VALUES (%s)", (base + 99,))
    conn.execute("INSERT INTO everything (id) VALUES (%s)", (base + 99,))


def test_every_type_round_trips(pair, spark):
    pair.src('CREATE SCHEMA "Ref Data"')
    pair.src("""CREATE TYPE "Ref Data"."Mood Type" AS ENUM ('sad', 'ok', 'happy', 'with space', 'Ünïcode',
                                                         'it''s, "q"')""")
    # Twins: `builtin` is copied with binary COPY, `everything` (it has enums) with text COPY.
    pair.src(sql.SQL("CREATE TABLE builtin (id int PRIMARY KEY, {})").format(sql.SQL(TYPE_COLUMNS)))
    pair.src(sql.SQL("CREATE TABLE everything (id int PRIMARY KEY, {}{})").format(
        sql.SQL(TYPE_COLUMNS), sql.SQL(ENUM_COLUMNS)))
    with psycopg.connect(pair.source, autocommit=True) as c:
        insert_samples(c, 0)
    create_movetables("types", pair.source, pair.target, ["builtin", "everything"], [], {})
    specs = dict(pair.dst("SELECT table_name, spec FROM sluicegate.copy_state"))
    assert Table.from_json(specs["public.builtin"]).binary_copy_safe  # both COPY formats are exercised
    assert not Table.from_json(specs["public.everything"]).binary_copy_safe
    rows = len(SAMPLES) + 1
    with EngineThread(spark, pair.target, "types"):
        running(pair, "types")
        assert assert_same(pair, "public.builtin", ["id"]) == rows
        assert assert_same(pair, "public.everything", ["id"]) == rows
        with psycopg.connect(pair.source, autocommit=True) as c:
            insert_samples(c, 100)  # the same values again, now through pgoutput
            every = sql.SQL(", ").join(map(sql.Identifier, COLUMNS))
            for table in ("builtin", "everything"):
                t = sql.Identifier(table)
                # Rotate the copied rows' values (1 <- 2 <- ... <- 6 <- all-NULL 99 <- 1): every edge value
                # is written by an UPDATE, values become NULL and NULLs become values.
                c.execute(sql.SQL(
                    "UPDATE {t} d SET ({c}) = (SELECT {c} FROM {t} s WHERE s.id = CASE d.id WHEN 99 THEN 1 "
                    "WHEN 6 THEN 99 ELSE d.id + 1 END) WHERE d.id < 100").format(t=t, c=every))
                c.execute(sql.SQL("UPDATE {t} SET ({c}) = (SELECT {c} FROM {t} WHERE id = 101) "
                                  "WHERE id = 199").format(t=t, c=every))
                c.execute(sql.SQL("UPDATE {t} SET ({c}) = ROW({n}) WHERE id = 101").format(
                    t=t, c=every, n=sql.SQL(", ").join([sql.NULL] * len(COLUMNS))))
                c.execute(sql.SQL("DELETE FROM {} WHERE id = 102").format(t))
            c.execute("""UPDATE everything SET m = 'Ünïcode', ma = '{{"with space"}}'
                         WHERE id IN (3, 103)""")
        settled(pair, "types")
        assert assert_same(pair, "public.builtin", ["id"]) == 2 * rows - 1
        assert assert_same(pair, "public.everything", ["id"]) == 2 * rows - 1
    # The comparison above could fail on exactly these: a float needing all 17 digits, a json value's
    # own spelling (whitespace, duplicate keys), a text full of COPY's escape characters.
    f8_is_sum = "SELECT f8 = 0.1::float8 + 0.2::float8 FROM builtin WHERE id IN (3, 104)"
    assert pair.dst(f8_is_sum) == [(True,), (True,)]
    assert pair.dst("SELECT j::text, t FROM everything WHERE id = 103") == [(SAMPLES[2][19], SAMPLES[2][7])]
    assert pair.dst("SELECT t FROM everything WHERE id = 1") == [(SAMPLES[1][7],)]


# -- 2. unchanged TOAST values ------------------------------------------------------------------------

BIG = "SELECT string_agg(md5(%s || g::text), '') FROM generate_series(1, 3300) g"  # ~105 KB, incompressible
DOCS = "SELECT id, n, md5(big), length(big), small FROM {} ORDER BY id"


def test_unchanged_toast_survives_updates(pair, spark):
    # `docs` has the default replica identity (updates carry no old values); `docs_full` has FULL.
    for name in ("docs", "docs_full"):
        t = sql.Identifier(name)
        pair.src(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY, n int NOT NULL DEFAULT 0, big text, "
                         "small text)").format(t))
        # always out of line and uncompressed: the kind of value pgoutput leaves out of an update
        pair.src(sql.SQL("ALTER TABLE {} ALTER COLUMN big SET STORAGE EXTERNAL").format(t))
        with psycopg.connect(pair.source, autocommit=True) as c:
            insert = sql.SQL("INSERT INTO {} (id, big, small) SELECT %s, ({}), 'x'").format(t, sql.SQL(BIG))
            for i in [*range(-4, 0), *range(1, 7), 91, 92]:  # 1..6 change while Running, the others in the copy
                c.execute(insert, (i, f"seed{i}"))
    pair.src("ALTER TABLE docs_full REPLICA IDENTITY FULL")
    create_movetables("toast", pair.source, pair.target, ["docs", "docs_full"], [],
                      {"cycle_rows": 2, "chunk_rows": 1})
    moved = set()

    def move_copied_rows(progress):
        """Rows at or below lastpk change key, keeping their big value: to stay below, and to go above."""
        with psycopg.connect(pair.source, autocommit=True) as c:
            for name, lastpk, done in progress:
                if lastpk is None or done:
                    continue
                t = sql.Identifier(*name.split("."))
                below = sql.SQL("SELECT id FROM {} WHERE id BETWEEN -99 AND -1 AND id <= %s ORDER BY id")
                below = below.format(t)
                ids = [r[0] for r in c.execute(below, (int(json.loads(lastpk)[0]),))]
                move = sql.SQL("UPDATE {} SET id = %s WHERE id = %s").format(t)
                if ids:
                    c.execute(move, (ids[0] - 100, ids[0]))  # stays below lastpk
                    moved.add(name)
                if len(ids) > 1:
                    c.execute(move, (ids[1] + 1000, ids[1]))  # goes above lastpk: the copy brings it
                if name == "public.docs_full":  # from above lastpk: only the full old row has the value
                    above = c.execute("SELECT min(id) FROM docs_full WHERE id BETWEEN 90 AND 99").fetchone()[0]
                    if above is not None:
                        c.execute(move, (above - 200, above))

    with EngineThread(spark, pair.target, "toast"):
        race_copy(pair, "toast", move_copied_rows)
        assert moved == {"public.docs", "public.docs_full"}
        with psycopg.connect(pair.source, autocommit=True) as c:
            for t in (sql.Identifier("docs"), sql.Identifier("docs_full")):
                def run(stmt, *params, t=t):
                    c.execute(sql.SQL(stmt).format(t=t, big=sql.SQL(BIG)), params or None)

                run("UPDATE {t} SET n = n + 1 WHERE id = 1")  # alone in its transaction
                with c.transaction():  # twice in one transaction
                    run("UPDATE {t} SET n = n + 1 WHERE id = 2")
                    run("UPDATE {t} SET n = n + 1, small = 'y' WHERE id = 2")
                with c.transaction():  # insert, then update the same row, in one transaction
                    run("INSERT INTO {t} (id, big) SELECT 10, ({big})", "ten")
                    run("UPDATE {t} SET n = 5 WHERE id = 10")
                with c.transaction():  # one row keeps its value while another's changes, in one statement
                    run("UPDATE {t} SET n = n + 1, big = CASE id WHEN 4 THEN ({big}) ELSE big END "
                        "WHERE id IN (3, 4)", "four")
                run("UPDATE {t} SET small = NULL WHERE id = 3")  # a later transaction keeps it too
                # The key changes and the big value does not: the new row must still get it.
                run("UPDATE {t} SET id = 50 WHERE id = 5")
                with c.transaction():
                    run("UPDATE {t} SET n = n + 1 WHERE id = 6")
                    run("UPDATE {t} SET id = 60 WHERE id = 6")
                    run("INSERT INTO {t} (id, big) SELECT 11, ({big})", "eleven")
                    run("UPDATE {t} SET id = 61 WHERE id = 11")
                    run("UPDATE {t} SET n = 7 WHERE id = 61")
        settled(pair, "toast")
        for name in ("docs", "docs_full"):
            query = sql.SQL(DOCS).format(sql.Identifier(name))
            src, dst = pair.src(query), pair.dst(query)
            assert len(src) == 14 and min(r[3] for r in src) > 100_000
            assert dst == src, f"{name}: the target lost or changed big values"
            assert_same(pair, f"public.{name}", ["id"])  # everything else too
        # the big values really are stored out of line, uncompressed: the kind pgoutput leaves out
        assert pair.src("SELECT min(pg_column_size(big)) FROM docs")[0][0] > 100_000


# -- 3. composite keys, quoted names, collation-sensitive and uuid keys ---------------------------------

TEXT_KEYS = ["a", "A", "b", "B", "ab", "aB", "Ab", "AB", "e", "é", "E", "É", "z", "Z", "ä", "Ä",
             "a b", "a-b", "a_b", "ß", "ss", "SS", "0", "9", "10", "Æ", "æ", "ǅ", "Ω", "ω", "中", "😀", " ", "~"]
ORDER_ITEMS = [sql.Identifier("public", "Order Items"), sql.Identifier("Sales Dept", "Order Items")]


def _names_writes(c: psycopg.Connection, r: int) -> None:
    """Round r of changes to every table: below and above any copy position, keys moving across it."""
    for t in ORDER_ITEMS:
        def run(stmt, *params, t=t):
            c.execute(sql.SQL(stmt).format(t=t), params)

        run("""INSERT INTO {t} ("Order Id", line, "select", "Mixed Case")
               VALUES (%s, %s, %s, %s), (%s, 1, 'late', 0)""",
            r % 3 + 1, 100 + r, f"new {r}", r, 1000 + r)
        run("""UPDATE {t} SET "Mixed Case" = "Mixed Case" + 1, "select" = "select" || '!'
               WHERE mod("Order Id" + line + %s, 4) = 0""", r)
        run("""UPDATE {t} SET line = line + 500 WHERE "Order Id" = %s AND line = 2""", r % 3 + 1)
        run("""DELETE FROM {t} WHERE "Order Id" = %s AND line = 3""", (r + 1) % 3 + 1)
        # keys that move from low to high, and from high to low
        run("""UPDATE {t} SET "Order Id" = 2000 + %s WHERE "Order Id" = %s AND line = 4""", r, r % 3 + 1)
        run("""UPDATE {t} SET "Order Id" = -%s WHERE "Order Id" = %s""", r, 1000 + r - 1)
    k = TEXT_KEYS[r % len(TEXT_KEYS)]
    c.execute('INSERT INTO "CaseKeys" (k, v) VALUES (%s, %s), (%s, %s) ON CONFLICT (k) DO UPDATE SET v = -1',
              (k + k.swapcase(), r, k.upper() + str(r), r))
    c.execute('UPDATE "CaseKeys" SET v = v + 1 WHERE k = %s', (TEXT_KEYS[(r * 7) % len(TEXT_KEYS)],))
    c.execute('UPDATE "CaseKeys" SET k = k || %s WHERE k = %s',
              (f" moved{r}", TEXT_KEYS[(r * 5) % len(TEXT_KEYS)]))
    c.execute('UPDATE "CaseKeys" SET k = upper(k) || lower(k) || %s WHERE k = %s',
              (str(r), TEXT_KEYS[(r * 11 + 2) % len(TEXT_KEYS)]))
    c.execute('DELETE FROM "CaseKeys" WHERE k = %s', (TEXT_KEYS[(r * 3 + 1) % len(TEXT_KEYS)],))
    c.execute("INSERT INTO uuid_keys (id, v) SELECT gen_random_uuid(), %s FROM generate_series(1, 2)",
              (f"r{r}",))
    c.execute("UPDATE uuid_keys SET v = v || '+' WHERE id = (SELECT id FROM uuid_keys ORDER BY v, id LIMIT 1)")
    c.execute("UPDATE uuid_keys SET id = gen_random_uuid() "
              "WHERE id = (SELECT id FROM uuid_keys ORDER BY id DESC LIMIT 1)")
    c.execute("DELETE FROM uuid_keys WHERE id = (SELECT id FROM uuid_keys ORDER BY id LIMIT 1)")


def test_awkward_names_and_keys(pair, spark):
    pair.src('CREATE SCHEMA "Sales Dept"')
    for t in ORDER_ITEMS:
        pair.src(sql.SQL("""CREATE TABLE {} ("Order Id" bigint, line int, "select" text, "Mixed Case" int,
                                             PRIMARY KEY ("Order Id", line))""").format(t))
        pair.src(sql.SQL("""INSERT INTO {} SELECT o, l, 'item ' || o || '/' || l, o * l
                            FROM generate_series(1, 3) o, generate_series(1, 4) l""").format(t))
    # The key's collation orders 'a' < 'B' (C would say 'B' < 'a'): ranges and lastpk must follow it.
    pair.src('CREATE TABLE "CaseKeys" (k text COLLATE "en-x-icu" PRIMARY KEY, v int)')
    pair.src('INSERT INTO "CaseKeys" SELECT k, ord FROM unnest(%s::text[]) WITH ORDINALITY u(k, ord)',
             (TEXT_KEYS,))
    pair.src("CREATE TABLE uuid_keys (id uuid PRIMARY KEY, v text)")
    pair.src("INSERT INTO uuid_keys SELECT gen_random_uuid(), 'u' || g FROM generate_series(1, 15) g")
    tables = ["public.Order Items", "Sales Dept.Order Items", "CaseKeys", "uuid_keys"]
    # Tiny cycles: many snapshots, so lastpk comparisons on every key type decide which changes apply.
    create_movetables("names", pair.source, pair.target, tables, [], {"cycle_rows": 7, "chunk_rows": 3})
    assert pair.dst("""SELECT collation_name FROM information_schema.columns
                       WHERE table_name = 'CaseKeys' AND column_name = 'k'""") == [("en-x-icu",)]
    keys = {
        "public.Order Items": ["Order Id", "line"], "Sales Dept.Order Items": ["Order Id", "line"],
        "public.CaseKeys": ["k"], "public.uuid_keys": ["id"],
    }
    raced = set()  # tables that took changes while partly copied
    with EngineThread(spark, pair.target, "names"), psycopg.connect(pair.source, autocommit=True) as c:
        rounds = iter(range(1000))

        def one_round(progress):
            raced.update(name for name, lastpk, done in progress if lastpk is not None and not done)
            _names_writes(c, next(rounds))

        race_copy(pair, "names", one_round)
        assert raced == set(keys), f"only {sorted(raced)} took changes while partly copied"
        for r in range(1000, 1005):
            _names_writes(c, r)
        settled(pair, "names")
        for table, key in keys.items():
            assert assert_same(pair, table, key) > 0

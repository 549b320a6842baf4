"""Copy rate of a wide table of many column types: native logical replication, pgcopydb and Sluicegate, same run.

    .venv/bin/python bench/wide.py                 # 300,000 rows: native, pgcopydb, Sluicegate, native again
    .venv/bin/python bench/wide.py --rows 50000    # a quick check

Two throwaway servers (127.0.0.1, temp dir). The source table has ~30 columns: integers, numerics, floats,
text and varchar, char(n), bytea, dates and times with zones, intervals, uuid, inet, json and jsonb, arrays
(with NULL elements, two-dimensional), a range, a multirange, tsvector, money, bit strings, an enum, a
composite type and hstore, each ~8% NULL. Native (`CREATE SUBSCRIPTION` into a table made by the same DDL)
copies until `pg_subscription_rel` is 'r'; Sluicegate (`movetables create` + `workflow run`, which makes its
own target table) until the stream is Running; pgcopydb (`pgcopydb clone --table-jobs 2 --index-jobs 2` of the
source database into a fresh one: extension, types, table, rows, key) from start to exit, between native's
first copy and Sluicegate's. Every result is checked against the source by a digest of the rows' text forms.
One JSON line on stdout: seconds, rows/s and MB/s of each, and the ratios Sluicegate ÷ native (the faster of
native's two copies, and their mean) and ÷ pgcopydb (issue 37's goal: ≤ 1.0).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from psycopg import sql

from sluicegate.localpg import LocalPostgres
from sluicegate.workflow.create import create_movetables

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pgcopydb_copy  # bench/'s own module, beside this script
from cpu_profile import CpuProfile

DB, WF, PUB = "bench", "wide", "bench_wide"

TYPES_DDL = """
CREATE EXTENSION IF NOT EXISTS hstore;
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE TYPE address AS (street text, zip int, tags text[]);
"""
TABLE_DDL = """
CREATE TABLE wide (
    id bigint PRIMARY KEY, i2 smallint, i4 int, num numeric(14,4), numu numeric, f4 real, f8 float8,
    t text, vc varchar(40), ch char(8), b bytea, flag boolean, d date, ts timestamp, tstz timestamptz,
    tm time, iv interval, u uuid, ip inet, j json, jb jsonb, ia int[], ta text[], im int[][],
    r int4range, mr int4multirange, tsv tsvector, m money, bits bit(12), vb varbit, md mood,
    addr address, hs hstore)
"""
FILL = """
INSERT INTO wide SELECT g,
    nullif(g %% 32000, 7)::smallint, g * 7, (g * 1.0001)::numeric(14,4), g / 7.0, g / 3.0, g / 7.0,
    repeat(md5(g::text), 2), 'vc ' || g, left(md5(g::text), 5), decode(md5(g::text), 'hex'), g %% 2 = 0,
    date '2000-01-01' + g %% 9000, timestamp '2000-01-01' + g * interval '17 min',
    timestamptz '2000-01-01 00:00+00' + g * interval '13 min', time '00:00' + g * interval '1 s',
    make_interval(0, g %% 12, 0, g %% 28, g %% 24, g %% 60, 0.5), md5(g::text)::uuid,
    ('10.' || g %% 256 || '.' || g / 256 %% 256 || '.1')::inet,
    json_build_object('id', g, 'name', 'n' || g), jsonb_build_object('id', g, 'tags', jsonb_build_array(g, 'x')),
    ARRAY[g, NULL, g + 1], ARRAY['a ' || g, NULL, 'q"uote'], ARRAY[[g, g + 1], [g + 2, NULL]],
    int4range(g, g + 10), int4multirange(int4range(g, g + 2), int4range(g + 5, g + 9)),
    to_tsvector('english', 'the quick brown fox ' || g), (g %% 100000)::money,
    (g %% 4096)::bit(12), (g %% 255)::bit(8)::varbit, (ARRAY['sad', 'ok', 'happy'])[1 + g %% 3]::mood,
    ROW('street ' || g, g %% 99999, ARRAY['t' || g])::address,
    hstore(ARRAY['k', 'v' || g, 'n', NULL])
FROM generate_series(1, %s) g
"""
NULLS = "UPDATE wide SET t = NULL, j = NULL, ia = NULL, addr = NULL, hs = NULL, iv = NULL WHERE id % 12 = 0"
DIGEST = "SELECT count(*), md5(string_agg(w::text, E'\\n' ORDER BY id)) FROM wide w"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def one(url: str, query, params=None):
    with psycopg.connect(url, autocommit=True) as c:
        return c.execute(query, params).fetchone()


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


def copy_native(source: LocalPostgres, target: LocalPostgres, db: str, timeout: float) -> float:
    target.create_database(db)
    target.psql(TYPES_DDL + TABLE_DDL, db)
    url = target.url(db)
    t = time.monotonic()
    target.psql(sql.SQL("CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {}").format(
        sql.Identifier(f"sub_{db}"), sql.Literal(source.url(DB)), sql.Identifier(PUB)), db)
    wait_for(lambda: one(url, "SELECT bool_and(srsubstate = 'r') FROM pg_subscription_rel")[0], timeout,
             "the native subscription's initial sync")
    elapsed = time.monotonic() - t
    target.psql(sql.SQL("DROP SUBSCRIPTION {}").format(sql.Identifier(f"sub_{db}")), db)
    return elapsed


def copy_pgcopydb(source: LocalPostgres, target: LocalPostgres, tmp: Path, jobs: int, timeout: float) -> dict:
    """`pgcopydb clone` of the source database into a fresh one: hstore, the types, the table, its rows and key.
    Its post-data also restores the publication (one statement)."""
    target.create_database("pgcopydb")
    return pgcopydb_copy.clone(source.url(DB, with_password=False), target.url("pgcopydb", with_password=False),
                               source.password, tmp / "pgcopydb", jobs=jobs, timeout=timeout)


def copy_sluicegate(source: LocalPostgres, target: LocalPostgres, tmp: Path, timeout: float,
                    profile: CpuProfile | None = None, profile_dir: Path | None = None) -> float:
    """profile: charges every process's CPU from create until Running (stopped here then); the driver then
    runs under cProfile (profile_dir/driver.prof)."""
    target.create_database("sg")
    url = target.url("sg")
    t = time.monotonic()
    create_movetables(WF, source.url(DB), url, ["wide"], [], {})
    cmd = [sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", WF, "--target", url, "--no-progress"]
    if profile_dir:
        profile_dir.mkdir(parents=True, exist_ok=True)
        cmd[1:1] = ["-m", "cProfile", "-o", str(profile_dir / "driver.prof")]
    with open(tmp / "workflow-run.log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if profile:
        profile.root = proc.pid
    try:
        def running() -> bool:
            if proc.poll() is not None:
                raise SystemExit(f"workflow run exited: {(tmp / 'workflow-run.log').read_text()[-1500:]}")
            state, message = one(url, "SELECT state, message FROM sluicegate.streams WHERE workflow = %s", (WF,))
            if state == "Error":
                raise SystemExit(f"Sluicegate workflow in Error: {message}")
            return state == "Running"
        wait_for(running, timeout, "Sluicegate's copy (state Running)")
        elapsed = time.monotonic() - t
        if profile:
            profile.stop()
        return elapsed
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--pgcopydb-jobs", type=int, default=2,
                        help="pgcopydb clone's --table-jobs and --index-jobs (default 2: this machine's cores)")
    parser.add_argument("--profile", metavar="DIR", type=Path,
                        help="CPU seconds of every process by group during pgcopydb's and Sluicegate's copies (in "
                             "the JSON), and Sluicegate's driver under cProfile (DIR/driver.prof)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sluicegate-bench-wide-"))
    settings = {"max_wal_size": "4GB"}
    source = LocalPostgres(tmp / "source", settings=settings)
    target = LocalPostgres(tmp / "target", settings={**settings, "wal_retrieve_retry_interval": "100ms"})
    pgpass = tmp / "pgpass"
    pgpass.write_text(f"{source.host}:*:*:{source.user}:{source.password}\n")
    pgpass.chmod(0o600)
    os.environ["PGPASSFILE"] = str(pgpass)
    out: dict = {"rows": args.rows, "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0]}
    try:
        source.start()
        target.start()
        source.create_database(DB)
        source.psql(TYPES_DDL + TABLE_DDL, DB)
        log(f"loading {args.rows} rows")
        with psycopg.connect(source.url(DB), autocommit=True) as c:
            c.execute(FILL, (args.rows,))
            c.execute(NULLS)
            c.execute("VACUUM ANALYZE wide")
            out["table_mb"] = round(float(c.execute("SELECT pg_table_size('wide') / 1e6").fetchone()[0]), 1)
            c.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE wide").format(sql.Identifier(PUB)))
        expected = one(source.url(DB), DIGEST)
        log("native copy")
        out["native_s"] = round(copy_native(source, target, "native", args.timeout), 2)
        assert one(target.url("native"), DIGEST) == expected, "native's copy differs from the source"
        log("pgcopydb clone")

        def profiler() -> CpuProfile | None:
            if not args.profile:
                return None
            profile = CpuProfile({"source": source.pid, "target": target.pid}, os.getpid())
            profile.start()
            return profile

        profile = profiler()
        done = copy_pgcopydb(source, target, tmp, args.pgcopydb_jobs, args.timeout)
        if profile:
            out["profile_pgcopydb"] = profile.stop()
        out["pgcopydb_s"], out["pgcopydb_command"] = round(done["seconds"], 2), done["command"]
        assert one(target.url("pgcopydb"), DIGEST) == expected, "pgcopydb's copy differs from the source"
        target.drop_database("pgcopydb")
        log("Sluicegate copy")
        profile = profiler()
        out["sluicegate_s"] = round(copy_sluicegate(source, target, tmp, args.timeout, profile, args.profile), 2)
        if profile:
            out["profile_sluicegate"] = profile.stop()
        assert one(target.url("sg"), DIGEST) == expected, "Sluicegate's copy differs from the source"
        log("native copy again")
        out["native_again_s"] = round(copy_native(source, target, "native2", args.timeout), 2)
        assert one(target.url("native2"), DIGEST) == expected, "native's second copy differs from the source"
        for who in ("native", "pgcopydb", "sluicegate", "native_again"):
            out[f"{who}_rows_per_s"] = round(args.rows / out[f"{who}_s"])
            out[f"{who}_mb_per_s"] = round(out["table_mb"] / out[f"{who}_s"], 1)
        out["ratio_native_faster"] = round(out["sluicegate_s"] / min(out["native_s"], out["native_again_s"]), 3)
        out["ratio_native_mean"] = round(out["sluicegate_s"] / ((out["native_s"] + out["native_again_s"]) / 2), 3)
        out["ratio_pgcopydb"] = round(out["sluicegate_s"] / out["pgcopydb_s"], 3)
        out["goals_met"] = {"ratio_pgcopydb <= 1.0": out["ratio_pgcopydb"] <= 1.0}
        out["loadavg_end"] = os.getloadavg()[0]
        print(json.dumps(out))
        return 0
    finally:
        for server in (target, source):
            try:
                server.stop()
            except Exception as exc:  # noqa: BLE001 - best effort at exit
                log(f"stopping {server.datadir}: {exc}")
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

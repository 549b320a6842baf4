"""Many small tables (issue 37, "Many tables"): native logical replication, pgcopydb and Sluicegate, same run.

    .venv/bin/python bench/many_tables.py                  # 2,000 tables of ~200 rows + one of 500,000 rows
    .venv/bin/python bench/many_tables.py --tables 200     # a quick check while developing

Two throwaway servers (127.0.0.1, temp dir). The source has a schema per tenant (`--per-schema` tables
each), every table with a primary key and a few columns (bigint, int, text, timestamptz, numeric), plus
`--large` tables of `--large-rows` rows in schema public. Native (CREATE PUBLICATION FOR ALL TABLES, then
CREATE SUBSCRIPTION into the same DDL on the target) is measured until every table of pg_subscription_rel is
'r'; pgcopydb (`pgcopydb clone --table-jobs 2 --index-jobs 2` of the whole database into a fresh one: tables,
rows, keys) from start to exit; Sluicegate (`movetables create` of every tenant schema and public, `workflow
run`) from create until the stream is Running with every table done. Order: native, pgcopydb, Sluicegate.
Row counts of all are checked against the source. One JSON line on stdout: seconds of each, the create's
share, tables/s, and the ratios Sluicegate ÷ native and ÷ pgcopydb (issue 37's goal: ≤ 1.0× pgcopydb).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pgcopydb_copy
from cpu_profile import CpuProfile
from run import DB, WF, Bench, BenchError, connect, cpu_times, fmt, log, one, run_bench, wait_for

from sluicegate.workflow.create import create_movetables

PUB, SUB = "many_pub", "many_sub"
SMALL_DDL = ("CREATE TABLE {} (id bigint PRIMARY KEY, account int NOT NULL, name text, "
             "created_at timestamptz NOT NULL, amount numeric(12,2))")
SMALL_FILL = ("INSERT INTO {} SELECT g, g % 97, 'name ' || md5(g::text), "
              "timestamptz '2026-01-01 00:00+00' + g * interval '1 min', g / 7.0 "
              "FROM generate_series(1, {}) g")


class ManyTables(Bench):
    def __init__(self, args):
        args.target_settings = getattr(args, "target_settings", [])
        args.drop_caches, args.scale, args.skip = False, 0, []
        super().__init__(args)
        self.out = {"tables": args.tables, "rows_per_table": args.rows, "large_tables": args.large,
                    "large_rows": args.large_rows, "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0]}
        self.names: list[str] = []  # every table, qualified

    def schemas(self) -> list[str]:
        n = -(-self.args.tables // self.args.per_schema)
        return [f"tenant_{i:04d}" for i in range(n)]

    def ddl(self) -> str:
        """Every table's CREATE TABLE (the source's, and native's target)."""
        out = []
        left = self.args.tables
        for schema in self.schemas():
            out.append(f"CREATE SCHEMA {schema};")
            for j in range(min(self.args.per_schema, left)):
                out.append(SMALL_DDL.format(f"{schema}.t{j:03d}") + ";")
            left -= self.args.per_schema
        for i in range(self.args.large):
            out.append(SMALL_DDL.format(f"public.large_{i}") + ";")
        return "\n".join(out)

    def setup(self) -> None:
        log(f"starting servers in {self.tmp}")
        self.source.start()
        self.target.start()
        self.source.create_database(DB)
        for db in ("native", "sg"):
            self.target.create_database(db)
        t = time.monotonic()
        self.source.psql(self.ddl(), DB)
        left = self.args.tables
        for schema in self.schemas():
            fills = [SMALL_FILL.format(f"{schema}.t{j:03d}", self.args.rows)
                     for j in range(min(self.args.per_schema, left))]
            left -= self.args.per_schema
            self.source.psql(";".join(fills), DB)
        for i in range(self.args.large):
            self.source.psql(SMALL_FILL.format(f"public.large_{i}", self.args.large_rows), DB)
        self.source.psql("VACUUM (ANALYZE)", DB)
        self.names = [f"{s}.{n}" for s, n in (r.split("\t") for r in self.source.psql(
            "SELECT schemaname, relname FROM pg_stat_user_tables ORDER BY 1, 2", DB).splitlines() if r)]
        self.rows = self.out["rows"] = self.total_rows(self.source.url(DB))
        log(f"made {len(self.names)} tables, {self.rows} rows in {time.monotonic() - t:.1f}s")

    def total_rows(self, url: str) -> int:
        union = " UNION ALL ".join(f"SELECT count(*) AS n FROM {n}" for n in self.names)
        return int(one(url, f"SELECT sum(n) FROM ({union}) c")[0])

    def check_rows(self, url: str, who: str) -> None:
        n = self.total_rows(url)
        if n != self.rows:
            raise BenchError(f"{who}: the target has {n} rows in its {len(self.names)} tables, the source {self.rows}")

    def copy_native(self, db: str = "native", sub: str = SUB) -> float:
        url = self.target.url(db)
        if not self.published:
            self.source.psql(sql.SQL("CREATE PUBLICATION {} FOR ALL TABLES").format(sql.Identifier(PUB)), DB)
            self.published = True
        self.target.psql(self.ddl(), db)
        t = time.monotonic()
        self.target.psql(sql.SQL("CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {}").format(
            sql.Identifier(sub), sql.Literal(self.source.url(DB)), sql.Identifier(PUB)), db)
        self.contenders["native"] = url
        with connect(url) as conn:
            ready = "SELECT count(*) FILTER (WHERE srsubstate = 'r') = %s FROM pg_subscription_rel"
            wait_for(lambda: conn.execute(ready, (len(self.names),)).fetchone()[0], self.args.timeout,
                     "the native subscription's initial sync of every table (pg_subscription_rel state 'r')")
        elapsed = time.monotonic() - t
        self.check_rows(url, "native subscription")
        return elapsed

    def copy_pgcopydb(self) -> float:
        """`pgcopydb clone` of the whole source database (every tenant schema and public) into a fresh one,
        timed from start to exit. Its post-data also restores native's publication (one statement)."""
        self.target.create_database("pgcopydb")
        profile = self.profiler()
        try:
            done = pgcopydb_copy.clone(
                self.source.url(DB, with_password=False), self.target.url("pgcopydb", with_password=False),
                self.source.password, self.tmp / "pgcopydb", jobs=self.args.pgcopydb_jobs,
                timeout=self.args.timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            raise BenchError(str(exc)) from None
        if profile:
            self.out["profile_pgcopydb"] = profile.stop()
        self.check_rows(self.target.url("pgcopydb"), "pgcopydb")
        self.target.drop_database("pgcopydb")
        self.out["pgcopydb_command"] = done["command"]
        return done["seconds"]

    def profiler(self) -> CpuProfile | None:
        """--profile: every process's CPU during a copy, by group (cpu_profile.py)."""
        if not self.args.profile:
            return None
        profile = CpuProfile({"source": self.source.pid, "target": self.target.pid}, os.getpid())
        profile.start()
        return profile

    def copy_sluicegate(self) -> dict:
        url = self.target.url("sg")
        profile = self.profiler()
        t0 = time.monotonic()
        tables = [f"{s}.*" for s in self.schemas()] + (["public.*"] if self.args.large else [])
        create_movetables(WF, self.source.url(DB), url, tables, [], {})
        created = time.monotonic()
        cmd = [sys.executable, "-m", "sluicegate.cli.main", "-v", "workflow", "run", WF, "--target", url,
               "--no-progress"]
        if profile:
            Path(self.args.profile).mkdir(parents=True, exist_ok=True)
            cmd[1:1] = ["-m", "cProfile", "-o", str(Path(self.args.profile) / "driver.prof")]
        with open(self.wf_log, "w") as out:
            self.workflow = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.memory.root = self.workflow.pid
        if profile:
            profile.root = self.workflow.pid
        poll = sql.SQL("""SELECT s.state, s.message, count(*) FILTER (WHERE c.done), count(*)
            FROM sluicegate.streams s JOIN sluicegate.copy_state c ON c.stream_id = s.id
            WHERE s.workflow = {} GROUP BY s.id""").format(sql.Literal(WF))
        seen = [0, time.monotonic()]
        with connect(url) as conn:
            def ready() -> bool:
                self.check_workflow()
                state, message, done, total = conn.execute(poll).fetchone()
                conn.rollback()
                if state == "Error":
                    raise BenchError(f"Sluicegate workflow {WF} is in Error: {message}")
                if done != seen[0] and time.monotonic() - seen[1] > 10:
                    log(f"sluicegate: {done}/{total} tables copied")
                    seen[:] = [done, time.monotonic()]
                return state == "Running" and done == total
            wait_for(ready, self.args.timeout, f"Sluicegate workflow {WF} to finish copying (state Running)",
                     interval=0.2)
        done = time.monotonic()
        if profile:
            self.out["profile_sluicegate"] = profile.stop()
        self.contenders["sluicegate"] = url
        self.check_rows(url, "Sluicegate")
        return {"sluicegate_s": done - t0, "sluicegate_create_s": created - t0,
                "sluicegate_run_s": done - created}

    def run(self) -> dict:
        self.memory.start()
        self.setup()
        copy: dict = {}
        cpu: dict = {}

        @contextlib.contextmanager
        def machine(name: str):
            before = cpu_times()
            yield
            after = cpu_times()
            if before and after:
                cpu[name] = {k: round(after[k] - before[k], 2) for k in before}

        if "native" not in self.args.skip:
            log(f"copy: native subscription of {len(self.names)} tables")
            self.quiesce()
            with machine("native"):
                copy["native_s"] = self.copy_native()
            self.copied.append("native")
        if "pgcopydb" not in self.args.skip:
            log(f"copy: pgcopydb clone of {len(self.names)} tables")
            self.quiesce()
            with machine("pgcopydb"):
                copy["pgcopydb_s"] = self.copy_pgcopydb()
        if "sluicegate" not in self.args.skip:
            log(f"copy: Sluicegate movetables create + workflow run of {len(self.names)} tables")
            self.quiesce()
            with machine("sluicegate"):
                copy.update(self.copy_sluicegate())
        copy["cpu_s"] = cpu
        if "native_s" in copy and "sluicegate_s" in copy:
            copy["ratio_native"] = copy["sluicegate_s"] / copy["native_s"]
        if "pgcopydb_s" in copy and "sluicegate_s" in copy:
            copy["ratio_pgcopydb"] = copy["sluicegate_s"] / copy["pgcopydb_s"]
            copy["goals_met"] = {"ratio_pgcopydb <= 1.0": copy["ratio_pgcopydb"] <= 1.0}
        for key in ("native_s", "pgcopydb_s", "sluicegate_s"):
            if key in copy:
                copy[key[:-2] + "_tables_per_s"] = len(self.names) / copy[key]
        self.out["copy"] = copy
        log(f"copy: {fmt(copy)}")
        if self.workflow is not None:
            self.out["sluicegate_stop_s"], self.out["sluicegate_exit"] = self.stop_workflow()
            text = self.wf_log.read_text(errors="replace")
            self.out["sluicegate_log_problems"] = sum(text.count(w) for w in ("Traceback", "ERROR", "retrying"))
            if self.args.profile:
                self.report_driver_profile()
        self.memory.stopping.set()
        if self.memory.peaks:
            self.out["memory_mb"] = {**self.memory.peaks, "peak": max(self.memory.peaks.values())}
        self.out["loadavg_end"] = os.getloadavg()[0]
        return self.out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", type=int, default=2000, help="small tables (default 2,000)")
    parser.add_argument("--rows", type=int, default=200, help="rows of each small table")
    parser.add_argument("--per-schema", type=int, default=20, help="small tables per tenant schema")
    parser.add_argument("--large", type=int, default=1, help="large tables (schema public)")
    parser.add_argument("--large-rows", type=int, default=500_000, help="rows of each large table")
    parser.add_argument("--skip", type=lambda s: [x for x in s.split(",") if x], default=[],
                        help="comma-separated, any of: native, pgcopydb, sluicegate")
    parser.add_argument("--pgcopydb-jobs", type=int, default=2,
                        help="pgcopydb clone's --table-jobs and --index-jobs (default 2: this machine's cores)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds any one wait may take")
    parser.add_argument("--profile", metavar="DIR",
                        help="profile pgcopydb's and Sluicegate's copies (CPU by process group in the JSON) and "
                             "Sluicegate's driver under cProfile (DIR/driver.prof, DIR/driver.txt)")
    parser.add_argument("--out", help="also write the JSON line to this file")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temporary directory and its logs")
    args = parser.parse_args()
    skip = args.skip
    bench = ManyTables(args)
    args.skip = skip
    return run_bench(bench, ManyTables.run, args.out)


if __name__ == "__main__":
    sys.exit(main())

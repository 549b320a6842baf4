"""`sluicegate vdiff` of pgbench_accounts against what `pg_dump` of both sides takes (issue 3; bench/README.md).

Starts a throwaway source and target PostgreSQL, loads `pgbench -i -s SCALE` (100,000 rows per scale) on the
source, copies it with a MoveTables (`workflow run`), and then times:
  - pg_dump of the table on both sides, one after the other and both at once (data to /dev/null), and a
    dump-based diff (both dumps sorted, then `cmp`) — what comparing by pg_dump would take;
  - vdiff with the workflow's driver running (its Spark application is warm), on a quiet source;
  - vdiff while pgbench TPC-B writes to the source (must report 0 differences);
  - vdiff after tampering with the target (must report exactly what was changed);
  - vdiff with no driver: the command starts Spark and plays the stream itself (Spark start-up included).
Progress goes to stderr, one JSON line of figures and ratios to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import DB, WF, Bench, BenchError, fmt, log, run_bench  # noqa: E402 - the copy bench's harness

from sluicegate.localpg import find_bindir  # noqa: E402


class VDiffBench(Bench):
    def dump_cmd(self, server, db: str) -> list[str]:
        return [str(find_bindir() / "pg_dump"), "-h", server.host, "-p", str(server.port), "-U", server.user,
                "--data-only", "-t", "pgbench_accounts", db]

    def dumps(self) -> dict:
        env = {**os.environ, "PGPASSWORD": self.source.password}
        sides = [(self.source, DB), (self.target, "sg")]
        t = time.monotonic()
        for server, db in sides:
            subprocess.run(self.dump_cmd(server, db), env=env, stdout=subprocess.DEVNULL, check=True)
        sequential = time.monotonic() - t
        t = time.monotonic()
        procs = [subprocess.Popen(self.dump_cmd(s, db), env=env, stdout=subprocess.DEVNULL) for s, db in sides]
        if any(p.wait() for p in procs):
            raise BenchError("pg_dump failed")
        parallel = time.monotonic() - t
        # A dump-based diff: both dumps (in physical order, which differs after updates) sorted, then compared.
        t = time.monotonic()
        files = []
        for (server, db), name in zip(sides, ("source", "target")):
            path = self.tmp / f"{name}.sorted"
            dump = subprocess.Popen(self.dump_cmd(server, db), env=env, stdout=subprocess.PIPE)
            # only the data: pg_dump 15.14+ writes a random \restrict key into every dump
            data = subprocess.Popen(["grep", "-v", "-E", r"^(\\(un)?restrict |--)"], stdin=dump.stdout,
                                    stdout=subprocess.PIPE)
            with open(path, "w") as out:
                subprocess.run(["sort", "-S", "256M", "-T", str(self.tmp)], stdin=data.stdout, stdout=out, check=True,
                               env={**os.environ, "LC_ALL": "C"})
            dump.wait()
            data.wait()
            files.append(path)
        same = subprocess.run(["cmp", "-s", *map(str, files)]).returncode == 0
        dump_diff = time.monotonic() - t
        for f in files:
            f.unlink()
        return {"pg_dump_both_sequential_s": sequential, "pg_dump_both_parallel_s": parallel,
                "dump_sort_cmp_s": dump_diff, "dump_sort_cmp_equal": same}

    def vdiff(self, *extra: str) -> tuple[float, int, dict]:
        cmd = [sys.executable, "-m", "sluicegate.cli.main", "vdiff", WF, "--target", self.target.url("sg"), "--json",
               *extra]
        t = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=self.args.timeout)
        elapsed = time.monotonic() - t
        if proc.returncode not in (0, 1):
            raise BenchError(f"vdiff exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
        return elapsed, proc.returncode, json.loads(proc.stdout)

    def measure(self) -> dict:
        self.memory.start()
        self.setup()
        log("copy: Sluicegate movetables create + workflow run")
        self.out["copy"] = self.copy_sluicegate()
        return {**self.out, "vdiff": self.run_vdiffs()}

    def run_vdiffs(self) -> dict:
        out = {"rows": self.rows}
        log("pg_dump of both sides")
        out.update(self.dumps())
        log(fmt(out))

        log("vdiff, driver running, quiet source")
        out["vdiff_warm_s"], code, rep = self.vdiff()
        counts = rep["tables"]["public.pgbench_accounts"]
        if code or counts["rows_compared"] != self.rows:
            raise BenchError(f"quiet vdiff: exit {code}, {counts}")

        log("vdiff under pgbench TPC-B on the source")
        load = threading.Thread(target=self.pgbench, args=("-T", str(self.args.load_seconds), "-c", "4", "-j", "2",
                                                           "-n"), kwargs={"timeout": self.args.load_seconds + 60})
        tps_before = self.commits()
        load.start()
        time.sleep(1.0)  # let pgbench get going: the point is a vdiff in the middle of the writes
        out["vdiff_under_load_s"], code, rep = self.vdiff()
        out["under_load_commits_during"] = self.commits() - tps_before
        out["under_load_differences"] = rep["differences"]
        load.join()
        if code:
            raise BenchError(f"vdiff under load found differences: {rep['tables']}")

        log("vdiff after tampering with the target")
        self.wait_caught_up()
        target = self.target.url("sg")
        with psycopg.connect(target, autocommit=True) as c:
            c.execute("UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid % 200000 = 7")  # 10 at scale 20
            c.execute("DELETE FROM pgbench_accounts WHERE aid IN (3, 1000003)")
            c.execute("INSERT INTO pgbench_accounts VALUES (0, 1, 0, ''), (-1, 1, 0, ''), (%s, 1, 0, '')",
                      (self.rows + 5,))
        changed = max(1, self.rows // 200_000)
        out["vdiff_tampered_s"], code, rep = self.vdiff()
        counts = rep["tables"]["public.pgbench_accounts"]
        out["tampered_found"] = {k: counts[k] for k in ("missing", "extra", "mismatched")}
        if code != 1 or (counts["missing"], counts["extra"], counts["mismatched"]) != (2, 3, changed):
            raise BenchError(f"tampered vdiff: exit {code}, {out['tampered_found']}, expected 2/3/{changed}")
        with psycopg.connect(target, autocommit=True) as c:  # undo, for the last run
            c.execute("DELETE FROM pgbench_accounts WHERE aid <= 0 OR aid > %s", (self.rows,))

        log("vdiff with no driver running (Spark start-up included)")
        self.stop_workflow()
        with psycopg.connect(target, autocommit=True) as c:
            c.execute("UPDATE pgbench_accounts SET abalance = abalance - 1 WHERE aid % 200000 = 7")
        self.copy_back_deleted()
        out["vdiff_cold_s"], code, rep = self.vdiff()
        if code:
            raise BenchError(f"cold vdiff found differences: {rep['tables']}")
        for key in ("vdiff_warm_s", "vdiff_under_load_s", "vdiff_tampered_s", "vdiff_cold_s"):
            out[f"ratio_{key[:-2]}_to_pg_dump_parallel"] = out[key] / out["pg_dump_both_parallel_s"]
        out["ratio_vdiff_warm_to_dump_sort_cmp"] = out["vdiff_warm_s"] / out["dump_sort_cmp_s"]
        return out

    def commits(self) -> int:
        with psycopg.connect(self.source.url(DB), autocommit=True) as c:
            return c.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
                             ).fetchone()[0]

    def wait_caught_up(self) -> None:
        with psycopg.connect(self.source.url(DB), autocommit=True) as s, \
                psycopg.connect(self.target.url("sg"), autocommit=True) as t:
            flushed = s.execute("SELECT pg_current_wal_flush_lsn()").fetchone()[0]
            deadline = time.monotonic() + self.args.timeout
            while t.execute("SELECT position < %s::pg_lsn FROM sluicegate.streams WHERE workflow = %s",
                            (flushed, WF)).fetchone()[0]:
                self.check_workflow()
                if time.monotonic() > deadline:
                    raise BenchError("the workflow did not catch up")
                time.sleep(0.05)

    def copy_back_deleted(self) -> None:
        """Put back the two rows the tamper step deleted, from the source."""
        with psycopg.connect(self.source.url(DB)) as s, psycopg.connect(self.target.url("sg")) as t:
            rows = s.execute("SELECT aid, bid, abalance, filler FROM pgbench_accounts WHERE aid IN (3, 1000003)"
                             ).fetchall()
            with t.cursor() as cur:
                cur.executemany("INSERT INTO pgbench_accounts VALUES (%s, %s, %s, %s)", rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=20, help="pgbench scale (100,000 accounts each)")
    parser.add_argument("--load-seconds", type=int, default=15, help="length of the TPC-B run during a vdiff")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds any one wait may take")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temporary directory and its logs")
    args = parser.parse_args()
    if args.scale < 11:
        parser.error("--scale is at least 11 (the tamper step deletes aid 1000003)")
    args.skip = ["raw", "native", "burst", "steady"]
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    return run_bench(VDiffBench(args), VDiffBench.measure)

if __name__ == "__main__":
    sys.exit(main())

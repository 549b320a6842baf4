"""One Delta copy task in this process, no Spark: where its time goes (issue 37, the Delta copy).

Starts a throwaway PostgreSQL, loads `pgbench -i -s SCALE`, exports a snapshot and runs
targets/delta/copy.copy_range over the whole of pgbench_accounts (one task: the read, the conversion to Arrow,
the Parquet files) `--repeat` times, printing wall and this process's CPU seconds; `--profile` runs it once
under cProfile instead. Compare two trees with PYTHONPATH=TREE/src (bench/README.md, "Delta copy blocks").
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from sluicegate.localpg import LocalPostgres, find_bindir
from sluicegate.postgres.catalog import describe_table
from sluicegate.targets.delta import copy as lake_copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=10, help="pgbench scale (100,000 accounts each)")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs (after one warm-up)")
    parser.add_argument("--profile", action="store_true", help="one run under cProfile: the top functions")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sluicegate-lake-task-"))
    server = LocalPostgres(tmp / "source").init().start()
    try:
        pgpass = tmp / "pgpass"
        pgpass.write_text(server.pgpass_line() + "\n")
        pgpass.chmod(0o600)
        os.environ["PGPASSFILE"] = str(pgpass)
        url = server.url("postgres", with_password=False)
        subprocess.run([str(find_bindir() / "pgbench"), "-i", "-q", "-s", str(args.scale), "-h", server.host,
                        "-p", str(server.port), "-U", server.user, "postgres"], check=True, capture_output=True)
        with psycopg.connect(url) as conn:
            table = describe_table(conn, "public", "pgbench_accounts")
        with psycopg.connect(url) as holder:  # the snapshot lives as long as this transaction
            holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            snapshot = holder.execute("SELECT pg_export_snapshot()").fetchone()[0]

            def run(n: int) -> None:
                out = tmp / f"lake{n}"
                out.mkdir()
                task = lake_copy.LakeCopyTask(url, table.to_json(), snapshot, None, None, None, str(out), 1)
                wall, cpu = time.perf_counter(), time.process_time()
                files = lake_copy.copy_range(task)
                print(f"copy_range scale {args.scale}: {time.perf_counter() - wall:.2f} s wall, "
                      f"{time.process_time() - cpu:.2f} s CPU, {lake_copy.rows_written(files)} rows, "
                      f"{len(files)} files", flush=True)
                shutil.rmtree(out)

            if args.profile:
                profile = cProfile.Profile()
                profile.runcall(run, 0)
                pstats.Stats(profile).sort_stats("tottime").print_stats(15)
                return
            for n in range(args.repeat + 1):
                run(n)
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

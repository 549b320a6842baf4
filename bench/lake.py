"""Sluicegate into a Delta target against Sluicegate into a PostgreSQL target, in the same run (issue 27 item 5).

Starts a throwaway source and target PostgreSQL on 127.0.0.1 (bench/run.py's Bench), loads `pgbench -i -s SCALE`
on the source, and measures (1) the copy of pgbench_accounts by `movetables create` + `workflow run` into the
PostgreSQL target and into `delta:DIR`, (2) catch-up of both after a burst of updates in 20 transactions while
both workflows run, (3) the peak RSS of each `workflow run` process tree per phase. Progress goes to stderr, one
JSON line of figures to stdout (bench/README.md, "Delta target vs PostgreSQL target").
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import (
    DB,
    TABLES,
    Bench,
    BenchError,
    MemorySampler,
    connect,
    cpu_probe_s,
    cpu_times,
    fmt,
    log,
    one,
    run_bench,
    wait_for,
)

from sluicegate.position import parse_lsn
from sluicegate.targets.delta import cli as lake
from sluicegate.targets.delta import read
from sluicegate.targets.delta.state import ERROR, RUNNING, Store

LWF = "lake"  # the Delta workflow (the PostgreSQL one is run.py's WF)
ACCOUNTS = "public.pgbench_accounts"
SKIPPABLE = {"postgres", "delta", "burst"}


def delta_sum_count(root: Path, workflow: str) -> tuple[int, int, int, object]:
    """(sum(abalance), count, live files, point) of pgbench_accounts at the newest consistent point: pyarrow
    over the live files of the point's version (never the directory: it also holds removed files)."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds
    from deltalake import DeltaTable

    point = read.point_for(str(root), workflow)
    files = DeltaTable(read.table_uri(str(root), ACCOUNTS), version=point.versions[ACCOUNTS]).file_uris()
    table = ds.dataset(files, format="parquet").to_table(columns=["abalance"])
    return pc.sum(table["abalance"]).as_py() or 0, table.num_rows, len(files), point


def logged_at(path: Path, pattern: str) -> float | None:
    """When a `workflow run -v` log first had a line matching `pattern` (Unix time), as run.py reads it."""
    for line in path.read_text(errors="replace").splitlines():
        found = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[.,](\d{3}) (?:[A-Z]+ [\w.]+: )?(.*)", line)
        if found and re.match(pattern, found[3]):
            return datetime.strptime(found[1], "%Y-%m-%d %H:%M:%S").timestamp() + int(found[2]) / 1000
    return None


class LakeBench(Bench):
    def __init__(self, args):
        args.skip = [s for s in args.skip]
        # run.py's options this bench does not offer: its defaults
        for k, v in {"cycle_rows": None, "chunk_rows": None, "keep_indexes": False, "rule": None,
                     "drop_caches": False, "timeout": args.timeout, "profile": None, "target_settings": []}.items():
            setattr(args, k, getattr(args, k, v))
        super().__init__(args)
        self.root = self.tmp / "lake"
        self.target_lake = f"delta:{self.root}"
        self.lake_proc: subprocess.Popen | None = None
        self.lake_log = self.tmp / "workflow-run-delta.log"
        self.lake_memory = MemorySampler()
        self.out["burst_updates"] = args.burst_updates
        self.out["stage_rows"] = args.stage_rows

    def setup(self) -> None:
        log(f"starting servers in {self.tmp}")
        self.source.start()
        self.target.start()
        self.source.create_database(DB)
        self.target.create_database("sg")
        log(f"pgbench -i -s {self.args.scale} on the source")
        t = time.monotonic()
        self.pgbench("-i", "-q", "-s", str(self.args.scale), timeout=max(300, 60 * self.args.scale))
        from run import HEARTBEAT_DDL
        self.source.psql(HEARTBEAT_DDL, DB)
        self.rows = self.out["rows"] = one(self.source.url(DB), "SELECT count(*) FROM pgbench_accounts")[0]
        self.source_sum = one(self.source.url(DB), "SELECT sum(abalance) FROM pgbench_accounts")[0]
        log(f"loaded {self.rows} rows in {time.monotonic() - t:.1f}s")

    def check_workflow(self) -> None:
        super().check_workflow()
        if self.lake_proc is not None and self.lake_proc.poll() is not None:
            tail = " | ".join(self.lake_log.read_text(errors="replace").strip().splitlines()[-5:])
            raise BenchError(f"`sluicegate workflow run {LWF} --target delta:…` exited ({self.lake_proc.returncode}): "
                             f"{tail}")

    def set_phase(self, phase: str) -> None:
        self.memory.phase = self.lake_memory.phase = phase

    # -- 1. copy ----------------------------------------------------------------------------------------
    def copy_delta(self) -> dict:
        t0 = time.monotonic()
        options = {"stage_rows": self.args.stage_rows} if self.args.stage_rows else {}
        lake.create(LWF, self.source.url(DB), self.target_lake, TABLES, None, [], options)
        created = time.monotonic()
        cmd = [sys.executable, "-m", "sluicegate.cli.main", "-v", "workflow", "run", LWF, "--target",
               self.target_lake, "--no-progress"]
        launched = time.time()
        with open(self.lake_log, "w") as out:
            self.lake_proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.lake_memory.root = self.lake_proc.pid
        store = Store(self.root)

        def ready() -> bool:
            self.check_workflow()
            wf = store.load(LWF)
            if wf.state == ERROR:
                raise BenchError(f"Delta workflow {LWF} is in Error: {wf.message}")
            return wf.state == RUNNING and wf.first_point and all(t.done for t in wf.tables)

        wait_for(ready, self.args.timeout, f"Delta workflow {LWF} to finish copying (Running, first point)", 0.05)
        done = time.monotonic()
        total, rows, files, _ = delta_sum_count(self.root, LWF)
        if (rows, total) != (self.rows, self.source_sum):
            raise BenchError(f"Delta copy: count/sum {rows}/{total}, the source {self.rows}/{self.source_sum}")
        spark = logged_at(self.lake_log, r"Spark \S+ ready in")
        return {"delta_s": done - t0, "delta_create_s": created - t0,
                "delta_spark_startup_s": spark - launched if spark else None,
                "delta_files": files, "delta_mb": dir_mb(self.root / "public" / "pgbench_accounts")}

    def phase_copy(self) -> None:
        copy: dict = {}
        cpu: dict = {}
        steps = [("postgres", self.copy_postgres), ("delta", self.copy_delta)]
        if self.args.delta_first:
            steps.reverse()
        for name, step in steps:
            if name in self.skip:
                continue
            log(f"copy: Sluicegate into the {name} target")
            self.set_phase(f"copy_{name}")
            self.quiesce()
            before = cpu_times()
            copy.update(step())
            after = cpu_times()
            if before and after:
                cpu[name] = {k: round(after[k] - before[k], 2) for k in before}
            if name == "postgres":
                self.copied.append("sg")
            log(f"copy into {name}: {fmt({k: v for k, v in copy.items() if k.startswith(name[:5])})}")
        copy["order"] = [n for n, _ in steps if n not in self.skip]
        copy["cpu_s"] = cpu
        if "postgres_s" in copy and "delta_s" in copy:
            copy["ratio_delta_postgres"] = copy["delta_s"] / copy["postgres_s"]
        self.out["copy"] = copy

    def copy_postgres(self) -> dict:
        got = self.copy_sluicegate()  # run.py's: movetables create + workflow run until Running, count checked
        total = one(self.target.url("sg"), "SELECT sum(abalance) FROM pgbench_accounts")[0]
        if total != self.source_sum:
            raise BenchError(f"PostgreSQL copy: sum(abalance) {total}, the source {self.source_sum}")
        return {"postgres_s": got["sluicegate_s"], "postgres_create_s": got["sluicegate_create_s"],
                "postgres_spark_startup_s": got["spark_startup_s"]}

    # -- 2. burst ---------------------------------------------------------------------------------------
    def phase_burst(self) -> None:
        per_txn = self.args.burst_updates // 20
        self.set_phase("burst")
        src_url = self.source.url(DB)
        self.quiesce()
        log(f"burst: {20 * per_txn} updates in 20 transactions of consecutive keys")
        burst: dict = {"updates": 0}
        t = time.monotonic()
        with psycopg.connect(src_url, connect_timeout=10) as src:
            for i in range(20):
                lo = (i * per_txn) % self.rows + 1
                hi = min(lo + per_txn - 1, self.rows)
                burst["updates"] += src.execute("UPDATE pgbench_accounts SET abalance = abalance + 1 "
                                                "WHERE aid BETWEEN %s AND %s", (lo, hi)).rowcount
                src.commit()
            end = time.monotonic()
            # The source's position after the burst: the end of the last commit (or a little after it).
            position = parse_lsn(src.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])
            src.commit()
        burst["source_s"] = end - t
        last = "SELECT abalance FROM pgbench_accounts WHERE aid = %s"
        want = one(src_url, last, (hi,))[0]
        expected_sum, expected_rows = one(src_url, "SELECT sum(abalance), count(*) FROM pgbench_accounts")
        pg = connect(self.target.url("sg")) if "postgres" not in self.skip else None
        points_log = self.root / "_sluicegate" / "points" / "_delta_log"
        pending = {n for n in ("postgres", "delta") if n not in self.skip}
        seen_log = [None]

        def delta_has_it() -> bool:
            # The points table's log changes once per applied batch: read the newest point only then. (By its
            # newest entry, not their count: the lake's vacuum removes old entries as batches add new ones.)
            try:
                entries = max(os.listdir(points_log), default=None)
            except FileNotFoundError:
                return False
            if entries == seen_log[0]:
                return False
            seen_log[0] = entries
            point = read.latest_point(str(self.root), LWF)
            return point is not None and point.position >= position

        try:
            def caught_up() -> bool:
                self.check_workflow()
                if "postgres" in pending and pg.execute(last, (hi,)).fetchone()[0] == want:
                    burst["postgres_s"] = time.monotonic() - end
                    log(f"burst: postgres target caught up after {burst['postgres_s']:.1f}s")
                    pending.discard("postgres")
                if "delta" in pending and delta_has_it():
                    burst["delta_s"] = time.monotonic() - end
                    log(f"burst: delta target caught up after {burst['delta_s']:.1f}s")
                    pending.discard("delta")
                return not pending
            wait_for(caught_up, self.args.timeout, "both targets to catch up with the burst", 0.02)
        finally:
            if pg is not None:
                pg.close()
        if "postgres" not in self.skip:
            got = one(self.target.url("sg"), "SELECT sum(abalance), count(*) FROM pgbench_accounts")
            if tuple(got) != (expected_sum, expected_rows):
                raise BenchError(f"burst: the PostgreSQL target has sum/count {got}, the source "
                                 f"{expected_sum}/{expected_rows}")
        if "delta" not in self.skip:
            total, rows, files, point = delta_sum_count(self.root, LWF)
            if (total, rows) != (expected_sum, expected_rows):
                raise BenchError(f"burst: the Delta target's newest point ({point.position_text}) has sum/count "
                                 f"{total}/{rows}, the source {expected_sum}/{expected_rows}")
            burst["delta_files"] = files
            burst["delta_mb"] = dir_mb(self.root / "public" / "pgbench_accounts")
            burst["delta_points"] = len(read.points(str(self.root), LWF))
            burst["delta_table_version"] = point.versions[ACCOUNTS]
        if "postgres_s" in burst and "delta_s" in burst:
            burst["ratio_delta_postgres"] = burst["delta_s"] / burst["postgres_s"]
        self.out["burst"] = burst
        log(f"burst: {fmt(burst)}")

    # -- the run and its cleanup ------------------------------------------------------------------------
    def run(self) -> dict:
        self.memory.start()
        self.lake_memory.start()
        self.setup()
        self.phase_copy()
        if "burst" not in self.skip and not {"postgres", "delta"} <= self.skip:
            self.phase_burst()
        for name in ("postgres", "delta"):
            proc = self.workflow if name == "postgres" else self.lake_proc
            if proc is not None:
                self.out[f"{name}_stop_s"], self.out[f"{name}_exit"] = self.stop(name)
        self.memory.stopping.set()
        self.lake_memory.stopping.set()
        self.out["memory_mb"] = {name: {**m.peaks, "peak": max(m.peaks.values())}
                                 for name, m in (("postgres", self.memory), ("delta", self.lake_memory)) if m.peaks}
        self.out["loadavg_end"] = os.getloadavg()[0]
        self.out["cpu_probe_s_end"] = cpu_probe_s()
        return self.out

    def stop(self, name: str) -> tuple[float, int]:
        """run.py's stop_workflow (SIGTERM, then SIGKILL by PID) for either workflow."""
        if name == "postgres":
            return self.stop_workflow()
        saved = self.workflow, self.memory
        self.workflow, self.memory = self.lake_proc, self.lake_memory
        self.lake_proc = None
        try:
            return self.stop_workflow()
        finally:
            self.workflow, self.memory = saved

    def cleanup(self) -> None:
        if self.lake_proc is not None:
            try:
                self.stop("delta")
            except Exception as exc:  # noqa: BLE001 - keep cleaning up
                log(f"cleanup: stopping the Delta `workflow run`: {exc}")
        self.lake_memory.stopping.set()
        super().cleanup()


def dir_mb(path: Path) -> float:
    """Bytes under `path` (every file, removed or not), in MB."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=50, help="pgbench scale (100,000 accounts each)")
    parser.add_argument("--burst-updates", type=int, default=2_000_000, help="row updates in the burst")
    parser.add_argument("--skip", type=lambda s: [x for x in s.split(",") if x], default=[],
                        help=f"comma-separated, any of: {', '.join(sorted(SKIPPABLE))}")
    parser.add_argument("--delta-first", action="store_true", help="copy into Delta first, then PostgreSQL")
    parser.add_argument("--stage-rows", type=int, help="the Delta workflow's stage_rows (changes a batch holds in "
                        "memory before staging them to Parquet; default: its own)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds any one wait may take")
    parser.add_argument("--out", help="also write the JSON line to this file")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temporary directory and its logs")
    args = parser.parse_args()
    args.target_settings = []  # (run.py's option: the PostgreSQL target with its default settings)
    if unknown := set(args.skip) - SKIPPABLE:
        parser.error(f"--skip {','.join(sorted(unknown))}: choose from {', '.join(sorted(SKIPPABLE))}")
    if args.scale < 1 or not 20 <= args.burst_updates <= 20 * 100_000 * args.scale:
        parser.error(f"--scale is at least 1, --burst-updates 20 to {20 * 100_000 * max(args.scale, 1)} at this scale")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    return run_bench(LakeBench(args), LakeBench.run, args.out)


if __name__ == "__main__":
    sys.exit(main())

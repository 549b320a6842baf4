"""The Spark streaming source (`readStream.format("sluicegate")`): a backlog of changes through a query to the
noop sink, with the CPU its driver side spent planning (bench/README.md).

Starts a throwaway source PostgreSQL on 127.0.0.1, writes the backlog (ROWS/2 inserts in 20 transactions,
then ROWS/2 updates in 20 transactions) behind a slot, and runs one query with Trigger.AvailableNow to the
noop sink on local[2] after a warm-up query over 10 rows. Measured: the query's wall time; CPU of the driver's
long-lived Python process that plans batches (PySpark's streaming source runner; `warm_planner_process_cpu_s`
is the same for the warm-up query: mostly its start-up) and of its source backend (the control connection:
the backend seen in the most samples); CPU of the whole source server. Progress to stderr, one JSON line to
stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg
from psycopg import sql

from sluicegate.localpg import LocalPostgres

DDL = "CREATE TABLE acc (id int PRIMARY KEY, bid int, bal int NOT NULL, filler char(84))"  # pgbench_accounts
TICK = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu(pid: int, children: bool = False) -> float | None:
    """User + system CPU seconds of a process (and of its reaped children), or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    used = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if children else 0)
    return used / TICK


def server_cpu(postmaster: int) -> float:
    """CPU seconds of a PostgreSQL server: the postmaster, its exited backends, its live processes."""
    total = cpu(postmaster, children=True) or 0.0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            if ppid == postmaster:
                total += cpu(int(entry.name)) or 0.0
    return total


def planner_pids() -> list[int]:
    """PySpark's streaming source runner: the driver-side Python process of a Python data source's reader."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"python_streaming_source_runner" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


class Sampler(threading.Thread):
    """Every 50 ms: the last CPU reading of the planner process and of each source backend."""

    def __init__(self, url: str, dbname: str):
        super().__init__(daemon=True)
        self.url, self.dbname = url, dbname
        self.stop_event = threading.Event()
        self.planner: dict[int, float] = {}
        self.backends: dict[int, tuple[int, float]] = {}  # pid -> (samples it was seen in, cpu)

    def run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as c:
            while not self.stop_event.is_set():
                for pid in planner_pids():
                    used = cpu(pid)
                    if used is not None:
                        self.planner[pid] = used
                for (pid,) in c.execute(
                        "SELECT pid FROM pg_stat_activity WHERE datname = %s "
                        "AND backend_type = 'client backend' AND pid <> pg_backend_pid()", (self.dbname,)):
                    used = cpu(pid)
                    if used is not None:
                        self.backends[pid] = (self.backends.get(pid, (0, 0.0))[0] + 1, used)
                self.stop_event.wait(0.05)

    def result(self, prefix: str = "") -> dict:
        planner = max(self.backends.values())[1] if self.backends else None  # lives as long as the query
        return {f"{prefix}planner_process_cpu_s": round(sum(self.planner.values()), 2),
                f"{prefix}planner_backend_cpu_s": None if planner is None else round(planner, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000, help="changes in the backlog (default 200k)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of the source (repeatable), e.g. maxBytesPerBatch=16MiB")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sg-bench-source-"))
    try:
        print(json.dumps(measure(args, work)))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(args, work: Path) -> dict:
    from sluicegate.spark import stream_source
    from sluicegate.spark.session import get_spark

    options = dict(o.split("=", 1) for o in args.option)
    out: dict = {"changes": args.rows, "options": options}
    with LocalPostgres(work / "source").init().start() as src:
        src.create_database("bench")
        url = src.url("bench")
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(DDL)
            c.execute("CREATE TABLE warm (id int PRIMARY KEY)")
            for name, table in (("bench", "acc"), ("warm", "warm")):
                c.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(sql.Identifier(name),
                                                                              sql.Identifier(table)))
                c.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (name,))
        per = args.rows // 40
        log(f"backlog: {per * 20} inserts and {per * 20} updates in 40 transactions")
        with psycopg.connect(url) as c:
            for i in range(20):
                c.execute("INSERT INTO acc SELECT g, 1, 0, '' FROM generate_series(%s::int, %s::int) g",
                          (i * per + 1, (i + 1) * per))
                c.commit()
            for i in range(20):
                c.execute("UPDATE acc SET bal = bal + 1 WHERE id BETWEEN %s AND %s",
                          (i * per + 1, (i + 1) * per))
                c.commit()
            c.execute("INSERT INTO warm SELECT generate_series(1, 10)")
            c.commit()
        spark = get_spark("local[2]", app_name="bench-stream-source")
        stream_source.register(spark)

        def run(slot: str, checkpoint: Path) -> float:
            reader = spark.readStream.format("sluicegate").option("source", url).option("slot", slot)
            for key, value in options.items():
                reader = reader.option(key, value)
            t = time.monotonic()
            query = reader.load().writeStream.format("noop").option("checkpointLocation", str(checkpoint)) \
                .trigger(availableNow=True).start()
            query.awaitTermination()
            if query.exception() is not None:
                raise SystemExit(f"query failed: {query.exception()}")
            took = time.monotonic() - t
            rows = sum(p["numInputRows"] for p in query.recentProgress)
            batches = sum(1 for p in query.recentProgress if p["numInputRows"])
            log(f"{slot}: {rows} rows in {batches} batches, {took:.2f} s")
            if slot == "bench":
                out.update(rows=rows, batches=batches)
            return took

        sampler = Sampler(src.url(), "bench")
        sampler.start()
        try:
            run("warm", work / "warm")  # Python workers started, the source registered
        finally:
            sampler.stop_event.set()
            sampler.join()
        out.update(sampler.result("warm_"))
        server_before = server_cpu(src.pid)
        sampler = Sampler(src.url(), "bench")
        sampler.start()
        try:
            out["wall_s"] = round(run("bench", work / "bench"), 2)
        finally:
            sampler.stop_event.set()
            sampler.join()
        out.update(sampler.result())
        out["server_cpu_s"] = round(server_cpu(src.pid) - server_before, 2)
        spark.stop()
    return out


if __name__ == "__main__":
    main()

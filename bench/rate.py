"""The highest sustained change rate with lag p99 <= 1 s: native logical replication and Sluicegate (issue 37, item 3).

Starts a throwaway source and target PostgreSQL on 127.0.0.1 (bench/run.py's Bench), loads `pgbench -i -s SCALE`
on the source, copies pgbench_accounts and a heartbeat table with a native subscription (target database
`native`) and with `movetables create` + `workflow run` (target database `sg`), then raises the write rate in
steps: pgbench runs single-row UPDATE transactions at a fixed rate (`--rate`) for S seconds while a heartbeat row
is written on the source every 50 ms and polled on the active target(s) every 20 ms; a heartbeat's lag is the
target's clock_timestamp() when it is first seen there minus the source's clock_timestamp() in the row (one
machine, one clock). Progress goes to stderr, one JSON line of figures to stdout (bench/README.md, "Sustained
change rate").
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from psycopg import sql
from run import (
    DB,
    SUB,
    WF,
    Bench,
    BenchError,
    connect,
    cpu_probe_s,
    cpu_times,
    find_bindir,
    fmt,
    log,
    one,
    rounded,
    run_bench,
    wait_for,
)

CONTENDERS = ("native", "sluicegate")
HEARTBEAT_S = 0.05  # one heartbeat row every 50 ms: 20 lag samples a second
POLL_S = 0.02  # each active target is polled for new heartbeats every 20 ms (a sample's error is below that)
LAG_LIMIT_S = 1.0
TICK = os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of a sorted list."""
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


class CpuTracker:
    """CPU seconds each process used during a step, from /proc, with its parent and command line as first
    seen (a pgbench backend exits at the step's end, before anyone could ask what it was). /proc is read every
    0.5 s and each process keeps its last reading, so the processes that exit are counted up to their last
    half second."""

    def __init__(self):
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.info: dict[int, tuple[int, str]] = {}  # pid -> (ppid, command line)

    def read(self) -> dict[int, float]:
        seen = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                pid = int(stat.parent.name)
                fields = stat.read_text().rsplit(")", 1)[1].split()
                seen[pid] = (int(fields[11]) + int(fields[12])) / TICK
                if pid not in self.info:
                    self.info[pid] = (int(fields[1]), cmdline(pid))
            except (OSError, ValueError, IndexError):
                pass
        return seen

    def start(self) -> None:
        self.last = self.read()
        self.first = dict(self.last)

    def sample(self) -> None:
        self.last.update(self.read())

    def used(self) -> dict[int, float]:
        return {pid: cpu - self.first.get(pid, 0.0) for pid, cpu in self.last.items()
                if cpu > self.first.get(pid, 0.0)}

    def descendants(self, root: int) -> set[int]:
        children: dict[int, list[int]] = collections.defaultdict(list)
        for pid, (ppid, _) in self.info.items():
            children[ppid].append(pid)
        tree, todo = set(), [root]
        while todo:
            tree.add(pid := todo.pop())
            todo += children.get(pid, [])
        return tree


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class RateBench(Bench):
    def __init__(self, args):
        # run.py's options this bench does not offer: its defaults
        for k, v in {"cycle_rows": None, "chunk_rows": None, "keep_indexes": False, "rule": None,
                     "drop_caches": False, "target_settings": [], "skip": []}.items():
            setattr(args, k, getattr(args, k, v))
        super().__init__(args)
        self.out.update({"mode": args.mode, "step_seconds": args.seconds, "clients": args.clients,
                         "rows_per_transaction": args.rows_per_transaction,
                         "uptime_start": uptime()})
        self.script = self.tmp / "update.sql"
        self.heartbeat_id = 0
        self.heartbeat_stop = threading.Event()
        self.heartbeat_errors: list[str] = []
        self.active: set[str] = set()  # contenders replicating now

    def setup(self) -> None:
        log(f"starting servers in {self.tmp}")
        self.source.start()
        self.target.start()
        self.source.create_database(DB)
        for db in ("native", "sg"):
            self.target.create_database(db)
        log(f"pgbench -i -s {self.args.scale} on the source")
        self.pgbench("-i", "-q", "-s", str(self.args.scale), timeout=max(300, 60 * self.args.scale))
        from run import HEARTBEAT_DDL
        self.source.psql(HEARTBEAT_DDL, DB)
        self.rows = self.out["rows"] = one(self.source.url(DB), "SELECT count(*) FROM pgbench_accounts")[0]
        # One statement a transaction (autocommit). With one row, the smallest change a replica can be asked
        # for; with --rows-per-transaction N, N neighbouring rows in that one statement: N changes a commit,
        # for a few microseconds more of the source's time, so the replicas' per-change work is what is tested.
        n = self.args.rows_per_transaction
        where = "aid = :aid" if n == 1 else f"aid BETWEEN :aid AND :aid + {n - 1}"
        self.script.write_text(f"\\set aid random(1, {max(1, self.rows - n + 1)})\n"
                               f"UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE {where};\n")

    # -- pausing and resuming a contender (sequential mode) ----------------------------------------------
    def pause(self, name: str) -> None:
        if name not in self.active:
            return
        self.active.discard(name)
        if name == "native":
            self.target.psql(sql.SQL("ALTER SUBSCRIPTION {} DISABLE").format(sql.Identifier(SUB)), "native")
        else:
            _, code = self.stop_workflow()
            if code:
                raise BenchError(f"`workflow run` exited {code} when stopped: see {self.wf_log}")

    def resume(self, name: str) -> float:
        """Start replicating again; returns the seconds until the target has a heartbeat written after the
        start (what the contender missed while paused is applied by then)."""
        t = time.monotonic()
        if name == "native":
            self.target.psql(sql.SQL("ALTER SUBSCRIPTION {} ENABLE").format(sql.Identifier(SUB)), "native")
        elif self.workflow is None:
            cmd = [sys.executable, "-m", "sluicegate.cli.main", "-v", "workflow", "run", WF, "--target",
                   self.contenders["sluicegate"], "--no-progress"]
            with open(self.wf_log, "a") as out:
                self.workflow = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL)
            self.memory.root = self.workflow.pid
        self.active.add(name)
        self.wait_caught_up(name)
        return time.monotonic() - t

    def wait_caught_up(self, name: str) -> None:
        want = self.heartbeat_id + 1  # written after this moment
        with connect(self.contenders[name]) as conn:
            def there() -> bool:
                self.check_workflow()
                self.check_heartbeat()
                return conn.execute("SELECT coalesce(max(id), 0) FROM bench_heartbeat").fetchone()[0] >= want
            wait_for(there, self.args.timeout, f"{name} to catch up (heartbeat {want} on its target)", 0.05)

    # -- the heartbeat ---------------------------------------------------------------------------------
    def heartbeat(self) -> None:
        try:
            with connect(self.source.url(DB)) as conn:
                while not self.heartbeat_stop.wait(HEARTBEAT_S):
                    self.heartbeat_id = conn.execute(
                        "INSERT INTO bench_heartbeat DEFAULT VALUES RETURNING id").fetchone()[0]
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            self.heartbeat_errors.append(f"heartbeat writer: {exc}")

    def check_heartbeat(self) -> None:
        if self.heartbeat_errors:
            raise BenchError("; ".join(self.heartbeat_errors))

    # -- one step ----------------------------------------------------------------------------------------
    def step(self, rate: int, names: list[str], profile: Path | None = None) -> dict:
        """pgbench at `rate` for S seconds while `names` replicate; their lag samples and the CPU split."""
        seconds = self.args.seconds
        cmd = [str(find_bindir() / "pgbench"), "-h", self.source.host, "-p", str(self.source.port),
               "-U", self.source.user, "-n", "-M", "prepared", "-f", str(self.script),
               "-c", str(self.args.clients), "-j", str(min(2, self.args.clients)), "-R", str(rate),
               "-T", str(seconds), DB]
        conns = {name: connect(self.contenders[name]) for name in names}
        query = "SELECT id, extract(epoch FROM clock_timestamp() - ts)::float8 FROM bench_heartbeat WHERE id > %s"
        seen_max = {name: conn.execute("SELECT coalesce(max(id), 0) FROM bench_heartbeat").fetchone()[0]
                    for name, conn in conns.items()}
        lags: dict[str, dict[int, float]] = {name: {} for name in names}
        cpu = CpuTracker()
        cpu.start()
        machine = cpu_times()
        spy = None
        if profile is not None and "sluicegate" in names:
            spy = subprocess.Popen([self.args.py_spy, "record", "--nonblocking", "--subprocesses", "--idle", "-f", "raw",
                                    "-r", "50", "-d", str(seconds), "-o", str(profile), "-p", str(self.workflow.pid)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        first = self.heartbeat_id + 1
        started = time.monotonic()
        load = subprocess.Popen(cmd, env={**os.environ, "PGPASSWORD": self.source.password},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        next_cpu = 0.0

        def poll() -> None:
            nonlocal next_cpu
            self.check_workflow()
            self.check_heartbeat()
            for name, conn in conns.items():
                for hid, lag in conn.execute(query, (seen_max[name],)):
                    lags[name].setdefault(hid, lag)
                    seen_max[name] = max(seen_max[name], hid)
            if time.monotonic() >= next_cpu:
                cpu.sample()
                next_cpu = time.monotonic() + 0.5

        try:
            while load.poll() is None:
                poll()
                if time.monotonic() - started > seconds + 60:
                    raise BenchError(f"pgbench at {rate}/s ran past {seconds + 60}s")
                time.sleep(POLL_S)
            last = self.heartbeat_id
            cpu.sample()
            after = cpu_times()
            out, err = load.communicate()
            if load.returncode:
                raise BenchError(f"pgbench at {rate}/s failed (exit {load.returncode}): "
                                 + " | ".join(err.strip().splitlines()[-3:]))
            # The step's heartbeats still on their way: wait for them, at most a few seconds past the limit (a
            # contender that far behind has failed the step; what it has not applied by then counts with the
            # lag it has at least, from the source's clock).
            deadline = time.monotonic() + max(5.0, 3 * LAG_LIMIT_S)
            while any(seen_max[n] < last for n in names) and time.monotonic() < deadline:
                poll()
                time.sleep(POLL_S)
            missing = [n for n in names if seen_max[n] < last]
            if missing:
                with connect(self.source.url(DB)) as src:
                    late = src.execute("SELECT id, extract(epoch FROM clock_timestamp() - ts)::float8 "
                                       "FROM bench_heartbeat WHERE id BETWEEN %s AND %s", (first, last)).fetchall()
                for name in missing:
                    for hid, lag in late:
                        lags[name].setdefault(hid, lag)
        finally:
            if load.poll() is None:
                load.kill()
                load.wait()
            for conn in conns.values():
                conn.close()
            if spy is not None:
                try:
                    spy.wait(30)
                except subprocess.TimeoutExpired:
                    spy.kill()
                    spy.wait()
        report = {"rate": rate, **pgbench_figures(out, seconds)}
        for name in names:
            values = sorted(lag for hid, lag in lags[name].items() if first <= hid <= last)
            if values:
                report[name] = {"p50_s": statistics.median(values), "p99_s": percentile(values, 0.99),
                                "max_s": values[-1], "samples": len(values), "behind_at_end": name in missing}
        report["cpu_cores"] = self.cpu_split(cpu, seconds, load.pid)
        if machine and after:
            report["machine_busy_cores"] = (after["busy"] - machine["busy"]) / seconds
            report["machine_steal_cores"] = (after["steal"] - machine["steal"]) / seconds
        report["loadavg"] = os.getloadavg()[0]
        return report

    def cpu_split(self, cpu: CpuTracker, seconds: float, pgbench_pid: int) -> dict:
        """Cores used by role during a step: the load (pgbench and the source's backends), the source's
        walsenders, the target's apply worker and backends, `workflow run`'s driver, JVM and Python workers,
        and everything else on the machine (other work: it is shared)."""
        roles: dict[str, float] = collections.defaultdict(float)
        driver = self.workflow.pid if self.workflow is not None else None
        sg = cpu.descendants(driver) if driver else set()
        src_pm, tgt_pm = self.source.pid, self.target.pid
        for pid, secs in cpu.used().items():
            ppid, line = cpu.info.get(pid, (0, ""))
            if pid == pgbench_pid:
                role = "pgbench"
            elif pid == driver:
                role = "sg_driver"
            elif pid in sg:
                role = "sg_jvm" if "java" in line else "sg_python_workers"
            elif ppid == src_pm:
                role = "source_walsender" if "walsender" in line else "source_backends"
            elif ppid == tgt_pm:
                role = ("target_apply_worker" if "logical replication" in line
                        else "target_backend_native" if " native " in line
                        else "target_backend_sg" if " sg " in line else "target_other")
            elif pid in (src_pm, tgt_pm):
                role = "postmasters"
            else:
                role = "other"
            roles[role] += secs
        return {k: round(v / seconds, 3) for k, v in sorted(roles.items())}

    # -- the series ----------------------------------------------------------------------------------------
    def run(self) -> dict:
        self.memory.start()
        self.setup()
        log("copy: native subscription")
        self.out["native_copy_s"] = self.copy_native()
        self.active.add("native")
        log("copy: Sluicegate movetables create + workflow run")
        self.out["sluicegate_copy_s"] = self.copy_sluicegate()["sluicegate_s"]
        self.active.add("sluicegate")
        self.memory.phase = "rate"
        beat = threading.Thread(target=self.heartbeat, daemon=True, name="bench-heartbeat")
        beat.start()
        try:
            if self.args.profile_only:
                self.pause("sluicegate")
                self.profile(self.args.profile_only)
            else:
                self.series()
        finally:
            self.heartbeat_stop.set()
            beat.join(10)
        self.memory.stopping.set()
        if self.memory.peaks:
            self.out["memory_mb"] = {**self.memory.peaks, "peak": max(self.memory.peaks.values())}
        self.out["loadavg_end"] = os.getloadavg()[0]
        self.out["uptime_end"] = uptime()
        self.out["cpu_probe_s_end"] = cpu_probe_s()
        return self.out

    def series(self) -> None:
        steps, failed = [], {name: 0 for name in CONTENDERS}
        running = list(CONTENDERS)  # contenders whose series goes on
        sequential = self.args.mode == "sequential"
        if sequential:
            self.pause("sluicegate")
        for i, rate in enumerate(self.args.rates):
            if not running:
                break
            step: dict = {"rate": rate}
            if sequential:
                # Each contender alone, the order alternating from one step to the next: a drift of the
                # machine's speed within a step pair does not always favour the same one.
                order = running if i % 2 == 0 else running[::-1]
                for name in order:
                    for other in CONTENDERS:
                        if other != name:
                            self.pause(other)
                    catch_up = self.resume(name)
                    log(f"rate {rate}/s: {name} alone (caught up in {catch_up:.1f}s)")
                    got = self.step(rate, [name])
                    step.setdefault("runs", {})[name] = {**{k: v for k, v in got.items() if k != name},
                                                         "catch_up_s": catch_up}
                    step[name] = got.get(name)
            else:
                for name in running:
                    if name not in self.active:
                        self.resume(name)
                log(f"rate {rate}/s: {' and '.join(running)} side by side")
                got = self.step(rate, running)
                step["runs"] = {"both": {k: v for k, v in got.items() if k not in CONTENDERS}}
                for name in running:
                    step[name] = got.get(name)
            # The source's best: with a contender that takes more CPU, the source (on the same cores) may
            # commit less; the rate each contender met is in its run.
            achieved = [r["tps"] for r in step["runs"].values() if r.get("tps")]
            step["achieved"] = max(achieved) if achieved else None
            log(f"rate {rate}/s: achieved {step['achieved']}, "
                + ", ".join(f"{n} p50 {step[n]['p50_s']:.3f}s p99 {step[n]['p99_s']:.3f}s"
                            for n in running if step.get(n)))
            for name in list(running):
                over = step.get(name) is None or step[name]["p99_s"] > LAG_LIMIT_S
                failed[name] = failed[name] + 1 if over else 0
                if failed[name] >= 2:
                    log(f"{name}: p99 over {LAG_LIMIT_S:.0f}s two steps in a row; its series ends")
                    running.remove(name)
                    self.pause(name)
            steps.append(step)
            if step["achieved"] is not None and step["achieved"] < 0.9 * rate:
                log(f"the source committed {step['achieved']:.0f}/s of {rate}/s asked: the series ends")
                break
        self.out["steps"] = steps
        self.out["highest_sustained"] = {name: highest(steps, name) for name in CONTENDERS}
        hi = {name: (self.out["highest_sustained"][name]["held_through"] or {}).get("rate", 0) for name in CONTENDERS}
        log(f"every step held lag p99 <= {LAG_LIMIT_S:.0f} s up to: " + fmt(hi) + "; the highest step held: "
            + fmt({n: (v["highest_held"] or {}).get("rate") for n, v in self.out["highest_sustained"].items()}))
        print_table(steps)
        if self.args.rows_per_transaction > 1:
            log(f"each transaction changed {self.args.rows_per_transaction} rows: changes a second are that many "
                "times the rates above")
        if self.args.py_spy and hi["sluicegate"] < hi["native"]:
            self.profile_step(steps)

    def profile_step(self, steps: list[dict]) -> None:
        """Sluicegate once more at the first rate it failed: where its time goes where it falls behind."""
        rate = next((s["rate"] for s in steps if not held(s, "sluicegate")), None)
        if rate is not None:
            self.profile(rate)

    def profile(self, rate: int) -> None:
        """Sluicegate alone at `rate` under py-spy (wall-clock samples of its driver and Python workers: the
        waits show too), then native alone at the same rate: both with the CPU split."""
        self.pause("native")
        self.resume("sluicegate")
        path = self.tmp / f"py-spy-{rate}.txt"
        log(f"profile: Sluicegate alone at {rate}/s under py-spy")
        got = self.step(rate, ["sluicegate"], profile=path)
        self.out["profile"] = {"rate": rate, "sluicegate": got, "py_spy": summarize_py_spy(path)}
        if self.args.profile_out:
            Path(self.args.profile_out).write_bytes(path.read_bytes() if path.exists() else b"")
        self.pause("sluicegate")
        self.resume("native")
        log(f"profile: native alone at {rate}/s")
        self.out["profile"]["native"] = self.step(rate, ["native"])
        log("profile: " + json.dumps(rounded(self.out["profile"])))

    def cleanup(self) -> None:
        self.heartbeat_stop.set()
        if "native" in self.contenders and "native" not in self.active and self.target.running:
            try:  # DROP SUBSCRIPTION of a disabled subscription keeps its slot: enable it first
                self.target.psql(sql.SQL("ALTER SUBSCRIPTION {} ENABLE").format(sql.Identifier(SUB)), "native")
            except Exception as exc:  # noqa: BLE001 - keep cleaning up
                log(f"cleanup: enabling {SUB}: {exc}")
        super().cleanup()


def uptime() -> str:
    return subprocess.run(["uptime"], check=False, capture_output=True, text=True).stdout.strip()


def pgbench_figures(report: str, seconds: int) -> dict:
    """pgbench's own count: the commit rate the source achieved, and how late its schedule ran."""
    figures: dict = {}
    for line in report.splitlines():
        if line.startswith("number of transactions actually processed:"):
            figures["transactions"] = int(line.split(":")[1].split()[0].split("/")[0])
        elif line.startswith("tps = "):
            figures["tps"] = float(line.split("=")[1].split()[0])
        elif line.startswith("rate limit schedule lag:"):
            figures["schedule_lag_avg_ms"] = float(line.split("avg")[1].split()[0])
        elif line.startswith("latency average"):
            figures["latency_ms"] = float(line.split("=")[1].split()[0])
    return figures


def held(step: dict, name: str) -> bool:
    return bool(step.get(name)) and step[name]["p99_s"] <= LAG_LIMIT_S


def highest(steps: list[dict], name: str) -> dict:
    """`held_through`: the highest step up to which every step held lag p99 within the limit (the headline:
    on a shared machine one step can fail and the next pass); `highest_held`: the highest step that held."""
    def figures(step: dict | None) -> dict | None:
        if step is None:
            return None
        run = step["runs"].get(name) or step["runs"]["both"]
        return {"rate": step["rate"], "achieved": run.get("tps"), "p99_s": step[name]["p99_s"]}

    through = None
    for step in steps:
        if not held(step, name):
            break
        through = step
    best = max((s for s in steps if held(s, name)), key=lambda s: s["rate"], default=None)
    return {"held_through": figures(through), "highest_held": figures(best)}


def print_table(steps: list[dict]) -> None:
    lines = ["rate asked | achieved (native / sluicegate) | native p50 / p99 s | sluicegate p50 / p99 s"]
    for s in steps:
        runs = s["runs"]
        achieved = " / ".join(f"{runs[n]['tps']:.0f}" if runs.get(n, {}).get("tps") else "-" for n in CONTENDERS) \
            if "both" not in runs else f"{runs['both'].get('tps', 0):.0f}"
        lags = [f"{s[n]['p50_s']:.3f} / {s[n]['p99_s']:.3f}" if s.get(n) else "-" for n in CONTENDERS]
        lines.append(f"{s['rate']:>10} | {achieved:>29} | {lags[0]:>18} | {lags[1]:>22}")
    print("\n".join(lines), file=sys.stderr, flush=True)


def summarize_py_spy(path: Path, top: int = 20) -> dict | None:
    """py-spy's raw output (one collapsed stack and its sample count a line, wall-clock with --idle) cut down
    to the stacks of the replay: the player's thread and its writer thread (sg-apply) in a Python worker. For
    each: the share of samples by the deepest Sluicegate frame and what it was doing under it (the leaf: a
    psycopg wait is a round trip to a server, a socket read the replication stream)."""
    if not path.exists():
        return None
    threads = {"player": collections.Counter(), "writer": collections.Counter()}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = [f.rsplit(":", 1)[0] + ")" if f.endswith(")") and ":" in f else f
                  for f in stack.split(";") if not f.startswith("process ")]
        if not any("sluicegate/workflow/player.py" in f or "sluicegate/appliers/" in f for f in frames):
            continue
        thread = "writer" if any(f.startswith("_worker (concurrent/futures/thread.py") for f in frames) else "player"
        ours = [f for f in frames if "sluicegate/" in f]
        where = ours[-1].replace("sluicegate/", "") if ours else "?"
        leaf = frames[-1]
        threads[thread][where if leaf == ours[-1] else f"{where} > {leaf}"] += int(count)
    out = {}
    for name, counter in threads.items():
        total = sum(counter.values())
        if total:
            out[name] = {"samples": total,
                         "top": {k: round(v / total, 3) for k, v in counter.most_common(top)}}
    return out or None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=10, help="pgbench scale (100,000 accounts each)")
    parser.add_argument("--rates", type=lambda s: [int(x) for x in s.split(",")],
                        default=[500 * 2 ** i for i in range(8)],
                        help="the steps' rates, transactions a second (default 500,1000,...,64000)")
    parser.add_argument("--seconds", type=int, default=20, help="length of each contender's step")
    parser.add_argument("--clients", type=int, default=8, help="pgbench clients (-c)")
    parser.add_argument("--rows-per-transaction", type=int, default=1,
                        help="rows each transaction's one UPDATE changes (neighbouring keys): the steps' rates stay "
                             "transactions a second; changes a second are this many times that")
    parser.add_argument("--mode", choices=("sequential", "side-by-side"), default="sequential",
                        help="sequential: each contender replicates alone during its own run of a step (the other "
                             "paused: subscription disabled, or `workflow run` stopped), so neither takes CPU "
                             "from the other; side-by-side: both at once, on the same load")
    parser.add_argument("--quick", action="store_true", help="two steps of 8 s at scale 1 (about a minute)")
    parser.add_argument("--py-spy", help="py-spy executable: if Sluicegate holds a lower rate than native, profile "
                                         "it alone at the first rate it failed")
    parser.add_argument("--profile-only", type=int, metavar="RATE",
                        help="no series: Sluicegate alone at RATE under py-spy (--py-spy), then native alone")
    parser.add_argument("--profile-out", help="also write py-spy's raw profile to this file")
    parser.add_argument("--timeout", type=float, default=600, help="seconds any one wait may take")
    parser.add_argument("--out", help="also write the JSON line to this file")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temporary directory and its logs")
    parser.set_defaults(profile=None)  # run.py's copy profile (its --profile): not part of this bench
    args = parser.parse_args()
    if args.quick:
        args.scale, args.rates, args.seconds = 1, [500, 1000], 8
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM cleans up like Ctrl-C
    return run_bench(RateBench(args), RateBench.run, args.out)


if __name__ == "__main__":
    sys.exit(main())

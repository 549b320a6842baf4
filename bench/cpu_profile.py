"""Where a copy's CPU goes, by process (a pidstat of every process on the machine, for the benches' --profile).

A thread reads /proc/*/stat every 0.25 s and charges each process's CPU increase to a group: the `workflow
run` driver, its JVM, its PySpark daemon and workers, pgcopydb's processes (and its pg_dump, pg_restore), each server's processes by their title's activity
("target: sg COPY", "source: walsender", ...), this bench process, and everything else (other work on the
machine). A process that exits between two samples loses at most its last 0.25 s; one that starts during the
window is charged from zero.
"""
from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a process, None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class CpuProfile(threading.Thread):
    INTERVAL = 0.25

    def __init__(self, servers: dict[str, int], bench_pid: int):
        """servers: name -> postmaster pid."""
        super().__init__(daemon=True, name="bench-cpu-profile")
        self.servers, self.bench_pid = servers, bench_pid
        self.root: int | None = None  # the `workflow run` process, once launched
        self.stopping = threading.Event()
        self.cpu: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.started = time.monotonic()
        self.seconds = 0.0

    def _group(self, pid: str, ppid: int, tree: set[int]) -> str:
        ipid = int(pid)
        for name, postmaster in self.servers.items():
            if ipid == postmaster:
                return f"{name}: postmaster"
            if ppid == postmaster:
                title = _cmdline(pid).removeprefix("postgres: ")
                # "postgres sg 127.0.0.1(40000) COPY" -> "sg COPY"; aux processes keep their name
                m = re.match(r"\S+ (\S+) \S+\(\d+\)\s*(.*)", title)
                if m:
                    what = m[2].split()[0] if m[2] else "idle"
                    return f"{name}: {m[1]} {what}"
                return f"{name}: {title.split()[0] if title else '?'}"
        if ipid == self.bench_pid:
            return "bench (incl. movetables create)"
        if ipid == self.root:
            return "sluicegate: driver (workflow run)"
        if (exe := _cmdline(pid).split(" ", 1)[0]).endswith(("pgcopydb", "pg_dump", "pg_restore")):
            return f"pgcopydb: {exe.rsplit('/', 1)[-1]}"
        if ipid in tree:
            cmd = _cmdline(pid)
            if "java" in cmd.split(" ", 1)[0]:
                return "sluicegate: JVM"
            if "pyspark.daemon" in cmd or "pyspark.worker" in cmd:
                return "sluicegate: PySpark daemon/workers"
            return "sluicegate: other child"
        return "other processes (not this bench)"

    def run(self) -> None:
        self.sample({})
        while not self.stopping.wait(self.INTERVAL):
            self.sample(self.tree())
        self.sample(self.tree())
        self.seconds = time.monotonic() - self.started

    def tree(self) -> set[int]:
        if self.root is None:
            return set()
        children: dict[int, list[int]] = {}
        for pid in os.listdir("/proc"):
            if pid.isdigit() and (st := _stat(pid)):
                children.setdefault(st[0], []).append(int(pid))
        out, todo = set(), [self.root]
        while todo:
            out.add(p := todo.pop())
            todo += children.get(p, [])
        return out

    def sample(self, tree: set[int]) -> None:
        first = not self.last
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or (st := _stat(pid)) is None:
                continue
            ppid, secs = st
            # new after the first sample: charged from zero; present at the first: from its value then
            before = self.last.get(pid, secs if first else 0.0)
            self.last[pid] = secs
            if secs > before:
                group = self._group(pid, ppid, tree)
                self.cpu[group] = self.cpu.get(group, 0.0) + secs - before

    def stop(self) -> dict:
        self.stopping.set()
        self.join(10)
        ranked = sorted(self.cpu.items(), key=lambda kv: -kv[1])
        return {"wall_s": round(self.seconds, 2), "cpu_s": {k: round(v, 2) for k, v in ranked if v >= 0.01}}

"""Time Spark's start as `workflow run` sees it (`local[*]`): from the `get_spark_context()` call to a ready
SparkContext, and to the end of a first one-task Python job, in seconds of the clock and of CPU (the
process tree's). Each run is a fresh process (a fresh JVM).

    .venv/bin/python bench/spark_start.py --runs 5
    .venv/bin/python bench/spark_start.py --runs 5 --case before=/tmp/base/src --case after=src
    .venv/bin/python bench/spark_start.py --case archive=src --case no-archive=src \
        --env no-archive:SLUICEGATE_SPARK_CLASS_ARCHIVE=off

Runs alternate between the cases (in the order given); a case's src/ is put first on the child's PYTHONPATH,
so an older checkout's sluicegate is timed with this virtual environment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, os, time
from sluicegate.spark import session

def tree_cpu():
    # CPU seconds of this process and its live descendants, each with the children it has waited for (the
    # launcher JVM that spark-submit runs before the driver): a figure the machine's other load moves less.
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(pid)] = (int(fields[1]), sum(map(int, fields[11:15])))
    tree, total, grew = {os.getpid()}, 0, True
    while grew:
        grew = False
        for pid, (ppid, _) in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return sum(parents[p][1] for p in tree if p in parents) / os.sysconf("SC_CLK_TCK")

t0 = time.monotonic()
cpu0 = tree_cpu()
sc = session.get_spark_context()
t1 = time.monotonic()
cpu1 = tree_cpu()
sc.parallelize([1], 1).map(lambda x: x + 1).collect()
t2 = time.monotonic()
cpu2 = tree_cpu()
print(json.dumps({"ready_s": round(t1 - t0, 3), "first_job_s": round(t2 - t0, 3),
                  "ready_cpu_s": round(cpu1 - cpu0, 2), "first_job_cpu_s": round(cpu2 - cpu0, 2)}))
"""


def run_once(src: str | None, extra_env: dict) -> dict:
    env = {**os.environ, **extra_env}
    if src:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(src), env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    if out.returncode:
        raise SystemExit(f"run failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--case", action="append", default=None, metavar="LABEL=SRC",
                    help="a checkout's src/ under a label (repeatable: runs alternate between cases)")
    ap.add_argument("--env", action="append", default=[], metavar="[LABEL:]NAME=VALUE",
                    help="for the timed processes (of one case with LABEL:)")
    args = ap.parse_args()
    cases = dict(c.split("=", 1) for c in args.case) if args.case else {"this": ""}
    envs: dict = {label: {} for label in cases}
    for item in args.env:
        head, _, value = item.partition("=")
        scope, _, name = head.rpartition(":")
        for label in ([scope] if scope else cases):
            envs[label][name] = value
    results: dict = {label: [] for label in cases}
    for i in range(args.runs):
        for label, src in cases.items():
            r = run_once(src or None, envs[label])
            results[label].append(r)
            print(f"run {i + 1} {label}: {r}", file=sys.stderr)
    summary = {label: {key: {"min": min(r[key] for r in rs), "median": statistics.median(r[key] for r in rs),
                             "max": max(r[key] for r in rs)} for key in rs[0]}
               for label, rs in results.items()}
    print(json.dumps({"runs": results, "summary": summary}))


if __name__ == "__main__":
    main()

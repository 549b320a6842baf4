"""Time Spark's start as `workflow run` sees it (`local[*]`): from the `get_spark_context()` call to a ready
SparkContext, and to the end of a first one-task Python job. Each run is a fresh process (a fresh JVM).

    .venv/bin/python bench/spark_start.py --runs 5
    .venv/bin/python bench/spark_start.py --runs 5 --src /tmp/base/src --src src   # alternate two checkouts

With several `--src`, runs alternate between them (the first `--src` first); each is put first on the
child's PYTHONPATH, so an older checkout's sluicegate is timed with this virtual environment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, time
from sluicegate.spark import session
t0 = time.monotonic()
sc = session.get_spark_context()
t1 = time.monotonic()
sc.parallelize([1], 1).map(lambda x: x + 1).collect()
t2 = time.monotonic()
print(json.dumps({"ready_s": round(t1 - t0, 3), "first_job_s": round(t2 - t0, 3)}))
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
    ap.add_argument("--src", action="append", default=None, help="a checkout's src/ (repeatable: alternated)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="for the timed processes")
    args = ap.parse_args()
    srcs = args.src or [None]
    extra_env = dict(e.split("=", 1) for e in args.env)
    results: dict = {str(s): [] for s in srcs}
    for i in range(args.runs):
        for src in srcs:
            r = run_once(src, extra_env)
            results[str(src)].append(r)
            print(f"run {i + 1} {src}: {r}", file=sys.stderr)
    summary = {}
    for src, rs in results.items():
        summary[src] = {key: {"min": min(r[key] for r in rs), "median": statistics.median(r[key] for r in rs),
                              "max": max(r[key] for r in rs)} for key in ("ready_s", "first_job_s")}
    print(json.dumps({"runs": results, "summary": summary}))


if __name__ == "__main__":
    main()

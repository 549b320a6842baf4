"""Lake size under steady writes against the source's size (issue 34): does a Delta target stay near it?

    .venv/bin/python bench/lake_size.py                       # an hour-equivalent in 5 minutes (scale 12)
    .venv/bin/python bench/lake_size.py --scale 1 --minutes 10 # real time: 10 minutes at 40 txn/s

Two throwaway servers are not needed: one source PostgreSQL (127.0.0.1, temp dir) and a local Delta path. The
source has `docs` (id, rev, body ~10 kB: half random hex, half repetitive, so that both TOAST and Parquet
compress it partly) and `events` (small rows). A writer runs steady transactions for the run: update a doc's
body (60%), insert an event (20%), insert a doc and delete the oldest one (10%), delete old events (10%), so
the source keeps its size. `movetables create --target delta:DIR` + `workflow run` with the housekeeping
schedule at its defaults.

A compressed hour: --scale k runs k times the rate (40 txn/s × k) for 60/k minutes with every housekeeping
period divided by k (optimize every, vacuum every, vacuum retention). The churn a retention window holds
(rate × retention) and the transactions of the run (144,000 at 40 txn/s for an hour) are those of a real
hour; the number of Delta commits is not (a faster writer fills each batch with more transactions).

Every --sample seconds: the source's size (pg_total_relation_size of both tables) and the lake's bytes on
disk (data files, _delta_log, the consistent-read log). At the end: the writer stops, the stream catches up,
the newest consistent point must hold the source's row counts; then VACUUM FULL gives the source's live size
(under this rate of 10 kB updates autovacuum falls behind and the source itself bloats several times over).
One JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg

from sluicegate.localpg import LocalPostgres
from sluicegate.targets.delta.state import HOUSEKEEPING_DEFAULTS, open_store

DB, WF = "bench", "lakesize"
DDL = """
CREATE TABLE docs (id bigint PRIMARY KEY, rev int NOT NULL, body text NOT NULL);
CREATE TABLE events (id bigserial PRIMARY KEY, doc bigint NOT NULL, kind text NOT NULL, at timestamptz NOT NULL);
"""
BODY = "(SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 160)) || repeat(md5(%s::text), 160)"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def du(path: Path) -> dict:
    """Bytes on disk under the lake: data files, Delta logs, the consistent-read log and state."""
    out = {"data": 0, "delta_log": 0, "sluicegate": 0, "files": 0}
    for d, _, names in os.walk(path):
        for n in names:
            try:
                size = os.path.getsize(os.path.join(d, n))
            except FileNotFoundError:  # vacuumed meanwhile
                continue
            kind = "sluicegate" if "/_sluicegate" in d else "delta_log" if "_delta_log" in d else "data"
            out[kind] += size
            out["files"] += 1
    out["total"] = out["data"] + out["delta_log"] + out["sluicegate"]
    return out


class Writer(threading.Thread):
    """Steady transactions at `rate` per second until stopped."""

    def __init__(self, url: str, rate: float, first_doc: int):
        super().__init__(daemon=True)
        self.url, self.rate, self.next_doc = url, rate, first_doc
        self.stop = threading.Event()
        self.txns = 0
        self.error: Exception | None = None

    def run(self) -> None:
        rng = random.Random(34)
        try:
            with psycopg.connect(self.url, autocommit=True) as c:
                start = time.monotonic()
                while not self.stop.is_set():
                    due = start + self.txns / self.rate
                    if due > time.monotonic():
                        time.sleep(max(0.0, due - time.monotonic()))
                    self.one(c, rng)
                    self.txns += 1
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc

    def one(self, c, rng) -> None:
        r = rng.random()
        with c.transaction():
            if r < 0.6:
                c.execute(f"UPDATE docs SET rev = rev + 1, body = {BODY} WHERE id = "
                          f"(SELECT id FROM docs ORDER BY id OFFSET %s LIMIT 1)", (rng.randrange(10**6),
                                                                                   rng.randrange(1000)))
            elif r < 0.8:
                c.execute("INSERT INTO events (doc, kind, at) VALUES (%s, %s, now())",
                          (rng.randrange(10**6), rng.choice(["view", "edit", "share"])))
            elif r < 0.9:
                c.execute(f"INSERT INTO docs VALUES (%s, 0, {BODY})", (self.next_doc, self.next_doc))
                c.execute("DELETE FROM docs WHERE id = (SELECT min(id) FROM docs)")
                self.next_doc += 1
            else:
                c.execute("DELETE FROM events WHERE id IN (SELECT id FROM events ORDER BY id LIMIT 2)")


def sluicegate(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluicegate.cli.main", *args], capture_output=True, text=True,
                          check=True, **kw)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=1000, help="rows of docs (~10 kB each)")
    parser.add_argument("--rate", type=float, default=40.0, help="transactions per second of real time")
    parser.add_argument("--scale", type=float, default=12.0, help="time compression (see above)")
    parser.add_argument("--minutes", type=float, default=None, help="run length (default: 60 / scale)")
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between size samples")
    parser.add_argument("--schedule", default=None,
                        help="housekeeping as optimize,vacuum,retention in seconds of real time "
                             "(default: the workflow defaults)")
    parser.add_argument("--commit-every", type=float, default=HOUSEKEEPING_DEFAULTS["commit_every"],
                        help="seconds of real time between commits (default: the workflow default)")
    args = parser.parse_args()
    minutes = args.minutes if args.minutes is not None else 60 / args.scale
    periods = dict(HOUSEKEEPING_DEFAULTS)
    if args.schedule:
        periods = dict(zip(periods, map(float, args.schedule.split(","))))
    periods["commit_every"] = args.commit_every
    scaled = {k: v / args.scale for k, v in periods.items()}
    rate = args.rate * args.scale
    tmp = Path(tempfile.mkdtemp(prefix="sluicegate-bench-lakesize-"))
    source = LocalPostgres(tmp / "source", settings={"max_wal_size": "4GB"})
    pgpass = tmp / "pgpass"
    out: dict = {"docs": args.docs, "rate_txn_s": rate, "scale": args.scale, "minutes": minutes,
                 "schedule_s": scaled, "cpus": os.cpu_count(), "samples": []}
    run = None
    try:
        source.start()
        pgpass.write_text(f"{source.host}:*:*:{source.user}:{source.password}\n")
        pgpass.chmod(0o600)
        os.environ["PGPASSFILE"] = str(pgpass)
        source.create_database(DB)
        url = source.url(DB, with_password=False)
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(DDL)
            c.execute(f"INSERT INTO docs SELECT g, 0, {BODY.replace('%s', 'g')} FROM generate_series(1, %s) g",
                      (args.docs,))
            c.execute("INSERT INTO events (doc, kind, at) SELECT g % 1000, 'view', now() "
                      "FROM generate_series(1, 5000) g")
            c.execute("VACUUM ANALYZE")

        def source_bytes() -> int:
            with psycopg.connect(url, autocommit=True) as c:
                return c.execute("SELECT pg_total_relation_size('docs') + pg_total_relation_size('events')"
                                 ).fetchone()[0]

        out["source_bytes_start"] = source_bytes()
        lake = tmp / "lake"
        target = f"delta:{lake}"
        sluicegate("movetables", "create", "--workflow", WF, "--source", url, "--target", target,
                   "--optimize-every", f"{scaled['optimize_every']}s", "--vacuum-every",
                   f"{scaled['vacuum_every']}s", "--vacuum-retention", f"{scaled['vacuum_retention']}s")
        with open_store(target).update(WF) as w:  # (`lake schedule --commit-every` says the same)
            w.options["commit_every"] = scaled["commit_every"]
        with open(tmp / "run.log", "w") as logf:
            run = subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", WF,
                                    "--target", target, "-v"], stdout=logf, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)

        def status() -> dict:
            return json.loads(sluicegate("workflow", "status", WF, "--target", target, "--json").stdout)

        deadline = time.monotonic() + 600
        while status()["state"] != "Running":
            if run.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"workflow run did not reach Running: {(tmp / 'run.log').read_text()[-2000:]}")
            time.sleep(1)
        log(f"copied; writing {rate:.0f} txn/s for {minutes:.1f} min (schedule {scaled})")
        writer = Writer(url, rate, args.docs + 1)
        started = time.monotonic()
        writer.start()
        peak = 0
        while time.monotonic() - started < minutes * 60:
            time.sleep(args.sample)
            if writer.error:
                raise writer.error
            if run.poll() is not None:
                raise SystemExit(f"workflow run exited: {(tmp / 'run.log').read_text()[-2000:]}")
            s, l = source_bytes(), du(lake)
            peak = max(peak, l["total"])
            sample = {"t": round((time.monotonic() - started) * args.scale), "txns": writer.txns,
                      "source": s, "lake": l["total"], "ratio": round(l["total"] / s, 2),
                      "data": l["data"], "delta_log": l["delta_log"], "sluicegate": l["sluicegate"],
                      "files": l["files"]}
            out["samples"].append(sample)
            log(json.dumps(sample))
        writer.stop.set()
        writer.join()
        out["txns"] = writer.txns
        out["txn_s_achieved"] = round(writer.txns / (time.monotonic() - started), 1)
        with psycopg.connect(url, autocommit=True) as c:
            lsn = c.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]
            counts = c.execute("SELECT (SELECT count(*) FROM docs), (SELECT count(*) FROM events)").fetchone()
        from sluicegate.position import parse_lsn
        from sluicegate.targets.delta import read

        deadline = time.monotonic() + 300
        while True:  # caught up: the newest point at or past the source's position at the end
            point = read.latest_point(str(lake), WF)
            if point is not None and point.position >= parse_lsn(lsn):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the stream did not catch up: {status()}")
            time.sleep(1)
        got = read.arrow_tables_as_of(str(lake), WF)
        assert (got["public.docs"].num_rows, got["public.events"].num_rows) == counts, (counts, got.keys())
        s, l = source_bytes(), du(lake)
        with psycopg.connect(url, autocommit=True) as c:  # the source without its dead rows: its live size
            c.execute("VACUUM FULL docs")
            c.execute("VACUUM FULL events")
        live = source_bytes()
        out |= {"source_live_bytes_end": live, "ratio_end_vs_live": round(l["total"] / live, 2),
                "ratio_peak_vs_live": round(peak / live, 2)}
        out |= {"source_bytes_end": s, "lake_bytes_end": l["total"], "ratio_end": round(l["total"] / s, 2),
                "lake_peak_bytes": peak, "ratio_peak": round(peak / s, 2), "lake_end": l,
                "housekeeping_runs": {job: (tmp / "run.log").read_text().count(f"{job} {WF}")
                                      for job in ("optimize", "vacuum")}}
        print(json.dumps(out))
        return 0
    finally:
        if run is not None and run.poll() is None:
            run.terminate()
            try:
                run.wait(timeout=60)
            except subprocess.TimeoutExpired:
                run.kill()
        try:
            source.stop()
        except Exception as exc:  # noqa: BLE001 - best effort at exit
            log(f"stopping {source.datadir}: {exc}")
        if os.environ.get("BENCH_KEEP"):
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

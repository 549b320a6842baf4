"""The change stream (issue 5): how fast a backlog of changes becomes Transaction messages and reaches appliers,
against native logical replication catching up on the same backlog (bench/README.md).

Starts a throwaway source and target PostgreSQL on 127.0.0.1, makes a slot for each reader, writes the backlog
(ROWS inserts in 20 transactions, then ROWS updates in 20 transactions) and then lets each reader catch up
from its slot, one after the other: the messages alone (read and dropped), through a VStream gRPC server to a
client, into the postgres applier, into the translog applier (fsync=commit), and a native subscription
enabled after the backlog. Progress to stderr, one JSON line to stdout.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from sluicegate.appliers.transactions import TransactionApplier
from sluicegate.changes import model as m
from sluicegate.changes.translog import TranslogApplier
from sluicegate.localpg import LocalPostgres
from sluicegate.position import parse_lsn
from sluicegate.vstream import VStreamServer, client

DDL = "CREATE TABLE acc (id int PRIMARY KEY, bid int, bal int NOT NULL, filler char(84))"  # pgbench_accounts


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def drain(events, end: int, apply=None) -> tuple[int, int]:
    """Read until everything committed before `end` was handed out: (messages, rows)."""
    n = rows = 0
    for ev in events:
        if isinstance(ev, m.Transaction):
            n += 1
            rows += sum(len(st.rows) for st in ev.statements)
            if apply is not None:
                apply(ev)
            if ev.end_segment and ev.context.position >= end:
                break
        elif ev.position >= end:
            break
    events.close()
    return n, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000, help="rows inserted, then updated (default 200k)")
    parser.add_argument("--threshold", type=int, default=1 << 20, help="transaction_message_threshold (bytes)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sg-bench-stream-"))
    try:
        print(json.dumps(measure(args, work)))
    finally:
        shutil.rmtree(work, ignore_errors=True)  # both servers' data and the translog: ~0.6 GB


def measure(args, work: Path) -> dict:
    out: dict = {"rows": args.rows, "changes": 2 * args.rows, "threshold": args.threshold}
    with LocalPostgres(work / "source").init().start() as src, LocalPostgres(work / "target").init().start() as dst:
        for db in ("native", "applier"):
            dst.create_database(db)
            with psycopg.connect(dst.url(db), autocommit=True) as c:
                c.execute(DDL)
        with psycopg.connect(src.url(), autocommit=True) as c:
            c.execute(DDL)
            c.execute("CREATE PUBLICATION native FOR TABLE acc")
            c.execute("SELECT pg_create_logical_replication_slot('native', 'pgoutput')")
        with psycopg.connect(dst.url("native"), autocommit=True) as c:
            c.execute(f"CREATE SUBSCRIPTION native CONNECTION '{src.url()}' PUBLICATION native "  # noqa: S608
                      "WITH (create_slot = false, slot_name = 'native', copy_data = false, enabled = false)")
        readers = ("messages", "grpc", "postgres", "translog")
        for name in readers:  # each reader's slot, at the position before the backlog
            drain(client.stream(src.url(), name, 0, ["acc"], args.threshold), 1)
        log(f"backlog: {args.rows} inserts and {args.rows} updates in 40 transactions")
        per = args.rows // 20
        with psycopg.connect(src.url()) as c:
            for i in range(20):
                c.execute("INSERT INTO acc SELECT g, 1, 0, '' FROM generate_series(%s::int, %s::int) g",
                          (i * per + 1, (i + 1) * per))
                c.commit()
            for i in range(20):
                c.execute("UPDATE acc SET bal = bal + 1 WHERE id BETWEEN %s AND %s", (i * per + 1, (i + 1) * per))
                c.commit()
            end = parse_lsn(c.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])

        def timed(name: str, fn) -> None:
            t = time.monotonic()
            n, rows = fn()
            s = time.monotonic() - t
            out[name] = {"s": round(s, 3), "messages": n, "rows_per_s": round(rows / s)}
            log(f"{name}: {rows} rows in {n} messages, {s:.2f} s")

        timed("messages", lambda: drain(client.stream(src.url(), "messages", 0, ["acc"], args.threshold), end))
        server = VStreamServer(src.url(), 0).start()
        try:
            timed("grpc", lambda: drain(client.stream(server.address, "grpc", 0, ["acc"], args.threshold), end))
        finally:
            server.stop()
        applier = TransactionApplier(dst.url("applier"), name="bench")
        try:
            timed("postgres", lambda: drain(client.stream(src.url(), "postgres", 0, ["acc"], args.threshold), end,
                                            applier.apply))
        finally:
            applier.close()
        translog = TranslogApplier(str(work / "translog"))
        try:
            timed("translog", lambda: drain(client.stream(src.url(), "translog", 0, ["acc"], args.threshold),
                                            end, translog.apply))
        finally:
            translog.close()

        want = "SELECT count(*), sum(bal) FROM acc"
        with psycopg.connect(src.url()) as c:
            expected = c.execute(want).fetchone()
        t = time.monotonic()
        with psycopg.connect(dst.url("native"), autocommit=True) as c:
            c.execute("ALTER SUBSCRIPTION native ENABLE")
            while c.execute(want).fetchone() != expected:
                if time.monotonic() - t > 600:
                    raise SystemExit("native did not catch up in 10 minutes")
                time.sleep(0.02)
            c.execute("ALTER SUBSCRIPTION native DISABLE")
            c.execute("ALTER SUBSCRIPTION native SET (slot_name = NONE)")
            c.execute("DROP SUBSCRIPTION native")
        out["native"] = {"s": round(time.monotonic() - t, 3)}
        log(f"native: caught up in {out['native']['s']} s")
        with psycopg.connect(dst.url("applier")) as c:
            if c.execute(want).fetchone() != expected:
                raise SystemExit("the postgres applier's target differs from the source")
        for name in readers:
            out[name]["ratio_native"] = round(out[name]["s"] / out["native"]["s"], 2)
    return out


if __name__ == "__main__":
    main()

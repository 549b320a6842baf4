"""A source and two sinks on three PostgreSQL servers, and consumers run as `sluicegate workflow run`."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from sluicegate.position import parse_lsn

from ..conftest import drop_slots
from .helpers import reap_group, table_rows

CLI = [sys.executable, "-m", "sluicegate.cli.main"]


@dataclass
class Cluster:
    workflow: str
    source: str
    sinks: list[str]
    servers: list = field(default_factory=list)  # (server, dbname) to clean up

    def src(self, text, params=None):
        return run(self.source, text, params)


def run(url: str, text, params=None):
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as c:
        cur = c.execute(text, params)
        return cur.fetchall() if cur.description else None


@contextlib.contextmanager
def cluster(source_server, *sink_servers):
    name = f"c{os.getpid()}_{random.randrange(10**6)}"
    for server in (source_server, *sink_servers):
        server.create_database(name)
    c = Cluster("rp", source_server.url(name), [s.url(name) for s in sink_servers],
                [(s, name) for s in (source_server, *sink_servers)])
    try:
        yield c
    finally:
        with contextlib.suppress(Exception), psycopg.connect(source_server.url(), autocommit=True) as conn:
            drop_slots(conn, name)
        for server, db in c.servers:
            with contextlib.suppress(Exception):
                with psycopg.connect(server.url(), autocommit=True) as conn:
                    conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                                 "AND pid <> pg_backend_pid()", (db,))
                server.drop_database(db)


def load_items(c: Cluster, rows: int = 5000) -> None:
    c.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int, note text)")
    c.src("INSERT INTO items SELECT g, g %% 7, md5(g::text) FROM generate_series(1, %s) g", (rows,))


def create(c: Cluster, *extra, sinks=None) -> subprocess.CompletedProcess:
    """`replicate create` of workflow rp from the source to the sinks (default: all of them)."""
    return cli("replicate", "create", "--workflow", c.workflow, "--source", c.source,
               *[a for s in (sinks or c.sinks) for a in ("--sink", s)], *extra)


def cli(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, check=False)


class Consumer:
    """`sluicegate workflow run W --target SINK` in its own process group (its Spark JVM follows it)."""

    def __init__(self, workflow: str, sink: str, log: Path):
        self.workflow, self.sink, self.log = workflow, sink, log
        self.proc = None

    def start(self) -> Consumer:
        env = dict(os.environ)
        env.pop("SLUICEGATE_DRIVER_PID", None)
        self.proc = subprocess.Popen([*CLI, "workflow", "run", self.workflow, "--target", self.sink, "--no-progress",
                                      "--spark-master", "local[2]"], env=env, stdout=self.log.open("ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def kill(self) -> None:
        if self.proc is not None:
            reap_group(self.proc)
            self.proc = None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def status(workflow: str, sink: str) -> dict:
    out = cli("workflow", "status", workflow, "--target", sink, "--json", timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def stream(sink: str, workflow: str = "rp") -> dict:
    (state, message, position, slot), = run(
        sink, "SELECT state, message, position::text, slot_name FROM sluicegate.streams WHERE workflow = %s",
        (workflow,))
    return {"state": state, "message": message, "position": parse_lsn(position) if position else None, "slot": slot}


def caught_up(c: Cluster, sink: str) -> bool:
    s = stream(sink, c.workflow)
    if s["state"] != "Running" or s["position"] is None:
        return False
    return s["position"] >= parse_lsn(c.src("SELECT pg_current_wal_flush_lsn()::text")[0][0])


def settle(c: Cluster, writer, tables=("public.items",)) -> None:
    """Stop the writer; every sink catches up and equals the source."""
    from ..conftest import wait_for

    writer.stop_event.set()
    writer.join()
    assert writer.error is None, writer.error
    for sink in c.sinks:
        wait_for(lambda sink=sink: caught_up(c, sink), 120, what=f"{sink} caught up")
        for table in tables:
            assert_equal(c, sink, table, ["id"])


def assert_equal(c: Cluster, sink: str, table: str, key: list[str]) -> int:
    src, dst = table_rows(c.source, table, key), table_rows(sink, table, key)
    if src != dst:
        raise AssertionError(f"{table} on {sink}: source {len(src)} rows, sink {len(dst)}; missing "
                             f"{sorted(set(src) - set(dst))[:5]}, extra {sorted(set(dst) - set(src))[:5]}")
    return len(src)

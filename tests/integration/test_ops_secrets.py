"""No secrets at rest: servers that require passwords (scram-sha-256), the passwords given to Sluicegate only
through a pgpass file (PGPASSFILE) at `workflow run`, `vdiff` and `status`; a dump of the target and every
output and log hold neither password. A workflow whose password an older version stored keeps working."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from sluicegate.localpg import LocalPostgres, find_bindir
from sluicegate.postgres.connect import strip_password

from ..conftest import wait_for
from .helpers import reap_group

pytestmark = pytest.mark.spark

# Distinctive, so that "never in the output" is a real check.
SOURCE_PASSWORD = "Src-" + secrets.token_hex(8)
TARGET_PASSWORD = "Dst-" + secrets.token_hex(8)
DB = "shop"


@pytest.fixture(scope="module")
def servers(pg_workdir):
    source = LocalPostgres(pg_workdir / "scram-source", password=SOURCE_PASSWORD).init().start()
    target = LocalPostgres(pg_workdir / "scram-target", password=TARGET_PASSWORD).init().start()
    try:
        source.create_database(DB)
        target.create_database(DB)
        yield source, target
    finally:
        source.stop()
        target.stop()


class Outputs:
    """Every output of every command, to search for the passwords at the end."""

    def __init__(self):
        self.texts: list[str] = []

    def sg(self, *args: str, env: dict) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "sluicegate.cli.main", *args], capture_output=True, text=True,
                              env=env, timeout=300, stdin=subprocess.DEVNULL, check=False)
        self.texts += [proc.stdout, proc.stderr]
        return proc

    def assert_clean(self, *more: str) -> None:
        for text in [*self.texts, *more]:
            assert SOURCE_PASSWORD not in text and TARGET_PASSWORD not in text, text[-3000:]


def environment(tmp_path: Path, name: str, *servers: LocalPostgres) -> dict:
    """The environment of a command that finds the passwords of `servers` (none: no password at all) only in
    its own pgpass file."""
    path = tmp_path / f"pgpass-{name}"
    path.write_text("".join(s.pgpass_line() for s in servers))
    path.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PGPASS", "SLUICEGATE_TARGET"))}
    return {**env, "PGPASSFILE": str(path), "SLUICEGATE_SPARK_MASTER": "local[2]"}


def start_driver(target_url: str, env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", "wf", "--target",
                             target_url, "--no-progress"], env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop_driver(driver: subprocess.Popen, log: Path) -> float:
    """SIGTERM; the seconds the driver took to exit (0)."""
    try:
        t0 = time.monotonic()
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) == 0, log.read_text()[-3000:]
        return time.monotonic() - t0
    finally:
        reap_group(driver)


def test_passwords_only_from_a_pgpass_file_and_never_at_rest(servers, tmp_path):
    source, target = servers
    out = Outputs()
    src, dst = source.url(DB), target.url(DB)  # with passwords: the test's own connections
    dst_bare = target.url(DB, with_password=False)
    with psycopg.connect(src, autocommit=True) as c:
        c.execute("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
        c.execute("INSERT INTO items SELECT g, 0, md5(g::text) FROM generate_series(1, 3000) g")
    nothing = environment(tmp_path, "none")
    both = environment(tmp_path, "both", source, target)

    # create: passwords in the URLs serve its checks; it says that the source's will be needed from libpq
    created = out.sg("movetables", "create", "--workflow", "wf", "--source", src, "--target", dst, env=nothing)
    assert created.returncode == 0, created.stderr
    assert "the source password is not stored" in created.stderr and "pgpass" in created.stderr
    with psycopg.connect(dst) as c:
        stored = c.execute("SELECT source_url FROM sluicegate.workflows WHERE name = 'wf'").fetchone()[0]
    assert stored == strip_password(src) and SOURCE_PASSWORD not in stored

    # without a password from libpq: one line naming the way out, for the target and then for the source
    for target_url, side in ((dst_bare, "target"), (dst, "source")):
        failed = out.sg("workflow", "run", "wf", "--target", target_url, "--no-progress", env=nothing)
        assert failed.returncode == 1, failed.stderr
        lines = failed.stderr.strip().splitlines()  # (a warning first: the target's password goes to tasks)
        errors = [line for line in lines if line.startswith("error:")]
        assert len(errors) == 1 and errors[0] == lines[-1], lines
        assert errors[0].startswith(f"error: no password for {side} ") and "pgpass file (PGPASSFILE" in errors[0]

    # the pgpass file alone: run, vdiff and status work with URLs that hold no password
    log = tmp_path / "driver.log"
    driver = start_driver(dst_bare, both, log)
    try:
        def running() -> bool:
            with psycopg.connect(dst) as c:
                return c.execute("SELECT state FROM sluicegate.streams").fetchone()[0] == "Running"

        wait_for(running, timeout=240, what="Running", describe=lambda: log.read_text()[-3000:])
        with psycopg.connect(src, autocommit=True) as c:
            c.execute("UPDATE items SET qty = qty + 1 WHERE id % 3 = 0")
            c.execute("INSERT INTO items VALUES (5000, 5, 'new')")
        vdiff = out.sg("vdiff", "wf", "--target", dst_bare, "--json", env=both)
        assert vdiff.returncode == 0, vdiff.stdout + vdiff.stderr
        assert json.loads(vdiff.stdout)["equal"] is True
        status = out.sg("workflow", "status", "wf", "--target", dst_bare, "--json", env=both)
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        assert report["state"] == "Running" and report["driver"]["running"] is True
        assert report["streams"][0]["retained_wal_bytes"] is not None  # asked of the source, with pgpass
        assert report["streams"][0]["wal_status"] in ("reserved", "extended")
    finally:
        stopped_in = stop_driver(driver, log)
    assert stopped_in < 10, f"SIGTERM while replicating took {stopped_in:.1f}s"

    # An older version's state: the password stored. It keeps working without pgpass (with a warning)...
    with psycopg.connect(dst) as c:
        c.execute("UPDATE sluicegate.workflows SET source_url = %s", (src,))
    status = out.sg("workflow", "status", "wf", "--target", dst, "--json", env=nothing)
    assert any("password is stored on the target" in w for w in json.loads(status.stdout)["warnings"])
    driver = start_driver(dst, nothing, log)
    try:
        with psycopg.connect(src, autocommit=True) as c:
            c.execute("UPDATE items SET note = 'legacy' WHERE id = 1")
        wait_for(lambda: _note(dst) == "legacy", timeout=240, what="the change applied",
                 describe=lambda: log.read_text()[-3000:])
    finally:
        stop_driver(driver, log)
    assert "password of" in log.read_text() and "is stored on the target" in log.read_text()
    with psycopg.connect(dst) as c:
        assert c.execute("SELECT source_url FROM sluicegate.workflows").fetchone()[0] == src  # not removed yet
    # ... and the first run whose libpq finds it elsewhere removes it.
    driver = start_driver(dst_bare, both, log)
    try:
        wait_for(lambda: _stored(dst) == strip_password(src), timeout=120, what="the stored password removed",
                 describe=lambda: log.read_text()[-3000:])
    finally:
        stop_driver(driver, log)

    dump = subprocess.run([str(find_bindir() / "pg_dump"), "--no-owner", dst_bare], capture_output=True, text=True,
                          env=both, timeout=120, check=False)
    assert dump.returncode == 0, dump.stderr
    assert "sluicegate.workflows" in dump.stdout and strip_password(src) in dump.stdout
    out.assert_clean(dump.stdout, log.read_text())


def _note(url: str) -> str | None:
    with psycopg.connect(url) as c:
        row = c.execute("SELECT note FROM items WHERE id = 1").fetchone()
        return row[0] if row else None


def _stored(url: str) -> str:
    with psycopg.connect(url) as c:
        return c.execute("SELECT source_url FROM sluicegate.workflows").fetchone()[0]

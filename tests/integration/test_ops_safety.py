"""A user's mistakes cannot hurt the source: a target that is the source (however its URL is written) or
that feeds it is refused at create with nothing created anywhere; a lock held on the target stops the copy
with a message naming the holder, and SIGTERM stops the driver within seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from sluicegate.errors import UsageError
from sluicegate.postgres.identity import identify, same_database
from sluicegate.workflow.create import create_movetables

from ..conftest import wait_for
from .helpers import reap_group, stream_row

pytestmark = pytest.mark.spark


def sg(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluicegate.cli.main", *args], capture_output=True, text=True,
                          timeout=180, stdin=subprocess.DEVNULL, check=False)


def source_state(pair) -> dict:
    """What a create could have left on the source database: schema, slots, publications, the table's key."""
    return {
        "schemas": pair.src("SELECT nspname FROM pg_namespace WHERE nspname = 'sluicegate'"),
        "slots": pair.src("SELECT slot_name FROM pg_replication_slots WHERE database = current_database()"),
        "publications": pair.src("SELECT pubname FROM pg_publication"),
        "indexes": pair.src("SELECT indexname FROM pg_indexes WHERE tablename = 'items' ORDER BY 1"),
        "rows": pair.src("SELECT count(*), sum(qty) FROM items"),
    }


def other_spellings(pair) -> list[str]:
    """The source database under other names: the same URL, libpq keywords, a URL with extra parameters."""
    s = pair.source_server
    return [
        pair.source,
        f"host={s.host} port={s.port} dbname={pair.name} user={s.user} password={s.password}",
        f"postgresql://{s.user}:{s.password}@{s.host}:{s.port}/{pair.name}?sslmode=disable&connect_timeout=7",
    ]


def test_target_that_is_the_source_is_refused_and_nothing_is_created(pair):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int)")
    pair.src("INSERT INTO items SELECT g, 1 FROM generate_series(1, 100) g")
    before = source_state(pair)
    for i, target in enumerate(other_spellings(pair)):
        with pytest.raises(UsageError, match="is the source database itself") as err:
            create_movetables(f"same{i}", pair.source, target, None, [], {})
        assert pair.source_server.password not in str(err.value)
        assert source_state(pair) == before
    # The command line: one line, exit 1, nothing created either.
    out = sg("movetables", "create", "--workflow", "same", "--source", pair.source, "--target",
             other_spellings(pair)[2])
    assert out.returncode == 1, out.stderr
    assert out.stderr.count("\n") == 1 and "is the source database itself" in out.stderr, out.stderr
    assert pair.source_server.password not in out.stderr
    assert source_state(pair) == before


def test_servers_that_share_an_identity_are_told_apart_live(source_server, target_server):
    """The test servers are copies of one data directory (LocalPostgres.template_cache), as a clone restored
    from a backup is: their `postgres` databases have the same system identifier and OID, and only the live
    check tells them apart."""
    with psycopg.connect(source_server.url(), autocommit=True) as a, \
            psycopg.connect(target_server.url(), autocommit=True) as b, \
            psycopg.connect(source_server.url(), autocommit=True) as a2:
        if not identify(a).may_be(identify(b)):
            pytest.skip("the servers were not made from one template")
        assert identify(a) == identify(b)
        assert not same_database(a, b) and not same_database(b, a)
        assert same_database(a, a2)


def test_a_workflow_back_into_its_own_source_is_refused(pair):
    """A -> B exists; B -> A would replicate every change around in a loop."""
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int)")
    create_movetables("forth", pair.source, pair.target, None, [], {})
    pair.src("CREATE TABLE other (id bigint PRIMARY KEY)")  # even other tables: the databases loop
    pair.dst("CREATE TABLE other (id bigint PRIMARY KEY)")
    with pytest.raises(UsageError, match="is the source of workflow 'forth'"):
        create_movetables("back", pair.target, pair.source, ["other"], [], {})
    assert pair.src("SELECT count(*) FROM pg_namespace WHERE nspname = 'sluicegate'") == [(0,)]


def test_a_lock_held_on_the_target_is_named_and_sigterm_stops_the_driver(pair, tmp_path: Path):
    """A read transaction left open on a target table blocks the copy's index drop: the stream's message
    names the session (pid, application) within the lock timeout, the driver says so in its log, SIGTERM
    stops it within 5 s, and the source keeps its table and key."""
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int)")
    pair.src("INSERT INTO items SELECT g, 1 FROM generate_series(1, 5000) g")
    create_movetables("held", pair.source, pair.target, None, [], {})
    source_before = source_state(pair)
    holder = psycopg.connect(pair.target, application_name="app-reader")
    holder.execute("SELECT count(*) FROM items")  # ACCESS SHARE, held until the transaction ends
    holder_pid = holder.info.backend_pid
    log = tmp_path / "driver.log"
    env = {**os.environ, "SLUICEGATE_LOCK_TIMEOUT": "2"}
    driver = subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", "held", "--target",
                               pair.target, "--no-progress"], env=env, stdout=log.open("wb"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def named() -> bool:
            return f"pid {holder_pid}" in stream_row(pair, "held")["message"]

        # Copying starts once the slot exists; then the drop waits 2 s and the message is recorded.
        wait_for(named, timeout=120, what="the holder named in the stream's message",
                 describe=lambda: (stream_row(pair, "held"), log.read_text()[-2000:]))
        message = stream_row(pair, "held")["message"]
        assert "dropping the indexes of public.items" in message and "'app-reader'" in message, message
        status = json.loads(sg("workflow", "status", "held", "--target", pair.target, "--json").stdout)
        assert f"pid {holder_pid}" in status["message"] and status["driver"]["running"]
        wait_for(lambda: f"pid {holder_pid}" in log.read_text(), timeout=30, what="the holder in the log")
        # The drop never happened: the target's key is still there, and no row was copied past it.
        assert pair.dst("SELECT indexname FROM pg_indexes WHERE tablename = 'items'") == [("items_pkey",)]

        # Stop while it waits again (or backs off): within 5 s.
        wait_for(lambda: pair.dst("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                  "AND datname = current_database()")[0][0] > 0,
                 timeout=60, what="the driver waiting for the lock again")
        t0 = time.monotonic()
        driver.send_signal(signal.SIGTERM)
        code = driver.wait(timeout=30)
        elapsed = time.monotonic() - t0
        assert code == 0, log.read_text()[-2000:]
        assert elapsed < 5, f"SIGTERM took {elapsed:.1f}s"
    finally:
        holder.close()
        reap_group(driver)
    after = source_state(pair)  # the source untouched: its table, key and rows (the run made its slot)
    assert (after["indexes"], after["rows"], after["schemas"]) == \
        (source_before["indexes"], source_before["rows"], source_before["schemas"])
    # A clean exit is on record: status says no driver runs.
    status = json.loads(sg("workflow", "status", "held", "--target", pair.target, "--json").stdout)
    assert status["driver"]["running"] is False and status["driver"]["pid"] is None

"""A migration a real application would run, executed on the source under live writes while the workflow
copies and while it replicates, with `--on-ddl exec` and a kill -9 of `workflow run` in the middle: the
target's schema (pg_dump -s of the moved tables) and rows end equal to the source's, vdiff finds nothing.
Tables made in the moved schema join the workflow (published, copied, replayed); dropped and renamed tables
leave or follow it (workflow/ddl_tables.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import psycopg
import pytest

from sluicegate.workflow.create import create_movetables

from ..conftest import wait_for
from .helpers import assert_same, caught_up, reap_group, stream_row
from .test_ddl_flow import Writes, backfill, cli, install
from .test_kill_restart import start_driver

pytestmark = pytest.mark.spark

ROWS = 3000


def schema_dump(server, url: str) -> str:
    """pg_dump -s of schema public, without what differs between two databases that hold the same tables
    (comments, settings, the dump's random \\restrict key)."""
    out = subprocess.run([str(server.bindir / "pg_dump"), "-s", "-n", "public", "-d", url], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    keep = [line for line in out.splitlines() if line.strip() and not line.startswith(("--", "SET ", "\\"))
            and not re.match(r"SELECT pg_catalog\.set_config", line)]
    return "\n".join(keep)


def copy_state(pair, workflow: str) -> list[str]:
    return [r[0] for r in pair.dst(
        "SELECT c.table_name FROM sluicegate.copy_state c JOIN sluicegate.streams s ON s.id = c.stream_id "
        "WHERE s.workflow = %s ORDER BY c.table_name", (workflow,))]


def published(pair, workflow: str) -> list[str]:
    slot = stream_row(pair, workflow)["slot"]
    return [r[0] for r in pair.src("SELECT schemaname || '.' || tablename FROM pg_publication_tables "
                                   "WHERE pubname = %s ORDER BY 1", (slot,))]


def test_migration_during_copy_and_replicate_with_kill_9(versions_pair_system, tmp_path):
    pair = versions_pair_system  # the system's PostgreSQL; 15 -> 18 and 18 in the slow set
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int, name text, legacy text)")
    pair.src("INSERT INTO items SELECT g, g %% 7, 'item ' || g, 'old' FROM generate_series(1, %s) g", (ROWS,))
    pair.src("CREATE TABLE audit_log (id bigint PRIMARY KEY, what text)")
    pair.src("INSERT INTO audit_log SELECT g, 'entry ' || g FROM generate_series(1, 200) g")
    install(pair)
    # every table of schema public: a table made there later joins; small copy cycles, so the migration's
    # first statements land between them (the copy's next cycle reads the new shape)
    create_movetables("mig9", pair.source, pair.target, None, [],
                      {"on_ddl": "exec", "cycle_rows": 400, "chunk_rows": 200})
    log = tmp_path / "driver.log"
    tail = lambda: log.read_text()[-3000:]
    writes = Writes(pair.source, ROWS + 1)
    writes.start()
    driver = start_driver(pair, "mig9", log)
    try:
        wait_for(lambda: pair.dst("SELECT count(*) FROM items")[0][0] > 0, timeout=180, what="the copy started",
                 describe=tail)
        # during copy: add a column with a default, backfill it in batches, set NOT NULL, add an index
        pair.src("ALTER TABLE items ADD COLUMN status text DEFAULT 'new'")
        backfill(pair.source, ROWS, 1000)
        pair.src("UPDATE items SET status = 'late' WHERE status IS NULL")
        pair.src("ALTER TABLE items ALTER COLUMN status SET NOT NULL")
        pair.src("CREATE INDEX CONCURRENTLY items_status ON items (status)")
        copying = stream_row(pair, "mig9")["state"]
        wait_for(lambda: pair.dst("SELECT 1 FROM pg_attribute WHERE attrelid = 'items'::regclass "
                                  "AND attname = 'status' AND attnotnull"),
                 timeout=180, what="SET NOT NULL replayed on the target", describe=tail)
        os.kill(driver.pid, signal.SIGKILL)  # in the middle of the migration
        reap_group(driver)
        # while nothing runs: rename a column, change a type with USING, drop a column
        pair.src("ALTER TABLE items RENAME COLUMN name TO title")
        pair.src("ALTER TABLE items ALTER COLUMN qty TYPE bigint USING qty::bigint * 10")
        pair.src("ALTER TABLE items DROP COLUMN legacy")
        driver = start_driver(pair, "mig9", log)
        wait_for(lambda: stream_row(pair, "mig9")["state"] == "Running", timeout=240, what="Running",
                 describe=tail)
        # during replicate: create a new table and fill it, rename and drop an old one
        with psycopg.connect(pair.source) as c:  # made and filled in one transaction
            c.execute("CREATE TABLE item_notes (id bigint PRIMARY KEY, item_id bigint, note text NOT NULL)")
            c.execute("INSERT INTO item_notes SELECT g, g, 'note ' || g FROM generate_series(1, 500) g")
        pair.src("INSERT INTO item_notes SELECT g, g, 'later ' || g FROM generate_series(501, 700) g")
        pair.src("CREATE INDEX item_notes_item ON item_notes (item_id)")
        pair.src("ALTER TABLE audit_log RENAME TO audit_log_old")
        pair.src("UPDATE audit_log_old SET what = 'renamed' WHERE id <= 10")
        wait_for(lambda: "public.item_notes" in copy_state(pair, "mig9"), timeout=120, what="item_notes joined",
                 describe=tail)
        pair.src("UPDATE item_notes SET note = 'changed' WHERE id % 50 = 0")
        pair.src("DELETE FROM item_notes WHERE id > 690")
        pair.src("DROP TABLE audit_log_old")
        wait_for(lambda: writes.commits > 50, what="writes")
        writes.finish()
        wait_for(lambda: caught_up(pair, "mig9") and "public.audit_log_old" not in copy_state(pair, "mig9"),
                 timeout=180, what="caught up", describe=lambda: f"{stream_row(pair, 'mig9')}; {tail()}")
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) == 0, tail()
    finally:
        writes.stop_event.set()
        reap_group(driver)
    assert copying == "Copying", "the first statements were meant to land during the copy"
    row = stream_row(pair, "mig9")
    assert row["state"] == "Running" and row["message"] == "", row
    assert copy_state(pair, "mig9") == ["public.item_notes", "public.items"]
    assert published(pair, "mig9") == ["public.item_notes", "public.items"]
    assert schema_dump(pair.target_server, pair.target) == schema_dump(pair.source_server, pair.source)
    assert pair.dst("SELECT to_regclass('audit_log'), to_regclass('audit_log_old')") == [(None, None)]
    assert assert_same(pair, "public.items", ["id"]) > ROWS
    assert assert_same(pair, "public.item_notes", ["id"]) == 690
    vdiff = cli("vdiff", "mig9", "--target", pair.target)
    assert vdiff.returncode == 0, vdiff.stdout + vdiff.stderr

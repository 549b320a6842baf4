"""A workflow deleted while a driver reads it (`movetables complete` drops the whole schema with the last
workflow) reads as not found, never as a torn workflow or a missing relation. The race is forced: the reader
is held on a lock between its statements while the table it reads next is dropped."""

from __future__ import annotations

import threading

import psycopg
import pytest

from sluicegate.errors import UsageError
from sluicegate.postgres.connect import connect
from sluicegate.workflow import state as st
from sluicegate.workflow.create import create_movetables

from ..conftest import wait_for

pytestmark = pytest.mark.spark


def _read_in_thread(url: str, read) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            with connect(url, role="target") as conn:
                out["value"] = read(conn)
        except Exception as exc:  # noqa: BLE001 - the test looks at which error it was
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


@pytest.mark.parametrize("reader", ["load_workflow", "list_workflows"])
def test_a_schema_dropped_under_a_reader_reads_as_no_workflow(pair, reader):
    pair.src("CREATE TABLE t (id int PRIMARY KEY)")
    create_movetables("mt", pair.source, pair.target, ["t"], [], {})
    read = (lambda conn: st.load_workflow(conn, "mt")) if reader == "load_workflow" else st.list_workflows
    with psycopg.connect(pair.target) as dropper:
        # The reader passes has_schema (to_regclass takes no lock), then waits on workflows while the schema
        # goes, as `movetables complete` drops it with the last workflow.
        dropper.execute("LOCK TABLE sluicegate.workflows IN ACCESS EXCLUSIVE MODE")
        t, out = _read_in_thread(pair.target, read)
        wait_for(lambda: pair.dst("SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = "
                                  "to_regclass('sluicegate.workflows')") == [(1,)],
                 timeout=30, what="the reader waiting on sluicegate.workflows")
        dropper.execute("DROP SCHEMA sluicegate CASCADE")
        dropper.commit()
    t.join(timeout=30)
    assert not t.is_alive()
    if reader == "load_workflow":
        assert isinstance(out.get("error"), UsageError), out
        assert "no workflow 'mt'" in str(out["error"]) and "deleted meanwhile" in str(out["error"])
    else:
        assert out == {"value": []}


def test_dropping_the_schema_waits_for_a_reader_without_deadlock(pair):
    """complete's last step drops the schema while a driver's load_workflow is between its statements: the
    drop waits for the reader's transaction; neither is chosen as a deadlock victim."""
    from sluicegate.workflow.traffic import _drop_empty_schema

    pair.src("CREATE TABLE t (id int PRIMARY KEY)")
    create_movetables("mt", pair.source, pair.target, ["t"], [], {})
    with connect(pair.target, role="target") as reader:
        reader.execute("SELECT count(*) FROM sluicegate.workflows")  # holds workflows, as load_workflow's 1st read

        def complete(conn):
            st.delete_workflow(conn, "mt")
            return _drop_empty_schema(conn, "target")

        t, out = _read_in_thread(pair.target, complete)
        wait_for(lambda: pair.dst("SELECT count(*) FROM pg_locks WHERE NOT granted AND relation IN "
                                  "(to_regclass('sluicegate.workflows'), to_regclass('sluicegate.streams'), "
                                  "to_regclass('sluicegate.copy_state'))") == [(1,)],
                 timeout=30, what="the schema's drop waiting for the reader")
        # the reader's next statements, as load_workflow's: they must not wait on the drop
        reader.execute("SELECT count(*) FROM sluicegate.streams")
        reader.execute("SELECT count(*) FROM sluicegate.copy_state")
    t.join(timeout=30)
    assert out == {"value": ["schema sluicegate on the target"]}, out
    assert pair.dst("SELECT count(*) FROM pg_namespace WHERE nspname = 'sluicegate'") == [(0,)]

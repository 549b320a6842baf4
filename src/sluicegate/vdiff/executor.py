"""Who executes a vdiff: the workflow's running driver (its Spark application is warm, and it is the
one playing the stream), else the `sluicegate vdiff` command itself."""

from __future__ import annotations

import logging
import threading

import psycopg

from ..postgres.connect import connect
from ..workflow import state as st
from . import store

log = logging.getLogger("sluicegate")


def driver_present(conn: psycopg.Connection, workflow: str) -> bool:
    """Is a `workflow run` holding the workflow's run lock (engine.py) right now?"""
    return conn.execute(
        """SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2
                            AND classid = hashtext('sluicegate')::oid AND objid = hashtext(%s)::oid
                            AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))""",
        (workflow,),
    ).fetchone()[0]


class DriverVDiffs:
    """In the driver: a thread that picks up each pending vdiff, takes its consistent point through the stream's
    durable stop (the driver's loop plays the stream to it: workflow/stream_control.py), then compares while
    replication goes on."""

    POLL_SECONDS = 0.2

    def __init__(self, engine):
        self.engine = engine
        self.thread: threading.Thread | None = None
        self._comparing = threading.Event()
        self._closed = threading.Event()  # the engine is done (its run may end while the driver goes on)

    def start(self) -> None:
        """Once, from the driver's loop (a workflow that never replicates serves none)."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._serve, name="sg-vdiffs", daemon=True)
            self.thread.start()

    def _serve(self) -> None:
        conn = None
        while not self._closed.wait(self.POLL_SECONDS) and not self.engine.stop.is_set():
            try:
                if conn is None or conn.closed:
                    conn = connect(self.engine.target_url, role="target", autocommit=True)
                if store.has_table(conn) and (vdiff_id := store.next_pending(conn, self.engine.workflow)):
                    self._execute(vdiff_id)
            except Exception as exc:  # noqa: BLE001 - the driver goes on; the next poll tries again
                log.warning("vdiffs of workflow %s: %s", self.engine.workflow, exc)
                if conn is not None:
                    conn.close()
        if conn is not None:
            conn.close()

    def _execute(self, vdiff_id: int) -> None:
        # Imported once a vdiff is asked for: the differ's rule support brings pyarrow (its import takes CPU), which
        # `workflow run` would otherwise import while Spark's JVM starts on the same cores.
        from .differ import VDiffRun

        run = VDiffRun(self.engine.target_url, vdiff_id, self.engine.runner, stop=self.engine.stop)
        if not run.claim("the workflow's driver"):
            return
        # Set before the stream goes on: with one task slot the driver's loop then waits for the comparison
        run.on_point = self._comparing.set
        try:
            wf = self.engine._load()
            prepared = run.prepare(wf, [self.engine._stream(wf)], None)
        except Exception as exc:  # noqa: BLE001 - a failed vdiff is reported on the vdiff, not the workflow
            log.warning("vdiff %s failed: %s", vdiff_id, exc)
            self._comparing.clear()
            run.fail(exc)
            return
        self._comparing.set()  # (prepare found nothing left to compare)
        try:
            run.compare(prepared)
        except Exception as exc:  # noqa: BLE001 - already recorded on the vdiff by compare()
            log.warning("vdiff %s failed: %s", vdiff_id, exc)
        finally:
            self._comparing.clear()

    def comparing(self) -> bool:
        return self._comparing.is_set()

    def wait(self, stop: threading.Event) -> None:
        """Until the comparison ends (or stop)."""
        while self.comparing() and not stop.is_set():
            stop.wait(0.5)

    def close(self, timeout: float = 30.0) -> None:
        """Serve no more vdiffs; wait for a comparison in flight (the engine's stop cancels its Spark jobs)."""
        self._closed.set()
        if self.thread is not None:
            self.thread.join(timeout)


def request(target_url: str, workflow: str, tables: list[str] | None, options: dict, *, resume: bool) -> int:
    """Create a vdiff of `workflow` (or make its latest unfinished one pending again): its id."""
    from .differ import check_comparable, select_tables

    with connect(target_url, role="target") as conn:
        st.ensure_schema(conn)
        wf = st.load_workflow(conn, workflow)
        check_comparable(wf)
        if resume:
            vdiff_id = store.latest_unfinished(conn, workflow)
            with connect(target_url, role="target", autocommit=True) as lock:  # (closing it ends the lock)
                if not store.try_lock(lock, vdiff_id):
                    return vdiff_id  # its executor is alive and at work: just wait for it
                store.set_state(conn, vdiff_id, store.PENDING, "resumed")
            return vdiff_id
        return store.create(conn, workflow, select_tables(wf, tables), options)


def execute_or_wait(target_url: str, workflow: str, vdiff_id: int, make_runner, *,
                    stop: threading.Event, poll: float = 0.05) -> store.VDiff:
    """Until the vdiff is completed or failed: leave it to a running driver, else execute it here.

    If the driver goes away mid-way, this process takes over from the last finished range.
    """
    from ..workflow.engine import Engine
    from .differ import VDiffRun

    runner = None
    while not stop.is_set():
        with connect(target_url, role="target", autocommit=True) as conn:
            vd = store.load(conn, vdiff_id)
            if vd.state in (store.COMPLETED, store.ERROR):
                return vd
            delegated = driver_present(conn, workflow)
            if not delegated and vd.state == store.RUNNING and store.try_lock(conn, vdiff_id):
                # its executor died (the lock went with its session): continue where it stopped
                store.set_state(conn, vdiff_id, store.PENDING, "its executor is gone; resuming")
                vd.state = store.PENDING
        # (leaving the `with` closed that connection, and with it the lock just taken)
        if not delegated and vd.state == store.PENDING:
            runner = runner or make_runner()
            run = VDiffRun(target_url, vdiff_id, runner, stop=stop)
            if run.claim("sluicegate vdiff"):
                engine = Engine(target_url, workflow, runner, stop=stop)
                try:
                    with connect(target_url, role="target") as conn:
                        wf = st.load_workflow(conn, workflow)
                    prepared = run.prepare(wf, wf.streams, engine.play)
                except BaseException as exc:
                    run.fail(exc)
                    raise
                run.compare(prepared)
                continue
        stop.wait(poll)
    raise KeyboardInterrupt

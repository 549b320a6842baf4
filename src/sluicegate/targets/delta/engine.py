"""The Delta target's workflow loop: Init -> Copying (cycles per table) -> Running (play tasks).

Init     -> publication + slot on the source; the stream's position is the slot's start.
Copying  -> the first table not done: one cycle (snapshot, plan, Spark tasks write files, one commit).
            No catchup between cycles: the stream stays at the slot's start, and the replay after the copy
            skips, per table, what its first cycle's snapshot already had (player.py). Rows of later cycles
            were copied at later snapshots: the replay brings them to the same point again (each change's net
            effect is the row's whole last state, so applying it twice converges), and no point is written
            before the stream has passed every cycle's snapshot.
Running  -> play tasks until stopped; between them, the driver runs the housekeeping that is due (optimize,
            vacuum: on the workflow's schedule), so it never runs beside the workflow's own merges.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import replace
from datetime import timedelta

from ... import config
from ...config import Settings
from ...errors import SluicegateError, TerminalError
from ...faults import fault_point
from ...position import format_lsn
from ...postgres import capture
from ...postgres.catalog import Column, Table
from ...postgres.connect import connect, first_line
from ...postgres.pgoutput import Column as RelColumn
from ...postgres.pgoutput import Relation
from ...postgres.snapshot import take_snapshot
from ...workflow import copier, live
from ...workflow.loop import StreamLoop
from ...workflow.schema_changes import source_columns
from . import apply, control, durable, location, rule_player
from . import copy as lake_copy
from .player import LakePlayTask, added_only, play
from .state import (
    COPYING,
    INIT,
    RUNNING,
    STOPPED,
    LakeWorkflow,
    copy_app_id,
    open_store,
)

log = logging.getLogger("sluicegate")


class LakeEngine(StreamLoop):
    def __init__(self, target: str, workflow: str, runner, *, stop: threading.Event | None = None,
                 max_backoff: float = 30.0):
        self.target = target
        self.location = location.parse(target)
        self.root: str = self.location.uri
        self.store = open_store(self.location)
        self.workflow = workflow
        self.runner = runner
        self.stop = stop or threading.Event()
        self.max_backoff = max_backoff
        self.tag = f"sluicegate-lake-{workflow}"
        self.lock = None
        self.lost = threading.Event()
        self.held: tuple | None = None  # ((reason, stop position, position), monotonic time first seen)

    def hold(self) -> None:
        """Take the workflow's run lock (a lease on an object store); `run` does if the caller did not (the CLI
        does before Spark starts, so a second driver exits at once)."""

        def on_lost() -> None:  # fencing: another driver holds the workflow's lease now (targets/delta/state.py)
            self.lost.set()
            self.stop.set()

        self.lock = self.store.hold_run_lock(self.workflow, on_lost=on_lost)

    def run(self) -> str:
        if self.lock is None:
            self.hold()
        lock, lost = self.lock, self.lost
        try:
            final = super().run()
        finally:
            lock.close()
            self.lock = None
        if lost.is_set():
            raise TerminalError(f"workflow {self.workflow}: another driver took its lease (this one could not "
                                f"renew it in time), so this one stopped; `sluicegate workflow status "
                                f"{self.workflow} --target {self.target}` shows which runs it")
        return final

    # -- the loop's hooks (workflow/loop.py) ----------------------------------------------------------------
    def load(self) -> LakeWorkflow:
        wf = self.store.load(self.workflow)
        if not (wf.state == STOPPED and wf.stop_reason):
            self.held = None
        return wf

    def await_release(self, wf: LakeWorkflow) -> None:
        """One poll of a stream its player stopped for a controller (control.py): the controller releases it;
        one that has not within the hold lapse (a killed vdiff's) this driver releases, so the stream does not
        stay stopped for ever."""
        key = (wf.stop_reason, wf.stop_position, wf.position)
        if self.held is None or self.held[0] != key:
            self.held = (key, time.monotonic())
        lapse = config.from_env("stream_hold_seconds")
        if time.monotonic() - self.held[1] < lapse:
            self.stop.wait(0.1)
            return
        if control.release(self.store, wf.name, wf.stop_reason, RUNNING):
            log.warning("workflow %s: stopped at %s for %s, not released within %.0fs (its controller is gone?); "
                        "released it", wf.name, format_lsn(wf.position), wf.stop_reason, lapse)
        self.held = None

    def step(self, wf: LakeWorkflow) -> None:
        if wf.state == INIT:
            self.init_stream(wf)
        elif wf.state == COPYING:
            self.copy_step(wf)
        elif wf.state == RUNNING:
            self.replicate_step(wf)
        else:
            raise TerminalError(f"workflow {wf.name} is in unknown state {wf.state!r}")

    def init_stream(self, wf: LakeWorkflow) -> None:
        with connect(wf.source_url, role="source", autocommit=True) as src:
            capture.check_source(src)
            # add-only: `replicate add-tables` may have widened it since wf was read (sink.py)
            capture.ensure_publication(src, wf.publication, [t.spec for t in wf.tables], add_only=True)
            start = capture.ensure_slot(src, wf.slot)
        with self.store.update(wf.name) as w:
            if w.state == INIT:
                w.position, w.state = start, COPYING

    def copy_step(self, wf: LakeWorkflow) -> None:
        from deltalake import DeltaTable

        current = next((t for t in wf.tables if not t.done), None)
        if current is None:
            self._start_running(wf)
            return
        table, lake, rule = current.spec, current.lake, current.compiled
        dt = DeltaTable(self._dir(lake))
        cycle = current.cycles + 1
        copy_app = copy_app_id(wf.name)
        outcome = lake_copy.committed_cycle(dt, copy_app, cycle)
        if outcome is None:
            settings = Settings.from_options(wf.options, f"workflow {wf.name}")
            computes = rule is not None and not rule.moves_only  # the cycle is a Spark SQL job (rules.py)
            with take_snapshot(wf.source_url, table, stop=self.stop) as snap:
                if current.cycles == 0 and rule is None:  # (a rule reads the columns it was made for)
                    # the Delta table is the source table's shape: the cycle's commit writes it with them
                    table = lake = self._adopt_added_columns(wf, table, dt, snap.conn)
                plan = copier.plan_cycle(snap.conn, table, current.lastpk, settings.cycle_rows, settings.chunk_rows,
                                         slots=self.runner.parallelism(), by_pages=not computes)
                if computes:
                    log.info("copying %s cycle %d through its rule in %d tasks", table.qualified, cycle,
                             len(plan.ranges))
                    files = lake_copy.copy_cycle_through_rule(self.runner, self.tag, wf.source_url, snap.name,
                                                              rule, plan.ranges, self._dir(lake), cycle)
                else:
                    # What the progress view adds to rows_copied while the cycle runs (workflow/live.py)
                    progress = live.cycle_started(self.target, wf.name, 1, current.qualified, current.rows_copied,
                                                  self.runner.counter())
                    tasks = [replace(t, label=progress.label)
                             for t in lake_copy.tasks_for(plan, wf.source_url, table, snap.name, self._dir(lake),
                                                          cycle, current.rule)]
                    log.info("copying %s cycle %d in %d tasks", table.qualified, cycle, len(tasks))
                    files = [f for out in self.runner.map(lake_copy.copy_range, tasks, f"copy {table.qualified}",
                                                          tag=self.tag, counter=progress.finished,
                                                          count=lake_copy.rows_written) for f in out]
                outcome = {"cycle": cycle, "lastpk": plan.new_lastpk, "done": plan.done,
                           "rows": sum(f["rows"] for f in files), "position": snap.position}
                if self.stop.is_set():
                    return
                # A copy's first cycle replaces whatever the table holds: a Replicate sink's rows under
                # --overwrite, or a re-bootstrap's stale ones (sink.py)
                lake_copy.commit_cycle(dt, lake, files, copy_app, outcome,
                                       mode="overwrite" if current.lastpk is None else "append")
        fault_point("lake.copy.before_progress")
        with self.store.update(wf.name) as w:
            t = w.table(current.qualified)
            if t.cycles >= cycle:
                return
            t.cycles = cycle
            t.lastpk = outcome["lastpk"]
            t.done = outcome["done"]
            t.rows_copied += outcome["rows"]
            t.copy_from = outcome["position"] if t.copy_from is None else t.copy_from
            t.copied_to = outcome["position"]
        entry = live.table_copy(self.target, wf.name, 1, current.qualified)
        if entry is not None:
            live.cycle_recorded(entry, t.rows_copied)
        log.info("copied %s rows of %s (done=%s)", outcome["rows"], table.qualified, outcome["done"])

    def _adopt_added_columns(self, wf: LakeWorkflow, table: Table, dt, conn) -> Table:
        """At a table's first copy cycle, the source's columns as of its snapshot (`conn`): columns added
        since `movetables create` join the Delta table and the state's description, so the copy reads them
        (no older row to fill: the copy brings every row); any other change stops in Error, as the stream's."""
        oid = conn.execute("SELECT to_regclass(%s)::oid", (table.ident.as_string(conn),)).fetchone()[0]
        if oid is None:
            raise TerminalError(f"source table {table.qualified} is gone: re-create the workflow")
        source = source_columns(conn, oid)
        rel = Relation(oid, table.schema, table.name, "f",
                       tuple(RelColumn(0, c.name, c.type_oid, c.typmod) for c in source.values()))
        change = added_only(rel, table, wf.name, self.location.target, " since the workflow was created")
        if change is None:
            return table
        added = tuple(Column(c.name, source[c.name].type_sql, c.type_oid, False, None, c.typmod)
                      for c in change.added)
        table = replace(table, columns=table.columns + added)
        version = dt.version()
        apply.add_columns(dt, table, [c.name for c in added], wf.name)
        durable.sync_versions(dt.table_uri, version, dt.version())  # before the state names the columns
        with self.store.update(wf.name) as w:
            w.table(table.qualified).table = table.to_json()
        log.info("columns %s added to %s before its copy", ", ".join(c.name for c in added), table.qualified)
        return table

    def _dir(self, table) -> str:
        return self.location.table(table.schema, table.name)

    def _start_running(self, wf: LakeWorkflow) -> None:
        """Every table is copied: the stream replays from the earliest first-cycle snapshot (nothing before
        it is missing from any table); the slot is confirmed up to there."""
        start = min([t.copy_from for t in wf.tables if t.copy_from is not None] or [wf.position])
        start = max(start, wf.position)
        with connect(wf.source_url, role="source", autocommit=True) as src:
            capture.advance_slot(src, wf.slot, start)
        fault_point("lake.copy.before_running")
        # (a table added or reset meanwhile by add-tables or bootstrap is copied first, at the next step)
        with self.store.update(wf.name, depends=(("tables",),)) as w:
            if w.state == COPYING and all(t.done for t in w.tables):
                w.state, w.position = RUNNING, start

    def replicate_step(self, wf: LakeWorkflow) -> None:
        settings = Settings.from_options(wf.options, f"workflow {wf.name}")
        until_due = self.housekeeping(wf, settings)
        if self.stop.is_set():
            return
        slice_seconds = math.inf if settings.slice_seconds is None else settings.slice_seconds
        if rule_player.takes(wf):  # through the rules: a Spark job a batch, driven from here
            rule_player.play(self, wf, settings.batch_changes, min(slice_seconds, until_due))
            return
        task = LakePlayTask.of(self.target, wf.name, wf.position, settings, max_seconds=min(slice_seconds, until_due),
                               commit_every=settings.commit_every)
        self.runner.map(play, [task], f"replicate {wf.name}", tag=self.tag)

    def housekeeping(self, wf: LakeWorkflow, settings: Settings) -> float:
        """Run the housekeeping that is due (no play task runs now); seconds until the next is due. Each job
        first comes due one interval after replication starts. A failure is logged and tried again at the next
        interval: replication goes on."""
        wait = math.inf
        for job in ("optimize", "vacuum"):
            every = getattr(settings, f"{job}_every")
            if every <= 0:
                continue
            if not wf.first_point:  # nothing to keep house for before readers have a point: look again later
                wait = min(wait, every)
                continue
            last = wf.housekeeping.get(job)
            now = time.time()
            if last is None or now - last >= every:
                if last is not None:
                    self._housekeep(job, wf, settings.vacuum_retention)
                last = time.time()
                with self.store.update(wf.name) as w:
                    w.housekeeping[job] = last
            wait = min(wait, last + every - time.time())
        return max(wait, 0.0)

    def _housekeep(self, job: str, wf: LakeWorkflow, retention: float) -> None:
        from . import housekeeping

        try:
            if job == "optimize":
                report = housekeeping.optimize(self.root, wf.name)
                log.info("optimize %s: %s", wf.name, ", ".join(
                    f"{t['table']} {t['files_before']} -> {t['files_after']} files" for t in report["tables"]))
            else:
                # allow_short: between play tasks this driver is the tables' only writer (it holds the run lock).
                report = housekeeping.vacuum(self.root, wf.name, timedelta(seconds=retention),
                                             allow_short=True)
                log.info("vacuum %s (retention %s): %d points dropped, %s", wf.name, timedelta(seconds=retention),
                         report["points_dropped"],
                         ", ".join(f"{t['table']} {t['files_removed']} files removed" for t in report["tables"]))
        except Exception as exc:  # noqa: BLE001 - housekeeping must not stop replication
            text = str(exc) if isinstance(exc, SluicegateError) else first_line(exc)
            log.warning("%s of %s failed, will try again at its next interval: %s", job, wf.name, text)

    def record(self, state: str | None, message: str) -> None:
        try:
            with self.store.update(self.workflow) as w:
                if state:
                    w.state = state
                w.message = message
        except Exception:  # noqa: BLE001 - best effort
            log.debug("could not record %r", message)

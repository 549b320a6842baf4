"""A PostgreSQL target's engine: what each state of a stream does, run by the driver's loop (loop.py).

Init     -> publication + slot on the source; the stream's position is the slot's start.
Copying  -> for the first table not done: catchup, snapshot, fast-forward to it, copy the next cycle.
Running  -> replicate: one play task that holds its replication connection until something needs the driver
            (the state changes, a vdiff is requested, stop), so the walsender never starts decoding again from
            the slot's restart_lsn (seconds after a big transaction). Streams that share the executors (a
            Reshard's) replicate in time slices instead, so each gets its turn.
Stopped / Error -> the loop returns (loop.py also retries, backs off and cancels on stop).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass, replace

import psycopg

from ..config import Settings
from ..errors import TerminalError
from ..postgres import capture, locks, standby_flush
from ..postgres.connect import connect, describe
from . import copier, metrics, run_lock, stream_control
from . import state as st
from .cluster_model import cluster_ids
from .cluster_model import direction as cluster_direction
from .cluster_model import way_out as cluster_way_out
from .loop import StreamLoop
from .player import PlayTask, play

log = logging.getLogger("sluicegate")
SHARED_SLICE_SECONDS = 10.0
# While another stream of the same driver copies: its catchup, fast-forward and copy jobs each wait for a
# task slot, which replicating streams free only at the end of a slice.
COPY_NEIGHBOUR_SLICE_SECONDS = 2.0
_tags = itertools.count(1)


@dataclass(frozen=True)
class _Turn:
    wf: st.Workflow
    stream: st.Stream

    @property
    def state(self) -> str:
        return self.stream.state

    @property
    def stop_reason(self) -> str:
        return self.stream.stop_reason


class Engine(StreamLoop):
    def __init__(self, target_url: str, workflow: str, runner, *, stop: threading.Event | None = None,
                 max_backoff: float = 30.0, vdiffs=None, stream_id: int | None = None,
                 copying: set | None = None, lock_conn: psycopg.Connection | None = None):
        """`stream_id`: run that one stream of the workflow (a Reshard runs an Engine per stream).
        `copying`: shared by the engines of one driver, the tags of those whose stream is not yet replicating.
        `lock_conn`: the session that already holds this engine's run lock (run_lock.take); the engine closes it.
        `vdiffs`: made with the engine, what serves the workflow's vdiffs between batches (vdiff/executor.py:
        DriverVDiffs, given by whoever runs the workflow: workflow/ does not import vdiff/); None: none."""
        self.target_url = target_url
        self.workflow = workflow
        self.stream_id = stream_id
        self.runner = runner
        self.stop = stop or threading.Event()
        self.max_backoff = max_backoff
        self.lock_conn: psycopg.Connection | None = lock_conn
        # The run lock's session on the target (run_lock.session): after a network cut the target may keep it
        # (and the lock) until it notices the client is gone; re-taking the lock ends that session of ours.
        self._lock_session: tuple | None = run_lock.session(lock_conn) if lock_conn is not None else None
        self.vdiffs = vdiffs(self) if vdiffs is not None else None
        self._runners: dict = {}
        self.tag = f"sluicegate-engine-{next(_tags)}"  # this engine's Spark jobs
        self._last_stream: st.Stream | None = None
        self.copier = copier.Copier(self)
        self._copying = copying if copying is not None else set()

    # -- the loop's hooks (loop.py) ------------------------------------------------------------------
    def load(self) -> _Turn:
        self._hold_run_lock()
        wf = self._load()
        stream = self._last_stream = self._stream(wf)
        return _Turn(wf, stream)

    def await_release(self, turn: _Turn) -> None:
        # Held by a controller (a vdiff taking its point: stream_control.py), not stopped by a user
        stream_control.wait_released(self.target_url, turn.stream.id, self.stop)

    def cancel_waits(self) -> None:
        locks.cancel_waiting(self._loop_thread)  # a lock wait of the loop's own thread (postgres/locks.py)

    def after_failure(self) -> None:
        self._drop_lock_conn()

    def ended(self) -> None:
        self._copying.discard(self.tag)  # ended while copying: its neighbours need short slices no more
        if self.stop.is_set():
            self._wait_reader_gone()

    def _wait_reader_gone(self, timeout: float = 20.0) -> None:
        """A cancelled task's worker is killed a moment after its job is (Spark waits for it to finish first):
        until then it may still apply a batch. Stopped means stopped: return only once the stream's slot has no
        reader left (its walsender ends with the worker). Best effort."""
        stream = self._last_stream
        if stream is None:
            return
        deadline = time.monotonic() + timeout
        try:
            with connect(stream.source_url, role="source", autocommit=True, connect_timeout=3) as src:
                while (info := capture.slot_info(src, stream.slot_name)) is not None and info.active_pid:
                    if time.monotonic() > deadline:
                        log.warning("replication slot %s still has a reader after stop", stream.slot_name)
                        return
                    time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the source may be the thing that is down
            log.debug("could not check replication slot %s after stop", stream.slot_name)

    def step(self, turn: _Turn) -> None:
        wf, stream = turn.wf, turn.stream
        if stream.state in (st.INIT, st.COPYING):
            self._copying.add(self.tag)
        else:
            self._copying.discard(self.tag)
        if stream.state == st.INIT:
            self.init_stream(wf, stream)
        elif stream.state == st.COPYING:
            self.copier.copy_next(wf, stream)
        elif stream.state == st.RUNNING:
            self.replicate_step(wf, stream)
        else:
            raise TerminalError(f"stream {stream.id} is in unknown state {stream.state!r}")

    # -- phases ---------------------------------------------------------------------------------------
    def init_stream(self, wf: st.Workflow, stream: st.Stream) -> None:
        with connect(stream.source_url, role="source", autocommit=True) as src:
            capture.check_source(src)
            capture.ensure_publication(src, stream.publication, [t.table for t in stream.tables])
            start = capture.ensure_slot(src, stream.slot_name)
        with connect(self.target_url, role="target") as dst:
            state, _ = st.lock_stream(dst, stream.id)
            # Tables that joined meanwhile (replicate add-tables) are not in the publication: the next turn
            # publishes them too.
            joined = {r[0] for r in dst.execute("SELECT table_name FROM sluicegate.copy_state WHERE stream_id = %s",
                                                (stream.id,))} - {t.table.qualified for t in stream.tables}
            if state == st.INIT and not joined:
                st.save_position(dst, stream.id, start, state=st.COPYING)

    def replicate_step(self, wf: st.Workflow, stream: st.Stream) -> None:
        if self.vdiffs is not None:
            self.vdiffs.start()  # its thread takes each requested vdiff's point through the stream's durable stop
            if self.vdiffs.comparing() and self.runner.parallelism() < 2:
                # One task slot (local[1]): a replicate task would hold it until interrupted, and the
                # comparison's tasks would never run. Replication waits for the comparison instead.
                self.vdiffs.wait(self.stop)
                return
        self.play(wf, stream, until="slice", expect=st.RUNNING)

    def play(self, wf, stream, *, until: str, expect: str, stop_at: int | None = None):
        """One play task (player.py) from where `stream` stands; at most one slice of time."""
        settings = Settings.from_options(wf.options, f"workflow {wf.name}")
        seconds = settings.slice_seconds
        if seconds is None:
            seconds = float("inf") if self.stream_id is None else SHARED_SLICE_SECONDS
            if self._copying - {self.tag}:
                seconds = COPY_NEIGHBOUR_SLICE_SECONDS
        origin, skip_origins = cluster_direction(wf)
        task = PlayTask(
            stream.source_url, self.target_url, wf.name, stream.id, stream.slot_name, stream.publication,
            [(t.table.to_json(), t.mode, t.lastpk) for t in stream.tables], stream.position, expect, until,
            stop_at=stop_at, max_seconds=seconds, batch_changes=settings.batch_changes,
            idle_poll=settings.idle_poll, clear_message=self.recovering,
            way_out=cluster_way_out(wf) or "", origin=origin, skip_origins=skip_origins,
            clusters=cluster_ids(wf), replica_role=bool(wf.options.get("apply_as_replica")),
            confirm_after_standbys=standby_flush.enabled(wf.options),
        )
        compiled = self._compiled_rules(stream)
        if any(not rule.moves_only for rule in compiled.values()):  # Spark SQL: one Spark job a batch
            from . import rule_player

            result = rule_player.play(self, task, self.rule_runners(stream))
        else:  # nothing for Spark SQL to compute: one task holds the stream, rules (if any) in Python
            task = replace(task, rules=tuple((name, rule.to_json()) for name, rule in compiled.items()))
            result = self.runner.map(play, [task], f"{until} {wf.name}", tag=self.tag)[0]
        if result.batches:
            self.recovering = False  # the task cleared the message with its first batch
        return result

    def _compiled_rules(self, stream: st.Stream) -> dict:
        """Source table's qualified name -> its CompiledRule, for the stream's tables that have a rule."""
        if not any(t.rule is not None for t in stream.tables):
            return {}
        from ..rules.compile import CompiledRule

        return {t.table.qualified: CompiledRule.from_json(t.rule, t.table) for t in stream.tables if t.rule is not None}

    def rule_runners(self, stream: st.Stream) -> dict:
        """(schema, name) of a source table -> its RuleRunner, made once per run."""
        runners = {}
        for t in stream.tables:
            if t.rule is None:
                continue
            name = (t.table.schema, t.table.name)
            if name not in self._runners:
                # Imported here: rules bring pyarrow (its import takes CPU), which a workflow without them never
                # needs, and `workflow run` imports the engine while Spark's JVM starts on the same cores.
                from ..rules.compile import CompiledRule
                from ..rules.evaluate import RuleRunner

                self._runners[name] = RuleRunner(self.runner.spark, CompiledRule.from_json(t.rule, t.table))
            runners[name] = self._runners[name]
        return runners

    # -- bookkeeping ----------------------------------------------------------------------------------
    def _load(self) -> st.Workflow:
        with connect(self.target_url, role="target") as conn:
            wf = st.load_workflow(conn, self.workflow)
        if not wf.streams:
            raise TerminalError(f"workflow {self.workflow} has no streams")
        return wf

    def _stream(self, wf: st.Workflow) -> st.Stream:
        if self.stream_id is None:
            return wf.streams[0]
        for s in wf.streams:
            if s.id == self.stream_id:
                return s
        raise TerminalError(f"stream {self.stream_id} of workflow {self.workflow} no longer exists")

    def unreachable(self) -> str | None:
        """Which database the stream waits for after a failure — 'target host:port/db' or 'source …' — found
        by connecting to each (a fresh session answers or it does not: no error text is read); None when both
        answer (the failure was something else: a lock, a restarting Spark task)."""
        sides = [("target", self.target_url)]
        if self._last_stream is not None:
            sides.append(("source", self._last_stream.source_url))
        for role, url in sides:
            try:
                with connect(url, role=role, autocommit=True, connect_timeout=3) as conn:
                    conn.execute("SELECT 1")
            except Exception:  # noqa: BLE001 - any failure to answer is the answer
                return f"{role} {describe(url)}"
        return None

    def _hold_run_lock(self) -> None:
        """One driver per workflow: a session advisory lock on the target, held while running."""
        if self.lock_conn is not None and not self.lock_conn.closed:
            try:
                self.lock_conn.execute("SELECT 1")
                return
            except psycopg.Error:
                self._drop_lock_conn()
        # A Reshard's streams each have their own driver thread: one lock per stream then.
        key = self.workflow if self.stream_id is None else f"{self.workflow}/stream {self.stream_id}"
        self.lock_conn = run_lock.take(self.target_url, self.workflow, key, former=self._lock_session)
        self._lock_session = run_lock.session(self.lock_conn)

    def _drop_lock_conn(self) -> None:
        if self.lock_conn is not None:
            with contextlib.suppress(Exception):  # already broken
                self.lock_conn.close()
            self.lock_conn = None

    def count(self, metric: str) -> None:
        """A retry or error for the metrics (metrics.py): the state records neither."""
        stream_id = self.stream_id or (self._last_stream.id if self._last_stream is not None else None)
        if stream_id is not None:  # else the workflow never loaded: the target is down, no stream to name
            metrics.count(metric, self.workflow, self.target_url, stream_id)

    def record(self, state: str | None, message: str) -> None:
        """Best effort: the target may be the thing that is down."""
        try:
            with connect(self.target_url, role="target", connect_timeout=3) as conn:
                wf = st.load_workflow(conn, self.workflow)
                for s in wf.streams:
                    if self.stream_id is not None and s.id != self.stream_id:
                        continue
                    if state:
                        st.set_state(conn, s.id, state, message)
                    else:
                        st.set_message(conn, s.id, message)
        except Exception:  # noqa: BLE001
            log.debug("could not record %r on the target", message)

    def close(self) -> None:
        if self.vdiffs is not None:
            self.vdiffs.close()
        self._drop_lock_conn()

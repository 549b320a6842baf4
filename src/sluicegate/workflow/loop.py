"""The driver's loop, one for every kind of target (VReplication's vreplicator): re-read the durable state,
dispatch on it, repeat; classify a failure, retry with backoff or stop in Error; cancel the running jobs when
told to stop.

A target's engine (workflow/engine.py for PostgreSQL, targets/delta/engine.py for Delta) says how to read its
state (`load`), what each state's step is (`step`), how to wait while a controller holds the stream
(`await_release`) and how to record a state or a message (`record`); the loop owns the rest.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timezone
from typing import Protocol

from ..errors import ONCE, TERMINAL, UsageError, classify, describe_error

log = logging.getLogger("sluicegate")

# The states every stream goes through, whatever its target keeps them in.
INIT, COPYING, RUNNING, STOPPED, ERROR = "Init", "Copying", "Running", "Stopped", "Error"


class Turn(Protocol):
    """What a turn reads first: the stream's state and, when a controller stopped it, why
    (workflow/stream_control.py)."""

    state: str
    stop_reason: str


class StreamLoop:
    """The loop, with the hooks a target's engine fills. Set by the engine: `runner` (the Spark task runner,
    or None), `tag` (its Spark jobs), `stop`, `max_backoff`."""

    runner = None
    tag = ""
    stop: threading.Event
    max_backoff = 30.0
    recovering = False  # the stream's message says "retrying …": the next step that succeeds clears it
    _loop_thread: int | None = None  # the loop's: cancel_waits may cancel what it waits for

    # -- what a target's engine provides ------------------------------------------------------------------
    def load(self) -> Turn:
        raise NotImplementedError

    def step(self, turn) -> None:
        raise NotImplementedError

    def await_release(self, turn) -> None:
        """The stream is Stopped for a controller: wait (some time or until released), then return."""
        raise NotImplementedError

    def record(self, state: str | None, message: str) -> None:
        """Best effort (the target may be what is down): the stream's state, or only its message."""
        raise NotImplementedError

    def count(self, metric: str) -> None:
        """A retry or an error, for the metrics."""

    def unreachable(self) -> str | None:
        """After a failure: which side does not answer ("source host:port/db"), or None."""
        return None

    def after_failure(self) -> None:
        """After a failure, before the backoff: drop what may be broken (a session)."""

    def cancel_waits(self) -> None:
        """On stop: cancel what the loop's own thread may be blocked on besides Spark jobs."""

    def ended(self) -> None:
        """The loop returned or raised."""

    # -- the loop -------------------------------------------------------------------------------------------
    def run(self) -> str:
        """Run until stopped (the event, or `workflow stop`) or in Error; the stream's final state, or
        "stopping"."""
        done = threading.Event()
        self._loop_thread = threading.get_ident()
        threading.Thread(target=self._cancel_on_stop, args=(done,), name="sg-engine-stop", daemon=True).start()
        try:
            return self._loop()
        finally:
            done.set()
            self.ended()

    def _cancel_on_stop(self, done: threading.Event) -> None:
        """A play task may run until interrupted: once stop is set, cancel this engine's jobs (again, until the
        loop returns: a job may start just after a cancel). Whatever a cancelled task had not committed is
        rolled back; the stream resumes from its saved position."""
        while not done.is_set():
            if not self.stop.wait(0.5) or done.is_set():
                continue
            self.cancel_waits()
            if self.runner is not None:
                try:
                    self.runner.cancel(self.tag)
                except Exception:  # noqa: BLE001 - the session may be stopping too
                    log.debug("could not cancel the jobs of %s", self.tag)
            done.wait(0.5)

    def _loop(self) -> str:
        failures = 0
        failing_since = datetime.now(timezone.utc)
        while not self.stop.is_set():
            try:
                turn = self.load()
                if turn.state == STOPPED and turn.stop_reason:  # held by a controller: not the end
                    self.await_release(turn)
                    continue
                if turn.state in (STOPPED, ERROR):
                    return turn.state
                self.recovering = failures > 0
                self.step(turn)
                if failures and self.recovering:
                    self.record(None, "")  # recovered: the retry message is no longer true
                failures = 0
            except UsageError:
                raise
            except Exception as exc:  # noqa: BLE001 - every failure is classified below
                if self.stop.is_set():
                    return "stopping"  # e.g. the job we cancelled on SIGTERM: not a fault to record
                kind = classify(exc)
                # ONCE: a failure whose class does not tell; the retry is how we find out (errors.classify)
                if kind == TERMINAL or (kind == ONCE and failures > 0):
                    self.count("errors")
                    self.record(ERROR, describe_error(exc))
                    return ERROR
                failures += 1
                if failures == 1:
                    failing_since = datetime.now(timezone.utc)
                self.count("retries")
                delay = min(self.max_backoff, 0.5 * 2 ** min(failures, 8))
                message = retry_message(self.unreachable(), failing_since, failures, delay, describe_error(exc))
                log.warning(message)
                self.record(None, message)
                self.after_failure()
                self.stop.wait(delay)
        return "stopping"


def retry_message(waiting_for: str | None, since: datetime, attempt: int, delay: float, error: str) -> str:
    """What the stream's message says while it retries: what it waits for, since when, and why.
    "waiting for source 10.1.2.3:5432/shop since 2026-01-02 12:03:04 UTC (attempt 5, retrying in 16s): …"."""
    when = since.strftime("%Y-%m-%d %H:%M:%S UTC")
    if waiting_for:
        return f"waiting for {waiting_for} since {when} (attempt {attempt}, retrying in {delay:.0f}s): {error}"
    return f"retrying in {delay:.0f}s (attempt {attempt}, failing since {when}): {error}"

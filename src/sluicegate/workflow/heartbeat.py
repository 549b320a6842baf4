"""The driver's heartbeat: `workflow run` writes when it was last alive into its workflow's row on the target.

Status reads it to tell a running workflow from one nobody runs: a driver killed with kill -9 leaves its streams
in state Running, and only the heartbeat's age shows that nothing replicates. A clean exit clears the pid (the
time stays: "last seen"). The beat runs in a thread of its own with its own connection, so a busy or blocked
engine never delays it, and it never waits for long itself: a target that is away just misses beats.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

import psycopg

from ..postgres.connect import connect, describe, first_line
from ..postgres.locks import LockTimeout
from . import state as st

log = logging.getLogger("sluicegate")

INTERVAL = 2.0  # seconds between beats
STALE_AFTER = 10.0  # seconds without a beat after which status says no driver runs


def is_running(driver: st.Driver) -> bool:
    return driver.pid is not None and driver.seen_seconds_ago is not None and driver.seen_seconds_ago <= STALE_AFTER


class Heartbeat(threading.Thread):
    """Beats for workflow `name` on every target in `targets` (a Reshard's target shards: each has the row)."""

    def __init__(self, targets: list[str], name: str, interval: float = INTERVAL):
        super().__init__(name="sluicegate-heartbeat", daemon=True)
        self.targets, self.workflow, self.interval = list(dict.fromkeys(targets)), name, interval
        self.pid, self.host = os.getpid(), socket.gethostname()
        self._stop_event = threading.Event()
        self._conns: dict[str, psycopg.Connection] = {}

    def start(self) -> Heartbeat:
        """The first beat before returning (the schema upgraded first if it predates the heartbeat: a target
        whose upgrade waits too long for a lock is tried again at every beat, the workflow runs meanwhile)."""
        for url in self.targets:
            with connect(url, role="target") as conn:
                self._upgrade(conn)
        self.beat()
        super().start()
        return self

    def _upgrade(self, conn: psycopg.Connection) -> bool:
        try:
            st.ensure_schema(conn)
            return True
        except LockTimeout as exc:
            log.warning("%s; the driver's heartbeat waits for it", exc)
            return False

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.beat()

    def beat(self, exiting: bool = False) -> None:
        """One beat on every target; `exiting` records a clean exit (unless another driver beat since: a second
        `workflow run` that found the workflow taken must not clear the first one's pid). Failures are only
        logged."""
        for url in self.targets:
            try:
                conn = self._conns.get(url)
                if conn is None or conn.closed:
                    conn = self._conns[url] = connect(url, role="target", autocommit=True, connect_timeout=5)
                    # Never wait behind a lock for long: a missed beat costs nothing.
                    conn.execute("SET lock_timeout = '1s'")
                    conn.execute("SET statement_timeout = '5s'")
                if exiting:
                    conn.execute("""UPDATE sluicegate.workflows SET driver_seen_at = now(), driver_pid = NULL
                                    WHERE name = %s AND driver_pid = %s AND driver_host = %s""",
                                 (self.workflow, self.pid, self.host))
                else:
                    conn.execute("""UPDATE sluicegate.workflows SET driver_seen_at = now(), driver_pid = %s,
                                           driver_host = %s WHERE name = %s""", (self.pid, self.host, self.workflow))
            except psycopg.errors.UndefinedColumn:  # the upgrade waited for a lock at start: again now
                if self._upgrade(conn):
                    self.beat(exiting)
            except Exception as exc:  # noqa: BLE001 - the target may be restarting: the next beat retries
                log.debug("heartbeat to %s failed: %s", describe(url), first_line(exc))
                self._close(url)

    def stop(self) -> None:
        """Stop beating and record the clean exit."""
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=10)
        self.beat(exiting=True)
        for url in list(self._conns):
            self._close(url)

    def _close(self, url: str) -> None:
        conn = self._conns.pop(url, None)
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - already broken
                log.debug("closing the heartbeat's connection to %s failed", describe(url))

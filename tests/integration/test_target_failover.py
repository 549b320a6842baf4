"""Target failover (workflow option confirm_after_target_standbys): the source slot is confirmed only to what the
target's physical standby has flushed too, so promoting a standby that lags its primary resumes the stream with
no re-copy and nothing lost.

The target is a primary with an asynchronous `pg_basebackup` standby; the workflow's target URL lists both
(libpq multi-host, target_session_attrs=read-write). Under source writes: the standby is stopped (the slot
waits while the target moves on, and the stream's message says why), started again (confirmation resumes),
stopped again so it lags, and then the primary is killed and the lagging standby promoted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import psycopg
import pytest

from sluicegate.localpg import LocalPostgres
from sluicegate.position import format_lsn
from sluicegate.postgres.standby_flush import OPTION
from sluicegate.workflow.create import create_movetables

from ..conftest import Pair, drop_slots, wait_for
from .helpers import assert_same, caught_up, reap_group, slot_confirmed, stream_row

pytestmark = pytest.mark.spark

WAITING = "waits for the target's standbys"


class Writes(threading.Thread):
    """An insert and an update per transaction, one after another, until stopped."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop_event, self.n, self.error = url, threading.Event(), 0, None

    def run(self):
        try:
            with psycopg.connect(self.url, autocommit=True) as c:
                while not self.stop_event.is_set():
                    with c.transaction():
                        c.execute("INSERT INTO a VALUES (%s, 0)", (1000 + self.n + 1,))
                        c.execute("UPDATE a SET v = v + 1 WHERE id = %s", (self.n % 200 + 1,))
                    self.n += 1
                    self.stop_event.wait(0.005)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            self.error = exc


def _side(source: str, target: str):
    """What the helpers take of a Pair, for a target that is not a LocalPostgres's own URL."""
    def run(url):
        def query(text, params=None):
            with psycopg.connect(url, autocommit=True) as c:
                cur = c.execute(text, params)
                return cur.fetchall() if cur.description else None
        return query

    return SimpleNamespace(source=source, target=target, src=run(source), dst=run(target))


class Failover:
    """A source database, a target primary with one standby, and (once started) a driver and source writes."""

    def __init__(self, source_server, tmp_path: Path):
        self.tmp_path = tmp_path
        self.primary = LocalPostgres(tmp_path / "primary")
        self.primary.template_cache = False  # a standby of it: its own system identifier, not the template's
        self.primary.init().start()
        self.standby = LocalPostgres.standby_of(self.primary, tmp_path / "standby").start()
        self.servers = [self.standby, self.primary]
        self.name = f"tf{os.getpid()}"
        self.p = Pair(source_server, self.primary, self.name)
        # The database reached the standby with the WAL: both hosts serve it, only the primary for writing.
        self.target = (f"postgresql://postgres@{self.primary.host}:{self.primary.port},{self.standby.host}:"
                       f"{self.standby.port}/{self.name}?target_session_attrs=read-write")
        self.log = tmp_path / "driver.log"
        self.driver = None
        self.writes = Writes(self.p.source)
        self.slot = None

    def start(self, rules: list[str], options: dict, then_set: str | None = None) -> None:
        """Create the MoveTables (`then_set`: and `workflow set` the option so), run it (the target URL lists
        both hosts) under writes until it confirms."""
        p = self.p
        p.src("CREATE TABLE a (id int PRIMARY KEY, v int NOT NULL)")
        p.src("INSERT INTO a SELECT g, 0 FROM generate_series(1, 200) g")
        create_movetables("tf", p.source, self.target, ["a"], rules, options)
        env = {k: v for k, v in os.environ.items() if k not in ("SLUICEGATE_TARGET", "SLUICEGATE_DRIVER_PID")}
        if then_set:
            out = subprocess.run([sys.executable, "-m", "sluicegate.cli.main", "workflow", "set", "tf",
                                  "--confirm-after-target-standbys", then_set, "--target", self.target],
                                 env=env, capture_output=True, text=True, check=False)
            assert out.returncode == 0 and f"confirm-after-target-standbys {then_set}" in out.stdout, out
        self.driver = subprocess.Popen(
            [sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", "tf", "--target", self.target,
             "--no-progress"], env=env, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
        self.writes.start()
        self.slot = stream_row(p, "tf")["slot"]
        first = slot_confirmed(p, self.slot) or 0
        wait_for(lambda: stream_row(p, "tf")["state"] == "Running" and (slot_confirmed(p, self.slot) or 0) > first
                 and self.writes.n > 50, timeout=60, what="running, the slot confirmed",
                 describe=lambda: (stream_row(p, "tf"), self.tail()))

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def confirmed(self) -> int:
        return slot_confirmed(self.p, self.slot)

    def apply_on(self, side, since: int) -> None:
        """Wait until the target has applied past `since` and the source wrote on."""
        n = self.writes.n
        wait_for(lambda: stream_row(side, "tf")["position"] > since and self.writes.n > n + 100, timeout=30,
                 what="the target applying on", describe=lambda: (stream_row(side, "tf"), self.tail()))

    def fail_over(self):
        """Kill the primary, start the (lagging) standby and promote it; the new primary's side."""
        self.primary.kill()
        self.standby.start()
        self.standby.promote()
        return _side(self.p.source, self.standby.url(self.name))

    def close(self, source_server) -> None:
        self.writes.stop_event.set()
        if self.driver is not None:
            reap_group(self.driver)
        with psycopg.connect(source_server.url(), autocommit=True) as c:
            drop_slots(c, self.name)
        source_server.drop_database(self.name)
        for server in self.servers:
            server.stop("immediate")


@pytest.fixture
def failover(source_server, tmp_path):
    f = Failover(source_server, tmp_path)
    yield f
    f.close(source_server)


# No rule: one Spark task holds the stream (player.py), the option set by `workflow set` after create. A rule
# with a WHERE: a Spark job a batch, the driver confirms (rule_player.py; ~65 s on 2 cores, so in the slow
# set), the option given to create. Both confirm through the same gate.
@pytest.mark.parametrize("rules", [[], pytest.param(["a: SELECT id, v FROM a WHERE v >= 0"], marks=pytest.mark.slow)],
                         ids=["player", "rule_player"])
def test_promoted_target_standby_resumes_without_recopy(failover, rules):
    f, p = failover, failover.p
    if rules:
        f.start(rules, {OPTION: True})
    else:
        f.start(rules, {}, then_set="on")

    # No standby streaming: the target moves on, the slot stays, the stream's message says why.
    f.standby.stop("fast")
    wait_for(lambda: WAITING in stream_row(p, "tf")["message"], timeout=30, what="the wait in the message",
             describe=lambda: (stream_row(p, "tf"), f.tail()))
    held = stream_row(p, "tf")["position"]  # every confirmation since the gate saw no standby is held
    f.apply_on(p, held)
    assert f.confirmed() <= held < stream_row(p, "tf")["position"], (format_lsn(f.confirmed()), format_lsn(held))

    # The standby back: confirmation catches up with the target, the message clears.
    f.standby.start()
    wait_for(lambda: f.confirmed() > held and stream_row(p, "tf")["message"] == "", timeout=30,
             what="confirmation resumed", describe=lambda: (format_lsn(f.confirmed()), stream_row(p, "tf"), f.tail()))

    # A standby that lags its primary when the primary dies: it is promoted all the same.
    f.standby.stop("fast")
    wait_for(lambda: WAITING in stream_row(p, "tf")["message"], timeout=30, what="the standby lagging",
             describe=lambda: (stream_row(p, "tf"), f.tail()))
    f.apply_on(p, stream_row(p, "tf")["position"])
    copied = p.dst("SELECT table_name, done, rows_copied FROM sluicegate.copy_state")
    before_kill = stream_row(p, "tf")["position"]
    after = f.fail_over()
    promoted_at = stream_row(after, "tf")["position"]
    assert promoted_at < before_kill, "the promoted standby should lack the dead primary's last commits"
    assert f.confirmed() <= promoted_at, "the slot passed what the promoted standby holds"
    n = f.writes.n
    wait_for(lambda: stream_row(after, "tf")["position"] > promoted_at and f.writes.n > n + 50, timeout=90,
             what="the stream resumed on the promoted standby", describe=lambda: (stream_row(after, "tf"), f.tail()))
    # The new primary has no standby yet: the slot waits, and says so, until one streams from it.
    wait_for(lambda: WAITING in stream_row(after, "tf")["message"], timeout=30, what="the wait on the new primary",
             describe=lambda: (stream_row(after, "tf"), f.tail()))
    assert f.confirmed() <= promoted_at
    f.servers.append(LocalPostgres.standby_of(f.standby, f.tmp_path / "standby2").start())
    wait_for(lambda: f.confirmed() > promoted_at and stream_row(after, "tf")["message"] == "", timeout=30,
             what="confirmation through the new primary's standby",
             describe=lambda: (format_lsn(f.confirmed()), stream_row(after, "tf"), f.tail()))
    f.writes.stop_event.set()
    f.writes.join(timeout=30)
    assert f.writes.error is None, f.writes.error
    wait_for(lambda: caught_up(after, "tf"), timeout=60, what="caught up on the new primary",
             describe=lambda: (stream_row(after, "tf"), f.tail()))
    assert assert_same(after, "a", ["id"]) == 200 + f.writes.n
    # No re-copy: the copy recorded before the failover stands, and the stream never stopped.
    assert after.dst("SELECT table_name, done, rows_copied FROM sluicegate.copy_state") == copied
    assert copied[0][1], copied
    text = f.log.read_text()
    assert "re-bootstrap" not in text and "stopped in Error" not in text, text[-3000:]


def test_without_the_option_a_lagging_standby_needs_a_rebootstrap(failover):
    """The control: confirmed as soon as the primary has flushed, the slot passes what the standby has."""
    f, p = failover, failover.p
    f.start([], {})
    f.standby.stop("fast")
    at_stop = stream_row(p, "tf")["position"]  # the standby has no more than this
    f.apply_on(p, at_stop)
    wait_for(lambda: f.confirmed() > at_stop, timeout=30, what="the slot past the stopped standby")
    after = f.fail_over()
    assert f.confirmed() > stream_row(after, "tf")["position"]
    wait_for(lambda: stream_row(after, "tf")["state"] == "Error", timeout=60, what="the stream in Error",
             describe=lambda: (stream_row(after, "tf"), f.tail()))
    assert "re-bootstrap" in stream_row(after, "tf")["message"]

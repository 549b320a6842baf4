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


# No rule: one Spark task holds the stream (player.py). A rule with a WHERE: a Spark job a batch, the driver
# confirms (rule_player.py; ~65 s on 2 cores, so in the slow set). Both confirm through the same gate.
@pytest.mark.parametrize("rules", [[], pytest.param(["a: SELECT id, v FROM a WHERE v >= 0"], marks=pytest.mark.slow)],
                         ids=["player", "rule_player"])
def test_promoted_target_standby_resumes_without_recopy(source_server, tmp_path, rules):
    primary = LocalPostgres(tmp_path / "primary")
    primary.template_cache = False  # a standby of it: its own system identifier, not the template's
    primary.init().start()
    standby = LocalPostgres.standby_of(primary, tmp_path / "standby").start()
    servers = [standby, primary]
    name = f"tf{os.getpid()}"
    p = Pair(source_server, primary, name)
    # The database reached the standby with the WAL: both hosts serve it, only the primary for writing.
    target = (f"postgresql://postgres@{primary.host}:{primary.port},{standby.host}:{standby.port}/{name}"
              f"?target_session_attrs=read-write")
    log = tmp_path / "driver.log"
    driver = None
    writes = Writes(p.source)
    try:
        p.src("CREATE TABLE a (id int PRIMARY KEY, v int NOT NULL)")
        p.src("INSERT INTO a SELECT g, 0 FROM generate_series(1, 200) g")
        create_movetables("tf", p.source, target, ["a"], rules, {OPTION: True})
        env = {k: v for k, v in os.environ.items() if k not in ("SLUICEGATE_TARGET", "SLUICEGATE_DRIVER_PID")}
        driver = subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", "tf", "--target",
                                   target, "--no-progress"], env=env, stdout=log.open("ab"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        tail = lambda: log.read_text()[-3000:]
        writes.start()
        slot = stream_row(p, "tf")["slot"]
        first = slot_confirmed(p, slot) or 0
        wait_for(lambda: stream_row(p, "tf")["state"] == "Running" and (slot_confirmed(p, slot) or 0) > first
                 and writes.n > 50, timeout=60, what="running, the slot confirmed as the standby flushes",
                 describe=lambda: (stream_row(p, "tf"), tail()))

        # No standby streaming: the target moves on, the slot stays, the stream's message says why.
        standby.stop("fast")
        wait_for(lambda: WAITING in stream_row(p, "tf")["message"], timeout=30, what="the wait in the message",
                 describe=lambda: (stream_row(p, "tf"), tail()))
        held = stream_row(p, "tf")["position"]  # every confirmation since the gate saw no standby is held
        n = writes.n
        wait_for(lambda: stream_row(p, "tf")["position"] > held and writes.n > n + 100, timeout=30,
                 what="the target applying on", describe=lambda: (stream_row(p, "tf"), tail()))
        confirmed = slot_confirmed(p, slot)
        assert confirmed <= held < stream_row(p, "tf")["position"], (format_lsn(confirmed), format_lsn(held))

        # The standby back: confirmation catches up with the target, the message clears.
        standby.start()
        wait_for(lambda: slot_confirmed(p, slot) > held and stream_row(p, "tf")["message"] == "", timeout=30,
                 what="confirmation resumed", describe=lambda: (format_lsn(slot_confirmed(p, slot)),
                                                                 stream_row(p, "tf"), tail()))

        # A standby that lags its primary when the primary dies: it is promoted all the same.
        standby.stop("fast")
        wait_for(lambda: WAITING in stream_row(p, "tf")["message"], timeout=30, what="the standby lagging",
                 describe=lambda: (stream_row(p, "tf"), tail()))
        lost = stream_row(p, "tf")["position"]
        n = writes.n
        wait_for(lambda: stream_row(p, "tf")["position"] > lost and writes.n > n + 100, timeout=30,
                 what="the primary ahead of its standby", describe=lambda: (stream_row(p, "tf"), tail()))
        copied = p.dst("SELECT table_name, done, rows_copied FROM sluicegate.copy_state")
        before_kill = stream_row(p, "tf")["position"]
        primary.kill()
        standby.start()
        standby.promote()
        after = _side(p.source, standby.url(name))
        promoted_at = stream_row(after, "tf")["position"]
        assert promoted_at < before_kill, "the promoted standby should lack the dead primary's last commits"
        assert slot_confirmed(p, slot) <= promoted_at, "the slot passed what the promoted standby holds"
        n = writes.n
        wait_for(lambda: stream_row(after, "tf")["position"] > promoted_at and writes.n > n + 50, timeout=90,
                 what="the stream resumed on the promoted standby", describe=lambda: (stream_row(after, "tf"), tail()))
        # The new primary has no standby yet: the slot waits, and says so, until one streams from it.
        wait_for(lambda: WAITING in stream_row(after, "tf")["message"], timeout=30, what="the wait on the new primary",
                 describe=lambda: (stream_row(after, "tf"), tail()))
        assert slot_confirmed(p, slot) <= promoted_at
        servers.append(LocalPostgres.standby_of(standby, tmp_path / "standby2").start())
        wait_for(lambda: slot_confirmed(p, slot) > promoted_at and stream_row(after, "tf")["message"] == "",
                 timeout=30, what="confirmation through the new primary's standby",
                 describe=lambda: (format_lsn(slot_confirmed(p, slot)), stream_row(after, "tf"), tail()))
        writes.stop_event.set()
        writes.join(timeout=30)
        assert writes.error is None, writes.error
        wait_for(lambda: caught_up(after, "tf"), timeout=60, what="caught up on the new primary",
                 describe=lambda: (stream_row(after, "tf"), tail()))
        assert assert_same(after, "a", ["id"]) == 200 + writes.n
        # No re-copy: the copy recorded before the failover stands, and the stream never stopped.
        assert after.dst("SELECT table_name, done, rows_copied FROM sluicegate.copy_state") == copied
        assert copied[0][1], copied
        text = log.read_text()
        assert "re-bootstrap" not in text and "stopped in Error" not in text, text[-3000:]
    finally:
        writes.stop_event.set()
        if driver is not None:
            reap_group(driver)
        with psycopg.connect(source_server.url(), autocommit=True) as c:
            drop_slots(c, name)
        source_server.drop_database(name)
        for server in servers:
            server.stop("immediate")

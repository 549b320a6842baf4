"""MoveTables to its end: switch-traffic under a steady write load, reverse-traffic back, a switch that cannot
get its lock, complete. Clients count every acknowledged write; none may be lost or applied twice."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psycopg
import pytest

from sluicegate.errors import RetryableError
from sluicegate.workflow.create import create_movetables
from sluicegate.workflow.state import object_name
from sluicegate.workflow.traffic import switch_traffic

from ..conftest import wait_for
from .helpers import assert_same, caught_up, reap_group, sluicegate_objects, stream_row

pytestmark = pytest.mark.spark

TABLES = """
CREATE TABLE events (id bigserial PRIMARY KEY, client int NOT NULL, k int NOT NULL);
CREATE TABLE counters (client int PRIMARY KEY, n int NOT NULL);
"""
CLIENTS = 6


class Client(threading.Thread):
    """Single-row writes in a loop (odd: an INSERT of its counter, even: an UPDATE of its row), on the side
    that takes writes: a denied write is retried on the other side. Counts what was acknowledged."""

    def __init__(self, n: int, urls: dict[str, str]):
        super().__init__(daemon=True)
        self.n, self.urls = n, urls
        self.side = "source"
        self.inserted: list[int] = []
        self.updates = 0
        self.acks: list[float] = []
        self.denials: list[str] = []
        self.error: BaseException | None = None
        self.stop_event = threading.Event()

    def run(self):
        conns: dict[str, psycopg.Connection] = {}
        k = 0
        try:
            while not self.stop_event.is_set():
                k += 1
                while True:
                    if self.side not in conns:
                        conns[self.side] = psycopg.connect(self.urls[self.side], autocommit=True)
                    try:
                        if k % 2:
                            conns[self.side].execute("INSERT INTO events (client, k) VALUES (%s, %s)", (self.n, k))
                        else:
                            conns[self.side].execute("UPDATE counters SET n = n + 1 WHERE client = %s", (self.n,))
                        break
                    except psycopg.errors.ReadOnlySqlTransaction as exc:
                        self.denials.append(str(exc))
                        self.side = "target" if self.side == "source" else "source"
                        if len(self.denials) % 2 == 0:  # both sides refuse (a traffic command was killed)
                            time.sleep(0.01)
                self.acks.append(time.monotonic())
                if k % 2:
                    self.inserted.append(k)
                else:
                    self.updates += 1
                time.sleep(0.002)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            self.error = exc
        finally:
            for c in conns.values():
                c.close()

    def max_gap(self, start: float, end: float) -> float:
        times = [t for t in self.acks if start <= t <= end]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def _cli(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "sluicegate.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def _driver(pair, log) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("SLUICEGATE_DRIVER_PID", None)
    env["SLUICEGATE_PROGRESS_INTERVAL"] = "1"
    return subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", "mt", "--target",
                             pair.target, "--no-progress"], env=env, stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _reverse_row(pair) -> dict | None:
    rows = pair.src("SELECT to_regclass('sluicegate.streams') IS NOT NULL")
    if not rows[0][0]:
        return None
    rows = pair.src("SELECT state, position::text FROM sluicegate.streams WHERE workflow = 'mt_reverse'")
    return {"state": rows[0][0], "position": rows[0][1]} if rows else None


def _switch(pair, verb: str, clients: list[Client]) -> tuple[dict, float]:
    """Run `movetables <verb>` while the clients write; (its JSON, the clients' longest gap between acks)."""
    start = time.monotonic()
    out = _cli("movetables", verb, "mt", "--target", pair.target, "--json", "--timeout", "20s")
    end = time.monotonic()
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    # the clients' acks around the switch: wait until each has written on the new side
    side = "target" if verb == "switch-traffic" else "source"
    wait_for(lambda: all(c.side == side and c.acks[-1] > end for c in clients) or any(c.error for c in clients),
             timeout=30, what=f"every client writing to the {side}")
    assert not [c.error for c in clients if c.error], [c.error for c in clients]
    gap = max(c.max_gap(start, time.monotonic()) for c in clients)
    print(f"{verb}: {result}; longest gap between a client's acks {gap:.3f} s")
    return result, gap


def test_switch_reverse_complete_under_load(pair, tmp_path):
    pair.src(TABLES)
    pair.src("INSERT INTO counters SELECT g, 0 FROM generate_series(0, %s) g", (CLIENTS - 1,))
    pair.src("INSERT INTO events (client, k) SELECT -1, g FROM generate_series(1, 500) g")
    # The target tables are made by create like their source (postgres/table_definition.py): the bigserial key
    # draws from a target sequence of its own, which the switch sets past the source's.
    create_movetables("mt", pair.source, pair.target, ["events", "counters"], [], {})
    log = tmp_path / "driver.log"
    driver = _driver(pair, log)
    clients = [Client(n, {"source": pair.source, "target": pair.target}) for n in range(CLIENTS)]
    try:
        wait_for(lambda: caught_up(pair, "mt") and pair.dst("SELECT caught_up_at IS NOT NULL FROM sluicegate.streams")
                 == [(True,)], timeout=180, what="the forward stream caught up",
                 describe=lambda: log.read_text()[-2000:])
        forward_slot = stream_row(pair, "mt")["slot"]
        reverse_slot = object_name("sg", "mt_reverse")

        # Item 3: a long transaction holds a lock on a moved table: the switch fails within its lock timeout,
        # names the blocker, and changes nothing.
        with psycopg.connect(pair.source) as blocker:
            blocker.execute("UPDATE counters SET n = n WHERE client = 0")
            pid = blocker.info.backend_pid
            began = time.monotonic()
            with pytest.raises(RetryableError, match=f"pid {pid} ") as failed:
                switch_traffic("mt", pair.target, lock_timeout=1.0, timeout=10.0)
            assert time.monotonic() - began < 1.0 + 3.0, "the failed switch took far longer than its lock timeout"
            assert "nothing was changed" in str(failed.value)
            blocker.rollback()
        pair.src("UPDATE counters SET n = n WHERE client = 1")  # the source takes writes
        assert stream_row(pair, "mt")["state"] == "Running"
        assert _reverse_row(pair) is None
        assert pair.dst("SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (reverse_slot,)) == [(0,)]
        assert pair.dst("SELECT count(*) FROM pg_publication") == [(0,)]
        assert pair.src("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'sluicegate%'") == [(0,)]

        # Item 2: switch under load.
        for c in clients:
            c.start()
        wait_for(lambda: all(len(c.acks) > 20 for c in clients), timeout=60, what="the clients writing")
        switched, gap = _switch(pair, "switch-traffic", clients)
        assert switched["traffic"] == "switched"
        bound = 2.0 + switched["lag_seconds"]
        assert switched["blocked_seconds"] < bound, switched
        assert gap < bound + 1.0, f"a client waited {gap:.2f} s for a write (switch: {switched})"
        assert all("reverse-traffic mt" in c.denials[0] for c in clients), clients[0].denials[:1]
        assert stream_row(pair, "mt")["state"] == "Stopped"
        # writes on the target reach the source through the reverse workflow
        newest = pair.dst("SELECT max(id) FROM events")[0][0]
        wait_for(lambda: pair.src("SELECT count(*) FROM events WHERE id = %s", (newest,)) == [(1,)], timeout=60,
                 what="a target write on the source", describe=lambda: (_reverse_row(pair), log.read_text()[-1500:]))
        # the driver's progress lines follow the reverse workflow: what it applies, not the stopped forward one
        reverse_applied = re.compile(r"sluicegate\.progress: replicate stream \d+: lag ([\d.]+s|unknown), position \S+, "
                                     r"([1-9][\d,]*) rows applied (since the last line|so far)")
        wait_for(lambda: reverse_applied.search(log.read_text().partition("running workflow mt_reverse")[2]),
                 timeout=60, what="a progress line of the reverse stream", describe=lambda: log.read_text()[-1500:])
        status = json.loads(_cli("workflow", "status", "mt", "--target", pair.target, "--json").stdout)
        assert status["traffic"]["state"] == "switched"
        assert status["traffic"]["reverse"]["state"] == "Running"
        assert status["traffic"]["reverse"]["lag_seconds"] is not None
        text = _cli("workflow", "status", "mt", "--target", pair.target).stdout
        assert "traffic: switched" in text and "reverse workflow mt_reverse: Running" in text, text
        # While switched, `workflow stop|start` act on the stream that runs, the reverse one; the forward one
        # stays stopped (its replay would loop).
        assert _cli("workflow", "stop", "mt", "--target", pair.target).returncode == 0
        assert _reverse_row(pair)["state"] == "Stopped"
        assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]  # nothing left for it to run
        assert _cli("workflow", "start", "mt", "--target", pair.target).returncode == 0
        assert _reverse_row(pair)["state"] == "Running" and stream_row(pair, "mt")["state"] == "Stopped"
        driver = _driver(pair, log)  # a new driver carries the reverse workflow
        newest = pair.dst("SELECT max(id) FROM events")[0][0]
        wait_for(lambda: pair.src("SELECT count(*) FROM events WHERE id = %s", (newest,)) == [(1,)], timeout=90,
                 what="target writes on the source after a stop and start", describe=lambda: log.read_text()[-1500:])

        # reverse-traffic: writes back to the source, the forward workflow resumes
        reversed_, gap = _switch(pair, "reverse-traffic", clients)
        assert reversed_["traffic"] == "reversed"
        # the source's sequence is the one set, from the target's (issue 34: it said "(source …)")
        assert reversed_["sequences"] == [line for line in reversed_["sequences"] if
                                          line.startswith("sequence public.events_id_seq on the source set to ")
                                          and "(target public.events_id_seq at " in line], reversed_
        assert len(reversed_["sequences"]) == 1, reversed_
        bound = 2.0 + reversed_["lag_seconds"]
        assert reversed_["blocked_seconds"] < bound, reversed_
        assert gap < bound + 1.0, f"a client waited {gap:.2f} s for a write (reverse: {reversed_})"
        newest = pair.src("SELECT max(id) FROM events")[0][0]
        wait_for(lambda: pair.dst("SELECT count(*) FROM events WHERE id = %s", (newest,)) == [(1,)], timeout=60,
                 what="a source write on the target again", describe=lambda: log.read_text()[-1500:])
        for c in clients:
            c.stop_event.set()
        for c in clients:
            c.join(timeout=30)
        assert not [c.error for c in clients if c.error]
        wait_for(lambda: caught_up(pair, "mt"), timeout=60, what="the forward stream caught up",
                 describe=lambda: (stream_row(pair, "mt"), log.read_text()[-1500:]))
        # every acknowledged write exactly once, on both sides
        for url in (pair.source, pair.target):
            with psycopg.connect(url) as c:
                for client in clients:
                    ks = [r[0] for r in c.execute("SELECT k FROM events WHERE client = %s ORDER BY k",
                                                  (client.n,))]
                    assert ks == client.inserted, f"client {client.n} on {url}: {len(ks)} rows, " \
                                                  f"{len(client.inserted)} acknowledged"
                    n = c.execute("SELECT n FROM counters WHERE client = %s", (client.n,)).fetchone()[0]
                    assert n == client.updates, (client.n, n, client.updates)
        assert assert_same(pair, "events", ["id"]) > 500
        assert_same(pair, "counters", ["client"])
        assert sum(c.side == "target" for c in clients) == 0

        # switch again (quiet), then complete: neither side keeps anything of Sluicegate's but the data
        out = _cli("movetables", "switch-traffic", "mt", "--target", pair.target)
        assert out.returncode == 0 and "blocked for" in out.stdout, out.stdout + out.stderr
        assert "\n  sequence public.events_id_seq on the target set to " in out.stdout, out.stdout
        assert "(source public.events_id_seq at " in out.stdout and "sequence sequence" not in out.stdout, out.stdout
        pair.dst("INSERT INTO events (client, k) VALUES (-2, 1)")  # the target's sequence is past the source's
        wait_for(lambda: pair.src("SELECT count(*) FROM events WHERE client = -2") == [(1,)], timeout=60,
                 what="the second switch's reverse stream", describe=lambda: log.read_text()[-1500:])
        out = _cli("movetables", "complete", "mt", "--target", pair.target)
        assert out.returncode == 0, out.stdout + out.stderr
        assert forward_slot in out.stdout and reverse_slot in out.stdout
        for url in (pair.source, pair.target):
            assert sluicegate_objects(url) == {"schema": 0, "slots": 0, "publications": 0, "triggers": 0,
                                                "functions": 0}, url
        assert_same(pair, "events", ["id"])
        out = _cli("workflow", "status", "mt", "--target", pair.target)  # nothing left: says why (issue 34)
        assert out.returncode != 0 and "`movetables complete`" in out.stderr, out.stderr
        assert "create 'mt' first" not in out.stderr, out.stderr
        # writable again, no trigger left (complete leaves the source's sequences where they are)
        pair.src("INSERT INTO events (id, client, k) SELECT max(id) + 1, -3, 1 FROM events")
        assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]
    finally:
        for c in clients:
            c.stop_event.set()
        if driver.poll() is None:
            driver.send_signal(signal.SIGTERM)
            try:
                driver.wait(timeout=60)
            except subprocess.TimeoutExpired:
                reap_group(driver)


# kill -9 of a traffic command at its steps (workflow/traffic.py's fault points); CI runs those at the commits.
SWITCH_POINTS = ["switch.publication", "switch.locked", "switch.caught_up", "switch.sequences", "switch.slot",
                 "switch.denied", "switch.before_commit", "switch.source_committed"]
REVERSE_POINTS = ["reverse.locked", "reverse.caught_up", "reverse.before_commit", "reverse.target_committed"]


@pytest.mark.parametrize("points", [
    pytest.param(["switch.slot", "switch.source_committed", "reverse.target_committed"], marks=pytest.mark.slow),
    pytest.param(SWITCH_POINTS + REVERSE_POINTS, marks=pytest.mark.slow),
])
def test_kill_9_of_traffic_commands(pair, tmp_path, points):
    pair.src(TABLES)
    pair.src("INSERT INTO counters SELECT g, 0 FROM generate_series(0, 1) g")
    pair.dst(TABLES)
    create_movetables("mt", pair.source, pair.target, ["events", "counters"], [], {})
    log = tmp_path / "driver.log"
    driver = _driver(pair, log)
    clients = [Client(n, {"source": pair.source, "target": pair.target}) for n in range(2)]
    try:
        wait_for(lambda: caught_up(pair, "mt") and pair.dst("SELECT caught_up_at IS NOT NULL FROM sluicegate.streams")
                 == [(True,)], timeout=180, what="the forward stream caught up",
                 describe=lambda: log.read_text()[-2000:])
        for c in clients:
            c.start()
        for point in points:
            _kill_at(pair, tmp_path, point, clients, log)
        for c in clients:
            c.stop_event.set()
        for c in clients:
            c.join(timeout=30)
        assert not [c.error for c in clients if c.error]
        wait_for(lambda: caught_up(pair, "mt"), timeout=60, what="the forward stream caught up",
                 describe=lambda: (stream_row(pair, "mt"), log.read_text()[-1500:]))
        for url in (pair.source, pair.target):
            with psycopg.connect(url) as c:
                for client in clients:
                    ks = [r[0] for r in c.execute("SELECT k FROM events WHERE client = %s ORDER BY k",
                                                  (client.n,))]
                    assert ks == client.inserted, (url, client.n, len(ks), len(client.inserted))
                    n = c.execute("SELECT n FROM counters WHERE client = %s", (client.n,)).fetchone()[0]
                    assert n == client.updates, (url, client.n, n, client.updates)
        # before any other switch: cancel drops what Sluicegate made, keeping the source's tables and rows
        out = _cli("movetables", "cancel", "mt", "--target", pair.target)
        assert out.returncode == 0 and "target table public.events" in out.stdout, out.stdout + out.stderr
        for url in (pair.source, pair.target):
            assert sluicegate_objects(url) == {"schema": 0, "slots": 0, "publications": 0, "triggers": 0,
                                                "functions": 0}, url
        assert pair.dst("SELECT to_regclass('public.events')") == [(None,)]
        assert pair.src("SELECT count(*) FROM events")[0][0] == sum(len(c.inserted) for c in clients)
        assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]
    finally:
        for c in clients:
            c.stop_event.set()
        if driver.poll() is None:
            driver.send_signal(signal.SIGTERM)
            try:
                driver.wait(timeout=60)
            except subprocess.TimeoutExpired:
                reap_group(driver)


def _traffic_ok(pair, verb: str, log) -> str:
    out = _cli("movetables", verb, "mt", "--target", pair.target, "--timeout", "20s")
    assert out.returncode == 0, out.stdout + out.stderr + log.read_text()[-1500:]
    return out.stdout + out.stderr


def _kill_at(pair, tmp_path, point: str, clients: list[Client], log) -> None:
    """kill -9 of a traffic command at `point`, a check of what it left, the command again, and back to the
    source."""
    verb = "switch-traffic" if point.startswith("switch") else "reverse-traffic"
    if verb == "reverse-traffic":
        _traffic_ok(pair, "switch-traffic", log)
    env = dict(os.environ, SLUICEGATE_FAULT_PAUSE=point, SLUICEGATE_FAULT_DIR=str(tmp_path))
    env.pop("SLUICEGATE_DRIVER_PID", None)
    proc = subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "movetables", verb, "mt",
                             "--target", pair.target, "--timeout", "20s"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: (tmp_path / point).exists() or proc.poll() is not None, timeout=60,
                 what=f"fault point {point}")
        assert proc.poll() is None, proc.stdout.read().decode()
    finally:
        reap_group(proc)
    before = [len(c.acks) for c in clients]
    committed = point in ("switch.source_committed", "reverse.target_committed")
    if not committed:  # nothing changed: the side that took writes still does
        side = "source" if verb == "switch-traffic" else "target"
        wait_for(lambda: all(len(c.acks) > b + 5 and c.side == side for c, b in zip(clients, before)),
                 timeout=30, what=f"writes on the {side} after a kill at {point}",
                 describe=lambda: [(c.side, c.error) for c in clients])
    else:  # status tells of the unfinished part
        status = json.loads(_cli("workflow", "status", "mt", "--target", pair.target, "--json").stdout)
        assert "interrupted" in status["traffic"], status["traffic"]
    out = _traffic_ok(pair, verb, log)
    assert ("finished" in out) == committed, out
    if verb == "switch-traffic":
        _traffic_ok(pair, "reverse-traffic", log)
    assert not [c.error for c in clients if c.error], [c.error for c in clients]

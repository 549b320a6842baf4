"""A Delta target under steady rewrites of ~10 kB rows stays near the source's size (issue 34): the driver's
vacuum keeps the versions of the points within the retention and nothing older, so a point a reader took
still reads the same until it ages out, and then the lake shrinks back within 3x the source."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import psycopg
import pytest

from sluicegate.targets.delta import read
from sluicegate.targets.delta.state import Store

from ..conftest import wait_for
from .helpers import reap_group
from .test_lake_big_and_small import caught_up, start_verbose_driver
from .test_lake_movetables import sluicegate

pytestmark = pytest.mark.spark

RETENTION = 12.0
BODY = "(SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 160)) || repeat(md5(%s::text), 160)"


def lake_bytes(root) -> int:
    total = 0
    for d, _, names in os.walk(root):
        for n in names:
            try:
                total += os.path.getsize(os.path.join(d, n))
            except FileNotFoundError:  # vacuumed meanwhile
                pass
    return total


def source_bytes(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as c:
        return c.execute("SELECT pg_total_relation_size('docs')").fetchone()[0]


def snapshot(root, point) -> list[tuple]:
    t = read.arrow_tables_as_of(str(root), "sz", position=point)["public.docs"]
    return sorted(zip(t.column("id").to_pylist(), t.column("rev").to_pylist()))


@pytest.mark.slow  # bench/lake_size.py measures it; the default suite keeps to its time
def test_lake_stays_near_the_source_size(pair, tmp_path):
    pair.src("CREATE TABLE docs (id bigint PRIMARY KEY, rev int NOT NULL, body text NOT NULL)")
    pair.src(f"INSERT INTO docs SELECT g, 0, {BODY.replace('%s', 'g')} FROM generate_series(1, 200) g")
    root = tmp_path / "lake"
    target = f"delta:{root}"
    made = sluicegate("movetables", "create", "--workflow", "sz", "--source", pair.source, "--target", target,
                      "--optimize-every", "3s", "--vacuum-every", "1s", "--vacuum-retention", f"{RETENTION}s")
    assert made.returncode == 0, made.stderr
    store = Store(root)
    with store.update("sz") as w:  # a commit a second (the default's schedule, compressed)
        w.options["commit_every"] = 1.0
    log = tmp_path / "driver.log"
    stop = threading.Event()
    commits = []

    def write():  # every doc rewritten ~once every 2 s: each commit rewrites the whole Delta table
        with psycopg.connect(pair.source, autocommit=True) as c:
            while not stop.is_set():
                c.execute(f"UPDATE docs SET rev = rev + 1, body = {BODY} WHERE id %% 20 = %s",
                          (len(commits), len(commits) % 20))
                commits.append(1)
                time.sleep(0.1)

    writer = threading.Thread(target=write, daemon=True)
    driver = start_verbose_driver(target, "sz", log)
    try:
        wait_for(lambda: store.load("sz").first_point, timeout=120, what="the first consistent point",
                 describe=lambda: log.read_text()[-2000:])
        writer.start()
        wait_for(lambda: len(commits) > 30, timeout=30, what="writes")
        point = read.latest_point(str(root), "sz")
        taken, before = time.monotonic(), snapshot(root, point)
        vacuums = log.read_text().count("vacuum sz")
        # Vacuum runs while the writes go on; the point stays readable, the same, within the retention.
        wait_for(lambda: log.read_text().count("vacuum sz") >= vacuums + 3, timeout=RETENTION * 0.6,
                 what="three vacuums", describe=lambda: log.read_text()[-2000:])
        assert snapshot(root, point) == before
        assert time.monotonic() - taken < RETENTION
        stop.set()
        writer.join()
        wait_for(caught_up(store, "sz", pair.source), timeout=60, what="caught up",
                 describe=lambda: log.read_text()[-2000:])
        # Once the points of the writes age out, the lake holds little more than the newest version.
        source = source_bytes(pair.source)
        def shrunk():  # old versions' files removed, and the lake within 3x the source
            removed = sum(int(n) for n in re.findall(r"public\.docs (\d+) files removed", log.read_text()))
            return removed > 0 and lake_bytes(root) <= 3 * source

        wait_for(shrunk, timeout=RETENTION * 3, what="the lake within 3x, old files removed",
                 describe=lambda: f"lake {lake_bytes(root)} bytes, source {source}: "
                                  f"{[x for x in log.read_text().splitlines() if 'vacuum sz' in x][-2:]}")
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) == 0, log.read_text()[-2000:]
    finally:
        stop.set()
        reap_group(driver)
    text = log.read_text()
    assert "failed, will try again" not in text, text[-3000:]
    with psycopg.connect(pair.source, autocommit=True) as c:
        want = sorted(c.execute("SELECT id, rev FROM docs").fetchall())
    assert snapshot(root, None) == want
    # The dry run: one line per table and a total, files and bytes; the files only under -v.
    out = sluicegate("lake", "vacuum", "sz", "--target", target, "--retention", "1h", "--dry-run")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert re.fullmatch(r"public\.docs: would remove \d+ files, [\d.]+ (bytes|kB|MB)(; keeps .*)?", lines[1])
    assert lines[-1].startswith("total: would remove ") and len(lines) == 4, out.stdout

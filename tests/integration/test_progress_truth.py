"""Progress lines that tell the truth (`workflow run > file`): a table that fits in one copy cycle shows its
rows moving during the cycle, at its real rate; a Delta target writes the same lines."""

from __future__ import annotations

import itertools
import re
import signal
import subprocess
import sys
from datetime import datetime

import pytest

from sluicegate.targets.delta import cli as lake

from ..conftest import wait_for
from .helpers import reap_group

pytestmark = pytest.mark.spark

STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3})"
COPY = re.compile(rf"^{STAMP} INFO sluicegate\.progress: copy public\.big: ([\d,]+)/([\d,]+) rows \((\d+)%\)"
                  r", ([\d,]+) rows/s$", re.MULTILINE)
COPIED = re.compile(rf"^{STAMP} INFO sluicegate\.progress: copied public\.big: ([\d,]+)/([\d,]+) rows, "
                    r"([\d,]+) rows/s$", re.MULTILINE)


def number(text: str) -> int:
    return int(text.replace(",", ""))


def when(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").timestamp()


def driver(workflow: str, target: str, out, log, interval: str = "0.5") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", workflow, "--target", target,
         "--spark-master", "local[2]", "--progress-interval", interval, "--log-level", "info",
         "--log-file", str(log)],
        stdout=out.open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def sg(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluicegate.cli.main", *args], capture_output=True, text=True,
                          timeout=180, stdin=subprocess.DEVNULL, check=False)


ROWS = 2_000_000
INTERVAL = 0.1


def test_one_cycle_copy_moves_at_its_real_rate(pair, tmp_path):
    pair.src("CREATE TABLE big (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src(f"INSERT INTO big SELECT g, g % 100, 'note ' || g FROM generate_series(1, {ROWS}) g")
    pair.src("ANALYZE big")
    created = sg("movetables", "create", "--workflow", "p", "--source", pair.source, "--target", pair.target)
    assert created.returncode == 0, created.stderr
    out, log = tmp_path / "stdout", tmp_path / "driver.log"
    # the copy itself may take under a second: lines 0.1 s apart see the rows move
    proc = driver("p", pair.target, out, log, interval=str(INTERVAL))
    describe = lambda: log.read_text()[-3000:] if log.exists() else out.read_text()[-3000:]
    try:
        text = wait_for(lambda: COPIED.search(log.read_text()) and log.read_text(), timeout=180,
                        what="the copied line", describe=describe)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, describe()
    finally:
        reap_group(proc)
    # one cycle: copy_state's rows_copied moved once
    assert len(re.findall(r"copied \d+ rows of public\.big", text)) == 1, text
    lines = [(when(m[0]), number(m[1]), number(m[2]), int(m[3]), number(m[4])) for m in COPY.findall(text)]
    during = [line for line in lines if 0 < line[1] < ROWS]
    started = when(re.search(rf"^{STAMP} INFO sluicegate: copying public\.big in \d+ tasks$", text, re.MULTILINE)[1])
    ended = when(re.search(rf"^{STAMP} INFO sluicegate: copied {ROWS} rows of public\.big", text, re.MULTILINE)[1])
    # the count moves during the cycle, line after line (lines keep coming while the rows move: below, none
    # more than a second after the one before, however busy the 2 cores), and never goes back; two lines may
    # show the same count (a COPY backend not scheduled between them)
    assert all(b[1] >= a[1] for a, b in itertools.pairwise(during)), during
    assert len({rows for _, rows, *_ in during}) >= 2, (during, text)
    assert all(b[0] - a[0] < 1.0 for a, b in itertools.pairwise(during)), during
    assert all(p < 100 for *_, p, _ in during), during
    # the rate is rows over wall time: the copied line's, within 10% of the copy's own start and end
    measured = ROWS / (ended - started)
    final = COPIED.search(text)
    assert number(final[2]) == number(final[3]) == ROWS
    assert abs(number(final[4]) - measured) <= 0.1 * measured, (final[0], measured, text[-3000:])
    # and each line's rate is the rows so far over the time since the copy started, not an interval's jump:
    # the time it implies (rows / rate) is the copy's so far, less at most the line's own lag behind its
    # count (a line is written after the count is read), never an interval's 0.1 s
    for at, rows, _, _, rate in during:
        if at - started >= 0.6:
            assert 0.5 * (at - started) <= rows / rate <= at - started + 0.1, (at - started, rows, rate)
    # the status table after it: 100%
    status = sg("workflow", "status", "p", "--target", pair.target, "--json")
    assert '"rows_copied": 2000000' in status.stdout and '"rows_total": 2000000' in status.stdout, status.stdout


def test_delta_run_writes_progress_lines(pair, tmp_path):
    pair.src("CREATE TABLE big (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    # ~250-byte notes, 75 MB a task: a task reads a few blocks (24 MB) ahead of what it writes, and the count
    # (rows read) then moves a block at a time as the writing frees one; narrow rows or small tasks are read
    # whole at once, too quick for lines 0.1 s apart to see the count move in between
    pair.src("INSERT INTO big SELECT g, 0, repeat(md5(g::text), 8) FROM generate_series(1, 600000) g")
    pair.src("ANALYZE big")
    target = f"delta:{tmp_path / 'lake'}"
    # one cycle of 2 tasks: the rows move as the tasks read them, not only when one ends
    lake.create("d", pair.source, target, None, None, [], {"chunk_rows": 300_000})
    out, log = tmp_path / "stdout", tmp_path / "driver.log"
    proc = driver("d", target, out, log, interval="0.1")
    try:
        wait_for(lambda: "replicate stream 1: lag" in out.read_text(), timeout=180,
                 what="a replicate line", describe=lambda: log.read_text()[-3000:])
        pair.src("UPDATE big SET qty = 1 WHERE id <= 10")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        reap_group(proc)
    text = out.read_text()
    assert re.search(r"INFO sluicegate\.progress: stream 1: Copying", text), text
    copied = COPIED.search(text)
    assert copied and number(copied[2]) == number(copied[3]) == 600_000, text
    during = sorted({number(m[1]) for m in COPY.findall(text)} - {0, 600_000})
    # The rows move as the tasks read them: counted only as tasks end, two tasks show one count between 0 and
    # the whole (the first to end's), whatever their sizes
    assert len(during) >= 2, text
    assert len(re.findall(r"copying public\.big cycle \d+ in 2 tasks", log.read_text())) == 1
    assert re.search(r"INFO sluicegate\.progress: replicate stream 1: lag ([\d.]+s|unknown), "
                     r"position [0-9A-F]+/[0-9A-F]+$",
                     text, re.MULTILINE), text

"""VDiff on real PostgreSQL and real local Spark: a consistent point under live writes, exact counts and keys
after tampering, values compared by their PostgreSQL meaning, a stopped stream played to the point, resume
after kill -9, and clear refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from sluicegate.workflow.create import create_movetables

from ..conftest import EngineThread, wait_for
from .helpers import Writer, caught_up, stream_row

pytestmark = pytest.mark.spark


def vdiff(target, *args, env=None, timeout=240):
    env = {**os.environ, "SLUICEGATE_SPARK_MASTER": "local[2]", **(env or {})}
    out = subprocess.run([sys.executable, "-m", "sluicegate.cli.main", "vdiff", *args, "--target", target],
                         capture_output=True, text=True, timeout=timeout, env=env, check=False)
    return out


def report(out) -> dict:
    assert out.stdout, out.stderr
    return json.loads(out.stdout)


def make_items(pair, rows=20_000):
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, note text)")
    pair.src("INSERT INTO items SELECT g, g %% 100, md5(g::text) FROM generate_series(1, %s) g", (rows,))


def test_equal_under_writes_then_exact_differences(pair, spark):
    make_items(pair)
    create_movetables("wf", pair.source, pair.target, ["items"], [], {})
    writer = Writer(pair.source, 20_000, pause=0.002)
    with EngineThread(spark, pair.target, "wf"):
        wait_for(lambda: stream_row(pair, "wf")["state"] == "Running", what="Running")
        writer.start()
        wait_for(lambda: writer.commits > 50, what="writes going on")
        # The running driver does the work; the writer keeps committing during the whole diff.
        before = writer.commits
        out = vdiff(pair.target, "wf", "--json", "--range-rows", "3000")
        during = writer.commits - before
        assert out.returncode == 0, (out.stdout, out.stderr)
        res = report(out)
        t = res["tables"]["public.items"]
        assert (t["missing"], t["extra"], t["mismatched"]) == (0, 0, 0)
        assert t["rows_compared"] > 19_000 and t["ranges"] >= 6 and t["ranges"] == t["ranges_done"]
        assert during > 20, "the source must take writes while the vdiff runs"
        assert res["state"] == "completed" and "the workflow's driver" in res["message"]
        writer.stop_event.set()
        writer.join()
        assert writer.error is None
        wait_for(lambda: caught_up(pair, "wf"), what="caught up")

        # Tamper with the target: 3 changed, 2 deleted, 4 added (one beyond the source's last key).
        ids = [r[0] for r in pair.src("SELECT id FROM items ORDER BY id")]
        changed, deleted = ids[100:103], [ids[5000], ids[15000]]
        added = [0, -7, ids[-1] + 10, ids[-1] + 11]
        pair.dst("UPDATE items SET qty = qty + 1 WHERE id = ANY(%s)", (changed,))
        pair.dst("DELETE FROM items WHERE id = ANY(%s)", (deleted,))
        pair.dst("INSERT INTO items SELECT unnest(%s::bigint[]), 1, 'extra'", (added,))
        out = vdiff(pair.target, "wf", "--json", "--range-rows", "3000", "--sample", "20")
        assert out.returncode == 1, (out.stdout, out.stderr)
        t = report(out)["tables"]["public.items"]
        assert (t["missing"], t["extra"], t["mismatched"]) == (2, 4, 3)
        kinds = {(s["kind"], int(s["key"][0])) for s in t["samples"]}
        assert kinds == {("mismatched", i) for i in changed} | {("missing", i) for i in deleted} | \
            {("extra", i) for i in added}
        sample = next(s for s in t["samples"] if s["kind"] == "mismatched")
        assert int(sample["target"]["qty"]) == int(sample["source"]["qty"]) + 1
        assert next(s for s in t["samples"] if s["kind"] == "missing")["target"] is None

        # The text report says the same.
        out = vdiff(pair.target, "wf", "--range-rows", "3000")
        assert out.returncode == 1
        assert "mismatched" in out.stdout and "9 differing rows" in out.stdout


def test_values_compare_by_postgres_meaning(pair, spark):
    pair.src("""CREATE TABLE vals (id int PRIMARY KEY, n numeric(10,3), f float8, r real, i interval,
                ts timestamptz, js json, jb jsonb, arr numeric[], p point, t text COLLATE "C")""")
    pair.src("""INSERT INTO vals VALUES
        (1, 1.5, 0, 'NaN', '1 mon', '2024-01-01 00:00+00', '{"a": 1}', '{"b": 2, "a": 1}', '{1.5,NaN}',
         '(1,2)', 'x'),
        (2, 'NaN', 'NaN', '-Infinity', '1 day', 'infinity', '[]', '[]', NULL, NULL, NULL),
        (3, NULL, -1e-310, 3.5, '-1 hour', '1999-12-31 23:59:59.999999+00', 'null', 'null', '{}', '(0,0)', '')""")
    create_movetables("vals", pair.source, pair.target, ["vals"], [], {})
    with EngineThread(spark, pair.target, "vals"):
        wait_for(lambda: caught_up(pair, "vals"), what="caught up")
    # Same values, other representations: equal by PostgreSQL's `=` (the hashes differ, the rows do not).
    pair.dst("UPDATE vals SET n = 1.500, f = '-0', i = '30 days' WHERE id = 1")
    out = vdiff(pair.target, "vals", "--json")
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert report(out)["tables"]["public.vals"]["rows_compared"] == 3
    # Real differences in types without an equality operator (json, point) and with one (jsonb, arrays).
    pair.dst("""UPDATE vals SET js = '{"a":1}' WHERE id = 1;
                UPDATE vals SET jb = '{"a": 2}', p = '(9,9)' WHERE id = 3;
                UPDATE vals SET arr = '{1.5,1}' WHERE id = 1""")
    out = vdiff(pair.target, "vals", "--json")
    assert out.returncode == 1
    t = report(out)["tables"]["public.vals"]
    assert (t["missing"], t["extra"], t["mismatched"]) == (0, 0, 2)
    assert {s["key"][0] for s in t["samples"]} == {"1", "3"}


def test_stopped_stream_is_played_to_the_point(pair):
    """No driver and a Stopped workflow: the command plays the stream up to its point itself."""
    make_items(pair, 5000)
    create_movetables("wf", pair.source, pair.target, ["items"], [], {})
    out = vdiff(pair.target, "wf")
    assert out.returncode == 2 and "still copying" in out.stderr, out.stderr
    with_engine_until_running(pair)
    subprocess.run([sys.executable, "-m", "sluicegate.cli.main", "workflow", "stop", "wf", "--target", pair.target],
                   check=True, capture_output=True)
    pair.src("UPDATE items SET qty = -1 WHERE id <= 1000")
    pair.src("DELETE FROM items WHERE id > 4900")
    before = stream_row(pair, "wf")["position"]
    out = vdiff(pair.target, "wf", "--json", "--range-rows", "1000")
    assert out.returncode == 0, (out.stdout, out.stderr)
    res = report(out)
    assert res["tables"]["public.items"]["rows_compared"] == 4900
    assert "compared by sluicegate vdiff" in res["message"]
    after = stream_row(pair, "wf")
    assert after["state"] == "Stopped" and after["position"] > before
    assert pair.dst("SELECT count(*) FROM items WHERE qty = -1")[0][0] == 1000


@pytest.mark.slow  # the default suite keeps to its time
def test_killed_vdiff_resumes_from_last_finished_range(pair, tmp_path):
    make_items(pair, 5000)
    create_movetables("wf", pair.source, pair.target, ["items"], [], {})
    with_engine_until_running(pair)
    pair.dst("UPDATE items SET qty = 1000 WHERE id IN (10, 1500, 4999)")
    pair.dst("DELETE FROM items WHERE id IN (2500, 3500)")
    env = {"SLUICEGATE_FAULT_PAUSE": "vdiff.range.2", "SLUICEGATE_FAULT_DIR": str(tmp_path),
           "SLUICEGATE_SPARK_MASTER": "local[1]"}
    proc = subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "vdiff", "wf", "--target", pair.target,
                             "--range-rows", "1000"], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: (tmp_path / "vdiff.range.2").exists(), timeout=120, what="vdiff paused at range 2")
    finally:
        proc.kill()
        proc.wait()
    done = pair.dst("SELECT generation, idx FROM sluicegate.vdiff_ranges WHERE done ORDER BY 1, 2")
    assert done == [(0, 0), (0, 1)]
    out = vdiff(pair.target, "wf", "--resume", "--json", "--range-rows", "1000")
    assert out.returncode == 1, (out.stdout, out.stderr)
    t = report(out)["tables"]["public.items"]
    assert (t["missing"], t["extra"], t["mismatched"]) == (2, 0, 3)
    assert t["rows_compared"] == 5000
    ranges = pair.dst("SELECT generation, idx, done FROM sluicegate.vdiff_ranges ORDER BY 1, 2")
    assert ranges[:2] == [(0, 0, True), (0, 1, True)]  # kept, not compared again
    assert {g for g, _, _ in ranges[2:]} == {1} and all(d for _, _, d in ranges)
    assert len(pair.dst("SELECT 1 FROM sluicegate.vdiffs")) == 1


def with_engine_until_running(pair):
    """Copy through a `workflow run` subprocess, then stop the driver (the stream stays Running)."""
    run = subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", "wf", "--target",
                            pair.target, "--no-progress"], env={**os.environ, "SLUICEGATE_SPARK_MASTER": "local[2]"},
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: caught_up(pair, "wf"), what="caught up")
    finally:
        run.send_signal(signal.SIGTERM)
        assert run.wait(60) == 0, run.stderr.read()


def test_bad_requests(pair):
    make_items(pair, 10)
    out = vdiff(pair.target, "nope")
    assert out.returncode == 2 and ("no Sluicegate workflows" in out.stderr or "no workflow" in out.stderr)
    create_movetables("wf", pair.source, pair.target, ["items"], [], {})
    with_engine_until_running(pair)
    out = vdiff(pair.target, "wf", "--tables", "itemz")
    assert out.returncode == 2 and "did you mean 'items'" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    out = vdiff(pair.target, "wf", "--resume")
    assert out.returncode == 2 and "no unfinished vdiff" in out.stderr, out.stderr


def test_driver_with_one_task_slot_serves_a_vdiff(pair, tmp_path):
    """`workflow run --spark-master local[1]`: its replicate task holds the only slot; the vdiff it serves must
    still run (replication waits for the comparison), not wait forever."""
    make_items(pair, 5000)
    create_movetables("wf", pair.source, pair.target, ["items"], [], {})
    run = subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", "wf", "--target",
                            pair.target, "--no-progress", "--spark-master", "local[1]"],
                           stdout=subprocess.DEVNULL, stderr=(tmp_path / "run.log").open("wb"),
                           start_new_session=True)
    try:
        wait_for(lambda: caught_up(pair, "wf"), what="caught up")
        out = vdiff(pair.target, "wf", "--json", timeout=120)
        assert out.returncode == 0, (out.stdout, out.stderr)
        assert report(out)["tables"]["public.items"]["rows_compared"] == 5000
        pair.src("UPDATE items SET qty = qty + 1 WHERE id <= 10")  # replication goes on after it
        wait_for(lambda: pair.dst("SELECT count(*) FROM items WHERE id <= 10 AND qty = id % 100 + 1")[0][0] == 10,
                 60, what="replication after the vdiff")
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait(30)

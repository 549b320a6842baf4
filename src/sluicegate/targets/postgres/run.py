"""`workflow run` of a workflow whose target is PostgreSQL: Spark, the heartbeat, metrics' absence or presence
aside (the command's), and the engines — one for the workflow, one per stream of a Reshard or a keyspace
Replicate, the governor of a Replicate, and a MoveTables' reverse workflow after switch-traffic."""

from __future__ import annotations

from collections.abc import Callable

import psycopg

from ...errors import SluicegateError, UsageError
from ...postgres.connect import connect
from ...spark.session import start_in_background
from ...vdiff.executor import DriverVDiffs
from ...workflow import state as st
from ...workflow.heartbeat import Heartbeat
from ...workflow.passwords import retire_stored_passwords, task_url
from ...workflow.shards import target_shards


def run(name: str, target: str, spark_master, conf: dict, stop, runners: list, progress,
        say: Callable[[str], None], lock) -> str:
    """`progress(kind, url)`: starts the progress view (the command's) of the workflow at `url` (the URL the
    engines key their live copy entries by: workflow/live.py); `lock`: the run lock (take_run_lock)."""
    with connect(target, role="target") as conn:
        wf = st.load_workflow(conn, name)
    kind = wf.kind
    # Without rules, rows never pass through the JVM (Python tasks pipe them between the databases): no
    # SparkSession (Spark SQL's state) to build, and a JVM that only coordinates.
    ruled = kind == "Reshard" or any(t.rule for s in wf.streams for t in s.tables)

    # Spark starts while this process imports the engine and the engine takes its snapshot; the first Spark
    # job waits for it.
    spark = start_in_background(spark_master, conf=conf, session=ruled, light_jvm=not ruled)

    # Spark's tasks get the target URL without its password when libpq finds it (pgpass file, PGPASSWORD).
    target = task_url(target, "target")
    shard_urls = list(target_shards(wf, target).values()) if kind == "Reshard" else [target]
    for url in shard_urls:
        for warning in retire_stored_passwords(url, name, wf if url == target else None):
            say(f"warning: {warning}")
    heartbeat = Heartbeat(shard_urls, name).start()  # status tells a running workflow from an abandoned one
    try:
        from ...spark.runner import SparkRunner

        runners.append(SparkRunner(spark))
        return _run(name, target, kind, runners[0], stop, progress, say, lock)
    finally:
        heartbeat.stop()


def _run(name, target, kind, runner, stop, progress, say, lock=None) -> str:
    from ...workflow.engine import Engine

    if kind == "Reshard":
        runner.sc  # noqa: B018 - one error line if Spark cannot start, not one per stream's engine
        view = progress(kind, target)
        try:
            return _run_streams(name, target, runner, stop)
        finally:
            view.stop()
    governor = None
    if kind == "Replicate":  # the seed's decision for an existing setup, printed; then the caps enforced
        from ...cluster.decisions import at_start
        from ...cluster.governor import Governor

        for line in at_start(target, name):
            say(line)
        governor = Governor(target, name, stop).start()
        with connect(target, role="target") as conn:
            several = len(st.load_workflow(conn, name).streams) > 1
        if several:  # a keyspace source: a stream per source shard, each its own Engine (as a Reshard's)
            view = progress("Reshard", target)
            try:
                return _run_streams(name, target, runner, stop)
            finally:
                view.stop()
                governor.close()
    view = progress(kind, target)
    engine = Engine(target, name, runner, stop=stop, lock_conn=lock, vdiffs=DriverVDiffs)
    running, url = name, target
    try:
        final = _run_engine(engine)
        # A MoveTables whose traffic switched: the same driver carries the reverse workflow (and the forward
        # one again after reverse-traffic), for as long as one of them runs.
        while kind == "MoveTables" and final == st.STOPPED and not stop.is_set():
            from ...workflow.traffic import active_stream

            nxt = active_stream(name, target)
            if nxt is None:
                break
            engine.close()
            running, url = nxt
            say(f"workflow {name}: running {running}")
            engine = Engine(url, running, runner, stop=stop, vdiffs=DriverVDiffs if running == name else None)
            view.follow(running, url)
            final = _run_engine(engine)
    finally:
        engine.close()
        view.stop()
        if governor is not None:
            governor.close()
    if final == st.ERROR:
        with connect(url, role="target") as conn:
            msg = st.load_workflow(conn, running).streams[0].message
        raise SluicegateError(f"workflow {running} stopped in Error: {msg}")
    return final


def _run_engine(engine) -> str:
    """engine.run(); a workflow deleted under it (complete, cancel, delete) ends it as Stopped, whatever its
    last step failed on (the slot, tables or state dropped under it)."""
    try:
        final = engine.run()
    except (UsageError, psycopg.Error) as failed:  # e.g. the last workflow's delete dropped the schema under it
        try:
            gone = _deleted(engine.workflow, engine.target_url)
        except psycopg.Error:
            raise failed from None  # the target is unreachable: its first error says more
        if not gone:
            raise
        return st.STOPPED
    if final == st.ERROR:
        try:
            if _deleted(engine.workflow, engine.target_url):
                return st.STOPPED
        except psycopg.Error:
            pass  # the caller reports the Error (and the target's state, when it can)
    return final


def _deleted(name: str, target: str) -> bool:
    with connect(target, role="target") as conn:
        return name not in st.list_workflows(conn)


def _run_streams(name, target, runner, stop) -> str:
    from ...workflow.reshard import run_all

    finals = run_all(name, target, runner, stop)
    failed = [f"stream {sid} (target shard {shard}): {state}" for shard, sid, state in finals if state.startswith("Error")]
    if failed and _deleted(name, target):  # cancelled or deleted under its streams
        finals = [(shard, sid, "Stopped") for shard, sid, _ in finals]
    elif failed:
        raise SluicegateError(f"workflow {name}: {'; '.join(failed)}; see `sluicegate workflow status {name}`")
    return ", ".join(sorted({state for _, _, state in finals}))

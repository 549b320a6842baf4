"""`sluicegate vdiff` of a workflow whose target is PostgreSQL: a vdiff per target shard, each executed by the
shard's running driver or here (vdiff/executor.py)."""

from __future__ import annotations

import threading

from ...postgres.connect import connect


def vdiff(name: str, target: str, tables: list[str] | None, options: dict, resume: bool, make_runner,
          stop: threading.Event) -> list[tuple[str, str, dict]]:
    from ...vdiff import report as rep
    from ...vdiff.executor import execute_or_wait, request
    from ...workflow.passwords import task_url
    from ...workflow.shards import load_all

    target = task_url(target, "target")  # Spark's tasks get it: without the password when libpq finds it
    shards = load_all(name, target)  # a Reshard: every target shard against the rows it should hold
    requests = [(shard, url, request(url, name, tables, options, resume=resume)) for shard, url, _ in shards]
    results = []
    for shard, url, vdiff_id in requests:
        execute_or_wait(url, name, vdiff_id, make_runner, stop=stop)
        with connect(url, role="target") as conn:
            results.append((shard, str(vdiff_id), rep.build(conn, vdiff_id)))
    return results

"""A PostgreSQL database as a target: the PostgreSQL kind's side of every command.

The work is workflow/'s (state in the target's `sluicegate` schema, the engine, copier and players), the
appliers', vdiff/'s and, for a Replicate sink, cluster/'s; run.py runs a workflow, admin.py changes one.
"""

from __future__ import annotations

import threading

from ...errors import UsageError
from ...postgres.connect import connect
from ...workflow import live
from ...workflow.metrics import MetricsServer
from ..base import ProgressGroup, Target


class PostgresTarget(Target):
    kind = "postgres"

    @classmethod
    def claims(cls, url: str) -> bool:
        return True  # a libpq URL or connection string: connect() says if it is not one

    def create_movetables(self, name, source, tables, excluded, rules, options, udfs, schedule, notes):
        from ...workflow.create import create_movetables

        given = [f"--{k.replace('_', '-')}" for k, v in schedule.items() if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)}: housekeeping is for a Delta target (--target delta:PATH)")
        return create_movetables(name, source, self.url, tables, rules, options, udfs, excluded, notes=notes), []

    def create_materialize(self, name, source, rules, options, udfs, notes):
        from ...workflow.create import create_materialize

        return create_materialize(name, source, self.url, rules, options, udfs), []

    def metrics(self, name: str, port: int, addr: str, tls: dict):
        try:
            return MetricsServer(self.url, name, port, addr, **tls)
        except OSError as exc:
            raise UsageError(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}; pick another "
                             f"--metrics-port") from None

    def take_run_lock(self, name: str):
        from ...workflow import run_lock
        from ...workflow import state as st

        with connect(self.url, role="target") as conn:
            st.load_workflow(conn, name)  # fail fast on a typo, before Spark starts
        return run_lock.take(self.url, name)

    def run(self, name, spark_master, conf, stop, runners, progress, say, lock=None) -> str:
        from .run import run

        return run(name, self.url, spark_master, conf, stop, runners, progress, say, lock)

    def status(self, name: str, wal_warning: int) -> dict:
        from .admin import status

        return status(name, self.url, wal_warning)

    def progress_groups(self, name: str) -> list[ProgressGroup]:
        from ...workflow.shards import load_all
        from ...workflow.status import workflow_status

        groups = []
        for shard, url, wf in load_all(name, self.url):
            applied = {s.id: s.rows_applied for s in wf.streams}
            streams = [{**s, "label": f"stream {s['id']}" + (f" (target shard {shard})" if shard else ""),
                        "rows_applied": applied[s["id"]]} for s in workflow_status(wf)["streams"]]
            # a cycle's running COPYs show the rows they have written on the target
            groups.append(ProgressGroup(streams, url, url, live.in_flight))
        return groups

    def set_state(self, name: str, verb: str) -> str:
        from .admin import set_state

        return set_state(name, self.url, verb)

    def configure(self, name, on_ddl, target_standbys, settings) -> list[str]:
        from .admin import configure

        return configure(name, self.url, on_ddl, target_standbys, settings)

    def delete(self, name, drop_tables, say) -> list[str]:
        from .admin import delete

        return delete(name, self.url, drop_tables, say)

    def cancel(self, kind: str, name: str, keep_target_tables: bool) -> list[str]:
        from ...workflow.traffic import cancel_workflow

        return cancel_workflow(name, self.url, keep_target_tables, kind)

    def vdiff(self, name, tables, compare, resume, make_runner, stop: threading.Event):
        from .vdiff import vdiff

        return vdiff(name, self.url, tables, compare, resume, make_runner, stop)

    def bootstrap_sink(self, name: str, tables: list[str] | None) -> list[str]:
        from ...cluster.bootstrap import bootstrap

        return bootstrap(name, self.url, tables)

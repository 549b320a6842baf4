"""Delta tables under a path or URI (`delta:PATH`) as a target: the Delta kind's side of every command.

This folder is the whole Delta target: its state beside the tables (state.py), engine, player, copy, apply,
staging, vdiff, read-as-of and housekeeping; and the Delta sink of a Replicate workflow (sink.py), which
cluster/ reaches through its sink registry (register_sink_kind below). Layout of a target directory: tables at
PATH/<schema>/<table>, Sluicegate's state and consistent-read log under PATH/_sluicegate/ (README, "Delta Lake
target").
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ...cluster import sinks
from ...errors import UsageError
from ..base import ProgressGroup, Target
from . import location

PREFIX = location.PREFIX


def register_sink_kind() -> None:
    sinks.register(location.is_delta, _sink_kind)


def _sink_kind():
    from .sink import DELTA  # (only once a Delta sink turns up: it costs the start of every command)

    return DELTA


class DeltaTarget(Target):
    kind = "delta"
    has_standbys = False  # its files are durable once written
    probed = False
    takes_keyspace = False

    @classmethod
    def claims(cls, url: str) -> bool:
        return location.is_delta(url)

    @classmethod
    def require(cls, url: str) -> str:
        """The lake commands' target: its path, or a UsageError saying how to write one."""
        if not cls.claims(url) or not url[len(PREFIX):].strip():
            raise UsageError(f"--target {url!r} is not a Delta target: write delta:PATH (a directory or a URI "
                             f"delta-rs supports, e.g. delta:/data/lake or delta:s3://bucket/lake)")
        return location.parse(url).uri

    def hint(self) -> str:
        import shlex

        return f" --target {shlex.quote(self.url)}"

    def _no_standbys(self, given) -> None:
        if given:
            raise UsageError("--confirm-after-target-standbys is for a PostgreSQL target: a Delta target has no "
                             "standbys")

    def create_movetables(self, name, source, tables, excluded, rules, options, udfs, schedule, notes):
        from ...postgres.standby_flush import OPTION
        from . import cli as lake

        self._no_standbys(options.pop(OPTION, None))
        options.pop("defer_indexes", None)  # (a Delta table has no indexes to defer)
        return lake.create(name, source, self.url, tables, excluded, rules,
                           options | lake.housekeeping_options(schedule), notes, udfs=udfs)

    def create_materialize(self, name, source, rules, options, udfs, notes):
        from ...postgres.standby_flush import OPTION
        from . import cli as lake

        self._no_standbys(options.pop(OPTION, None))
        return lake.create(name, source, self.url, None, None, rules, options | lake.housekeeping_options({}),
                           notes, kind="Materialize", udfs=udfs)

    def run(self, name, spark_master, conf, stop, runners, progress, say, lock=None) -> str:
        from . import cli as lake

        return lake.run(name, self.url, spark_master, conf, stop, runners, progress=lambda: progress("MoveTables", self.url))

    def status(self, name: str, wal_warning: int) -> dict:
        from . import cli as lake

        return lake.status(name, self.url)

    def status_lines(self, status: dict) -> list[str]:
        from . import cli as lake

        return lake.format_status(status)

    def progress_groups(self, name: str) -> list[ProgressGroup]:
        from ...workflow import live
        from .cli import progress_streams

        # a cycle's running tasks show the rows they have read on their source sessions
        return [ProgressGroup([s], self.url, s.pop("source_url"), live.in_flight_reads)
                for s in progress_streams(name, self.url)]

    def set_state(self, name: str, verb: str) -> str:
        from . import cli as lake

        return lake.set_state(name, self.url, verb)

    def configure(self, name, on_ddl, target_standbys, settings) -> list[str]:
        from . import cli as lake

        self._no_standbys(target_standbys is not None)
        lake.configure(name, self.url, on_ddl, settings)
        return ([f"on-ddl {on_ddl}"] if on_ddl else []) + [f"{k} {'default' if v is None else v}"
                                                            for k, v in settings.items()]

    def delete(self, name: str, drop_tables: bool, say: Callable[[str], None]) -> list[str]:
        from . import cli as lake
        from .state import open_store

        wf = open_store(self.url).load(name)
        dropped = lake.delete(name, self.url, drop_tables)
        if wf.kind == "Replicate":  # the other sinks stop governing and showing this one
            from ...cluster.forget import forget_sink
            from ...cluster.model import Cluster

            missed = forget_sink(Cluster.of(wf))
            if missed:
                say(f"warning: sinks {', '.join(missed)} could not be told and still list this one")
        return dropped

    def cancel(self, kind: str, name: str, keep_target_tables: bool) -> list[str]:
        from ...workflow.traffic import cancel_command
        from . import cli as lake
        from .state import open_store

        found = open_store(self.url).load(name).kind
        if found != kind:
            raise UsageError(f"workflow {name} is a {found}, not a {kind}: {cancel_command(found, name)} cancels it")
        return lake.delete(name, self.url, not keep_target_tables)

    def check_vdiff(self, name: str, resume: bool) -> None:
        from . import vdiff as lake_vdiff
        from .state import open_store

        if resume:
            raise UsageError("a vdiff of a Delta target runs whole: --resume is for PostgreSQL targets")
        lake_vdiff.check_comparable(open_store(self.url), name)

    def vdiff(self, name, tables, compare, resume, make_runner, stop: threading.Event):
        from . import vdiff as lake_vdiff

        report = lake_vdiff.run(name, self.url, make_runner(), tables=tables, sample=compare["sample"],
                                range_rows=compare.get("range_rows"), stop=stop)
        return [("", f"into {report['target']}", report)]

    def bootstrap_sink(self, name: str, tables: list[str] | None) -> list[str]:
        from .sink import bootstrap

        return bootstrap(name, self.url, tables)

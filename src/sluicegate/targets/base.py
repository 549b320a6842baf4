"""The interface every kind of target offers the commands (targets/<kind>/ implements it)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class ProgressGroup:
    """Streams whose copy in flight is counted on one server (cli/progress.py): status streams with "label"
    and "rows_applied"; `key_url` names their live copy entries (workflow/live.py), `ask_url` is where
    `in_flight` (live.in_flight or live.in_flight_reads) counts rows of running copy sessions."""

    streams: list[dict]
    key_url: str
    ask_url: str
    in_flight: Callable


class Target:
    kind = ""  # "postgres", "delta"
    has_standbys = True  # a database whose physical standbys a source position may wait for
    probed = True  # preflight probes its rights as a database (preflight/)
    takes_keyspace = True  # a sink of a keyspace source (a stream per source shard)

    def __init__(self, url: str):
        self.url = url

    @classmethod
    def claims(cls, url: str) -> bool:
        raise NotImplementedError

    def hint(self) -> str:
        """What a command line needs to name this target after `sluicegate workflow run NAME` (a Delta target
        is never the environment's default)."""
        return ""

    # -- create and run ----------------------------------------------------------------------------------
    def create_movetables(self, name: str, source: str, tables: list[str] | None, excluded: list[str] | None,
                          rules: list[str], options: dict, udfs: list, schedule: dict,
                          notes: list[str]) -> tuple[list[str], list[str]]:
        """(the moved tables, lines saying what else was made); `notes`: what the target leaves out."""
        raise NotImplementedError

    def create_materialize(self, name: str, source: str, rules: list[str], options: dict, udfs: dict,
                           notes: list[str]) -> tuple[list[str], list[str]]:
        """A workflow of rules only: (the target tables, lines saying what else was made)."""
        raise NotImplementedError

    def run(self, name: str, spark_master, conf: dict, stop: threading.Event, runners: list, progress,
            say: Callable[[str], None], lock=None) -> str:
        """Run the workflow until stopped; its final state. `progress(kind, url)` starts the progress view of
        the workflow at `url`."""
        raise NotImplementedError

    def metrics(self, name: str, port: int, addr: str, tls: dict):
        """Serve the workflow's Prometheus metrics while it runs (a handle with stop()), or None: not offered."""
        return

    def take_run_lock(self, name: str):
        """One driver per workflow: refused (UsageError) while another runs; a handle with close(), or None."""
        return

    # -- look and change -----------------------------------------------------------------------------------
    def status(self, name: str, wal_warning: int) -> dict:
        raise NotImplementedError

    def status_lines(self, status: dict) -> list[str] | None:
        """The status as text lines, or None: the common renderer (cli/output.py) shows it."""
        return None

    def progress_groups(self, name: str) -> list[ProgressGroup]:
        raise NotImplementedError

    def set_state(self, name: str, verb: str) -> str:
        """`workflow stop|start`: the new state."""
        raise NotImplementedError

    def configure(self, name: str, on_ddl: str | None, target_standbys: str | None,
                  settings: dict) -> list[str]:
        """`workflow set`: what changed. `settings`: config.tuned's, into the workflow's options."""
        raise NotImplementedError

    def delete(self, name: str, drop_tables: bool, say: Callable[[str], None]) -> list[str]:
        """`workflow delete`: the objects dropped; warnings through `say`."""
        raise NotImplementedError

    def cancel(self, kind: str, name: str, keep_target_tables: bool) -> list[str]:
        raise NotImplementedError

    def vdiff(self, name: str, tables: list[str] | None, compare: dict, resume: bool, make_runner,
              stop: threading.Event) -> list[tuple[str, str, dict]]:
        """Compare; per target shard ('' for one target): (shard, the vdiff's label, its report)."""
        raise NotImplementedError

    def check_vdiff(self, name: str, resume: bool) -> None:
        """Refuse (UsageError) what cannot be compared, before Spark starts."""

    def bootstrap_sink(self, name: str, tables: list[str] | None) -> list[str]:
        """`replicate bootstrap` of this sink: lines saying what was re-copied."""
        raise NotImplementedError

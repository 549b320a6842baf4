"""`sluicegate lake …`: housekeeping of a Delta Lake target (compaction, vacuum)."""

from __future__ import annotations

from datetime import timedelta

import click

from .. import config
from ..errors import UsageError
from ..sizes import parse_duration
from ..targets.delta import DeltaTarget
from .output import JSON, emit, friendly

LAKE_TARGET = click.option("--target", envvar=config.env_var("target"), required=True, metavar="delta:PATH",
                           help="The workflow's Delta target, delta:PATH (or SLUICEGATE_TARGET).")


@click.group("lake")
def lake_group() -> None:
    """Housekeeping of a Delta Lake target: compact small files, vacuum unneeded ones.

    `workflow run` runs them on the schedule given at create (--optimize-every, --vacuum-every,
    --vacuum-retention), which `lake schedule` shows and changes; `lake optimize|vacuum` run them now.
    """


@lake_group.command("optimize")
@click.argument("name")
@LAKE_TARGET
@JSON
@friendly
def lake_optimize(name, target, as_json):
    """Compact the small files of the workflow's Delta tables (and of its consistent-read log).

    Rows, versions and the workflow's app transactions stay; a new version of each table holds the data in
    fewer files. Old versions stay readable until `lake vacuum` removes their files.
    """
    from ..targets.delta.housekeeping import optimize

    def human(report: dict) -> None:
        for t in report["tables"]:
            click.echo(f"{t['table']}: {t['files_before']} files -> {t['files_after']} "
                       f"(version {t['version_before']} -> {t['version_after']})")

    emit(optimize(DeltaTarget.require(target), name), as_json, human)


def _retention(text: str) -> timedelta:

    try:
        return timedelta(seconds=parse_duration(text))
    except UsageError as exc:
        raise UsageError(f"--retention {exc}") from None


@lake_group.command("vacuum")
@click.argument("name")
@LAKE_TARGET
@click.option("--retention", default="7d", show_default=True, metavar="DURATION",
              help="Keep what readers of the last DURATION need (7d, 36h; whole hours, rounded up).")
@click.option("--dry-run", is_flag=True, help="Say what would be removed (files, bytes); remove nothing.")
# (not -v/--verbose: every command has those for its log)
@click.option("--list", "list_files", is_flag=True, help="List each file removed and each version kept.")
@click.option("--allow-short-retention", is_flag=True,
              help="Accept a retention under one hour: only when no `workflow run` writes to the target, whose "
                   "files not yet committed would go too.")
@JSON
@friendly
def lake_vacuum(name, target, retention, dry_run, list_files, allow_short_retention, as_json):
    """Remove the files of the workflow's Delta tables that nothing kept needs.

    Drops consistent points older than the retention (never the newest one), then deletes files that only
    versions older than the retention used, and files no version ever added (a killed writer's) once older
    than the retention. Every file of a kept point's versions stays.
    """
    from ..targets.delta.housekeeping import format_vacuum, vacuum

    report = vacuum(DeltaTarget.require(target), name, _retention(retention), dry_run=dry_run,
                    allow_short=allow_short_retention)
    emit(report, as_json, lambda r: click.echo("\n".join(format_vacuum(r, list_files))))


@lake_group.command("schedule")
@click.argument("name")
@LAKE_TARGET
@click.option("--optimize-every", default=None, metavar="DURATION",
              help="Compact the tables this often while `workflow run` runs (e.g. 30m; 0: never).")
@click.option("--vacuum-every", default=None, metavar="DURATION",
              help="Vacuum this often while `workflow run` runs (e.g. 12h; 0: never).")
@click.option("--vacuum-retention", default=None, metavar="DURATION",
              help="What the scheduled vacuum keeps (e.g. 7d).")
@click.option("--commit-every", default=None, metavar="DURATION",
              help="The least time between two commits of changes (e.g. 5s; 0: as they come).")
@JSON
@friendly
def lake_schedule(name, target, optimize_every, vacuum_every, vacuum_retention, commit_every, as_json):
    """Show the workflow's housekeeping schedule, or change it (the options given; the others stay).

    A running `workflow run` follows the new schedule from its next batch: no restart needed.
    """
    from ..targets.delta.cli import schedule

    def human(now: dict) -> None:
        for key, seconds in now.items():
            shown = "never" if seconds <= 0 and key.endswith("_every") and key != "commit_every" \
                else str(timedelta(seconds=seconds))
            click.echo(f"{key.replace('_', '-')}: {shown}")

    DeltaTarget.require(target)
    emit(schedule(name, target, {"optimize_every": optimize_every, "vacuum_every": vacuum_every,
                                 "vacuum_retention": vacuum_retention, "commit_every": commit_every}), as_json, human)

"""`sluicegate movetables switch-traffic|reverse-traffic|complete|cancel`: a MoveTables to its end; and
`materialize cancel`, `reshard cancel` (workflow/traffic.py: cancel_workflow)."""

from __future__ import annotations

import click

from .. import config, targets
from ..errors import UsageError
from ..position import format_lsn
from ..sizes import parse_duration
from .output import JSON, emit, friendly

TARGET = click.option("--target", envvar=config.env_var("target"), required=True, metavar="URL",
                      help="libpq URL of the target database (or SLUICEGATE_TARGET).")
KEEP_TARGET_TABLES = click.option("--keep-target-tables", is_flag=True,
                                  help="Keep the target tables and their rows (default: drop them, as Vitess does).")


def _seconds(ctx, param, value):

    try:
        seconds = parse_duration(value) if isinstance(value, str) else value
    except UsageError as exc:
        raise click.BadParameter(str(exc)) from None
    if seconds <= 0:
        raise click.BadParameter(f"{value!r} is no time: give a duration above zero (2s, 0.5)")
    return seconds


def _switch_options(fn):
    for option in reversed([
        TARGET,
        click.option("--lock-timeout", default="2s", show_default=True, callback=_seconds, metavar="DURATION",
                     help="How long to wait for the lock that blocks writes; on timeout nothing changes."),
        click.option("--timeout", default="30s", show_default=True, callback=_seconds, metavar="DURATION",
                     help="How long writes may stay blocked while the other side catches up."),
        click.option("--max-lag", default="30s", show_default=True, callback=_seconds, metavar="DURATION",
                     help="Refuse to start when the stream lags more than this."),
        JSON,
    ]):
        fn = option(fn)
    return fn


def _report(result, as_json: bool) -> None:
    if result.finished_interrupted:
        click.echo(f"note: finished {result.finished_interrupted} first", err=True)

    def human(_) -> None:
        where = "the target" if result.traffic == "switched" else "the source"
        click.echo(f"workflow {result.workflow}: traffic {result.traffic} to {where} at "
                   f"{format_lsn(result.position)}; writes to the moved tables were blocked for "
                   f"{result.blocked_seconds:.3f} s (lag at the start {result.lag_seconds or 0:.3f} s)")
        for line in result.sequences:  # each says "sequence …" itself
            click.echo(f"  {line}")

    emit({"workflow": result.workflow, "traffic": result.traffic, "position": format_lsn(result.position),
          "blocked_seconds": round(result.blocked_seconds, 3),
          "lag_seconds": None if result.lag_seconds is None else round(result.lag_seconds, 3),
          "sequences": result.sequences}, as_json, human)


@click.command("switch-traffic")
@click.argument("name")
@_switch_options
@friendly
def switch_traffic_cmd(name, target, lock_timeout, timeout, max_lag, as_json):
    """Move writes to the target: block them on the source, wait until the target has everything, start the
    reverse workflow, deny writes on the source. The running `workflow run` carries the reverse stream."""
    from ..workflow.traffic import switch_traffic

    _report(switch_traffic(name, target, lock_timeout=lock_timeout, timeout=timeout, max_lag=max_lag), as_json)


@click.command("reverse-traffic")
@click.argument("name")
@_switch_options
@friendly
def reverse_traffic_cmd(name, target, lock_timeout, timeout, max_lag, as_json):
    """Move writes back to the source: the same steps the other way; the forward workflow resumes."""
    from ..workflow.traffic import reverse_traffic

    _report(reverse_traffic(name, target, lock_timeout=lock_timeout, timeout=timeout, max_lag=max_lag), as_json)


@click.command("complete")
@click.argument("name")
@TARGET
@click.option("--drop-source-tables", is_flag=True, help="Drop the moved tables on the source too.")
@friendly
def complete_cmd(name, target, drop_source_tables):
    """After switch-traffic: drop the reverse workflow, the denials, slots, publications and state."""
    from ..workflow.traffic import complete

    echo_dropped(f"completed workflow {name}", complete(name, target, drop_source_tables))


@click.command("cancel")
@click.argument("name")
@TARGET
@KEEP_TARGET_TABLES
@friendly
def cancel_cmd(name, target, keep_target_tables):
    """Before any switch: drop everything the workflow made (target tables too, unless kept); the source
    stays as it was."""
    from ..workflow.traffic import cancel

    echo_dropped(f"cancelled workflow {name}", cancel(name, target, keep_target_tables))


def echo_dropped(done: str, dropped: list[str]) -> None:
    """What a command did, then each thing it dropped on a line of its own."""
    click.echo(done + (": dropped" if dropped else ""))
    for thing in dropped:
        click.echo(f"  {thing}")


def kind_cancel_command(kind: str, what: str) -> click.Command:
    """`materialize cancel` / `reshard cancel`: the workflow (of `kind`) deleted everywhere, its target tables
    dropped unless kept."""

    @click.command("cancel", help=f"Stop and delete the workflow: {what}, and the target tables it writes "
                                  f"(unless --keep-target-tables). The sources stay as they were.")
    @click.argument("name")
    @TARGET
    @KEEP_TARGET_TABLES
    @friendly
    def cmd(name, target, keep_target_tables):
        echo_dropped(f"cancelled workflow {name}", targets.resolve(target).cancel(kind, name, keep_target_tables))

    return cmd


commands = [switch_traffic_cmd, reverse_traffic_cmd, complete_cmd, cancel_cmd]

"""The `sluicegate` command line (contract: ../shared/DESIGN.md, Interfaces)."""

from __future__ import annotations

import faulthandler
import logging
import shlex
import signal
import sys
import threading

import click

from .. import config, targets
from ..errors import SluicegateError, UsageError
from ..postgres.connect import connect, redact
from ..sizes import parse_size
from .ddl import ON_DDL
from .logsetup import LEVELS
from .logsetup import configure as configure_logging
from .output import JSON, VERBOSE, emit, fail, friendly, make_console, print_status, print_workflows
from .traffic import echo_dropped

# The CLI composes the program: the sink kinds cluster/ reaches through its interface (cluster/sinks.py).
targets.register_sink_kinds()

TARGET = click.option("--target", envvar=config.env_var("target"), required=True, metavar="URL",
                      help="libpq URL of the target database, or delta:PATH for Delta tables under PATH (or SLUICEGATE_TARGET).")


_LOG = "sluicegate.log"


def _log_option(ctx: click.Context, param: click.Parameter, value) -> None:
    """-v, --log-level, --log-file: before the subcommand or after it, each one read applies at once."""
    if value in (None, False):
        return
    root = ctx.find_root()
    options = root.meta.setdefault(_LOG, {})
    options[param.name] = value
    _configure_logging(root)


def _configure_logging(root: click.Context) -> None:
    options = root.meta.get(_LOG, {})
    level = LEVELS[options["log_level"]] if options.get("log_level") else (
        logging.INFO if options.get("verbose") else logging.WARNING)
    if level <= logging.INFO:
        root.meta[VERBOSE] = True  # an unexpected error shows its traceback
    try:
        configure_logging(level, options.get("log_file"))
    except OSError as exc:
        fail(f"cannot write the log file {options.get('log_file')}: {exc.strerror or exc}")


def _log_options() -> list[click.Option]:
    return [
        click.Option(["-v", "--verbose"], is_flag=True, expose_value=False, callback=_log_option,
                     help="Log what the engine does (= --log-level info)."),
        click.Option(["--log-level"], type=click.Choice(list(LEVELS), case_sensitive=False), default=None,
                     expose_value=False, callback=_log_option,
                     help="debug, info, warning (default) or error; debug also lets Spark's py4j speak."),
        click.Option(["--log-file"], type=click.Path(dir_okay=False), default=None, expose_value=False,
                     callback=_log_option,
                     help="Write log lines (and progress lines) to this file, not stderr."),
    ]


def _stop_on_signals(stop: threading.Event, runners: list) -> None:
    """SIGTERM and Ctrl-C set `stop` and cancel the Spark jobs of `runners` (those made so far or later)."""
    def on_signal(signum, frame):
        stop.set()
        # Cancel from another thread: the main thread may be inside a Py4J call on the same gateway.
        for runner in runners:
            threading.Thread(target=runner.cancel, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


@click.group(params=_log_options())
@click.version_option(package_name="sluicegate")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Sluicegate: consistent, resumable PostgreSQL table replication on Apache Spark."""
    _configure_logging(ctx.find_root())


@cli.group()
def movetables() -> None:
    """Move tables from a source database to a target database."""


RULE = click.option("--rule", "rules", multiple=True, metavar="'TARGET: SELECT … FROM source …'",
                    help="A Spark SQL rule: project, rename, compute and filter one source table into TARGET "
                         "(repeatable; a TARGET with * matches tables by name).")
UDF = click.option("--udf", "udfs", multiple=True, metavar="NAME=MODULE:FUNCTION[:TYPE]",
                   help="A Python function rules may call as NAME (TYPE: its Spark return type, default string).")
RULES_FILE = click.option("--rules-file", type=click.Path(exists=True, dir_okay=False), default=None,
                          help="A YAML file with a list of rules under `rules:`.")
SPARK_MASTER = click.option(
    "--spark-master", default=None, metavar="URL",
    help="Spark master: spark://..., yarn, k8s://..., local[N] (default: SLUICEGATE_SPARK_MASTER, else "
         "spark-defaults.conf's, else local[*]).")
SPARK_CONF = click.option(
    "--conf", "spark_conf", multiple=True, metavar="KEY=VALUE",
    help="A Spark setting (repeatable); beats spark-defaults.conf (see docs/spark-cluster.md).")


def _configure_spark(ctx, param, value) -> None:
    # Create commands start Spark only deep inside (rule validation): the settings go to session.configure.
    from ..spark.session import configure, parse_conf

    try:
        configure(conf=parse_conf(value))
    except UsageError as exc:
        fail(str(exc))


CREATE_SPARK_CONF = click.option("--conf", multiple=True, metavar="KEY=VALUE", expose_value=False,
                                 callback=_configure_spark,
                                 help="A Spark setting for the Spark that validates rules (repeatable).")
SCHEMAS = click.option("--schemas", default=None, metavar="A,B",
                       help="Comma-separated source schemas whose tables all move (with those --tables names; "
                            "default: public).")
EXCLUDE = click.option("--exclude-tables", default=None, metavar="A,B",
                       help="Comma-separated tables not to move (of those --tables names, or of schema public).")
COPY_SIZES = [click.option("--cycle-rows", type=click.IntRange(1), default=None, help="Rows per copy cycle (snapshot)."),
              click.option("--chunk-rows", type=click.IntRange(1), default=None, help="Rows per parallel copy task.")]
TARGET_STANDBYS = click.option(
    "--confirm-after-target-standbys", "target_standbys", is_flag=True,
    help="Confirm a source position only once every physical standby streaming from the target has flushed it "
         "too, so a promoted target standby resumes with no re-copy (list its host in the target URL). While no "
         "standby streams, the source keeps its WAL. A user that is not a superuser needs pg_read_all_stats on "
         "the target.")


def _options(cycle_rows, chunk_rows, target_standbys=False) -> dict:
    from ..postgres.standby_flush import OPTION

    return {k: v for k, v in (("cycle_rows", cycle_rows), ("chunk_rows", chunk_rows),
                              (OPTION, target_standbys or None)) if v is not None}


def _all_rules(rules, rules_file) -> list[str]:
    from ..rules.spec import load_rules_file

    return list(rules) + (load_rules_file(rules_file) if rules_file else [])


def _rule_options(fn):
    """--rule, --rules-file, --udf, the copy sizes and the target's standbys: what every create command takes."""
    for option in reversed([RULE, RULES_FILE, UDF, *COPY_SIZES, TARGET_STANDBYS, CREATE_SPARK_CONF]):
        fn = option(fn)
    return fn


@movetables.command("create")
@click.option("--workflow", "name", required=True, help="Name of the new workflow.")
@click.option("--source", required=True, metavar="URL", help="libpq URL of the source database.")
@TARGET
@click.option("--tables", default=None, help="Comma-separated source tables, named as SQL names them "
                                                 "(default: all of schema public).")
@SCHEMAS
@EXCLUDE
@_rule_options
@click.option("--keep-indexes", is_flag=True,
              help="Keep each target table's indexes while it is copied (default: a table copied without a rule "
                   "has them dropped before its first copy cycle and built again when that cycle commits).")
@click.option("--optimize-every", default=None, metavar="DURATION",
              help="A Delta target: how often `workflow run` compacts the tables' small files (default 5m; 0: never).")
@click.option("--vacuum-every", default=None, metavar="DURATION",
              help="A Delta target: how often `workflow run` vacuums the tables (default 30s; 0: never).")
@click.option("--vacuum-retention", default=None, metavar="DURATION",
              help="A Delta target: how long the scheduled vacuum keeps old versions and points (default 60s; "
                   "longer for readers of old versions).")
@click.option("--commit-every", default=None, metavar="DURATION",
              help="A Delta target: the least time between two commits of changes (default 30s; 0: as they "
                   "come). Each commit rewrites the files it touches: fewer commits, fewer old files.")
@ON_DDL
@friendly
def movetables_create(name, source, target, tables, schemas, exclude_tables, rules, rules_file, udfs, cycle_rows,
                      chunk_rows, target_standbys, keep_indexes, optimize_every, vacuum_every, vacuum_retention,
                      commit_every, on_ddl):
    """Validate everything, then create the workflow's state and target tables in one transaction."""
    from ..rules.udfs import parse_udfs

    schedule = {"optimize_every": optimize_every, "vacuum_every": vacuum_every,
                "vacuum_retention": vacuum_retention, "commit_every": commit_every}
    options = _options(cycle_rows, chunk_rows, target_standbys) | ({"defer_indexes": False} if keep_indexes else {}) | \
        ({"on_ddl": on_ddl} if on_ddl else {})
    notes: list[str] = []
    where = targets.resolve(target)
    moved, made = where.create_movetables(name, source, _table_names(tables, schemas), _excluded(exclude_tables),
                                          _all_rules(rules, rules_file), options, parse_udfs(list(udfs)), schedule,
                                          notes)
    _created(name, f"{len(moved)} tables ({', '.join(moved)})", where.hint(), [source], made, notes)


def _table_names(tables: str | None, schemas: str | None = None) -> list[str] | None:
    """--tables (and --schemas, as `SCHEMA.*`) as the list of names catalog.resolve_tables takes."""
    from ..postgres.catalog import split_list, with_schemas

    names = None
    if tables is not None:
        names = split_list(tables)
        if not names:  # an empty $TABLES must not silently mean "every table"
            raise UsageError("--tables names no table: list them (--tables a,b), or leave --tables out "
                             "to move every table of schema public")
    if schemas is not None and not split_list(schemas):
        raise UsageError("--schemas names no schema: list them (--schemas public,sales), or leave it out")
    return with_schemas(names, split_list(schemas) if schemas else None)


def _excluded(exclude_tables: str | None) -> list[str] | None:
    from ..postgres.catalog import split_list

    return split_list(exclude_tables) if exclude_tables else None


def _created(name: str, what: str, target_hint: str = "", sources: list[str] = (), made: list[str] = (),
             notes: list[str] = ()) -> None:
    from ..workflow.create import source_password_note

    for line in made:
        click.echo(f"created {line}")
    click.echo(f"created workflow {name}: {what}; run it with: sluicegate workflow run {shlex.quote(name)}"
               f"{target_hint}")
    for note in dict.fromkeys(filter(None, map(source_password_note, sources))):
        click.echo(note, err=True)
    for line in notes:  # what the target tables do not get of their source's definition
        click.echo(f"note: {line}", err=True)


@cli.group()
def materialize() -> None:
    """Keep filtered, transformed copies of source tables (rules) up to date on a target."""


@materialize.command("create")
@click.option("--workflow", "name", required=True, help="Name of the new workflow.")
@click.option("--source", required=True, metavar="URL", help="libpq URL of the source database.")
@TARGET
@_rule_options
@friendly
def materialize_create(name, source, target, rules, rules_file, udfs, cycle_rows, chunk_rows, target_standbys):
    """Check every rule with Spark's analyzer, then create the target tables and the workflow."""
    from ..rules.udfs import parse_udfs

    where = targets.resolve(target)
    notes: list[str] = []
    created, made = where.create_materialize(name, source, _all_rules(rules, rules_file),
                                             _options(cycle_rows, chunk_rows, target_standbys),
                                             parse_udfs(list(udfs)), notes)
    _created(name, f"{len(created)} tables ({', '.join(created)})", where.hint(), [source], made, notes)


@cli.group()
def reshard() -> None:
    """Move a keyspace's rows from N source shards to M target shards by key ranges."""


@reshard.command("create")
@click.option("--workflow", "name", required=True, help="Name of the new workflow.")
@click.option("--source-shard", "source_shards", multiple=True, required=True, metavar="RANGE=URL",
              help="A source shard: its key range in Vitess notation (-80, 80-) and its libpq URL (repeatable).")
@click.option("--target-shard", "target_shards", multiple=True, required=True, metavar="RANGE=URL",
              help="A target shard, likewise (repeatable); the shards of each side cover the keyspace once.")
@click.option("--tables", default=None, help="Comma-separated tables (default: all of schema public).")
@EXCLUDE
@click.option("--shard-key", "shard_keys", multiple=True, metavar="TABLE=COLUMN",
              help="The column whose hash places a row in a shard (default: the table's first key column).")
@_rule_options
@friendly
def reshard_create(name, source_shards, target_shards, tables, exclude_tables, shard_keys, rules, rules_file, udfs,
                   cycle_rows, chunk_rows, target_standbys):
    """Check every shard and rule, then create tables and state on every target shard."""
    from ..rules.udfs import parse_udfs
    from ..workflow.reshard import create_reshard, parse_shard_keys, parse_shards

    sources = parse_shards("source", list(source_shards))
    created = create_reshard(name, sources, parse_shards("target", list(target_shards)),
                             _table_names(tables), parse_shard_keys(list(shard_keys)), _all_rules(rules, rules_file),
                             _options(cycle_rows, chunk_rows, target_standbys), parse_udfs(list(udfs)),
                             _excluded(exclude_tables))
    _created(name, f"{len(created)} target shards ({'; '.join(created)})", " --target <any target shard URL>",
             sources=list(sources.values()))


@cli.group()
def workflow() -> None:
    """Run and manage workflows."""


@workflow.command("run")
@click.argument("name")
@TARGET
@SPARK_MASTER
@SPARK_CONF
@click.option("--no-progress", is_flag=True,
              help="Progress lines on stdout instead of the live table (as when stdout is not a terminal).")
@click.option("--progress-interval", type=click.FloatRange(min=0.1), default=config.default("progress_interval"),
              show_default=True,
              envvar=config.env_var("progress_interval"), metavar="SECONDS",
              help="Seconds between progress lines (stdout, when not drawn on a terminal).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="N",
              help="Serve Prometheus metrics at http://ADDR:N/metrics while the workflow runs.")
@click.option("--metrics-addr", default="127.0.0.1", show_default=True, metavar="ADDR",
              help="The address the metrics are served on (0.0.0.0: every interface; off loopback it needs "
                   "TLS and scrapers' certificates, or --metrics-insecure).")
@click.option("--metrics-cert-file", default=None, metavar="PATH",
              help="Serve the metrics over HTTPS with this certificate (PEM; with --metrics-key-file).")
@click.option("--metrics-key-file", default=None, metavar="PATH", help="The key of --metrics-cert-file.")
@click.option("--metrics-client-ca-file", default=None, metavar="PATH",
              help="Admit only scrapers with a client certificate this CA signed.")
@click.option("--metrics-insecure", is_flag=True,
              help="Serve the metrics off loopback without TLS and client certificates anyway.")
@friendly
def workflow_run(name, target, spark_master, spark_conf, no_progress, progress_interval, metrics_port,
                 metrics_addr, metrics_cert_file, metrics_key_file, metrics_client_ca_file, metrics_insecure):
    """Run the workflow in the foreground. SIGTERM stops cleanly; SIGKILL is always safe."""
    from ..spark.session import launch_settings, parse_conf

    conf = parse_conf(spark_conf)
    launch_settings(spark_master, conf)  # a usage error (two masters) before anything starts
    metrics_tls = {"cert_file": metrics_cert_file, "key_file": metrics_key_file,
                   "client_ca_file": metrics_client_ca_file, "insecure": metrics_insecure}
    if metrics_port is not None:
        from ..workflow.metrics import check_metrics_listen

        check_metrics_listen(metrics_addr, **metrics_tls)  # before Spark or the target: a refusal costs nothing

    # From the start: a SIGTERM while the driver starts up stops it as cleanly as one later.
    stop = threading.Event()
    runners: list = []
    _stop_on_signals(stop, runners)  # (an interrupted copy cycle is redone on the next run)
    where = targets.resolve(target)
    # One driver per workflow: a second one is refused here, before its Spark, heartbeat or progress lines
    # (its heartbeat would record it as the driver); the engine keeps holding it (a Reshard's: per stream).
    lock = where.take_run_lock(name)
    metrics = None
    try:
        if metrics_port is not None:
            metrics = where.metrics(name, metrics_port, metrics_addr, metrics_tls)
        final = where.run(name, spark_master, conf, stop, runners,
                          lambda kind, url: _progress(name, url, kind, no_progress, progress_interval),
                          lambda line: click.echo(line, err=True), lock)
    finally:
        if metrics is not None:
            metrics.stop()
        if lock is not None:
            lock.close()
    click.echo(f"workflow {name}: {final}", err=True)


def _progress(name, target, kind, no_progress, interval):
    """The live table (on stderr) when both outputs are a terminal, but not for a Reshard's many streams;
    else a line per interval on stdout (`workflow run > file`)."""
    from rich.console import Console

    from .progress import ProgressLines, ProgressView

    console = Console(stderr=True)
    if not no_progress and console.is_terminal and sys.stdout.isatty() and kind != "Reshard":
        view = ProgressView(target, name, console)
    else:
        view = ProgressLines(target, name, interval)
    view.start()
    return view


def _size(ctx, param, value):
    try:
        return parse_size(value) if isinstance(value, str) else value
    except SluicegateError as exc:
        raise click.BadParameter(str(exc)) from None


@workflow.command("status")
@click.argument("name")
@TARGET
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (every table).")
@click.option("--tables", "every_table", is_flag=True,
              help="List every table (of a stream of many, the text shows a summary and the tables being copied).")
@click.option("--wal-warning", default=config.default("wal_warning"), show_default=True, metavar="SIZE", callback=_size,
              envvar=config.env_var("wal_warning"),
              help="Warn when a stream's replication slot holds more WAL than this on its source.")
@friendly
def workflow_status_cmd(name, target, as_json, every_table, wal_warning):
    """Show a workflow's state, driver, position, lag, the WAL its slots hold and per-table copy progress."""
    where = targets.resolve(target)

    def human(status: dict) -> None:
        lines = where.status_lines(status)
        if lines is not None:
            click.echo("\n".join(lines))
        else:
            print_status(make_console(), status, every_table)

    emit(where.status(name, wal_warning), as_json, human)


@workflow.command("list")
@TARGET
@JSON
@friendly
def workflow_list(target, as_json):
    """Every workflow on the target: its kind, state, lag and driver."""
    from ..workflow import state as st
    from ..workflow.status import workflow_summary

    with connect(target, role="target") as conn:
        rows = [workflow_summary(st.load_workflow(conn, n)) for n in st.list_workflows(conn)]
    emit({"workflows": rows}, as_json, lambda r: print_workflows(make_console(), r["workflows"]))


def _pair(text: str, where: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise UsageError(f"{where}: {text!r} is not KEY=VALUE (e.g. batch_changes=10000)")
    return key.strip(), value.strip()


@workflow.command("stop")
@click.argument("name")
@TARGET
@friendly
def workflow_stop(name, target):
    """Stop the workflow; a running driver notices within one batch and exits."""
    targets.resolve(target).set_state(name, "stop")
    click.echo(f"workflow {name}: Stopped")


@workflow.command("start")
@click.argument("name")
@TARGET
@friendly
def workflow_start(name, target):
    """Start a stopped (or failed) workflow again from where it stands; then `workflow run` it."""
    targets.resolve(target).set_state(name, "start")
    click.echo(f"workflow {name}: started; run it with: sluicegate workflow run {shlex.quote(name)}")


@workflow.command("set")
@click.argument("name")
@click.argument("pairs", nargs=-1, metavar="[KEY=VALUE]...")
@TARGET
@click.option("--on-ddl", type=click.Choice(("stop", "ignore", "exec", "exec-ignore")), default=None,
              help="The workflow's DDL mode (see `movetables create --on-ddl`); the next statement the stream "
                   "meets follows it, without restarting `workflow run`.")
@click.option("--confirm-after-target-standbys", "target_standbys", type=click.Choice(("on", "off")), default=None,
              help="Confirm source positions only once the target's standbys have flushed them (see `movetables "
                   "create`); a running `workflow run` follows it once restarted.")
@friendly
def workflow_set(name, pairs, target, on_ddl, target_standbys):
    """Change settings of an existing workflow: its DDL mode and standbys by their flags, and as KEY=VALUE
    (KEY=default: back to the default) the sizes a run works in: cycle_rows, chunk_rows, batch_changes,
    slice_seconds; a PostgreSQL target's idle_poll; a Delta target's stage_rows, stage_bytes (README,
    "Settings"). A running `workflow run` takes a copy setting at its next cycle and a stream's at its next
    play task: a Delta target's at its next batch; a PostgreSQL target's at its next slice, which for a single
    stream without slice_seconds is once `workflow run` is restarted."""
    where = f"workflow {name}"
    settings = config.tuned(dict(_pair(p, where) for p in pairs), where)
    if on_ddl is None and target_standbys is None and not settings:
        raise UsageError("workflow set: give a setting to change (KEY=VALUE, --on-ddl, "
                         "--confirm-after-target-standbys)")
    changed = targets.resolve(target).configure(name, on_ddl, target_standbys, settings)
    click.echo(f"workflow {name}: {', '.join(changed)}")


@workflow.command("delete")
@click.argument("name")
@TARGET
@click.option("--drop-target-tables", "--drop-tables", "drop_tables", is_flag=True,
              help="Drop the tables the workflow writes on the target too (a Delta target's Delta tables; a "
                   "Reshard's on every target shard); refused for a table another workflow uses.")
@friendly
def workflow_delete(name, target, drop_tables):
    """Delete the workflow: its state on the target, its slot and publication on the source.

    The target tables and their rows stay, unless --drop-target-tables.
    """
    warnings: list[str] = []
    dropped = targets.resolve(target).delete(name, drop_tables, warnings.append)
    echo_dropped(f"deleted workflow {name}", dropped)
    for line in warnings:
        click.echo(line, err=True)


@cli.command()
@click.argument("name")
@TARGET
@click.option("--tables", default=None, metavar="A,B", help="Compare only these tables of the workflow.")
@JSON
@click.option("--resume", is_flag=True, help="Continue the workflow's last unfinished vdiff from its last finished range.")
@click.option("--sample", type=click.IntRange(0, 1000), default=10, show_default=True,
              help="Differing rows to show per table.")
@click.option("--range-rows", type=click.IntRange(1000), default=None,
              help="Rows per comparison task (default: one task per Spark slot, 50k to 1M rows).")
@SPARK_MASTER
@SPARK_CONF
@friendly(code=2)
def vdiff(name, target, tables, as_json, resume, sample, range_rows, spark_master, spark_conf):
    """Compare the workflow's target with its source at one consistent point.

    Exit status: 0 equal, 1 differences, 2 error. The workflow's running driver does the work when there is
    one; else this command plays the stream up to the comparison point itself.
    """
    try:
        code = _vdiff(name, target, tables, as_json, resume, sample, range_rows, spark_master, spark_conf)
    except KeyboardInterrupt:
        fail(f"interrupted; `sluicegate vdiff {name} --resume` continues from the last finished range", code=2)
    sys.exit(code)


def _vdiff(name, target, tables, as_json, resume, sample, range_rows, spark_master, spark_conf) -> int:
    from ..spark.session import launch_settings, parse_conf
    from ..vdiff import report as rep

    conf = parse_conf(spark_conf)
    launch_settings(spark_master, conf)  # a usage error (two masters) before anything starts
    where = targets.resolve(target)
    where.check_vdiff(name, resume)  # before Spark starts
    names = [t.strip() for t in tables.split(",") if t.strip()] if tables else None
    options = {"sample": sample, **({"range_rows": range_rows} if range_rows else {})}
    stop = threading.Event()
    runners = []

    def make_runner():
        from ..spark.runner import SparkRunner
        from ..spark.session import get_spark

        if not runners:
            runners.append(SparkRunner(get_spark(spark_master, conf)))
        return runners[0]

    _stop_on_signals(stop, runners)
    results = where.vdiff(name, names, options, resume, make_runner, stop)

    def human(_) -> None:
        from rich.console import Console

        console = Console(highlight=False, soft_wrap=True)
        for shard, label, result in results:
            if shard:
                console.print(f"[bold]target shard {shard}[/]")
            rep.render(console, {**result, "vdiff_id": label})

    emit(results[0][2] if len(results) == 1 else
         {"workflow": name, "equal": all(r["equal"] for _, _, r in results),
          "shards": [{"target_shard": shard, **r} for shard, _, r in results]}, as_json, human)
    failed = [(shard, label, r) for shard, label, r in results if r.get("state", "completed") != "completed"]
    for shard, label, r in failed:
        where_ = f" (target shard {shard})" if shard else ""
        click.echo(f"error: vdiff {label}{where_} {r['state']}: {redact(r['message'])}", err=True)
    if failed:
        return 2
    return 0 if all(r["equal"] for _, _, r in results) else 1


@cli.command()
@click.option("--rows", type=click.IntRange(1000), default=200_000, show_default=True, help="Rows to load.")
@click.option("--keep", is_flag=True, help="Leave the servers running and print how to connect.")
@click.option("--workdir", type=click.Path(file_okay=False), default=None, help="Where the servers live.")
@friendly
def demo(rows, keep, workdir):
    """Local source and target PostgreSQL, live writes during a MoveTables, status, and a check."""
    from .demo import run_demo

    sys.exit(run_demo(rows=rows, keep=keep, workdir=workdir))


# Groups in modules of their own (they look up `friendly` here when a command runs).
from .check import check_group
from .ddl import ddl_group
from .lake import lake_group
from .log import log_group
from .replicate import replicate_group
from .traffic import commands as traffic_commands
from .traffic import kind_cancel_command
from .vstream import vstream_group

for _command in traffic_commands:
    movetables.add_command(_command)
materialize.add_command(kind_cancel_command("Materialize", "its slot and publication on the source, its state on "
                                                           "the target"))
reshard.add_command(kind_cancel_command("Reshard", "every source shard's slot and publication, every target "
                                                   "shard's state"))

cli.add_command(ddl_group)
cli.add_command(lake_group)
cli.add_command(log_group)
cli.add_command(replicate_group)
cli.add_command(vstream_group)
cli.add_command(check_group({"movetables": movetables_create, "materialize": materialize_create,
                             "reshard": reshard_create, "replicate": replicate_group.commands["create"]}))

def _log_options_everywhere(group: click.Group) -> None:
    """-v, --log-level and --log-file after the subcommand too (`sluicegate workflow run W -v`)."""
    for cmd in group.commands.values():
        if not any("--log-level" in p.opts for p in cmd.params):
            cmd.params.extend(_log_options())
        if isinstance(cmd, click.Group):
            _log_options_everywhere(cmd)


_log_options_everywhere(cli)


def main() -> None:
    # A crash inside a native library (the JVM bridge, pyarrow, delta-rs, libpq) leaves every thread's stack on
    # stderr instead of a bare "Segmentation fault".
    faulthandler.enable()
    cli(prog_name="sluicegate")


if __name__ == "__main__":
    main()

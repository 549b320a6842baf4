"""`sluicegate replicate …`: cluster replication (YugabyteDB 2DC) from a source database to sink databases."""

from __future__ import annotations

import shlex

import click

from .. import config, targets
from ..errors import UsageError
from ..postgres.connect import strip_password
from ..sizes import parse_duration, parse_size
from .ddl import ON_DDL
from .output import friendly


def _cap(value: str | None, option: str, parse) -> int | float | None:
    """A retention cap, parsed in the command (not by a click callback) so a bad one is a one-line error."""
    if value is None:
        return None
    try:
        cap = parse(value)
    except UsageError as exc:
        raise UsageError(f"{option} {exc}") from None
    if cap <= 0:
        raise UsageError(f"{option} {value!r} caps nothing: give a value above zero, or leave the option out")
    return cap


def _names(text: str | None, what: str) -> list[str] | None:
    if text is None:
        return None
    from ..postgres.catalog import split_list

    names = split_list(text)
    if not names:
        raise UsageError(f"{what} names no table: list them ({what} a,b)")
    return names


OVERWRITE = click.option("--overwrite", is_flag=True,
                         help="A sink table that already holds rows has them replaced by the copy (default: refuse).")

SHARD_KEY = click.option("--shard-key", "shard_keys", multiple=True, metavar="TABLE=COLUMN",
                         help="From a keyspace (--source-shard): the sharding column of a table (default: its first "
                              "key column).")


@click.group("replicate")
def replicate_group() -> None:
    """Replicate a source database to one or more sink databases (cluster replication)."""


@replicate_group.command("create")
@click.option("--workflow", "name", required=True, help="Name of the new workflow.")
@click.option("--source", default=None, metavar="URL", help="libpq URL of the source database.")
@click.option("--source-shard", "source_shards", multiple=True, metavar="RANGE=URL",
              help="Instead of --source: a source shard of a keyspace (repeatable; the ranges cover it).")
@SHARD_KEY
@click.option("--sink", "sinks", multiple=True, required=True, metavar="URL",
              help="libpq URL of a sink database (repeatable: one source, several sinks).")
@click.option("--tables", default=None, help="Comma-separated source tables (default: all of schema public).")
@click.option("--schemas", default=None, metavar="A,B",
              help="Comma-separated source schemas whose tables all replicate (default: public).")
@click.option("--exclude-tables", default=None, metavar="A,B", help="Comma-separated tables not to replicate.")
@click.option("--max-retained-wal", default=None, metavar="SIZE",
              help="Release a sink's slot once it holds more source WAL than this (e.g. 64GB); the sink then "
                   "needs `replicate bootstrap`.")
@click.option("--max-retention-age", default=None, metavar="DURATION",
              help="Release a sink's slot once the WAL it holds is older than this (e.g. 36h, 7d).")
@OVERWRITE
@click.option("--bidirectional", is_flag=True,
              help="Active-active: the sink replicates back to the source too (exactly one --sink).")
@click.option("--allow-unsafe-schema", is_flag=True,
              help="With --bidirectional: create despite secondary unique indexes or sequence-drawn keys "
                   "(printed as warnings).")
@click.option("--tombstone-retention", default="7d", metavar="DURATION", show_default=True,
              help="With --bidirectional: how long deleted rows' tombstones are kept; must outlive replication "
                   "lag (an older change arriving after its tombstone is collected brings the row back).")
@click.option("--cycle-rows", type=click.IntRange(1), default=None, help="Rows per copy cycle (snapshot).")
@click.option("--chunk-rows", type=click.IntRange(1), default=None, help="Rows per parallel copy task.")
@click.option("--confirm-after-target-standbys", "target_standbys", is_flag=True,
              help="Confirm a source position to a sink only once every physical standby streaming from that sink "
                   "has flushed it too, so a promoted sink standby resumes with no re-copy. While none streams, the "
                   "source keeps its WAL. A user that is not a superuser needs pg_read_all_stats on the sink.")
@ON_DDL
@friendly
def replicate_create(name, source, source_shards, shard_keys, sinks, tables, schemas, exclude_tables, max_retained_wal,
                     max_retention_age, overwrite, bidirectional, allow_unsafe_schema, tombstone_retention, cycle_rows,
                     chunk_rows, target_standbys, on_ddl):
    """Check the source and every sink, print each sink table's bootstrap decision, create the workflow."""
    from ..cluster.create import create_replicate
    from ..workflow.create import source_password_note

    max_retained_wal = _cap(max_retained_wal, "--max-retained-wal", parse_size)
    max_retention_age = _cap(max_retention_age, "--max-retention-age", parse_duration)
    tombstone_retention = _cap(tombstone_retention, "--tombstone-retention", parse_duration)

    from ..postgres.standby_flush import OPTION

    options = {k: v for k, v in (("cycle_rows", cycle_rows), ("chunk_rows", chunk_rows),
                                 (OPTION, target_standbys or None), ("on_ddl", on_ddl)) if v is not None}
    from ..postgres.catalog import split_list, with_schemas

    excluded = split_list(exclude_tables) if exclude_tables else None
    names = with_schemas(_names(tables, "--tables"), _names(schemas, "--schemas"))

    if target_standbys and (lake := [u for u in sinks if not targets.resolve(u).has_standbys]):
        raise UsageError(f"--confirm-after-target-standbys is for PostgreSQL sinks: the Delta sink {lake[0]} has no "
                         f"standbys (its files are durable once written); create it without the option")
    if bool(source) == bool(source_shards):
        raise UsageError("replicate create takes its source as --source URL or as --source-shard RANGE=URL "
                         "(repeated): give exactly one of the two")
    if shard_keys and not source_shards:
        raise UsageError("--shard-key names a keyspace's sharding columns: it goes with --source-shard")
    if source_shards:
        if on_ddl not in (None, "stop"):
            raise UsageError(f"--on-ddl {on_ddl}: a keyspace source (--source-shard) does not replay schema changes "
                             f"yet; leave the option out (an added column follows)")
        lake = [u for u in sinks if not targets.resolve(u).takes_keyspace]
        if lake:
            raise UsageError(f"a keyspace source (--source-shard) replicates into PostgreSQL sinks only, "
                             f"not the Delta sink {lake[0]}: use --source, or a PostgreSQL sink")
        if bidirectional:
            raise UsageError("--bidirectional pairs two databases: a keyspace source (--source-shard) "
                             "replicates one way only; use --source")
        from ..cluster.keyspace import create_keyspace_replicate
        from ..workflow.reshard import parse_shard_keys, parse_shards

        decisions = create_keyspace_replicate(
            name, parse_shards("source", list(source_shards)), list(sinks), names, excluded,
            parse_shard_keys(list(shard_keys)), options, overwrite=overwrite, max_retained_wal=max_retained_wal,
            max_retention_age=max_retention_age)
        for d in decisions:
            click.echo(d.line())
        click.echo(f"created workflow {name}: {len({d.table for d in decisions})} table(s) from "
                   f"{len(source_shards)} source shard(s) to {len(sinks)} sink(s); run each sink's consumer with:")
        for url in sinks:
            click.echo(f"  {_run(name, url)}")
        for note in filter(None, (source_password_note(i.partition("=")[2].strip()) for i in source_shards)):
            click.echo(note, err=True)
        return
    notes: list[str] = []
    decisions = create_replicate(name, source, list(sinks), names, excluded, options,
                                 overwrite=overwrite, max_retained_wal=max_retained_wal,
                                 max_retention_age=max_retention_age, bidirectional=bidirectional,
                                 allow_unsafe_schema=allow_unsafe_schema, tombstone_retention=tombstone_retention,
                                 warn=lambda line: click.echo(f"warning: {line}", err=True), notes=notes)
    for d in decisions:
        click.echo(d.line())
    for line in notes:  # what the sink tables made here do not get of their source's definition
        click.echo(f"note: {line}", err=True)
    tables_n = len({d.table for d in decisions})
    if bidirectional:
        click.echo(f"created workflow {name}: {tables_n} table(s) both ways between the source and the sink; run "
                   f"each side's consumer with:")
        click.echo(f"  {_run(name, source)}")
    else:
        click.echo(f"created workflow {name}: {tables_n} table(s) to {len(sinks)} sink(s); run each sink's "
                   f"consumer with:")
    for url in sinks:
        click.echo(f"  {_run(name, url)}")
    note = source_password_note(source)
    if note:
        click.echo(note, err=True)


def _run(name: str, url: str) -> str:
    return f"sluicegate workflow run {shlex.quote(name)} --target {shlex.quote(strip_password(url))}"


@replicate_group.command("bootstrap")
@click.argument("name")
@click.option("--sink", required=True, metavar="URL", help="The sink to (re-)bootstrap.")
@click.option("--tables", default=None, metavar="A,B",
              help="Re-copy these tables even if the sink could resume them (default: only what cannot resume).")
@friendly
def replicate_bootstrap(name, sink, tables):
    """Re-copy, from the source, what this sink cannot resume; the other sinks are not touched."""
    for line in targets.resolve(sink).bootstrap_sink(name, _names(tables, "--tables")):
        click.echo(line)
    click.echo(f"run the sink's consumer: {_run(name, sink)}")


@replicate_group.command("add-tables")
@click.argument("name")
@click.option("--tables", required=True, metavar="A,B", help="Comma-separated source tables to add.")
@click.option("--target", "--sink", "target", envvar=config.env_var("target"), required=True, metavar="URL",
              help=f"Any sink of the workflow (env {config.env_var('target')}); the tables are added on every sink.")
@SHARD_KEY
@OVERWRITE
@friendly
def replicate_add_tables(name, tables, target, shard_keys, overwrite):
    """Add tables to every sink while the workflow runs: each is copied, then replicated."""
    from ..cluster.add_tables import add_tables
    from ..workflow.reshard import parse_shard_keys

    for d in add_tables(name, target, _names(tables, "--tables"), overwrite=overwrite,
                        shard_keys=parse_shard_keys(list(shard_keys))):
        click.echo(d.line())
    click.echo(f"added to workflow {name}: running consumers copy the tables, then replicate them")

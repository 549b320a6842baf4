"""Consistent reads of a Delta target: several tables as of one point of the consistent-read log.

Delta has no multi-table commit. The applier appends a row to `PATH/_sluicegate/points` after every table's
commit of a batch succeeded: the batch's source position and each table's Delta version holding it. Reading
each table at the versions of one point gives every table at the same source position, never one with a source
transaction and another without it.

Every table is read from the live files of its version (`DeltaTable(p, version=v).file_uris()`), never from
its directory: a directory also holds files that later versions removed, and files a killed writer left.
`DeltaTable.to_pyarrow_table()` is avoided: it has been seen to abort the process at exit (PLATFORM.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial

from ...errors import RetryableError, TerminalError, UsageError, did_you_mean
from ...position import format_lsn, parse_lsn
from .location import file_uris, filesystem, filesystem_paths, parse

POINTS = "_sluicegate/points"


@dataclass(frozen=True)
class Point:
    """One row of the consistent-read log: every table of the workflow at source position `position`."""

    workflow: str
    position: int
    position_text: str
    committed_at: datetime | None
    versions: dict[str, int] = field(hash=False)  # "schema.table" -> Delta version holding the position


def lake_path(path: str) -> str:
    """PATH of a `delta:PATH` target (or PATH itself): a local absolute path or a URI, without a trailing
    slash."""
    return parse(path).uri


def table_uri(path: str, table: str) -> str:
    """Where the Delta table of "schema.table" lives: PATH/<schema>/<table>."""
    schema, _, name = table.partition(".")
    return f"{lake_path(path)}/{schema}/{name}"


def points_uri(path: str) -> str:
    return f"{lake_path(path)}/{POINTS}"


def as_position(position) -> int | None:
    """None, an int, a Point or '0/16B3748' as an int."""
    if position is None or isinstance(position, int):
        return position
    if isinstance(position, Point):
        return position.position
    try:
        return parse_lsn(str(position))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


# --- reading Delta tables through pyarrow.dataset -------------------------------------------------------------

def _open(uri: str, version: int | None = None, storage_options: dict | None = None):
    """The DeltaTable at `uri` (at `version`), or None when there is no Delta table there."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        return DeltaTable(uri, version=version, storage_options=storage_options)
    except TableNotFoundError:
        return None


def _arrow_schema(dt):
    import pyarrow as pa

    return pa.schema(dt.schema().to_arrow())  # arro3 -> pyarrow through the Arrow C interface


def _missing(uris: list[str]) -> list[str]:
    import pyarrow.fs as pafs

    fs, paths = filesystem_paths(uris)
    return [u for u, info in zip(uris, fs.get_file_info(paths)) if info.type == pafs.FileType.NotFound]


def _dataset(dt):
    """A pyarrow dataset of the live files of `dt`'s version, in the version's schema (older files lacking an
    added column read it as null)."""
    import pyarrow.dataset as ds

    fs, paths = filesystem_paths(file_uris(dt))
    return ds.dataset(paths, schema=_arrow_schema(dt), format="parquet", filesystem=fs)


# --- the consistent-read log ----------------------------------------------------------------------------------

def _point_rows(path: str, where, storage_options=None):
    """The points table's rows `where` selects (a pyarrow.dataset filter; None: all), or None when there is
    no points table yet."""
    dt = _open(points_uri(path), storage_options=storage_options)
    return None if dt is None else _dataset(dt).to_table(filter=where)


def _to_point(row: dict) -> Point:
    return Point(workflow=row["workflow"], position=row["position"],
                 position_text=row["position_text"] or format_lsn(row["position"]),
                 committed_at=row["committed_at"], versions={k: int(v) for k, v in json.loads(row["versions"]).items()})


def points(path: str, workflow: str, storage_options=None) -> list[Point]:
    """Every recorded point of `workflow`, oldest first ([] when there is none)."""
    import pyarrow.dataset as ds

    rows = _point_rows(path, ds.field("workflow") == workflow, storage_options)
    if rows is None:
        return []
    return sorted((_to_point(r) for r in rows.to_pylist()), key=lambda p: p.position)


def latest_point(path: str, workflow: str, position=None, storage_options=None) -> Point | None:
    """The newest point of `workflow` (with position <= `position` when given), or None."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    limit = as_position(position)
    where = ds.field("workflow") == workflow
    if limit is not None:
        where = where & (ds.field("position") <= limit)
    rows = _point_rows(path, where, storage_options)
    if rows is None or rows.num_rows == 0:
        return None
    newest = pc.max(rows["position"]).as_py()
    return _to_point(rows.filter(pc.equal(rows["position"], newest)).slice(0, 1).to_pylist()[0])


def point_for(path: str, workflow: str, position=None, storage_options=None) -> Point:
    """latest_point, or an error saying why there is none and what to do."""
    if isinstance(position, Point):
        return position
    point = latest_point(path, workflow, position, storage_options)
    if point is not None:
        return point
    where = f"delta:{lake_path(path)}"
    known = points(path, workflow, storage_options)
    if known:  # all newer than the position asked for
        raise UsageError(f"{where}: workflow {workflow} has no consistent point at or before "
                         f"{format_lsn(as_position(position))}: the oldest kept one is {known[0].position_text} "
                         f"(older points were vacuumed away, or the copy finished there); ask for a later position")
    rows = _point_rows(path, None, storage_options)
    others = sorted(set(rows["workflow"].to_pylist())) if rows is not None else []
    hint = did_you_mean(workflow, others)
    if hint:
        raise UsageError(f"{where}: no workflow {workflow} has recorded points{hint}")
    raise RetryableError(f"{where}: workflow {workflow} has no consistent point yet: the copy has not finished; "
                         f"read again once `sluicegate workflow status {workflow}` shows Running")


def _resolve(point: Point, tables, path: str) -> dict[str, str]:
    """{name as the caller gave it: "schema.table"} for `tables` (all of the point's when None)."""
    known = sorted(point.versions)
    if tables is None:
        return {t: t for t in known}
    if isinstance(tables, str):
        tables = [tables]
    by_name: dict[str, list[str]] = {}
    for t in known:
        by_name.setdefault(t.partition(".")[2], []).append(t)
    out = {}
    for name in tables:
        if name in point.versions:
            out[name] = name
        elif len(by_name.get(name, [])) == 1:
            out[name] = by_name[name][0]
        else:
            why = " names tables of several schemas: qualify it" if by_name.get(name) else " is not one"
            raise UsageError(f"delta:{lake_path(path)}: table {name!r}{why} of workflow {point.workflow}'s tables "
                             f"({', '.join(known)}){did_you_mean(name, known) or did_you_mean(name, list(by_name))}")
    return out


def _version(path: str, point: Point, table: str, storage_options=None):
    """The DeltaTable of `table` at the point's version, its files checked to be there."""
    from deltalake.exceptions import DeltaError

    version = point.versions[table]
    uri = table_uri(path, table)
    try:
        dt = _open(uri, version, storage_options)
    except DeltaError as exc:  # the version's log entry is gone (log retention)
        raise TerminalError(f"table {uri} version {version} (point {point.position_text}) cannot be read any "
                            f"more ({exc}): read a later point") from None
    if dt is None:
        raise TerminalError(f"table {uri} of point {point.position_text} is not a Delta table any more: "
                            f"was it deleted? Read the workflow's tables again once it has a newer point")
    gone = _missing(file_uris(dt))
    if gone:
        raise TerminalError(f"table {uri} version {version} (point {point.position_text}) was vacuumed away "
                            f"({len(gone)} of its files are gone, e.g. {gone[0]}): read a later point, or vacuum "
                            f"with `sluicegate lake vacuum`, which keeps the files of every kept point")
    return dt


def arrow_tables_as_of(path: str, workflow: str, tables=None, position=None,
                       storage_options=None) -> dict[str, object]:
    """{table: pyarrow.Table} of `tables` (default: all of the workflow's) at one consistent point: the newest,
    or the newest at or before `position` (an int, '0/16B3748', or a Point)."""
    point = point_for(path, workflow, position, storage_options)
    out = {}
    for name, table in _resolve(point, tables, path).items():
        out[name] = _dataset(_version(path, point, table, storage_options)).to_table()
    return out


def tables_as_of(spark, path: str, workflow: str, tables=None, position=None, storage_options=None) -> dict:
    """{table: Spark DataFrame} of `tables` (default: all of the workflow's) at one consistent point: the newest,
    or the newest at or before `position` (an int, '0/16B3748', or a Point)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    point = point_for(path, workflow, position, storage_options)
    out = {}
    for name, table in _resolve(point, tables, path).items():
        dt = _version(path, point, table, storage_options)
        # The version's schema, not the files': a column added later is null in older files, not dropped.
        schema = from_arrow_schema(_arrow_schema(dt))
        files = file_uris(dt)
        if not files:
            out[name] = spark.createDataFrame([], schema)
        elif files[0].startswith("/"):
            # A bare path means the cluster's default filesystem to Spark (HDFS on some): name the local one.
            out[name] = spark.read.schema(schema).parquet(*("file://" + f for f in files))
        else:
            out[name] = _object_store_frame(spark, files, _arrow_schema(dt), schema)
    return out


def _object_store_frame(spark, files: list[str], arrow_schema, schema):
    """A DataFrame of Parquet files on an object store, read by Spark tasks through pyarrow (each rebuilds the
    filesystem from the URI and the environment): Spark's own reader would need the store's Hadoop connector
    (hadoop-aws for s3a://...), which a plain PySpark install lacks."""
    sc = spark.sparkContext
    rdd = sc.parallelize([(f,) for f in files], max(1, min(len(files), 4 * sc.defaultParallelism)))
    return spark.createDataFrame(rdd, "file string").mapInArrow(partial(_read_files, arrow_schema), schema)


def _read_files(arrow_schema, batches):
    """mapInArrow's function: each input row names one Parquet file; out come its rows in the version's schema
    (a column added later is null in older files)."""
    import pyarrow.dataset as ds

    for batch in batches:
        for uri in batch.column(0).to_pylist():
            fs, path = filesystem(uri)
            yield from ds.dataset([path], schema=arrow_schema, format="parquet", filesystem=fs).to_batches()

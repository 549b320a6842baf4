"""Delta tables and a consistent-read log written directly with delta-rs, in the documented format
(README, "Delta Lake target"): what the applier leaves, without depending on it."""

from __future__ import annotations

import glob
import json
import os
from datetime import datetime, timezone

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from sluicegate.position import format_lsn

POINTS_SCHEMA = pa.schema([("workflow", pa.string()), ("position", pa.int64()), ("position_text", pa.string()),
                           ("committed_at", pa.timestamp("us", tz="UTC")), ("versions", pa.string())])
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def uri(path, table: str) -> str:
    schema, name = table.split(".")
    return f"{path}/{schema}/{name}"


def txn(workflow: str, position: int) -> CommitProperties:
    return CommitProperties(app_transactions=[Transaction(app_id=f"sluicegate:{workflow}", version=position)])


def create(path, table: str, schema: pa.Schema) -> int:
    return DeltaTable.create(uri(path, table), schema=schema).version()


def apply(path, table: str, workflow: str, position: int, upserts: list[dict] = (), deletes: list[int] = (),
          schema: pa.Schema | None = None) -> int:
    """One batch on one table as the applier commits it (one MERGE carrying the position); its new version."""
    dt = DeltaTable(uri(path, table))
    assert (dt.transaction_version(f"sluicegate:{workflow}") or -1) < position, "batch already applied"
    schema = schema or pa.schema(dt.schema().to_arrow())
    rows = [{**r, "_op": "u"} for r in upserts] + [{"id": k, "_op": "d"} for k in deletes]
    source = pa.Table.from_pylist(rows, schema=schema.append(pa.field("_op", pa.string())))
    cols = {f'"{c}"': f's."{c}"' for c in schema.names}
    (dt.merge(source, predicate="t.id = s.id", source_alias="s", target_alias="t", merge_schema=True,
              commit_properties=txn(workflow, position))
     .when_matched_delete(predicate="s._op = 'd'")
     .when_matched_update(cols, predicate="s._op = 'u'")
     .when_not_matched_insert(cols, predicate="s._op = 'u'")
     .execute())
    return DeltaTable(uri(path, table)).version()


def record_point(path, workflow: str, position: int, versions: dict[str, int],
                 committed_at: datetime | None = None) -> None:
    row = {"workflow": workflow, "position": position, "position_text": format_lsn(position),
           "committed_at": committed_at, "versions": json.dumps(versions)}
    write_deltalake(f"{path}/_sluicegate/points", pa.Table.from_pylist([row], schema=POINTS_SCHEMA), mode="append")


def micros(value: datetime) -> int:
    return (value - EPOCH) // (datetime.resolution)


def norm_value(value):
    if isinstance(value, datetime):
        return micros(value if value.tzinfo else value.replace(tzinfo=timezone.utc))
    if hasattr(value, "as_tuple"):  # Decimal
        return str(value)
    return value


def norm_rows(rows: list[dict]) -> list[tuple]:
    """Rows comparable across readers: sorted (column, value) tuples, timestamps as microseconds."""
    return sorted(tuple(sorted((k, norm_value(v)) for k, v in r.items())) for r in rows)


def arrow_rows(table: pa.Table) -> list[tuple]:
    return norm_rows(table.to_pylist())


def spark_rows(df) -> list[tuple]:
    # unix_micros: Spark hands timestamps to Python in its session time zone, naive.
    cols = [f"unix_micros(`{f.name}`) AS `{f.name}`" if f.dataType.typeName() == "timestamp" else f"`{f.name}`"
            for f in df.schema.fields]
    return norm_rows([r.asDict() for r in df.selectExpr(*cols).collect()])


def duckdb_rows(table_uri: str, version: int | None = None) -> list[tuple]:
    """The table's version (default: newest) as DuckDB's delta extension reads it: an independent reader."""
    import duckdb
    import duckdb_extension_delta

    ext = glob.glob(os.path.join(os.path.dirname(duckdb_extension_delta.__file__), "**", "delta.duckdb_extension"),
                    recursive=True)[0]
    con = duckdb.connect()
    try:
        con.execute(f"LOAD '{ext}'")
        if version is None:
            return arrow_rows(con.execute("SELECT * FROM delta_scan(?)", [table_uri]).to_arrow_table())
        query = "SELECT * FROM delta_scan(?, version => ?)"
        return arrow_rows(con.execute(query, [table_uri, version]).to_arrow_table())
    finally:
        con.close()


def parquet_files(table_uri: str) -> set[str]:
    """Every Parquet file in the table's directory, live or not."""
    return {os.path.relpath(f, table_uri) for f in glob.glob(f"{table_uri}/**/*.parquet", recursive=True)
            if "/_delta_log/" not in f}

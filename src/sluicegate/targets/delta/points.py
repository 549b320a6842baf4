"""The consistent-read log: PATH/_sluicegate/points, a Delta table with one row per applied batch.

A row says: at source position `position`, table "schema.table" is Delta version `versions[...]`, for every
table of the workflow. It is appended only after every table's commit of the batch succeeded. Its commit
carries the workflow's app transaction (version = position), so a batch replayed after a kill between the
point and the state records its point once.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pyarrow as pa

from ...position import format_lsn
from .read import points_uri
from .state import app_id

SCHEMA = pa.schema([
    pa.field("workflow", pa.string()),
    pa.field("position", pa.int64()),
    pa.field("position_text", pa.string()),
    pa.field("committed_at", pa.timestamp("us", tz="UTC")),
    pa.field("versions", pa.string()),
])


def record(path: str | Path, workflow: str, position: int, committed_at: datetime | None,
           versions: dict[str, int]) -> bool:
    """Append the point (path: the lake root). False if this workflow already recorded it (or a later one)."""
    from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

    where = points_uri(path)
    app = app_id(workflow)
    if DeltaTable.is_deltatable(where):
        done = DeltaTable(where).transaction_version(app)
        if done is not None and done >= position:
            return False
    row = pa.table({
        "workflow": [workflow], "position": [position], "position_text": [format_lsn(position)],
        "committed_at": [committed_at], "versions": [json.dumps(dict(sorted(versions.items())))],
    }, schema=SCHEMA)
    write_deltalake(where, row, mode="append",
                    commit_properties=CommitProperties(app_transactions=[Transaction(app, position)]))
    return True


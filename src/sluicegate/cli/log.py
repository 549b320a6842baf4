"""`sluicegate log …`: read transaction-log files written by the translog applier (changes/translog.py)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import click

from ..position import format_lsn
from .output import friendly, line

if TYPE_CHECKING:  # the messages' module (protobuf: slow to import) loads where a command uses it
    from ..changes import model as m


@click.group("log")
def log_group() -> None:
    """Transaction-log files (the translog applier's sg-translog.NNNNNN)."""


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def statement_summary(st: m.Statement) -> str:
    """'INSERT public.t (3 rows)', 'TRUNCATE public.a, public.b CASCADE', 'ROLLBACK', …"""
    from ..changes import model as m

    kind = m.type_name(st.type)
    if st.type == m.TRUNCATE:
        tables = ", ".join(f"{t.schema}.{t.name}" for t in st.truncated)
        return " ".join(filter(None, (kind, tables, "CASCADE" if st.cascade else "",
                                      "RESTART IDENTITY" if st.restart_identity else "")))
    if st.type == m.ROLLBACK:
        return kind
    if st.type == m.DDL:
        return f"{kind} {st.ddl.tag} {', '.join(f'{t.schema}.{t.name}' for t in st.ddl.tables)}"
    if st.type == m.ROLLBACK_STATEMENT:
        return f"{kind} subtransaction {st.subtransaction_id}"
    table = f"{st.table.schema}.{st.table.name}"
    if st.type == m.SCHEMA_CHANGE:
        return f"{kind} {table} ({len(st.table.columns)} columns)"
    part = "" if st.segment_id == 1 and st.end_segment else f", part {st.segment_id}{'' if st.end_segment else '+'}"
    return f"{kind} {table} ({_rows(len(st.rows))}{part})"


def human_line(file: str, offset: int, txn: m.Transaction) -> str:
    ctx = txn.context
    statements = "; ".join(statement_summary(st) for st in txn.statements) or "(no statements)"
    return (f"{file}:{offset} txn {ctx.transaction_id} position {format_lsn(ctx.position)} "
            f"segment {txn.segment_id}{' end' if txn.end_segment else ''} {statements}")


@log_group.command("dump")
@click.argument("path", type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per message (model.to_json, plus file, offset).")
@friendly
def dump(path, as_json):
    """Print every message of a log directory (all its files, in order) or of one file.

    Exits 1 with the file and byte offset where a record is damaged (after printing the records before it).
    """
    from ..changes import model as m
    from ..changes.translog import read_log

    out = sys.stdout
    try:
        for file, offset, txn in read_log(path):
            if as_json:
                out.write(line({"file": file, "offset": offset, **m.to_json(txn)}))
            else:
                out.write(human_line(file, offset, txn))
            out.write("\n")
    except BrokenPipeError:  # `sluicegate log dump DIR | head`: the reader has seen enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    finally:
        out.flush()  # the records before a damaged one come out before its error line

"""The PostgreSQL applier of Transaction messages (the `postgres` applier plugin).

A transaction may come in several messages, even before its commit (segments, streaming), and may then be
rolled back whole (ROLLBACK) or in part (ROLLBACK_STATEMENT for a subtransaction). So its segments are staged
in a spool file — memory stays bounded whatever its size — and only its last segment applies it: the spooled
statements, less those of rolled-back subtransactions, through the set-based PostgresApplier, in one target
transaction together with the stream's position in `sluicegate.applied_positions`. A rolled-back statement
therefore never touches the target, and a message replayed after a crash (its position at or before the stored
one) is skipped: exactly once.
"""

from __future__ import annotations

import struct
import tempfile
from collections.abc import Iterator

from psycopg import sql

from ..changes import model as m
from ..errors import TerminalError, UsageError
from ..position import format_lsn, parse_lsn
from ..postgres import catalog, locks
from ..postgres.assembler import Change
from ..postgres.connect import connect
from ..postgres.pgoutput import Column, Relation
from .postgres import PostgresApplier, TargetTable

_LEN = struct.Struct(">I")
_KINDS = {m.INSERT: "I", m.UPDATE: "U", m.DELETE: "D"}


class _Spool:
    """A transaction's statements so far, on disk: appended as they come, read back once at its end."""

    def __init__(self, directory: str | None):
        self.file = tempfile.TemporaryFile(dir=directory, prefix="sg-spool-")  # noqa: SIM115 - gone on close, even after kill -9
        self.rolled_back: set[int] = set()

    def add(self, st: m.Statement) -> None:
        data = st.SerializeToString()
        self.file.write(_LEN.pack(len(data)))
        self.file.write(data)

    def statements(self) -> Iterator[m.Statement]:
        self.file.flush()
        self.file.seek(0)
        while head := self.file.read(4):
            (n,) = _LEN.unpack(head)
            st = m.Statement.FromString(self.file.read(n))
            if st.subtransaction_id not in self.rolled_back:
                yield st

    def close(self) -> None:
        self.file.close()


class TransactionApplier:
    """`postgres:url=postgresql://…,name=NAME[,spool_dir=DIR]`: tables must exist on the target with the source's
    columns (same names, same order). `name` keys the stored position (default `vstream`)."""

    def __init__(self, url: str = "", name: str = "vstream", spool_dir: str | None = None):
        if not url:
            raise UsageError("the postgres applier needs url=<libpq URL of the target database>")
        self.name, self.spool_dir = name, spool_dir
        self.conn = connect(url, role="target")
        self._spools: dict[int, _Spool] = {}
        self._tables: dict[tuple[str, str], catalog.Table] = {}
        self._oids: dict[tuple[str, str], int] = {}
        with locks.guard(self.conn, "creating sluicegate.applied_positions", ["sluicegate.applied_positions"]):
            self.conn.execute("CREATE SCHEMA IF NOT EXISTS sluicegate")
            self.conn.execute("""CREATE TABLE IF NOT EXISTS sluicegate.applied_positions (
                                   name text PRIMARY KEY, position pg_lsn NOT NULL,
                                   updated_at timestamptz NOT NULL DEFAULT now())""")
        self.conn.commit()
        self.applied_transactions = 0

    def position(self) -> int:
        """Everything before this position is applied: where a reader resumes (0: nothing yet)."""
        row = self.conn.execute("SELECT position::text FROM sluicegate.applied_positions WHERE name = %s",
                                (self.name,)).fetchone()
        self.conn.rollback()
        return parse_lsn(row[0]) if row else 0

    def apply(self, txn: m.Transaction) -> None:
        xid = txn.context.transaction_id
        spool = self._spools.get(xid)
        whole = txn.segment_id == 1 and txn.end_segment
        for st in txn.statements:
            if st.type == m.ROLLBACK:
                self._drop(xid)
                return
            if st.type == m.ROLLBACK_STATEMENT:
                if spool is not None:
                    spool.rolled_back.add(st.subtransaction_id)
                continue
            if not whole:
                if spool is None:
                    spool = self._spools[xid] = _Spool(self.spool_dir)
                spool.add(st)
        if not txn.end_segment:
            return
        try:
            if txn.context.position and txn.context.position <= self.position():
                return  # applied before a restart: the reader sent it again
            statements = txn.statements if whole else (spool.statements() if spool else iter(()))
            self._apply(statements, txn.context.position)
        finally:
            self._drop(xid)

    def _apply(self, statements, position: int) -> None:
        applier = PostgresApplier(self.conn, [])
        try:
            for st in statements:
                if st.type == m.SCHEMA_CHANGE:
                    raise TerminalError(
                        f"columns of {st.table.schema}.{st.table.name} changed on the source to "
                        f"{[c.name for c in st.table.columns]}: change the target table the same way, then "
                        f"resume from position {format_lsn(position)}"
                    )
                if st.type == m.TRUNCATE:
                    applier.truncate(tuple(self._relation(applier, h) for h in st.truncated))
                    continue
                kind = _KINDS.get(st.type)
                if kind is None:
                    continue
                rel = self._relation(applier, st.table)
                for r in st.rows:
                    old = m.values(r.before) if r.HasField("before") else None
                    new = m.values(r.after) if r.HasField("after") else None
                    applier.change(Change(kind, rel, old, new, st.start_position, r.ByteSize()))
            applier.flush()
            self.conn.execute(
                """INSERT INTO sluicegate.applied_positions (name, position) VALUES (%s, %s::pg_lsn)
                   ON CONFLICT (name) DO UPDATE SET position = excluded.position, updated_at = now()""",
                (self.name, format_lsn(position)))
            self.conn.commit()
            self.applied_transactions += 1
        except BaseException:
            self.conn.rollback()
            raise

    def _relation(self, applier: PostgresApplier, h: m.TableHeader) -> Relation:
        """The header as the Relation the set-based applier reads; its target table made known to it."""
        key = (h.schema, h.name)
        if key not in applier.by_name:
            applier.add_table(TargetTable(self._table(key)))
        oid = self._oids.setdefault(key, len(self._oids) + 1)
        cols = tuple(Column(1 if c.key else 0, c.name, c.type_oid, c.typmod) for c in h.columns)
        return Relation(oid, h.schema, h.name, h.replica_identity or "d", cols)

    def _table(self, key: tuple[str, str]) -> catalog.Table:
        table = self._tables.get(key)
        if table is None:
            found = self.conn.execute(
                "SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')", key).fetchone()
            if found is None:
                ident = sql.Identifier(*key).as_string(self.conn)
                raise TerminalError(f"table {ident} does not exist on the target: create it with the source's "
                                    f"columns, then resume")
            table = self._tables[key] = catalog.describe_table(self.conn, *key)
        return table

    def _drop(self, xid: int) -> None:
        spool = self._spools.pop(xid, None)
        if spool is not None:
            spool.close()

    def close(self) -> None:
        for xid in list(self._spools):
            self._drop(xid)
        self.conn.close()

"""The applier of a bidirectional stream: each key's net effect, applied by last-writer-wins (lww.py).

The player's interface (change, truncate, flush, settle, abandon), with `begin(commit_time)` for each source
transaction: a staged change keeps the commit time of the transaction that made it and the peer's cluster
id, and meets the target's own version of the row in `LwwTable.apply`. A key change is a delete of the old
key and an upsert of the new one, as in PostgresApplier. Writes are synchronous (no executor, no C row
sink): settle and abandon have nothing to wait for.

Schema changes: a Relation whose columns differ from the table's description goes to `schema_changes` (the
play task's SchemaFollower) once the rows staged before it are written, as in PostgresApplier: an added column
follows, and so does a change the target table already has (the statement ran here first and this is the peer's
copy of it coming back in the new shape). A replayed statement (workflow/ddl_replay.py) calls `sync`, then `reshape` or
`forget_plan`.
"""

from __future__ import annotations

from datetime import datetime

import psycopg
from psycopg import sql

from ..errors import TerminalError
from ..postgres import origins
from ..postgres.assembler import Change
from ..postgres.catalog import Table
from ..postgres.pgoutput import UNCHANGED, Relation
from .lww import Incoming, LwwTable, origin_ids
from .postgres import TargetTable, check_columns, key_getter, same_columns


class LwwApplier:
    def __init__(self, conn: psycopg.Connection, tables: list[TargetTable], *, local_cluster: int,
                 peer_cluster: int, origin: str, plans: dict | None = None, chunk_rows: int = 20_000,
                 unplaced=None, schema_changes=None):
        """`origin`: the replication origin this direction's writes carry (its rows here are the peer's);
        `plans`: LwwTables kept across batches of one task (qualified name -> (what it was made for, LwwTable,
        its staging table's number));
        `unplaced`, `schema_changes`: as PostgresApplier's (None: columns must not change)."""
        self.conn, self.local_cluster, self.peer_cluster = conn, local_cluster, peer_cluster
        self.unplaced, self.schema_changes = unplaced, schema_changes
        self.origin = origin
        self.plans = {} if plans is None else plans
        self.by_name = {(t.table.schema, t.table.name): t for t in tables if t.mode != "skip"}
        self.staged: dict[tuple[str, str], dict] = {}  # table -> key -> Incoming
        self.commit_time: datetime | None = None
        self.chunk_rows, self.pending = chunk_rows, 0
        self._checked: dict[int, Relation] = {}

    def begin(self, commit_time: datetime) -> None:
        self.commit_time = commit_time

    def _target(self, rel: Relation) -> TargetTable | None:
        t = self.by_name.get((rel.schema, rel.name))
        if t is None and self.unplaced is not None and self._checked.get(rel.oid) is not rel:
            self.unplaced(rel)
            self._checked[rel.oid] = rel
        if t is not None and self._checked.get(rel.oid) is not rel:
            if self.schema_changes is None:
                check_columns(rel, t.table)
            elif not same_columns(rel, t.table):
                self.flush()  # rows of the old shape are written in it
                self.reshape((t.table.schema, t.table.name), self.schema_changes(rel, t.table))
            self._checked[rel.oid] = rel
        return t

    # -- what a replayed statement (workflow/ddl_replay.py) needs -----------------------------------------------------
    def sync(self) -> None:
        self.flush()

    def reshape(self, source: tuple[str, str], table: Table) -> None:
        """The table's new description: rows after it are staged in it (its plan is made again)."""
        t = self.by_name.pop(source, None)
        if t is None:
            return
        t.table = table
        self.by_name[(table.schema, table.name)] = t
        self._checked.clear()

    def forget_plan(self, source: tuple[str, str]) -> None:
        """A statement changed the target table's indexes or constraints: its plan is made again."""
        t = self.by_name.get(source)
        hit = self.plans.get(t.table.qualified) if t is not None else None
        if hit is not None:
            self.plans[t.table.qualified] = (None, *hit[1:])  # matches no table: made again, same staging name

    def drop_table(self, source: tuple[str, str]) -> None:
        if self.by_name.pop(source, None) is not None:
            self._checked.clear()

    def change(self, ch: Change) -> None:
        t = self._target(ch.relation)
        if t is None:
            return
        if self.commit_time is None:
            raise TerminalError(f"a change of {t.table.qualified} arrived outside a transaction: the "
                                f"bidirectional applier needs each transaction's commit time")
        key_of = key_getter(tuple(t.table.key_indices))
        rows = self.staged.setdefault((t.table.schema, t.table.name), {})
        time, peer = self.commit_time, self.peer_cluster
        if ch.kind == "D":
            rows[key_of(ch.old)] = Incoming("D", ch.old, time, peer)
        else:
            new = ch.new
            key = key_of(new)
            prev = rows.get(key)
            # inserted in this batch, then updated: still an insert where the target has nothing
            op = "I" if ch.kind == "I" or (prev is not None and prev.op == "I") else "U"
            if ch.old is not None and key_of(ch.old) != key:  # the key changed: the old row goes away
                rows[key_of(ch.old)] = Incoming("D", ch.old, time, peer)
                new = self._fill(new, ch.old)
            elif ch.old is not None and ch.relation.replica_identity == "f":  # REPLICA IDENTITY FULL
                new = self._fill(new, ch.old)  # the whole old row: the values an update left unchanged
            missing = ()
            if UNCHANGED in new:
                values = list(new)
                missing = []
                for i, v in enumerate(values):
                    if v is UNCHANGED:
                        if prev is not None and prev.op != "D" and i not in prev.missing:
                            values[i] = prev.values[i]
                        else:
                            values[i], missing = None, [*missing, i]
                new, missing = tuple(values), tuple(missing)
            rows[key] = Incoming(op, new, time, peer, missing)
        self.pending += 1
        if self.pending >= self.chunk_rows:
            self.flush()

    @staticmethod
    def _fill(new: tuple, old: tuple) -> tuple:
        """Unchanged TOAST values from the old tuple where it has them (a key change; REPLICA IDENTITY FULL)."""
        return tuple(o if v is UNCHANGED and o is not None and o is not UNCHANGED else v
                     for v, o in zip(new, old))

    def truncate(self, relations) -> None:
        names = [f"{r.schema}.{r.name}" for r in relations if (r.schema, r.name) in self.by_name]
        if names:
            raise TerminalError(
                f"a TRUNCATE of {', '.join(names)} arrived in a bidirectional workflow: last-writer-wins "
                f"cannot order it against the other cluster's writes; run the same TRUNCATE on this cluster "
                f"too, then `workflow delete` the workflow on both sides and create it again (use DELETE to "
                f"empty a bidirectional table)")

    def _plan(self, t: TargetTable) -> LwwTable:
        name = t.table.qualified
        upto = t.lastpk if t.mode == "upto" else None
        # The direction's pool of origins (postgres/origins.py), all standing for the peer: read each time, as
        # a copy task may make one more while this task runs (a row of an origin not named counts as local).
        names = {self.origin if k == 0 else f"{self.origin}_{k}": self.peer_cluster
                 for k in range(origins.POOL)} if self.origin else {}
        ids = origin_ids(self.conn, names)
        hit = self.plans.get(name)
        if hit is None or hit[0] != (t.table, upto, ids):
            index = len(self.plans) if hit is None else hit[2]
            if hit is not None:  # its staging table, made earlier in this transaction, has the old shape
                self.conn.execute(sql.SQL("DROP TABLE IF EXISTS pg_temp.{}").format(
                    sql.Identifier(f"sg_lww_{index}")))
            hit = self.plans[name] = ((t.table, upto, ids), LwwTable(
                self.conn, t.table, local_cluster=self.local_cluster, origins=ids, index=index,
                upto=upto), index)
        return hit[1]

    def flush(self) -> None:
        staged, self.staged, self.pending = self.staged, {}, 0
        for name, rows in staged.items():
            if rows:
                self._plan(self.by_name[name]).apply(rows.values())

    def settle(self) -> None:
        """Writes are synchronous: nothing in flight."""

    def abandon(self) -> None:
        self.staged, self.pending = {}, 0

"""The PostgreSQL applier: row changes, set-based, into the target inside the caller's transaction.

Changes are collected per table into a chunk that keeps only each key's net effect (its last change,
with unchanged TOAST values filled in from an earlier change of the same chunk, or from the old row
when the key changed). A chunk is flushed with
COPY into a temporary staging table and three statements per table (delete, update, insert), so the
cost per row is COPY's, not a round trip. Chunks flush in order, which keeps per-row order across them;
their size bounds memory, whatever the transaction's size. Given an executor (one thread), a chunk is
written in the background while the caller collects the next one — the target's work overlaps the decoding;
whatever uses the connection itself waits for the chunk in flight first (`settle`).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from decimal import Decimal
from itertools import islice
from operator import itemgetter, lt

import psycopg
from psycopg import sql

from ..errors import TerminalError
from ..postgres import keyrange, locks
from ..postgres.assembler import Change, Framing
from ..postgres.catalog import Table
from ..postgres.pgoutput import UNCHANGED, Relation
from ..postgres.relation_changes import classify
from . import keyless
from .identity import overriding_clause
from .keyless import ESCAPE
from .plans import FACTS, Kept, TablePlans


@dataclass
class TargetTable:
    """A replicated table and how replayed changes treat it (all / only keys <= lastpk / skip)."""

    table: Table
    mode: str = "all"
    lastpk: list[str] | None = None
    source: tuple[str, str] | None = None  # (schema, name) of the source table, when a rule renames it
    index: int = 0
    rows: dict = field(default_factory=dict)  # key -> (op, values, keep): this chunk's net effect
    has_keep: bool = False
    _plan: dict | None = None
    key_of: object = None  # row -> its key tuple (set by the applier): read per row
    key_indices: tuple = ()  # the key's column positions (set by the applier), for the C path
    order_of: object = None  # keys -> values that sort them in (about) the key's order (set by the applier)
    integer_key: bool = False  # one key column, an integer (set by the applier): see dense_range


def check_columns(rel: Relation, source: Table, reader: str = "") -> None:
    """The source table still has the columns the workflow was made with (a Relation message says), where
    nothing follows added ones. `reader`: what reads the columns (a rule), for the message."""
    names = tuple(c.name for c in rel.columns)
    if names != source.column_names:
        what = "; ".join(classify(rel, source).describe(all_added=True)) or f"now {list(names)}"
        why = (f"; {reader} does not select them (a rule reads the columns it was made with):" if reader
               else ": schema changes are not replicated here;")
        raise TerminalError(f"columns of source table {source.qualified} changed ({what}){why} re-create the "
                            f"workflow")


def same_columns(rel: Relation, table: Table) -> bool:
    """The Relation's columns are the table's: names, types, typmods (where the description has them), key."""
    return classify(rel, table).unchanged


def key_getter(indices: tuple[int, ...]):
    """row -> tuple of its key values: the fastest way for one key column and for several."""
    if len(indices) == 1:
        (i,) = indices
        return lambda row: (row[i],)
    return itemgetter(*indices)


def _float_key(v: str) -> tuple:
    return (1, 0.0) if v == "NaN" else (0, float(v))  # NaN above every number, as in PostgreSQL


def _numeric_key(v: str) -> tuple:
    return (1, 0) if v == "NaN" else (0, Decimal(v))


# Key types whose text form does not sort in the type's order, and how to read it so it does. Any other type
# sorts by its text form: the same order for uuid, ISO dates and times in UTC, and text in the C collation;
# close to it otherwise.
_KEY_READERS = {20: int, 21: int, 23: int, 26: int, 700: _float_key, 701: _float_key, 1700: _numeric_key}

# A key of one of these (int8, int2, int4) can tell when a chunk's keys are a dense range (dense_range).
_INTEGER_KEYS = frozenset((20, 21, 23))
# Dense: the keys a statement joins lie within _DENSE times as many consecutive integers as there are keys,
# and enough of them that the time saved a row outweighs the planner settings' two round trips.
_DENSE = 2
_DENSE_MIN_ROWS = 1000
_MERGE_JOIN = "SET LOCAL enable_nestloop = off; SET LOCAL enable_hashjoin = off"
_PLANNER_DEFAULTS = "SET LOCAL enable_nestloop TO DEFAULT; SET LOCAL enable_hashjoin TO DEFAULT"


def key_order_getter(table: Table):
    """keys -> a list of values that sort them in (about) the target's key order, one a key; map-based, so a
    chunk's keys are read in C loops, not one Python call a key."""
    readers = tuple(_KEY_READERS.get(table.columns[i].type_oid) for i in table.key_indices)
    if not any(readers):
        return list  # the key tuples sort as they are
    if len(readers) == 1:
        first, read = itemgetter(0), readers[0]
        return lambda keys: list(map(read, map(first, keys)))
    return lambda keys: [tuple(v if r is None else r(v) for r, v in zip(readers, key)) for key in keys]


def _keyed(t: TargetTable) -> None:
    """How the table's changes are staged, from its description (its staged rows already written)."""
    if t.table.keyless:  # rows matched by value (keyless.py); never the C path, which stages by key
        if not isinstance(t.rows, keyless.KeylessRows):
            t.rows = keyless.KeylessRows()
        t.key_indices, t.key_of, t.order_of, t.integer_key = None, None, None, False
        return
    if not isinstance(t.rows, dict):  # a key added to a table that had none
        t.rows = {}
    t.key_indices = tuple(t.table.key_indices)
    t.key_of = key_getter(t.key_indices)
    t.order_of = key_order_getter(t.table)
    t.integer_key = len(t.key_indices) == 1 and t.table.columns[t.key_indices[0]].type_oid in _INTEGER_KEYS


def sort_by_key(rows: dict, order_of) -> tuple[list, list | None]:
    """The chunk's staged rows sorted by key, and the values that sorted them (one a row of `rows`, None when
    the keys do not sort). Each statement then meets the target's key index and heap in order, walking
    forward instead of at random, which costs the target backend less a row when the keys came in random
    order. The order cannot change the outcome (staged keys are unique),
    so a key that does not sort (not text, as a rule's output may be) leaves the order the rows came in."""
    values = list(rows.values())
    try:
        order = order_of(rows)
        if all(map(lt, order, islice(order, 1, None))):  # already in order (rows came in key order)
            return values, order
        return [values[i] for i in sorted(range(len(order)), key=order.__getitem__)], order
    except (TypeError, ValueError, ArithmeticError):
        return values, None


def dense_range(span: tuple[int, int] | None, rows: int) -> bool:
    """Whether `rows` staged keys within span (the chunk's lowest and highest integer key) are dense enough
    for a statement to meet the target's rows by one walk of the key index over the span, merged with the
    sorted staged rows, instead of one index search a row: a burst over a range of keys (an UPDATE … WHERE
    id BETWEEN, a purge, rows appended): one sequential walk costs less a row than as many searches. Keys
    spread wider keep the search a row, whose cost does not grow with the span."""
    return span is not None and rows >= _DENSE_MIN_ROWS and span[1] - span[0] < _DENSE * rows


try:  # the C versions (postgres/_pgoutput_rows.c): optional, like the decoder's
    from ..postgres._pgoutput_rows import RowSink as _RowSink
    from ..postgres._pgoutput_rows import copy_lines as _copy_lines_c  # no interpreter a value
    from ..postgres._pgoutput_rows import stage_change as _stage_change_c
except ImportError:  # pragma: no cover - a build without a compiler
    _copy_lines_c = _stage_change_c = _RowSink = None

_LINES_PER_WRITE = 1000


def copy_text(rows, ncols: int, write) -> int:
    """Write staged rows (op, values, keep) as COPY text lines (`_sg_op`, `_sg_keep`, the columns), a block
    of lines per `write` call (str or bytes); returns how many are deletes. The C version writes a block
    unless one of its rows is of another shape (a value not text), which the Python version then writes."""
    rows = rows if isinstance(rows, list) else list(rows)
    deletes = 0
    for start in range(0, len(rows), _LINES_PER_WRITE):
        stop = min(start + _LINES_PER_WRITE, len(rows))
        done = _copy_lines_c(rows, start, stop, UNCHANGED) if _copy_lines_c is not None else None
        if done is None:
            done = _copy_lines_py(rows[start:stop], ncols)
        text, n = done
        write(text)
        deletes += n
    return deletes


def _copy_lines_py(rows: list, ncols: int) -> tuple[str, int]:
    """The Python version of the C `copy_lines`: a row without NULLs or characters to escape is joined as it
    is (the usual case); the others go value by value."""
    lines: list[str] = []
    deletes = 0
    tabs = ncols - 1
    for op, values, keep in rows:
        if op == "D":
            deletes += 1
        head = op + ("\t{" + ",".join(map(str, keep)) + "}\t" if keep else "\t\\N\t")
        line = None
        if None not in values and UNCHANGED not in values:
            line = "\t".join(values)
            if "\\" in line or "\n" in line or "\r" in line or line.count("\t") != tabs:
                line = None
        if line is None:
            line = "\t".join("\\N" if v is None or v is UNCHANGED else v.translate(ESCAPE) for v in values)
        lines.append(head + line)
    return "\n".join(lines) + "\n", deletes


class PostgresApplier:
    def __init__(self, conn: psycopg.Connection, tables: list[TargetTable], *, chunk_rows: int = 20_000,
                 chunk_bytes: int = 32 << 20, executor: Executor | None = None, schema_changes=None,
                 unplaced=None, plans: TablePlans | None = None):
        """`schema_changes`: (Relation, Table) -> Table, given a Relation whose columns differ from its
        table's, once everything staged before it is written: the table's new description, after bringing the
        target table to it (workflow/schema_changes.SchemaFollower), or an error. None: columns must not
        change. `unplaced`: given a Relation that names none of the tables, returns if its changes may be
        passed over, else raises (the stream may never drop a change it cannot place); None: passed over.
        `plans`: table plans kept across the appliers (transactions) of one play task (plans.py); None: made
        for this applier alone."""
        self.conn = conn
        self.schema_changes = schema_changes
        self.unplaced = unplaced
        self.executor = executor
        self._writing: Future | None = None  # the chunk in flight (one at a time: memory stays two chunks)
        self._rels: dict[int, tuple[Relation, TargetTable | None]] = {}  # oid -> (that Relation, its table)
        self.by_name = {}
        for t in tables:
            self.add_table(t)
        self.chunk_rows, self.chunk_bytes = chunk_rows, chunk_bytes
        # With a writer, whether to write is asked every step (an eighth of a chunk): a free writer takes what
        # is there, so that decoding and writing overlap even in a batch smaller than a chunk (a steady stream
        # of small transactions); a busy one lets the chunk grow, up to its limits (a burst).
        self.step_rows, self.step_bytes = (max(1, chunk_rows // 8), max(1, chunk_bytes // 8)) \
            if executor is not None else (chunk_rows, chunk_bytes)
        self.pending_rows = self.pending_bytes = 0  # since the last step
        self.held_rows = self.held_bytes = 0  # in the chunk before that
        self.plans = TablePlans() if plans is None else plans
        self._serial = self.plans.begin()
        self._checked = False  # kept plans checked against the target in this transaction (plans.py)
        self._filled: set[tuple] = set()  # tables whose staging table holds an earlier chunk of this transaction

    def add_table(self, t: TargetTable) -> None:
        """A table met on the way (the Transaction applier learns tables from the messages)."""
        t.index = len(self.by_name)
        _keyed(t)
        self.by_name[t.source or (t.table.schema, t.table.name)] = t
        self._rels.clear()

    # -- intake ---------------------------------------------------------------------------------------
    def _target(self, rel: Relation) -> TargetTable | None:
        """The table a Relation's changes go to (None: not replicated), its columns checked; memoized per
        Relation message, so a new one (after a schema change) is checked again."""
        hit = self._rels.get(rel.oid)
        if hit is None or hit[0] is not rel:
            t = self.by_name.get((rel.schema, rel.name))
            if t is None and self.unplaced is not None:
                self.settle()  # (it reads the target on this connection)
                self.unplaced(rel)
            if t is not None and self.schema_changes is not None:
                if not same_columns(rel, t.table):
                    self.sync()  # rows of the old shape are written with it
                    self._retable(t, self.schema_changes(rel, t.table))
            elif t is not None and t.mode != "skip":
                check_columns(rel, t.table)
            if t is not None and t.mode == "skip":
                t = None
            hit = self._rels[rel.oid] = (rel, t)
        return hit[1]

    def _retable(self, t: TargetTable, table: Table) -> None:
        """The table took a new shape (columns added): its plan and staging table are made again."""
        if table is t.table:
            return
        self._forget(t)
        t.table = table
        _keyed(t)  # a column dropped before the key moves it; a key added or dropped changes how rows stage

    def _forget(self, t: TargetTable) -> None:
        """The table's plan is made again before its next chunk (its staging table with it)."""
        t._plan = None
        self.plans.forget(_plan_key(t))

    def forget_plan(self, source: tuple[str, str]) -> None:
        """A statement changed the target table (workflow/ddl_replay.py): its plan and staging table are made again
        (its columns, indexes and constraints may differ now). Nothing of it may be staged."""
        t = self.by_name.get(source)
        if t is not None:
            self._forget(t)

    def reshape(self, source: tuple[str, str], table: Table) -> None:
        """A statement gave the table a new description (workflow/ddl_tables.py): rows after it are staged in it. A
        renamed table is known by its new name from then on."""
        t = self.by_name.pop(source, None)
        if t is None:
            return
        self._forget(t)
        self._retable(t, table)
        self.by_name[(table.schema, table.name)] = t
        self._rels.clear()

    def drop_table(self, source: tuple[str, str]) -> None:
        """The table was dropped (workflow/ddl_tables.py): nothing of it is staged (the caller synced first)."""
        t = self.by_name.pop(source, None)
        if t is not None:
            self._forget(t)
            self._rels.clear()

    def change(self, ch: Change) -> None:
        t = self._target(ch.relation)
        if t is None:
            return
        if t.table.keyless:
            t.rows.stage(t.table, ch.kind, ch.old, ch.new)
        # An insert, a whole-row update or a delete (nearly every change) is staged in C, as _stage would.
        elif _stage_change_c is None or not _stage_change_c(t.rows, t.key_indices, ch, UNCHANGED):
            self._stage(t, ch)
        self.pending_rows += 1
        self.pending_bytes += ch.size
        if self.pending_rows >= self.step_rows or self.pending_bytes >= self.step_bytes:
            self.chunk_due()

    def _stage(self, t: TargetTable, ch: Change) -> None:
        """A change into the chunk's net effect: the row's last state by key (deletes, upserts, unchanged
        TOAST values kept, a key change as a delete of the old key)."""
        key_of = t.key_of
        kind = ch.kind
        if kind == "D":
            t.rows[key_of(ch.old)] = ("D", ch.old, None)
        else:
            new, old = ch.new, ch.old
            key = key_of(new)
            if old is None and (kind == "I" or UNCHANGED not in new):
                t.rows[key] = ("U", new, None)  # an insert, or an update of every value under the same key
            else:
                if old is not None:
                    old_key = key_of(old)
                    if old_key != key:  # the key changed: the old row goes away
                        if UNCHANGED in new:
                            new = self._moved_values(t, old_key, key, old, new)
                        t.rows[old_key] = ("D", old, None)
                keep = None
                if kind == "U" and UNCHANGED in new:
                    keep, new = self._resolve_unchanged(t, key, new)
                t.rows[key] = ("U", new, keep)

    def row_sink(self, framing: Framing):
        """A fast lane for `assemble(..., rows=)`: row messages staged here straight from their bytes, as
        change() stages their Changes and with the same counting (postgres/_pgoutput_rows.c RowSink), or
        declined to the usual path. The caller sets its `active` per transaction (False: one already
        applied). None without the C extension."""
        if _RowSink is None:
            return None
        return _RowSink(self, framing.relations, self._rels, UNCHANGED, self.step_rows, self.step_bytes)

    def put(self, t: TargetTable, op: str, key: tuple, values: tuple, keep: list[int] | None = None) -> None:
        """A row already in the target's shape (a rule's output): 'U' upserts it, 'D' deletes its key.
        `keep`: columns whose value the change did not carry (unchanged TOAST), kept as the target has them."""
        if keep:
            prev = t.rows.get(key)
            if prev is not None and prev[0] == "U":  # an earlier change in this chunk has the value
                merged, still = list(values), []
                for i in keep:
                    if prev[2] is None or i not in prev[2]:
                        merged[i] = prev[1][i]
                    else:
                        still.append(i)
                values, keep = tuple(merged), still or None
            if keep:
                t.has_keep = True
        t.rows[key] = (op, values, keep)
        self.pending_rows += 1
        self.pending_bytes += sum(len(v) for v in values if v is not None) + 16
        if self.pending_rows >= self.step_rows or self.pending_bytes >= self.step_bytes:
            self.chunk_due()

    def truncate_tables(self, targets: list[TargetTable]) -> None:
        if not targets:
            return
        self.sync()
        names = [t.table.ident.as_string(self.conn) for t in targets]
        with locks.guard(self.conn, f"applying a TRUNCATE of {', '.join(t.table.qualified for t in targets)}", names):
            self.conn.execute(sql.SQL("TRUNCATE {}").format(sql.SQL(", ").join(t.table.ident for t in targets)))

    def delete_where(self, t: TargetTable, condition: sql.Composable) -> None:
        self.sync()
        self.conn.execute(sql.SQL("DELETE FROM {} WHERE {}").format(t.table.ident, condition))

    def _resolve_unchanged(self, t: TargetTable, key, new: tuple):
        """Unchanged TOAST values come from this chunk's earlier change of the row, else stay as on target."""
        prev = t.rows.get(key)
        values = list(new)
        keep = []
        for i, v in enumerate(values):
            if v is UNCHANGED:
                if prev is not None and prev[0] == "U" and prev[1][i] is not UNCHANGED:
                    values[i] = prev[1][i]
                else:
                    keep.append(i)
        if keep:
            t.has_keep = True
        return (keep or None), tuple(values)

    def _moved_values(self, t: TargetTable, old_key: tuple, key: tuple, old: tuple, new: tuple) -> tuple:
        """Unchanged TOAST values of a row whose key changed: the row at the new key cannot keep them,
        so they come from the full old tuple (REPLICA IDENTITY FULL), else from the old row itself."""
        prev = t.rows.get(old_key)
        values = list(new)
        for i, v in enumerate(values):
            if v is UNCHANGED:
                if old[i] is not None and old[i] is not UNCHANGED:
                    values[i] = old[i]
                elif prev is not None and prev[0] == "U" and prev[1][i] is not UNCHANGED:
                    values[i] = prev[1][i]
        missing = [i for i, v in enumerate(values) if v is UNCHANGED]
        if not missing:
            return tuple(values)
        if t.mode == "upto" and not self._upto(t, key):
            return tuple(values)  # the new row is above lastpk: not applied, the copy brings it
        self.sync()  # the old row on the target now holds every earlier change
        table = t.table
        names = table.column_names
        row = self.conn.execute(
            sql.SQL("SELECT {} FROM {} WHERE {}").format(
                sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(names[i])) for i in missing),
                table.ident, keyrange.compare(table, "=", list(old_key)),
            )
        ).fetchone()
        if row is None:
            alter = sql.SQL("ALTER TABLE {} REPLICA IDENTITY FULL").format(table.ident).as_string(self.conn)
            raise TerminalError(
                f"an update of {table.qualified} moved key {list(old_key)} to {list(key)} and left a large "
                f"(TOASTed) value unchanged, which the change does not carry and the target has no old "
                f"row to take it from: run {alter} on the source, then re-create the workflow"
            )
        for i, v in zip(missing, row):
            values[i] = v
        return tuple(values)

    def _upto(self, t: TargetTable, key: tuple) -> bool:
        """key <= lastpk, compared by the target the way the source orders keys."""
        self.settle()
        return self.conn.execute(
            sql.SQL("SELECT {}").format(keyrange.compare_values(t.table, "<=", list(key), t.lastpk))
        ).fetchone()[0]

    def truncate(self, relations: tuple[Relation, ...]) -> None:
        self.truncate_tables([t for t in (self._target(r) for r in relations) if t is not None])

    # -- apply ----------------------------------------------------------------------------------------
    def chunk_due(self) -> None:
        """A step's rows are collected (change, put, the C RowSink): the chunk is written if the writer is
        free, or once it reaches chunk_rows or chunk_bytes."""
        self.held_rows += self.pending_rows
        self.held_bytes += self.pending_bytes
        self.pending_rows = self.pending_bytes = 0
        writing = self._writing
        if self.held_rows >= self.chunk_rows or self.held_bytes >= self.chunk_bytes or (
                self.executor is not None and (writing is None or writing.done())):
            self.flush()

    def flush(self) -> None:
        """Write the chunk collected so far (in the background, given an executor)."""
        chunk = [(t, t.rows, t.has_keep) for t in self.by_name.values() if t.rows]
        for t, _, _ in chunk:
            t.rows, t.has_keep = keyless.KeylessRows() if t.table.keyless else {}, False
        self.pending_rows = self.pending_bytes = self.held_rows = self.held_bytes = 0
        if not chunk:
            return
        if self.executor is None:
            self._write(chunk)
            return
        self.settle()
        self._writing = self.executor.submit(self._write, chunk)

    def settle(self) -> None:
        """Wait for the chunk in flight; its error, if it failed. Before anything else uses the connection."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()

    def sync(self) -> None:
        """Everything collected so far is written: the connection is the caller's. What the caller runs on it
        may change any table: plans are checked again before their next use (plans.py)."""
        self.flush()
        self.settle()
        self._checked = False
        for t in self.by_name.values():
            t._plan = None

    def abandon(self) -> None:
        """The caller failed: let a chunk in flight finish (the caller rolls the transaction back) so the
        connection is idle again; its own error, if any, is not the one to report."""
        with contextlib.suppress(BaseException):
            self.settle()

    def _write(self, chunk: list) -> None:
        for t, rows, has_keep in chunk:
            self._flush_table(t, rows, has_keep)

    def _flush_table(self, t: TargetTable, rows: dict, has_keep: bool) -> None:
        plan = self._plan_for(t)
        key = _plan_key(t)
        with self.conn.cursor() as cur:
            # The staging table is emptied before a chunk, not after: the commit empties it after the last one
            # (usually the only one of a batch).
            if key in self._filled:
                cur.execute(plan["clear"])
            self._filled.add(key)
            if t.table.keyless:
                keyless.flush(cur, t.table, plan, rows)
                return
            ordered, order = sort_by_key(rows, t.order_of)
            with cur.copy(plan["copy"]) as copy:
                deletes = copy_text(ordered, len(t.table.columns), copy.write)
            span = (min(order), max(order)) if t.integer_key and order else None
            # Only the statements this chunk needs: each costs a join with the staged rows.
            if deletes:
                self._join(cur, t, plan["delete"], span, deletes)
            upserts = len(rows) - deletes
            if upserts and plan["unique"]:
                # A unique index besides the key: an update that swaps two values (or moves one to a row
                # that gave it up, later in the chunk) is refused row by row. Such a chunk is applied again
                # as a delete of its rows and an insert of their new versions.
                cur.execute("SAVEPOINT sg_upsert")
                try:
                    self._upsert(cur, t, plan, has_keep, span, upserts)
                except psycopg.errors.UniqueViolation:
                    cur.execute("ROLLBACK TO SAVEPOINT sg_upsert")
                    self._replace(cur, t, plan, has_keep)
                cur.execute("RELEASE SAVEPOINT sg_upsert")
            elif upserts:
                self._upsert(cur, t, plan, has_keep, span, upserts)

    def _upsert(self, cur, t: TargetTable, plan: dict, has_keep: bool, span, upserts: int) -> None:
        updated = 0
        if plan["update"] is not None:
            update = plan["update_keep"] if has_keep else plan["update"]
            updated = self._join(cur, t, update, span, upserts)
        # Staged keys are unique, so when the update met as many rows as were staged, every row exists
        # and there is nothing to insert (the usual case: updates of rows the target has).
        if updated < upserts:
            if has_keep and cur.execute(plan["orphans"]).fetchone()[0]:
                self._orphan_error(t)
            self._join(cur, t, plan["insert"], span, upserts)

    def _replace(self, cur, t: TargetTable, plan: dict, has_keep: bool) -> None:
        """The chunk's upserts as a delete of the rows the target has and an insert of every new version: the
        unique values they exchange are all free when the insert checks them. Values the changes did not carry
        (unchanged TOAST) are taken from the target first."""
        if plan["referenced"]:  # a delete would fire the foreign keys that point at the rows (cascades)
            raise TerminalError(
                f"an update of {t.table.qualified} exchanges values of a unique index between rows, which a "
                f"set-based update cannot apply, and foreign keys point at the table on the target, so its rows "
                f"cannot be deleted and inserted again: make the unique constraint DEFERRABLE on the target, or "
                f"drop the foreign keys that reference it, then `sluicegate workflow start` the workflow")
        if has_keep:
            if plan["fill_keep"] is not None:
                cur.execute(plan["fill_keep"])
            if cur.execute(plan["orphans"]).fetchone()[0]:
                self._orphan_error(t)
        cur.execute(plan["delete_upserts"])
        try:
            cur.execute(plan["insert"][0] + plan["insert"][1])
        except psycopg.errors.UniqueViolation as exc:
            diag = exc.diag
            raise TerminalError(
                f"applying changes to {t.table.qualified} violates its unique constraint {diag.constraint_name} "
                f"({(diag.message_detail or '').rstrip('.')}): the target table has a row the source does not "
                f"have; remove it on the target, then `sluicegate workflow start` the workflow") from None

    @staticmethod
    def _join(cur, t: TargetTable, statement: tuple[sql.Composed, sql.SQL],
              span: tuple[int, int] | None, rows: int) -> int:
        """Run a statement (head, tail) that joins `rows` of the staged rows with the target table `d`; the
        rows it wrote. When they are dense within the chunk's span of keys (dense_range), the join is held to
        it and the planner to a merge join: with no statistics on the staging table it would search the key
        index once a row."""
        head, tail = statement
        if not dense_range(span, rows):
            return cur.execute(head + tail).rowcount
        within = sql.SQL(" AND {} AND {}").format(keyrange.compare(t.table, ">=", [str(span[0])], "d"),
                                                  keyrange.compare(t.table, "<=", [str(span[1])], "d"))
        cur.execute(_MERGE_JOIN)
        met = cur.execute(head + within + tail).rowcount
        # Back for the rest of the transaction; after an error it rolls back, and SET LOCAL with it.
        cur.execute(_PLANNER_DEFAULTS)
        return met

    def _orphan_error(self, t: TargetTable) -> None:
        schema, name = t.source or (t.table.schema, t.table.name)
        alter = sql.SQL("ALTER TABLE {} REPLICA IDENTITY FULL").format(sql.Identifier(schema, name))
        raise TerminalError(
            f"an update of {schema}.{name} left a large (TOASTed) value unchanged, which the change does not "
            f"carry, for a row the target does not have yet (it moved into a rule's filter, or changed its key): "
            f"run {alter.as_string(self.conn)} on the source so changes carry every value, then re-create the workflow"
        )

    def _plan_for(self, t: TargetTable) -> dict:
        """Statements for one table (cf. Vitess's table plans): kept across the task's batches (plans.py),
        checked once a transaction; made when none is kept or it no longer holds."""
        if t._plan is not None:  # made or checked in this transaction
            return t._plan
        if not self._checked:
            self.plans.check(self.conn)
            self._checked = True
        key, made_for = _plan_key(t), (t.table, t.mode, t.lastpk)
        plan = self.plans.use(key, made_for, self._serial)
        if plan is None:
            plan = self._make_plan(t, key, made_for)
        t._plan = plan
        return plan

    def _make_plan(self, t: TargetTable, key: tuple, made_for: tuple) -> dict:
        table = t.table
        name = f"sg_stage_{self.plans.number(key, self._serial)}"
        stage, qualified = sql.Identifier(name), sql.Identifier("pg_temp", name).as_string(self.conn)
        target = table.ident.as_string(self.conn)
        # The target's own definition: a unique index besides the key (_flush_table), an identity column
        # GENERATED ALWAYS among those written (the source's values are the ones to keep), foreign keys that
        # reference it; the facts the plan is checked against later; domains' base types (staged_columns).
        unique, always, cascades, facts, bases = self.conn.execute(
            """SELECT EXISTS (SELECT 1 FROM pg_index WHERE indrelid = %(t)s::regclass AND indisunique AND NOT indisprimary),
                      EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = %(t)s::regclass AND attidentity = 'a'
                                                          AND attname = ANY(%(cols)s)),
                      EXISTS (SELECT 1 FROM pg_constraint WHERE confrelid = %(t)s::regclass AND contype = 'f')
                      AND current_setting('session_replication_role') <> 'replica', """
            + FACTS.format(rel="%(t)s::regclass::oid")
            + f", (SELECT coalesce(json_object_agg(b.attname, b.base), '{{}}') FROM ({_DOMAIN_BASES}) b(attname, base))",
            {"t": target, "cols": list(table.column_names)},
        ).fetchone()
        if table.keyless:
            plan = keyless.compose_plan(table, stage, always=always)
        else:
            plan = compose_plan(table, stage, mode=t.mode, lastpk=t.lastpk, staged=staged_columns_of(table, bases),
                                unique=unique, always=always, referenced=cascades)
        # Made anew, whatever the session has under that name (a rollback may have brought an older one back).
        cur = self.conn.execute(plan["create"] + sql.SQL("; SELECT {}::regclass::oid").format(sql.Literal(qualified)))
        while cur.nextset():  # the last statement's result: the staging table's oid
            pass
        stage_oid = cur.fetchone()[0]
        self._filled.discard(key)
        self.plans.keep(key, Kept(made_for, plan, target, qualified, facts, stage_oid, self._serial))
        return plan


def _plan_key(t: TargetTable) -> tuple:
    """What a table's kept plan is found by: its source (a rule renames it) and target names."""
    return t.source, t.table.schema, t.table.name


def compose_plan(table: Table, stage: sql.Identifier, *, mode: str = "all", lastpk: list[str] | None = None,
                 staged: sql.Composable | None = None, unique: bool = False, always: bool = False,
                 referenced: bool = False) -> dict:
    """A keyed table's statements (pure: the caller read the target's facts). `mode`/`lastpk`: a table being
    copied applies only keys <= lastpk ("upto"); `staged`: the staging table's columns (staged_columns), None
    when the staging table exists already; `unique`: the target has a unique index besides the key;
    `always`: an identity column GENERATED ALWAYS among those written; `referenced`: foreign keys point at it."""
    cols = [sql.Identifier(c) for c in table.column_names]
    col_list = sql.SQL(", ").join(cols)
    # Kept across transactions, emptied by each commit (ON COMMIT DELETE ROWS: plans.py); made anew, in place of
    # any older one of that name. No constraints, so deletes may leave non-key columns NULL; domains staged as
    # their base types, or a NOT NULL domain would refuse those NULLs.
    create = None if staged is None else sql.SQL(
        """DROP TABLE IF EXISTS pg_temp.{}; CREATE TEMP TABLE {} ON COMMIT DELETE ROWS AS
           SELECT NULL::"char" AS _sg_op, NULL::int[] AS _sg_keep, {} FROM {} WITH NO DATA"""
    ).format(stage, stage, staged, table.ident)
    match = keyrange.key_equal(table, "d", "s")
    flt = sql.SQL("")
    if mode == "upto":
        flt = sql.SQL(" AND {}").format(keyrange.compare(table, "<=", lastpk, alias="s"))
    non_key = [c for c in table.column_names if c not in table.key]
    overriding = overriding_clause(always)
    plan = {
        "create": create,
        "copy": sql.SQL("COPY {} (_sg_op, _sg_keep, {}) FROM STDIN").format(stage, col_list),
        # A statement that joins the staged rows with the target `d` is (head, tail): a range of keys the
        # join is held to goes between the two (_join).
        "delete": (sql.SQL("DELETE FROM {} AS d USING {} AS s WHERE s._sg_op = 'D' AND {}{}").format(
            table.ident, stage, match, flt), sql.SQL("")),
        "insert": (sql.SQL(
            "INSERT INTO {} ({}){} SELECT {} FROM {} AS s WHERE s._sg_op = 'U'{} "
            "AND NOT EXISTS (SELECT 1 FROM {} AS d WHERE {}"
        ).format(table.ident, col_list, overriding, sql.SQL(", ").join(sql.Identifier("s", c) for c in table.column_names),
                 stage, flt, table.ident, match), sql.SQL(")")),
        "clear": sql.SQL("TRUNCATE {}").format(stage),
        # rows that keep a value the target does not have: the insert would write NULL in its place
        "orphans": sql.SQL(
            "SELECT EXISTS (SELECT 1 FROM {} AS s WHERE s._sg_op = 'U' AND s._sg_keep IS NOT NULL{} "
            "AND NOT EXISTS (SELECT 1 FROM {} AS d WHERE {}))"
        ).format(stage, flt, table.ident, match),
        "update": None,
        "delete_upserts": sql.SQL("DELETE FROM {} AS d USING {} AS s WHERE s._sg_op = 'U' AND {}{}").format(
            table.ident, stage, match, flt),
        "fill_keep": None,
    }
    plan["unique"], plan["referenced"] = unique, referenced
    if non_key:
        keep = keep_assignments(table, non_key)
        plain = sql.SQL(", ").join(sql.SQL("{c} = s.{c}").format(c=sql.Identifier(c)) for c in non_key)
        upd = "UPDATE {} AS d SET {} FROM {} AS s WHERE s._sg_op = 'U' AND {}{}"
        for name, assign in (("update", plain), ("update_keep", keep)):
            plan[name] = (sql.SQL(upd).format(table.ident, assign, stage, match, flt), sql.SQL(""))
        plan["fill_keep"] = sql.SQL(
            "UPDATE {} AS s SET {} FROM {} AS d WHERE s._sg_op = 'U' AND s._sg_keep IS NOT NULL AND {}").format(
            stage, keep, table.ident, match)
    return plan


def keep_assignments(table: Table, columns: list[str]) -> sql.Composable:
    """SET items giving each column the staged row's value (`s`), or the target row's (`d`) where _sg_keep
    lists the column (an unchanged TOAST value the change did not carry)."""
    return sql.SQL(", ").join(
        sql.SQL("{c} = CASE WHEN {i} = ANY(s._sg_keep) THEN d.{c} ELSE s.{c} END").format(
            c=sql.Identifier(c), i=sql.Literal(table.column_names.index(c))) for c in columns)


# The base type (format_type) of each of a table's columns whose type is a domain, through domains of domains;
# the table as %(t)s (a plan's query has it inside).
_DOMAIN_BASES = """
WITH RECURSIVE d(attname, typ, typmod) AS (
    SELECT a.attname, a.atttypid, a.atttypmod FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
    WHERE a.attrelid = %(t)s::regclass AND a.attnum > 0 AND NOT a.attisdropped AND t.typtype = 'd'
  UNION ALL
    SELECT d.attname, t.typbasetype, t.typtypmod FROM d JOIN pg_type t ON t.oid = d.typ WHERE t.typtype = 'd')
SELECT d.attname, format_type(d.typ, d.typmod) FROM d JOIN pg_type t ON t.oid = d.typ WHERE t.typtype <> 'd'"""


def staged_columns(conn: psycopg.Connection, table: Table) -> sql.Composable:
    """The table's columns as the staging table has them: a domain's as its base type."""
    return staged_columns_of(table, dict(conn.execute(_DOMAIN_BASES, {"t": table.ident.as_string(conn)}).fetchall()))


def staged_columns_of(table: Table, bases: dict[str, str]) -> sql.Composable:
    """staged_columns, given each domain column's base type (column name -> format_type)."""
    return sql.SQL(", ").join(
        sql.SQL("{c}::{t} AS {c}").format(c=sql.Identifier(c), t=sql.SQL(bases[c])) if c in bases
        else sql.Identifier(c) for c in table.column_names)


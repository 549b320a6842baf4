"""A batch's changes to one Delta table: the net effect per key, then one MERGE.

`NetEffect` (pure) folds a table's row changes into the last state of each key: an upsert of the row's
final values, or a delete. A value the source did not send (unchanged TOAST) comes from an earlier change
of the row in the batch, else the merge keeps the table's own (a `__u_<i>` flag column says which rows).
`merge_source` turns that into an Arrow batch with an `_op` column ('U' upsert, 'D' delete); `merge` commits
it with the workflow's app transaction (version = the batch's end position) in one Delta commit.
"""

from __future__ import annotations

import pyarrow as pa

from ...errors import TerminalError
from ...postgres.catalog import Table
from ...postgres.pgoutput import UNCHANGED
from . import netframe
from .types import SPECIAL, arrow_schema, convert_text_arrays, may_be_special

OP = "_op"


def _flag(i: int) -> str:
    return f"__u_{i}"


class NetEffect:
    """One table's changes of a batch, in order; values as PostgreSQL text in the table's column order.

    Changes are logged as they come and folded with Arrow (netframe.py) into a frame when the effect is
    merged or staged; `rows` (key -> (op, values, kept columns)) is the same effect folded row by row, for
    the rarer paths that edit rows (a log with an unchanged TOAST value, reshapes, added columns)."""

    def __init__(self, table: Table):
        self.table = table
        self._rows: dict[tuple, tuple[str, tuple | None, frozenset]] | None = {}  # the folded base, or
        self._frame: pa.Table | None = None  # ... the base as a frame; the log applies after the base
        self._ops: list[str] = []
        self._values: list[tuple] = []  # the new row (the old one of a delete)
        self._old_at: list[int] = []  # updates that carried the old row: their place in the log, the row
        self._olds: list[tuple] = []
        self.changes = 0
        self.truncated = False  # a TRUNCATE came first: the table is emptied, then the rows merged

    @classmethod
    def from_frame(cls, table: Table, frame: pa.Table) -> NetEffect:
        effect = cls(table)
        effect._rows, effect._frame = None, frame
        return effect

    def add(self, kind: str, old: tuple | None, new: tuple | None) -> None:
        """A change ('I', 'U' or 'D') with its rows in the table's column order: the player's hot path."""
        self.changes += 1
        if kind == "D":
            self._ops.append(kind)
            self._values.append(old)
            return
        if old is not None and kind == "U":
            if UNCHANGED in new:  # may move a key without a value it needs: folded now, it stops here
                self.rows  # noqa: B018 (folds the log)
                self._update(old, new)
                return
            self._old_at.append(len(self._values))
            self._olds.append(old)
        self._ops.append(kind)
        self._values.append(new)

    def truncate(self) -> None:
        self.changes += 1
        self.truncated = True
        self.clear()

    def clear(self) -> None:
        """Forget the rows (not the count of changes): staged, or truncated."""
        self._rows, self._frame = {}, None
        self._ops, self._values, self._old_at, self._olds = [], [], [], []

    @property
    def nonempty(self) -> bool:
        if self._ops:
            return True
        return self._frame.num_rows > 0 if self._frame is not None else bool(self._rows)

    @property
    def rows(self) -> dict[tuple, tuple[str, tuple | None, frozenset]]:
        """The net effect per key, folded row by row."""
        if self._frame is not None:
            self._rows, self._frame = dict(netframe.to_rows(self.table, self._frame)), None
        if self._ops:
            olds = dict(zip(self._old_at, self._olds))
            for j, (kind, values) in enumerate(zip(self._ops, self._values)):
                if kind == "I":
                    self._insert(values)
                elif kind == "U":
                    self._update(olds.get(j), values)
                else:
                    self._delete(values)
            self._ops, self._values, self._old_at, self._olds = [], [], [], []
        return self._rows

    def reshaped(self, table: Table, fn) -> NetEffect:
        """The effect in the shape `table`: `fn(values, keep)` gives a row's new values and kept columns."""
        fresh = NetEffect(table)
        fresh.changes, fresh.truncated = self.changes, self.truncated
        for key, (op, values, keep) in self.rows.items():
            if values is not None:
                values, keep = fn(values, keep)
                values, keep = tuple(values), frozenset(keep)
            fresh._rows[key] = (op, values, keep)
        return fresh

    def frame(self) -> pa.Table:
        """The net effect as a frame (netframe.py), one row per key."""
        if self._ops:
            logged = netframe.log_frame(self.table, self._ops, self._values, self._old_at, self._olds)
            if logged is None:  # an unchanged TOAST value: it takes from earlier changes of its row
                self.rows  # noqa: B018 (folds the log)
            else:
                base = self._frame if self._frame is not None else netframe.from_rows(self.table, self._rows)
                self.clear()
                # (no row of the log keeps a column: each replaces its key's earlier state whole)
                self._rows, self._frame = None, logged if base.num_rows == 0 else netframe.last_per_key(
                    self.table, pa.concat_tables([base, logged]))
        if self._frame is None:
            self._rows, self._frame = None, netframe.from_rows(self.table, self._rows)
        return self._frame

    def _key(self, values: tuple) -> tuple:
        return tuple(values[i] for i in self.table.key_indices)

    def _insert(self, new: tuple) -> None:
        self._rows[self._key(new)] = ("U", new, frozenset())

    def _delete(self, old: tuple) -> None:
        self._rows[self._key(old)] = ("D", None, frozenset())

    def _update(self, old: tuple | None, new: tuple) -> None:
        key = self._key(new)
        prev_key = key
        if old is not None and self._key(old) != key:  # the key changed: the old row goes away
            prev_key = self._key(old)
        prev = self._rows.get(prev_key)
        values, keep = list(new), set()
        for i, v in enumerate(values):
            if v is not UNCHANGED:
                continue
            if old is not None and old[i] is not None and old[i] is not UNCHANGED:
                values[i] = old[i]  # REPLICA IDENTITY FULL: the old tuple has it
            elif prev is not None and prev[0] == "U" and i not in prev[2]:
                values[i] = prev[1][i]
            elif prev_key != key:
                raise TerminalError(
                    f"table {self.table.qualified}: a row whose key changed did not carry column "
                    f"{self.table.columns[i].name} (unchanged TOAST); a Delta target needs it: "
                    f"ALTER TABLE {self.table.qualified} REPLICA IDENTITY FULL on the source, then re-create "
                    f"the workflow")
            else:
                values[i] = None
                keep.add(i)
        if prev_key != key:
            self._rows[prev_key] = ("D", None, frozenset())
        self._rows[key] = ("U", tuple(values), frozenset(keep))

    def merge_source(self, kept: set[int] | None = None) -> pa.Table:
        """The net effect as the merge's source: the table's columns, `_op`, and a flag per column some row
        keeps (or per column of `kept`: every part of a staged effect has the same columns)."""
        table, frame = self.table, self.frame()
        n = len(table.columns)
        kept = sorted(kept if kept is not None else netframe.kept(frame))
        arrays = convert_text_arrays(table, [frame.column(f"c{i}").combine_chunks() for i in range(n)])
        fields = list(arrow_schema(table))
        arrays.append(frame.column(OP).combine_chunks())
        fields.append(pa.field(OP, pa.string(), nullable=False))
        if kept:
            keeps = frame.column(netframe.KEEP).to_pylist() if netframe.has_keep(frame) else None
            for i in kept:
                flags = [False] * frame.num_rows if keeps is None else [i in (k or ()) for k in keeps]
                arrays.append(pa.array(flags, pa.bool_()))
                fields.append(pa.field(_flag(i), pa.bool_(), nullable=False))
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def merge_clauses(table: Table, source: pa.Table | pa.Schema,
                  fills: dict[str, str] | None = None) -> tuple[str, dict[str, str], dict[str, str]]:
    """(predicate, updates, inserts) of the MERGE of `source` (merge_source's, or its schema) into the table.
    `fills`: columns being filled in this MERGE (column -> SQL value): a row keeping its own value of one
    has none yet, so it takes the fill."""
    fills = fills or {}
    predicate = " AND ".join(f"t.{quote(k)} = s.{quote(k)}" for k in table.key)
    names = set(source.names if isinstance(source, pa.Schema) else source.column_names)
    updates, inserts = {}, {}
    for i, c in enumerate(table.columns):
        col = quote(c.name)
        inserts[col] = f"s.{col}"
        if _flag(i) in names:
            own = fills.get(c.name, f"t.{col}")
            updates[col] = f"CASE WHEN s.{quote(_flag(i))} THEN {own} ELSE s.{col} END"
        else:
            updates[col] = f"s.{col}"
    if SPECIAL in names:
        inserts[quote(SPECIAL)] = f"s.{quote(SPECIAL)}"
        updates[quote(SPECIAL)] = _special_update(table, names)
    return predicate, updates, inserts


def _special_update(table: Table, names: set[str]) -> str:
    """`_sg_special` of a matched row: the source row's, except that a column the row keeps (unchanged TOAST)
    keeps its entry from the table's row too; entries in column order, as the conversion makes them."""
    sp_s, sp_t = f"s.{quote(SPECIAL)}", f"t.{quote(SPECIAL)}"
    kept = [(i, c) for i, c in enumerate(table.columns) if _flag(i) in names and may_be_special(c, table.type_tree)]
    if not kept:
        return sp_s
    keys, values = [], []
    for i, c in enumerate(table.columns):
        if not may_be_special(c, table.type_tree):
            continue
        name = "'" + c.name.replace("'", "''") + "'"
        entry = f"map_extract({sp_s}, {name})"
        if _flag(i) in names:
            entry = f"CASE WHEN s.{quote(_flag(i))} THEN map_extract({sp_t}, {name}) ELSE {entry} END"
        keys.append(f"CASE WHEN ({entry})[1] IS NOT NULL THEN make_array({name}) ELSE make_array() END")
        values.append(f"CASE WHEN ({entry})[1] IS NOT NULL THEN {entry} ELSE make_array() END")
    any_kept = " OR ".join(f"s.{quote(_flag(i))}" for i, _ in kept)
    rebuilt = f"map(array_concat({', '.join(keys)}), array_concat({', '.join(values)}))"
    return (f"CASE WHEN NOT ({any_kept}) THEN {sp_s} "
            f"WHEN cardinality(array_concat({', '.join(keys)})) = 0 THEN NULL ELSE {rebuilt} END")


def merge(dt, table: Table, effect: NetEffect, app: str, version: int, fills: dict[str, str] | None = None) -> dict:
    """One Delta commit: the batch's deletes, updates and inserts, carrying (app, version). Columns the
    source added since the table was made are added to it (merge_schema); `fills` (column -> SQL value, the
    columns already added by `add_columns`) set every row the batch does not touch to what the source's
    older rows hold, in the same commit."""
    return merge_arrow(dt, table, effect.merge_source(), app, version, fills)


def merge_staged(dt, table: Table, effect: NetEffect, spill, app: str, version: int,
                 fills: dict[str, str] | None = None) -> dict:
    """`merge` of an effect part of which is staged (staging.Spill): the merge's source streams from the
    staged partitions, one in memory at a time, into one Delta commit."""
    kept = spill.kept | spill.pad_keep | netframe.kept(effect.frame())
    schema = NetEffect(table).merge_source(kept).schema

    bounds = spill.bounds if spill.bounded else None
    if bounds is not None and effect.nonempty:
        bounds = netframe.widest(bounds, netframe.key_bounds(table, effect.frame()))

    def batches():
        for part in spill.partitions(effect):
            yield from part.merge_source(kept).to_batches()

    return merge_arrow(dt, table, pa.RecordBatchReader.from_batches(schema, batches()), app, version, fills,
                       bounds)


def merge_arrow(dt, table: Table, source, app: str, version: int, fills: dict[str, str] | None = None,
                bounds: tuple[int, int] | None = None) -> dict:
    """One MERGE of `source` (a merge_source table, or a reader of its batches) carrying (app, version).
    A table keyed by integers or text is handed over whole (delta-rs then reads only the files its keys'
    statistics may match; it cannot make that filter of a key of other types, a struct say); a reader
    streams, and `bounds` (its least and greatest integer key) narrow the files instead."""
    from deltalake import CommitProperties, Transaction

    predicate, updates, inserts = merge_clauses(table, source.schema, fills)
    if bounds is not None and not fills:  # (a fill touches rows outside the bounds too)
        key = quote(table.key[0])
        predicate += f" AND t.{key} >= {int(bounds[0])} AND t.{key} <= {int(bounds[1])}"
    props = CommitProperties(app_transactions=[Transaction(app, version)])
    builder = (dt.merge(source, predicate, source_alias="s", target_alias="t", merge_schema=True,
                        streamed_exec=not (isinstance(source, pa.Table) and _plain_key(source.schema, table)),
                        commit_properties=props)
               .when_matched_delete(predicate=f"s.{OP} = 'D'")
               .when_matched_update(updates=updates, predicate=f"s.{OP} = 'U'")
               .when_not_matched_insert(updates=inserts, predicate=f"s.{OP} = 'U'"))
    fills = {quote(c): v for c, v in (fills or {}).items() if v != "NULL"}
    if fills:
        builder = builder.when_not_matched_by_source_update(updates=fills)
    return builder.execute()


def _plain_key(schema: pa.Schema, table: Table) -> bool:
    return all(pa.types.is_integer(t) or pa.types.is_string(t) for t in (schema.field(k).type for k in table.key))


ADDED_BY = "sluicegate.added_by"  # field metadata of a Delta column Sluicegate added: the workflow's name


def add_columns(dt, table: Table, names: list[str], workflow: str) -> None:
    """Columns `names` of `table` added to the Delta table (nullable) unless it has them: one commit. A MERGE's
    schema evolution adds columns too, but then sets nothing in them (delta-rs drops a not-matched-by-source
    update of a column it adds), so columns to fill are added first. Each carries `ADDED_BY`: a column the
    Delta table already has without it was added by hand."""
    from deltalake.schema import Field

    have = {f.name for f in dt.schema().fields}
    schema = arrow_schema(table)
    fields = [Field.from_arrow(pa.field(n, schema.field(n).type, nullable=True, metadata={ADDED_BY: workflow}))
              for n in names if n not in have]
    if fields:
        dt.alter.add_columns(fields)


def added_by(dt, name: str) -> str | None:
    """Who added the Delta table's column `name`: a workflow's name, "" (by hand) or None (no such column)."""
    for f in dt.schema().fields:
        if f.name == name:
            return (f.metadata or {}).get(ADDED_BY, "")
    return None


def truncate(dt, app: str, version: int | None = None) -> None:
    """Every row of the table deleted (a TRUNCATE on the source), in one commit."""
    from deltalake import CommitProperties, Transaction

    props = CommitProperties(app_transactions=[Transaction(app, version)]) if version is not None else None
    dt.delete(commit_properties=props)

"""Captured DDL statements (ddl/) in a Delta workflow, as its `--on-ddl` mode says (issue 36).

The lake player meets each 'sluicegate.ddl' message at its place among a transaction's rows. On a table the
workflow moves:

Index statements are passed over in every mode (a Delta table has none).

- stop: the stream stops in Error before the statement's transaction (the player applies what came before
  it), naming it (an ALTER TABLE that only adds columns is not stopped for: added columns follow from the
  Relation messages, as without capture). A statement a table's rewrite holds already (run under exec before
  a kill, the mode changed since) is followed whatever the mode.
- ignore: passed over; the Relation handling decides as without capture (added columns follow, anything else
  stops the stream).
- exec, exec-ignore: ALTER TABLE's column actions are followed: ADD COLUMN as without capture, DROP COLUMN and
  RENAME COLUMN at once, ALTER COLUMN TYPE where the Delta type widens losslessly (integers to wider integers,
  real to double precision, a decimal's precision with its scale) or stays the same (varchar(n) to text).
  Actions that leave the columns as they are (defaults, NOT NULL, constraints, indexes, replica identity, ...)
  are passed over: a Delta table has none of them. Anything else (another action, DROP/CREATE TABLE, a table
  renamed) cannot be followed: Error under exec, passed over with a note under exec-ignore.

Rows keep their shape: the batch's rows staged before the statement are reshaped to the new shape (a dropped
column's value goes, a renamed one's stays in its place, a widened real is converted as PostgreSQL does), and
rows after it come in the new shape. At the batch's commit, each reshaped table is first rewritten in the new
shape (`rewrite`), then takes the batch's MERGE. delta-rs 1.6.6 has no column mapping, no rename or drop of a
column and no type widening, and Sluicegate's readers read the tables' Parquet files by name (Spark over
`file_uris()`), so a rewrite (`schema_mode="overwrite"`) is the one way a column leaves or changes its name
or type. The rewrite commits a second app transaction (`ddl_app_id`, version: the last statement it holds),
so a kill between it and the MERGE is safe: the batch is read again, at least up to that statement (the
player's `min_end`), the statements it holds are recognised as done, and only the MERGE is made.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...ddl import modes
from ...ddl.message import BadDdlMessage, DdlMessage, parse
from ...ddl.statement import NotReplayable, _name, read, tokens
from ...ddl.touched import touched
from ...position import format_lsn
from ...postgres.catalog import Column, Table
from ...postgres.types import FIRST_USER_OID
from ...workflow.schema_changes import SchemaStop, source_columns
from . import staging
from .apply import NetEffect
from .read import _dataset
from .types import SPECIAL, arrow_type

log = logging.getLogger("sluicegate")


def ddl_app_id(workflow: str) -> str:
    """The app transaction of a table's rewrites: its version is the last statement the table has."""
    return f"sluicegate:{workflow}:ddl"


# -- ALTER TABLE's actions, read from its text (pure) -----------------------------------------------------------

@dataclass(frozen=True)
class Action:
    kind: str  # 'add', 'drop', 'rename', 'type' (columns change), 'keep' (they do not), 'other' (not followed)
    column: str | None = None
    new: str | None = None  # a rename's new name
    text: str = ""  # the action's leading words, for messages


# Actions that change no column of a Delta table (it has no defaults, constraints, indexes, storage options).
_KEEP = {"VALIDATE", "REPLICA", "CLUSTER", "OWNER", "ENABLE", "DISABLE", "FORCE", "NO", "SET", "RESET"}
_NOT_KEPT_SET = {"SCHEMA", "ACCESS"}  # SET SCHEMA moves the table; SET ACCESS METHOD rewrites it elsewhere
_CONSTRAINTS = {"CONSTRAINT", "PRIMARY", "UNIQUE", "CHECK", "FOREIGN", "EXCLUDE"}
_COLUMN_KEEP = {"DEFAULT", "NOT", "STATISTICS", "STORAGE", "COMPRESSION", "GENERATED", "IDENTITY", "RESTART",
                "INCREMENT", "START", "MAXVALUE", "MINVALUE", "CACHE", "CYCLE", "OPTIONS"}


def actions(text: str) -> list[Action]:
    """The actions of `ALTER TABLE [IF EXISTS] [ONLY] name [*] action [, ...]`, split at top-level commas."""
    toks = list(tokens(text))
    i = 2
    while i < len(toks) and toks[i][0] == "word" and text[toks[i][1]:toks[i][2]].upper() in ("IF", "EXISTS", "ONLY"):
        i += 1
    _, i = _name(toks, text, i)
    if i < len(toks) and text[toks[i][1]:toks[i][2]] == "*":
        i += 1
    parts, depth, current = [], 0, []
    for t in toks[i:]:
        depth += (t[0] == "(") - (t[0] == ")")
        if t[0] == "," and depth == 0:
            parts.append(current)
            current = []
        else:
            current.append(t)
    parts.append(current)
    return [_action(p, text) for p in parts]


def _action(toks: list, text: str) -> Action:
    def word(j):
        return text[toks[j][1]:toks[j][2]].upper() if j < len(toks) and toks[j][0] == "word" else None

    def tok(j):
        return toks[j][0] if j < len(toks) else None

    head = " ".join(w for w in (word(0), word(1), word(2)) if w)
    first = word(0)
    j = 1
    if first == "RENAME":
        if word(1) == "TO":
            return Action("other", text=head)  # the table itself: not followed
        if word(1) == "CONSTRAINT":
            return Action("keep", text=head)
        j += word(1) == "COLUMN"
        old, j = _name(toks, text, j)
        if word(j) != "TO":
            return Action("other", text=head)
        new, _ = _name(toks, text, j + 1)
        return Action("rename", old[0], new[0], head) if len(old) == 1 and len(new) == 1 else Action("other", text=head)
    if first == "ADD":
        if word(1) in _CONSTRAINTS and tok(1) != "quoted":
            return Action("keep", text=head)
        j += word(1) == "COLUMN"
        if word(j) == "IF":
            j += 3
        name, _ = _name(toks, text, j)
        return Action("add", name[0] if name else None, text=head)
    if first == "DROP":
        if word(1) == "CONSTRAINT":
            return Action("keep", text=head)
        j += word(1) == "COLUMN"
        if word(j) == "IF":
            j += 2
        name, _ = _name(toks, text, j)
        return Action("drop", name[0], text=head) if len(name) == 1 else Action("other", text=head)
    if first == "ALTER":
        if word(1) == "CONSTRAINT":
            return Action("keep", text=head)
        j += word(1) == "COLUMN"
        name, j = _name(toks, text, j)
        if len(name) != 1:
            return Action("other", text=head)
        if word(j) == "TYPE" or (word(j) == "SET" and word(j + 1) == "DATA" and word(j + 2) == "TYPE"):
            return Action("type", name[0], text=head)
        after = word(j + 1) if word(j) in ("SET", "DROP", "ADD") else word(j)
        if after in _COLUMN_KEEP or (word(j) == "SET" and tok(j + 1) == "("):
            return Action("keep", name[0], text=head)
        return Action("other", name[0], text=head)  # e.g. SET EXPRESSION, DROP EXPRESSION
    if first == "SET" and word(1) in _NOT_KEPT_SET:
        return Action("other", text=head)
    if first in _KEEP:
        return Action("keep", text=head)
    return Action("other", text=head)


# -- types a Delta column can widen to -------------------------------------------------------------------------

def widens(old: pa.DataType, new: pa.DataType) -> bool:
    """A Delta column of type `old` holds every value of `new` after a lossless cast (or the type stays)."""
    if old == new:
        return True
    if pa.types.is_integer(old) and pa.types.is_integer(new):
        return pa.types.is_signed_integer(old) == pa.types.is_signed_integer(new) and new.bit_width >= old.bit_width
    if pa.types.is_floating(old) and pa.types.is_floating(new):
        return new.bit_width >= old.bit_width
    if pa.types.is_decimal(old) and pa.types.is_decimal(new):
        return new.scale == old.scale and new.precision >= old.precision
    return False


def _float4_as_float8(text: str | None) -> str | None:
    """A real's text as PostgreSQL's real -> double precision cast gives it (1.1 -> 1.100000023841858)."""
    if text is None or text in ("NaN", "Infinity", "-Infinity"):
        return text
    return repr(float(np.float32(text)))


# -- the player's part ------------------------------------------------------------------------------------------

INDEX_TAGS = ("CREATE INDEX", "DROP INDEX", "ALTER INDEX")  # passed over in every mode: a lake has no indexes


class Unsupported(ValueError):
    """A statement a Delta table cannot follow; the text says why."""


class LakeDdl:
    """The statements of one play task (its mode is the workflow's options' at the task's start: a change of
    the options ends the task)."""

    def __init__(self, workflow: str, target: str, options: dict):
        self.workflow, self.target = workflow, target
        self.mode = modes.of(options)
        self.notes: list[str] = []  # statements exec-ignore passed over: the workflow's message
        # "schema.table" -> [(action, lsn)] the Delta table does not have yet: its rewrite at the batch's commit
        self.pending: dict[str, list[tuple[Action, int]]] = {}

    # -- a statement met ---------------------------------------------------------------------------------------
    def met(self, msg, commit_lsn: int, tables, batch, skipped) -> None:
        """`tables`: the player's _Tables; `batch`: its _Batch; `skipped(q)`: the transaction is one table q
        has already (its rows are passed over)."""
        try:
            ddl = parse(msg.content, msg.lsn)
        except BadDdlMessage as exc:
            raise SchemaStop(f"{exc}; or remove the capture (`sluicegate ddl remove`)") from None
        at = format_lsn(ddl.lsn)
        # A transaction older than a table's copy: the copy read the table in the statement's shape.
        moved = {q for q in _touched(ddl, tables.specs) if commit_lsn >= tables.copy_from.get(q, 0)}
        if not moved:
            log.debug("DDL at %s (%s) touches no table workflow %s moves: passed over", at, ddl.tag, self.workflow)
            return
        names = ", ".join(sorted(moved))
        if ddl.tag in INDEX_TAGS:
            log.info("on-ddl %s: passed over %s at %s on %s (a Delta table has no indexes)", self.mode, ddl.tag, at,
                     names)
            return
        # Held by the tables' rewrites already (run under exec before a kill, the mode changed since): followed.
        mode = modes.EXEC if all(ddl.lsn <= tables.markers.get(q, 0) for q in moved) else self.mode
        if mode == modes.IGNORE:
            log.info("on-ddl ignore: passed over %s at %s on %s", ddl.tag, at, names)
            return
        try:
            stmt = read(ddl.statement, ddl.tag)
        except NotReplayable as exc:
            stmt, unreadable = None, str(exc)
        if mode == modes.STOP:
            if stmt is not None and stmt.adds_columns_only:
                return  # added columns follow from the Relation messages, as without capture
            raise SchemaStop(
                f"a schema change of {names} at {at} (--on-ddl stop): {_quoted(ddl.statement)}; a Delta target "
                f"follows added, dropped and renamed columns and widened types under --on-ddl exec: "
                f"`sluicegate workflow set {self.workflow} --on-ddl exec --target {self.target}` (or ignore), then "
                f"`sluicegate workflow start {self.workflow} --target {self.target}`; or re-create the workflow")
        try:
            if stmt is None:
                raise Unsupported(f"it cannot be read as one statement ({unreadable})")
            plan = self._plan(ddl, stmt, moved, tables)
        except Unsupported as exc:
            self.failed(ddl.tag, at, names, ddl.statement, str(exc))
            return
        for q, (acts, retyped) in plan.items():
            self._apply(q, acts, retyped, ddl.lsn, tables, batch, skipped(q))
        log.info("on-ddl %s: %s at %s followed on %s", self.mode, ddl.tag, at, names)

    def _plan(self, ddl: DdlMessage, stmt, moved: set[str], tables) -> dict[str, tuple[list[Action], dict]]:
        """Each table's column actions and its retyped columns' new descriptions, checked against its
        description before any is applied."""
        if stmt.kind != "alter table":
            raise Unsupported(f"a Delta target follows ALTER TABLE's column changes only, not {ddl.tag}")
        if stmt.renames_table is not None:
            raise Unsupported("a Delta table keeps its name and place: a renamed table is not followed")
        acts = actions(stmt.text)
        other = [a.text for a in acts if a.kind == "other"]
        if other:
            raise Unsupported(f"{', '.join(other)} is not followed by a Delta table")
        plan = {}
        for q in sorted(moved):
            names = list(tables.specs[q].column_names)
            key = set(tables.specs[q].key)
            for a in acts:
                if a.kind == "rename":
                    if a.column not in names or a.new in names:
                        raise Unsupported(f"column {a.column} of {q} cannot be renamed to {a.new} as the stream "
                                          f"knows the table")
                    names[names.index(a.column)] = a.new
                    key = {a.new if k == a.column else k for k in key}
                elif a.kind == "drop":
                    if a.column not in names:
                        raise Unsupported(f"{q} has no column {a.column} as the stream knows the table")
                    if a.column in key:
                        raise Unsupported(f"column {a.column} is in the key the Delta table merges by")
                    names.remove(a.column)
                elif a.kind == "type" and a.column not in names:
                    raise Unsupported(f"{q} has no column {a.column} as the stream knows the table")
            typed = [a.column for a in acts if a.kind == "type"]
            plan[q] = acts, (_retyped(tables.src, tables.specs[q], typed) if typed else {})
        return plan

    def _apply(self, q: str, acts: list[Action], retyped: dict, lsn: int, tables, batch, skipped: bool) -> None:
        spec = tables.specs[q]
        for a in acts:
            effect = batch.effects.get(q)  # (a drop before replaces it)
            if a.kind == "rename":
                spec = _renamed(spec, a.column, a.new)
                fills = tables.fills.get(q)
                if fills and a.column in fills:
                    fills[a.new] = fills.pop(a.column)
                if effect is not None:
                    effect.table = spec
            elif a.kind == "drop":
                k = spec.column_names.index(a.column)
                spec = _dropped(spec, a.column)
                tables.fills.get(q, {}).pop(a.column, None)
                _reshape(batch, q, spec, lambda values, keep, k=k: (
                    values[:k] + values[k + 1:], frozenset(i - (i > k) for i in keep if i != k)))
        if retyped:
            was = {c.name: c for c in spec.columns}
            converts = {i: _float4_as_float8 for i, c in enumerate(spec.columns) if c.name in retyped and pa.types.is_float32(
                arrow_type(was[c.name], spec.type_tree)) and pa.types.is_float64(arrow_type(retyped[c.name]))}
            spec = replace(spec, columns=tuple(retyped.get(c.name, c) for c in spec.columns),
                           type_tree=_without(spec.type_tree, list(retyped)))
            if converts:
                _reshape(batch, q, spec, lambda values, keep: (tuple(
                    converts[i](v) if i in converts and i not in keep else v for i, v in enumerate(values)), keep))
            elif q in batch.effects:
                batch.effects[q].table = spec
        tables.specs[q] = batch.reshaped[q] = spec
        if not skipped and lsn > tables.markers.get(q, 0) and any(a.kind in ("rename", "drop", "type") for a in acts):
            self.pending.setdefault(q, []).extend((a, lsn) for a in acts if a.kind in ("rename", "drop", "type"))
            # the table commits with the batch (its rewrite) even when the batch has no rows of it
            batch.effects.setdefault(q, NetEffect(spec)).changes += 1

    def failed(self, tag: str, at: str, names: str, statement: str, why: str) -> None:
        where = f" at {at}" if at else ""
        if self.mode == modes.EXEC_IGNORE:
            note = f"on-ddl exec-ignore: passed over {tag}{where} on {names}: {why}"
            log.warning("%s; statement: %s", note, statement)
            self.notes.append(note)
            return
        raise SchemaStop(
            f"a schema change of {names}{where} (--on-ddl exec): {_quoted(statement)}; {why}. A Delta target "
            f"follows added, dropped and renamed columns and types its columns widen to; re-create the workflow "
            f"(`sluicegate workflow delete {self.workflow} --target {self.target} --drop-tables`, then create it "
            f"again) to copy the table in its new shape, or `sluicegate workflow set {self.workflow} --on-ddl "
            f"exec-ignore --target {self.target}` and `workflow start` to pass the statement over")

    # -- the batch's commit -----------------------------------------------------------------------------------------
    def rewrite_pending(self, q: str, tables) -> bool:
        """Table q rewritten in its new shape, if statements of this batch changed it: True if it was."""
        ops = self.pending.pop(q, None)
        if not ops:
            return False
        last = max(lsn for _, lsn in ops)
        done = rewrite(tables.dts[q], [a for a, _ in ops], tables.specs[q], tables.ddl_app, last)
        tables.markers[q] = last
        if done:
            log.info("Delta table of %s rewritten in its new shape (statements up to %s)", q, format_lsn(last))
        return done


def _retyped(src, spec: Table, names: list[str]) -> dict[str, Column]:
    """The new descriptions of columns an ALTER COLUMN TYPE changed, from the source's catalog; Unsupported
    when a Delta column cannot widen to its new type (or the source changed the column again since: the
    catalog is read now, the statement is older)."""
    oid = src.execute("SELECT to_regclass(%s)::oid::int", (spec.ident.as_string(src),)).fetchone()[0]
    now = source_columns(src, oid) if oid is not None else {}
    out = {}
    for name in names:
        was = next(c for c in spec.columns if c.name == name)
        col = now.get(name)
        if col is None:
            raise Unsupported(f"column {name} of {spec.qualified} is gone from the source since (changed again)")
        new = Column(name, col.type_sql, col.type_oid, was.not_null, col.collation, col.typmod)
        if (col.type_oid, col.typmod) == (was.type_oid, was.typmod):
            continue
        try:
            old_t, new_t = arrow_type(was, spec.type_tree), arrow_type(new, None)
        except Exception as exc:  # noqa: BLE001 - a type the lake does not map: said in the message
            raise Unsupported(f"column {name} changed type to {col.type_sql}: {exc}") from None
        if was.type_oid >= FIRST_USER_OID or col.type_oid >= FIRST_USER_OID or not widens(old_t, new_t):
            raise Unsupported(f"column {name} changed type from {was.type_sql} to {col.type_sql}, which its Delta "
                              f"column ({old_t}) cannot widen to (Delta widens integers, real to double "
                              f"precision, a decimal's precision)")
        out[name] = new
    return out


def _touched(ddl: DdlMessage, specs: dict) -> set[str]:
    """The moved tables ("schema.table") the statement names: those it changed, those it dropped."""
    moved = {(s.schema, s.name): q for q, s in specs.items()}
    return {moved[t] for t in touched(ddl, lambda s, n: (s, n) in moved)}


def _reshape(batch, q: str, spec: Table, fn) -> None:
    """The batch's rows of table q (in memory and staged) in the new shape `spec` (NetEffect.reshaped's
    `fn`). Staged generations are read back and staged again, one partition at a time (memory stays bounded
    by a partition)."""
    effect = batch.effects.get(q)
    if effect is None:
        return
    spill = batch.spills.get(q)
    if spill is not None and spill.generations > 0:
        again = staging.Spill(spill.dir.with_name(spill.dir.name + f".r{spill.generations}"))
        for part in spill.partitions(effect):
            again.write(part.reshaped(spec, fn))
        effect.clear()  # (its rows are staged again, with the rest)
        spill.discard()
        if again.dir.exists():
            again.dir.rename(spill.dir)
        again.dir = spill.dir
        batch.spills[q] = again
    batch.effects[q] = effect.reshaped(spec, fn)


def _renamed(spec: Table, old: str, new: str) -> Table:
    columns = tuple(replace(c, name=new) if c.name == old else c for c in spec.columns)
    tree = spec.type_tree
    if tree is not None:
        tree = dict(tree)
        tree["columns"] = [new if n == old else n for n in tree.get("columns", ())]
        if old in (tree.get("dims") or {}):
            tree["dims"] = {(new if k == old else k): v for k, v in tree["dims"].items()}
    return replace(spec, columns=columns, key=tuple(new if k == old else k for k in spec.key), type_tree=tree)


def _dropped(spec: Table, name: str) -> Table:
    return replace(spec, columns=tuple(c for c in spec.columns if c.name != name),
                   type_tree=_without(spec.type_tree, [name]))


def _without(tree: dict | None, names: list[str]) -> dict | None:
    """The type tree without these columns (a retyped column is a built-in type: it maps without one)."""
    if tree is None:
        return None
    tree = dict(tree)
    tree["columns"] = [n for n in tree.get("columns", ()) if n not in names]
    tree["dims"] = {k: v for k, v in (tree.get("dims") or {}).items() if k not in names}
    return tree


def rewrite(dt, ops: list[Action], spec: Table, app: str, lsn: int) -> bool:
    """The Delta table's rows rewritten in one commit: columns renamed and dropped as `ops` say (in order),
    types cast to `spec`'s, `_sg_special` entries following their columns; the commit carries app transaction
    (ddl_app_id, lsn). Streams the table batch by batch. False (no commit) when the table has that shape
    already."""
    from deltalake import CommitProperties, Transaction, write_deltalake

    current = pa.schema(dt.schema().to_arrow())
    wanted = {c.name: arrow_type(c, spec.type_tree) for c in spec.columns}
    names: dict[str, str | None] = {}
    for f in current:
        if f.name == SPECIAL:
            continue
        name = f.name
        for a in ops:
            if a.kind == "rename" and name == a.column:
                name = a.new
            elif a.kind == "drop" and name == a.column:
                name = None
        names[f.name] = name
    fields, sources = [], []
    for f in current:
        if f.name == SPECIAL or names[f.name] is None:
            continue
        new = names[f.name]
        fields.append(pa.field(new, wanted.get(new, f.type), nullable=f.nullable, metadata=f.metadata))
        sources.append(f.name)
    special = SPECIAL in current.names
    if special:
        fields.append(current.field(SPECIAL))
    if [f.name for f in fields] == current.names and all(f.type == current.field(i).type
                                                         for i, f in enumerate(fields)):
        return False
    schema = pa.schema(fields)
    columns = sources + ([SPECIAL] if special else [])
    # (pyarrow's own file system: delta-rs's would be called back inside write_deltalake's runtime)
    data = _dataset(dt)

    def batches():
        for b in data.to_batches(columns=columns):
            arrays = [b.column(s) if b.column(s).type == f.type else pc.cast(b.column(s), f.type)
                      for s, f in zip(sources, fields)]
            if special:
                arrays.append(_special(b.column(SPECIAL), names))
            yield pa.RecordBatch.from_arrays(arrays, schema=schema)

    write_deltalake(dt, pa.RecordBatchReader.from_batches(schema, batches()), mode="overwrite",
                    schema_mode="overwrite", commit_properties=CommitProperties(
                        app_transactions=[Transaction(app, lsn)]))
    dt.update_incremental()
    return True


def _special(column, names: dict[str, str | None]):
    """`_sg_special`'s entries under their columns' new names; a dropped column's left out."""
    out = []
    for m in column.to_pylist():
        if m is None:
            out.append(None)
            continue
        kept = [(names.get(k, k), v) for k, v in m if names.get(k, k) is not None]
        out.append(kept or None)
    return pa.array(out, column.type)


def _quoted(statement: str, limit: int = 300) -> str:
    one = " ".join(statement.split())
    return repr(one if len(one) <= limit else one[:limit] + "…")

"""Drizzle's filtered replicator: only some tables' statements, and without some columns, go on.

Options (from a spec, so lists are separated by ``;`` — ``,`` separates the spec's options)::

    filter:tables=public.orders;public.order_*,exclude_tables=public.order_audit,columns=public.users.ssn

- ``tables``: schema.table patterns to keep (a bare ``t`` means ``public.t``; shell globs via fnmatch, matched
  on schema and name separately, so ``*`` never crosses the dot). ``schemas``: whole schemas to keep. Given both,
  a table is kept when either keeps it; given neither, every table is kept.
- ``exclude_tables``: patterns dropped even when kept above.
- ``columns``: schema.table.column patterns (``t.c`` means ``public.t.c``) removed from the table header and from
  every record. A key column (replica identity) is never removed: the message is refused with an error naming it.

ROLLBACK and ROLLBACK_STATEMENT always pass. A TRUNCATE keeps the kept tables only (and goes when none is left);
a DDL statement passes, as it is, when it touches a kept table.
A message left without statements is dropped, unless it ends a transaction of which an earlier message went on
(the reader needs that end to close it).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from ..errors import UsageError
from . import model as m

SEPARATOR = ";"


def _patterns(text: str, option: str, parts: int) -> list[tuple[str, ...]]:
    """'public.a;b' -> [('public', 'a'), ('public', 'b')] for parts=2; a missing schema means public."""
    out = []
    for item in filter(None, (p.strip() for p in text.split(SEPARATOR))):
        pieces = item.split(".")
        if len(pieces) == parts - 1 and parts > 1:
            pieces = ["public", *pieces]
        if len(pieces) != parts or not all(pieces):
            shape = {1: "schema", 2: "schema.table or table", 3: "schema.table.column or table.column"}[parts]
            raise UsageError(f"filter {option}={text!r}: {item!r} is not {shape} (separate several with "
                             f"{SEPARATOR!r}: {option}=a{SEPARATOR}b)")
        out.append(tuple(pieces))
    return out


def _matches(patterns: list[tuple[str, ...]], names: tuple[str, ...]) -> bool:
    return any(all(fnmatchcase(n, p) for n, p in zip(names, pat)) for pat in patterns)


def _drop_columns(rec: m.Record, gone: set[int], renumber: dict[int, int]) -> None:
    kept = [v for i, v in enumerate(rec.values) if i not in gone]
    del rec.values[:]
    rec.values.extend(kept)
    for marks in (rec.nulls, rec.unchanged):
        if marks:
            kept = [renumber[i] for i in marks if i in renumber]
            del marks[:]
            marks.extend(kept)
    if rec.binary:
        kept = {renumber[i]: b for i, b in rec.binary.items() if i in renumber}
        rec.binary.clear()
        rec.binary.update(kept)


class FilterReplicator:
    def __init__(self, tables: str = "", schemas: str = "", exclude_tables: str = "", columns: str = ""):
        self.tables = _patterns(tables, "tables", 2)
        self.schemas = _patterns(schemas, "schemas", 1)
        self.exclude = _patterns(exclude_tables, "exclude_tables", 2)
        self.columns = _patterns(columns, "columns", 3)
        self._kept: dict[tuple[str, str], bool] = {}
        self._dropped_columns: dict[tuple[str, str, str], bool] = {}
        self._passed: set[tuple[str, int]] = set()  # open transactions with a message passed on

    def keeps(self, schema: str, name: str) -> bool:
        known = self._kept.get((schema, name))
        if known is None:
            wanted = (not self.tables and not self.schemas) or _matches(self.tables, (schema, name)) \
                or _matches(self.schemas, (schema,))
            known = self._kept[(schema, name)] = wanted and not _matches(self.exclude, (schema, name))
        return known

    def _drops(self, schema: str, table: str, column: str) -> bool:
        key = (schema, table, column)
        known = self._dropped_columns.get(key)
        if known is None:
            known = self._dropped_columns[key] = _matches(self.columns, key)
        return known

    def _untouched(self, st: m.Statement) -> bool:
        """The statement goes on exactly as it is."""
        if st.type in (m.ROLLBACK, m.ROLLBACK_STATEMENT):
            return True
        if st.type == m.TRUNCATE:
            return all(self.keeps(t.schema, t.name) for t in st.truncated)
        if st.type == m.DDL:
            return all(self.keeps(t.schema, t.name) for t in st.ddl.tables)
        h = st.table
        return self.keeps(h.schema, h.name) and not (
            self.columns and any(self._drops(h.schema, h.name, c.name) for c in h.columns))

    def replicate(self, txn: m.Transaction) -> m.Transaction | None:
        out = m.Transaction()
        if all(self._untouched(st) for st in txn.statements):  # the common case: one copy in the runtime
            out.CopyFrom(txn)
            return self._pass_or_drop(txn, out)
        out.context.CopyFrom(txn.context)
        out.segment_id, out.end_segment = txn.segment_id, txn.end_segment
        for st in txn.statements:
            if st.type in (m.ROLLBACK, m.ROLLBACK_STATEMENT):
                out.statements.append(st)
            elif st.type == m.TRUNCATE:
                kept = [t for t in st.truncated if self.keeps(t.schema, t.name)]
                if kept:
                    new = out.statements.add()
                    new.CopyFrom(st)
                    if len(kept) < len(st.truncated):
                        del new.truncated[:]
                        new.truncated.extend(kept)
            elif st.type == m.DDL:
                if any(self.keeps(t.schema, t.name) for t in st.ddl.tables):
                    out.statements.append(st)
            elif self.keeps(st.table.schema, st.table.name):
                self._copy_without_columns(st, out)
        return self._pass_or_drop(txn, out)

    def _copy_without_columns(self, st: m.Statement, out: m.Transaction) -> None:
        h = st.table
        drop = [i for i, c in enumerate(h.columns) if self.columns and self._drops(h.schema, h.name, c.name)]
        new = out.statements.add()
        new.CopyFrom(st)
        if not drop:
            return
        for i in drop:
            if h.columns[i].key:
                raise UsageError(f"filter columns=: {h.schema}.{h.name}.{h.columns[i].name} is a key column of "
                                 f"{h.schema}.{h.name} (its replica identity), which a reader needs to find the "
                                 f"row: key columns cannot be removed (take it out of columns=)")
        for i in reversed(drop):
            del new.table.columns[i]
        # Records are flat (values, and the indexes of NULL / unchanged / binary columns): renumber those.
        gone = set(drop)
        renumber = {old: new for new, old in enumerate(i for i in range(len(h.columns)) if i not in gone)}
        for row in new.rows:
            for rec in (getattr(row, side) for side in ("before", "after") if row.HasField(side)):
                _drop_columns(rec, gone, renumber)

    def _pass_or_drop(self, txn: m.Transaction, out: m.Transaction) -> m.Transaction | None:
        key = (txn.context.source_id, txn.context.transaction_id)
        if txn.end_segment:
            opened = key in self._passed
            self._passed.discard(key)
            return out if out.statements or opened else None
        if not out.statements:
            return None
        self._passed.add(key)
        return out

"""What a table looks like on the source, and making (or checking) its twin on the target."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import psycopg
from psycopg import sql

from ..errors import UsageError, did_you_mean
from ..names import quote_name
from . import types as pgtypes
from .types import FIRST_USER_OID, EnumType, Extension, UserType

# Built-in types whose binary COPY does not carry every value back: an empty tsquery is refused on input
# ("malformed tsquery: operand not found"), aclitem has no binary form. Tables with such a column (or an
# array of it) are copied in text form. (Every other built-in type was tried with its edge values.)
_TEXT_COPY_TYPES = frozenset((3615, 3645, 1033, 1034))


@dataclass(frozen=True)
class Column:
    name: str
    type_sql: str  # format_type(): 'numeric(12,2)', 'order_status[]'
    type_oid: int
    not_null: bool
    collation: str | None  # non-default collation name, or None
    typmod: int | None = None  # atttypmod (-1: none); None in descriptions made before it was kept


class Named:
    """What has a `schema` and a `name` (a table, a sequence): its display name, and its SQL identifier."""

    @property
    def qualified(self) -> str:
        """Display name and state key: 'public.Order Items'."""
        return f"{self.schema}.{self.name}"

    @property
    def ident(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.name)


@dataclass(frozen=True)
class Table(Named):
    schema: str
    name: str
    columns: tuple[Column, ...]
    key: tuple[str, ...]  # primary key, or the non-null unique key that is the replica identity; () if keyless
    enums: tuple[EnumType, ...] = ()
    estimated_rows: int = 0
    types: tuple[UserType, ...] = ()  # composites, domains, ranges the columns use, dependencies first
    extensions: tuple[Extension, ...] = ()  # extensions whose types the columns use
    existing_types: tuple[tuple[str, str, str], ...] = ()  # user types the target must have already
    inherited: bool = False  # a plain table with inheritance children, which are tables of their own
    # No usable key, REPLICA IDENTITY FULL: rows are identified by their whole value (duplicates allowed).
    keyless: bool = False
    # describe_types(): the columns' types' structure (composites' attributes, array elements, ...) for
    # targets that map types without a database (Delta); None in descriptions made before it was kept
    type_tree: dict | None = field(default=None, hash=False, compare=False)

    @property
    def scan(self) -> sql.Composable:
        """The table in a FROM that reads its rows: an inheritance parent's own rows only (its children
        move as tables of their own, and its publication sends their changes under their names)."""
        return sql.SQL("ONLY {}").format(self.ident) if self.inherited else self.ident

    @cached_property  # read per row on the hot path
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @cached_property  # read per row on the hot path
    def key_indices(self) -> tuple[int, ...]:
        names = self.column_names
        return tuple(names.index(k) for k in self.key)

    @cached_property  # read per row on the hot path
    def binary_copy_safe(self) -> bool:
        """Binary COPY embeds type OIDs in arrays and composites, and user types' OIDs differ between servers
        (extension types' binary forms between versions too). Some built-in types do not round-trip either."""
        return all(c.type_oid < FIRST_USER_OID and c.type_oid not in _TEXT_COPY_TYPES for c in self.columns)

    @property
    def type_needs(self) -> pgtypes.TypeNeeds:
        return pgtypes.TypeNeeds(self.enums, self.types, self.extensions, self.existing_types)

    def to_json(self) -> dict:
        return {
            "schema": self.schema, "name": self.name, "key": list(self.key),
            "estimated_rows": self.estimated_rows, "inherited": self.inherited,
            "columns": [[c.name, c.type_sql, c.type_oid, c.not_null, c.collation, c.typmod]
                        for c in self.columns],
            "enums": [[e.schema, e.name, list(e.labels)] for e in self.enums],
            "types": [t.to_json() for t in self.types],
            "extensions": [[e.name, e.schema] for e in self.extensions],
            "existing_types": [list(t) for t in self.existing_types],
            "keyless": self.keyless,
            **({"type_tree": self.type_tree} if self.type_tree is not None else {}),
        }

    @classmethod
    def from_json(cls, d: dict) -> Table:
        return cls(
            schema=d["schema"], name=d["name"], key=tuple(d["key"]),
            estimated_rows=d.get("estimated_rows", 0), inherited=d.get("inherited", False),
            columns=tuple(Column(*c) for c in d["columns"]),
            enums=tuple(EnumType(s, n, tuple(labels)) for s, n, labels in d.get("enums", [])),
            types=tuple(UserType.from_json(t) for t in d.get("types", [])),
            extensions=tuple(Extension(*e) for e in d.get("extensions", [])),
            existing_types=tuple(tuple(t) for t in d.get("existing_types", [])),
            keyless=d.get("keyless", False),  # descriptions stored before keyless tables have a key
            type_tree=d.get("type_tree"),
        )


def split_name(name: str) -> tuple[str | None, str]:
    """A table name as a user writes it -> (schema or None, name). SQL's quoting works
    ('"Sales Dept"."Order Items"', 'sales."a.b"', '"x""y"'); unquoted parts are taken as written, not folded
    to lower case ('Sales Dept.Order Items', 'public.Orders'), as names were matched before quoting was read."""
    name = name.strip()
    if '"' not in name:
        if "." in name:
            schema, _, rel = name.partition(".")
            return schema.strip(), rel.strip()
        return None, name
    parts, i = [], 0
    while i <= len(name):
        if name.startswith('"', i):
            j, buf = i + 1, []
            while True:
                k = name.find('"', j)
                if k < 0:
                    raise UsageError(f"table name {name!r} has an unclosed double quote")
                buf.append(name[j:k])
                if name.startswith('"', k + 1):  # "" inside quotes is one "
                    buf.append('"')
                    j = k + 2
                    continue
                break
            parts.append("".join(buf))
            i = k + 1
            if i < len(name) and name[i] != ".":
                raise UsageError(f"table name {name!r}: expected '.' after {parts[-1]!r}")
        else:
            k = name.find(".", i)
            k = len(name) if k < 0 else k
            part = name[i:k].strip()
            if '"' in part:
                raise UsageError(f"table name {name!r}: a quote inside an unquoted part")
            parts.append(part)
            i = k
        i += 1
    if len(parts) > 2 or not all(parts):
        raise UsageError(f"table name {name!r}: write TABLE or SCHEMA.TABLE (quoted as SQL quotes names)")
    return (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])


def split_list(text: str) -> list[str]:
    """'a, "b,c".d' -> ['a', '"b,c".d']: a comma-separated list of names, commas inside double quotes kept."""
    items, buf, quoted = [], [], False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            items.append("".join(buf).strip())
            buf = []
        else:
            buf.append(ch)
    items.append("".join(buf).strip())
    return [i for i in items if i]


def with_schemas(tables: list[str] | None, schemas: list[str] | None) -> list[str] | None:
    """--tables and --schemas as one list of names for resolve_tables: a schema as `SCHEMA.*`."""
    if not schemas:
        return tables
    return [*(tables or []), *(f"{s}.*" for s in schemas)]


def list_tables(conn: psycopg.Connection) -> list[tuple[str, str]]:
    return conn.execute(
        """SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
             AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'sluicegate')
             AND n.nspname NOT LIKE 'pg\\_%'
           ORDER BY 1, 2"""
    ).fetchall()


def resolve_tables(conn: psycopg.Connection, names: list[str] | None) -> list[Table]:
    """The source tables a workflow moves: the named ones, or every table of schema public. A name
    `SCHEMA.*` stands for every table of that schema (--schemas)."""
    existing = list_tables(conn)
    if not names:
        chosen = [t for t in existing if t[0] == "public"]
        if not chosen:
            raise UsageError("source has no tables in schema public: name them with --tables, or their "
                             "schemas with --schemas")
    else:
        chosen = []
        for raw in names:
            if raw.strip().endswith(".*"):
                schema = split_name(raw.strip()[:-2] + ".x")[0]
                found = [t for t in existing if t[0] == schema]
                if not found:
                    schemas = sorted({s for s, _ in existing})
                    raise UsageError(f"source schema {schema!r} has no tables{did_you_mean(schema, schemas)}")
            else:
                found = [_resolve_or_explain(conn, existing, raw)]
            chosen.extend(t for t in found if t not in chosen)
    return [describe_table(conn, s, n) for s, n in chosen]


def _resolve_or_explain(conn: psycopg.Connection, existing: list[tuple[str, str]], raw: str) -> tuple[str, str]:
    """resolve_name, and where the name is a partition, a view or the like, the reason it cannot be moved."""
    try:
        return resolve_name(existing, raw)
    except UsageError:
        schema, rel = split_name(raw)
        row = conn.execute(
            """SELECT n.nspname, c.relkind, c.relispartition,
                      (SELECT format('%%I.%%I', pn.nspname, p.relname) FROM pg_partition_root(c.oid) r(oid)
                       JOIN pg_class p ON p.oid = r.oid JOIN pg_namespace pn ON pn.oid = p.relnamespace)
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
               WHERE c.relname = %s AND (%s::text IS NULL OR n.nspname = %s)
               ORDER BY n.nspname <> 'public' LIMIT 1""", (rel, schema, schema)).fetchone()
        if row is None:
            raise
        nsp, kind, is_partition, root = row
        what = quote_name(nsp, rel)
        if is_partition:
            raise UsageError(f"table {what} is a partition of {root}: move {root} (all its partitions move "
                             f"with it, as one table)") from None
        kinds = {"v": "a view", "m": "a materialized view", "f": "a foreign table", "S": "a sequence",
                 "i": "an index", "I": "an index", "c": "a composite type", "t": "a TOAST table"}
        if kind in kinds:
            raise UsageError(f"{what} is {kinds[kind]}, not a table: logical replication moves tables only")
        raise


def exclude_tables(tables: list[Table], names: list[str] | None) -> list[Table]:
    """`tables` without the ones `names` lists (--exclude-tables), each of which must be among them."""
    if not names:
        return tables
    existing = [(t.schema, t.name) for t in tables]
    dropped = set()
    for raw in names:
        try:
            dropped.add(resolve_name(existing, raw.strip()))
        except UsageError:
            candidates = [n for _, n in existing] + [f"{s}.{n}" for s, n in existing]
            raise UsageError(f"--exclude-tables names {raw.strip()!r}, which is not among the tables this workflow "
                             f"moves{did_you_mean(raw.strip(), candidates, cutoff=0.5)}") from None
    left = [t for t in tables if (t.schema, t.name) not in dropped]
    if not left:
        raise UsageError("--exclude-tables leaves no table to move")
    return left


def resolve_name(existing: list[tuple[str, str]], raw: str) -> tuple[str, str]:
    """A table name as a user wrote it ('t', 'sales.t') -> (schema, name) among `existing`; a bare name
    prefers schema public; unknown or ambiguous -> an error with the closest names."""
    schema, rel = split_name(raw)
    hits = [t for t in existing if t[1] == rel and (schema is None or t[0] == schema)]
    if schema is None and len(hits) > 1:
        hits = [t for t in hits if t[0] == "public"] or hits
    if len(hits) != 1:
        candidates = [n for _, n in existing] + [f"{s}.{n}" for s, n in existing]
        raise UsageError(f"unknown source table {raw!r}{did_you_mean(raw, candidates, cutoff=0.5)}")
    return hits[0]


def describe_table(conn: psycopg.Connection, schema: str, name: str) -> Table:
    oid, replident, reltuples, persistence, kind, children = conn.execute(
        """SELECT c.oid, c.relreplident, c.reltuples::bigint, c.relpersistence, c.relkind,
                  EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhparent = c.oid)
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s""",
        (schema, name),
    ).fetchone()
    if persistence != "p":
        # Neither is written to the WAL, so logical decoding never sees their changes.
        what = "UNLOGGED" if persistence == "u" else "TEMPORARY"
        fix = (f"ALTER TABLE {quote_name(schema, name)} SET LOGGED, or leave it out with --exclude-tables"
               if persistence == "u" else "leave it out with --exclude-tables")
        raise UsageError(f"table {quote_name(schema, name)} is {what}: its changes are not in the WAL, so no "
                         f"logical replication can carry them: {fix}")
    cols = conn.execute(
        """SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.atttypid::int, a.attnotnull,
                  CASE WHEN a.attcollation <> 0 AND a.attcollation <> t.typcollation
                       THEN co.collname END, a.atttypmod
           FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
           LEFT JOIN pg_collation co ON co.oid = a.attcollation
           WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
           ORDER BY a.attnum""",
        (oid,),
    ).fetchall()
    columns = tuple(Column(*c) for c in cols)
    key = _find_key(conn, oid, replident, schema, name)
    needs = pgtypes.discover(conn, [c.type_oid for c in columns])
    if reltuples < 0:  # never analyzed: count, so progress has a total
        reltuples = conn.execute(sql.SQL("SELECT count(*) FROM {}{}").format(
            sql.SQL("ONLY " if kind == "r" else ""), sql.Identifier(schema, name))).fetchone()[0]
    return Table(schema, name, columns, key, needs.enums, int(reltuples), needs.types, needs.extensions,
                 needs.existing, inherited=kind == "r" and children, keyless=not key,
                 type_tree=describe_types(conn, oid))


def _find_key(conn, oid: int, replident: str, schema: str, name: str) -> tuple[str, ...]:
    qualified = f"{schema}.{name}"
    idx = conn.execute(
        """SELECT i.indisprimary, i.indisreplident, ci.relname,
                  array_agg(a.attname ORDER BY k.ord), bool_and(a.attnotnull)
           FROM pg_index i JOIN pg_class ci ON ci.oid = i.indexrelid
           CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
           JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
           WHERE k.ord <= i.indnkeyatts  -- INCLUDE columns are stored in the index, not part of its key
             AND i.indrelid = %s AND i.indisunique AND i.indpred IS NULL AND i.indexprs IS NULL
             AND i.indisvalid
           GROUP BY i.indexrelid, i.indisprimary, i.indisreplident, ci.relname
           ORDER BY i.indisprimary DESC, i.indisreplident DESC, ci.relname""",
        (oid,),
    ).fetchall()
    usable = [r for r in idx if r[4]]
    if replident == "n":
        fix = "DEFAULT" if usable else "FULL"  # DEFAULT identifies rows only by a primary key
        raise UsageError(
            f"table {qualified} has REPLICA IDENTITY NOTHING, so its updates and deletes are not replicated: "
            f"{_alter(conn, schema, name, 'REPLICA IDENTITY ' + fix)}"
        )
    for primary, is_replident, _, columns, not_null in idx:
        if primary and replident in ("d", "f") or (is_replident and not_null):
            return tuple(columns)
    if usable and replident == "f":  # the old row carries every column, this key among them
        return tuple(usable[0][3])
    if usable:
        index = usable[0][2]
        raise UsageError(
            f"table {qualified} has no primary key; its unique key {index} can identify rows once it is the "
            f"replica identity: {_alter(conn, schema, name, 'REPLICA IDENTITY USING INDEX %I', index)}"
        )
    if replident == "f":  # every change carries the whole old row: rows are matched by their value
        return ()
    raise UsageError(
        f"table {qualified} has no primary key or non-null unique key, so its updates and deletes do not say "
        f"which row they change: {_alter(conn, schema, name, 'REPLICA IDENTITY FULL')} on the source "
        f"(or add a primary key, or leave the table out with --tables)"
    )


def _alter(conn, schema: str, name: str, what: str, *args: str) -> str:
    """`ALTER TABLE schema.name <what>` as a person would type it: format('%I') quotes only the names that need
    it. `what` may hold more %I, filled from `args`."""
    template = "ALTER TABLE %I.%I " + what
    params = sql.SQL(", ").join(sql.Literal(a) for a in (template, schema, name, *args))
    return conn.execute(sql.SQL("SELECT format({})").format(params)).fetchone()[0]


def refuse_keyless(tables, why: str) -> None:
    """A create-time refusal for what cannot take a table without a key (REPLICA IDENTITY FULL) yet."""
    for t in tables:
        if t.keyless:
            raise UsageError(f"table {t.qualified} has no primary key (REPLICA IDENTITY FULL): {why}")


def describe_types(conn: psycopg.Connection, oid: int) -> dict:
    """The structure of table `oid`'s column types, followed down to base types, as JSON:
    {"oids": {oid: type}, "dims": {column: declared array dimensions, when over 1}, "columns": [names]}, a type
    being {"kind": typtype, "name", "schema"} and, as it applies, "elem" and "delim" (arrays), "base" and
    "basemod" (domains), "attrs": [[name, oid, typmod, ndims]] (composites), "sub" (ranges), "range"
    (multiranges)."""
    described = conn.execute(
        """SELECT attname, atttypid::int, attndims FROM pg_attribute
           WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped AND attgenerated = '' ORDER BY attnum""",
        (oid,)).fetchall()
    dims = {name: n for name, _, n in described if n > 1}
    todo = {r[1] for r in described}
    oids: dict[str, dict] = {}
    while todo:
        rows = conn.execute(
            """SELECT t.oid::int, t.typtype, t.typname, n.nspname,
                      CASE WHEN t.typcategory = 'A' THEN t.typelem::int END, t.typdelim,
                      t.typbasetype::int, t.typtypmod, r.rngsubtype::int, mr.rngtypid::int,
                      (SELECT json_agg(json_build_array(a.attname, a.atttypid::int, a.atttypmod, a.attndims)
                                       ORDER BY a.attnum)
                       FROM pg_attribute a WHERE a.attrelid = t.typrelid AND a.attnum > 0 AND NOT a.attisdropped)
               FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
               LEFT JOIN pg_range r ON r.rngtypid = t.oid LEFT JOIN pg_range mr ON mr.rngmultitypid = t.oid
               WHERE t.oid = ANY(%s)""", (sorted(todo),)).fetchall()
        todo = set()
        for toid, kind, name, schema, elem, delim, base, basemod, sub, rng, attrs in rows:
            desc = {"kind": kind, "name": name, "schema": schema}
            if elem:
                desc.update(elem=elem, delim=delim)
            if kind == "d":
                desc.update(base=base, basemod=basemod)
            if kind == "c":
                desc["attrs"] = attrs or []
            if sub:
                desc["sub"] = sub
            if rng:
                desc["range"] = rng
            oids[str(toid)] = desc
            todo |= {o for o in (elem, base if kind == "d" else None, sub, rng) if o}
            todo |= {a[1] for a in attrs or []} if kind == "c" else set()
        todo -= {int(o) for o in oids}
    return {"oids": oids, "dims": dims, "columns": [r[0] for r in described]}


def prepare_target(conn: psycopg.Connection, table: Table, definition=None) -> bool:
    """Create the target table (and the extensions, enums, composite types and domains its columns use) if
    missing, else check it can take the rows. True if created. `definition`: the source table's
    TableDefinition (table_definition.py), made in full; without it, only columns, types, collations,
    NOT NULL and the key."""
    pgtypes.ensure(conn, table.type_needs, _ensure_enum)
    row = conn.execute(
        """SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')""",
        (table.schema, table.name),
    ).fetchone()
    if row is None:
        if definition is not None:
            definition.create(conn)
            return True
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(table.schema)))
        conn.execute(create_table_sql(table))
        return True
    check_target_table(conn, table, row[0])
    return False


def create_table_sql(table: Table) -> sql.Composed:
    defs = []
    for c in table.columns:
        parts = [sql.Identifier(c.name), sql.SQL(c.type_sql)]  # format_type() output is valid, quoted SQL
        if c.collation:
            parts.append(sql.SQL("COLLATE {}").format(sql.Identifier(c.collation)))
        if c.not_null:
            parts.append(sql.SQL("NOT NULL"))
        defs.append(sql.SQL(" ").join(parts))
    if table.key:
        defs.append(sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(map(sql.Identifier, table.key))))
    return sql.SQL("CREATE TABLE {} ({})").format(table.ident, sql.SQL(", ").join(defs))


def check_target_table(conn: psycopg.Connection, table: Table, oid: int) -> None:
    rows = conn.execute(
        """SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull, a.atthasdef
           FROM pg_attribute a WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped""",
        (oid,),
    ).fetchall()
    target = {r[0]: r for r in rows}
    for c in table.columns:
        if c.name not in target:
            raise UsageError(
                f"target table {table.qualified} has no column {c.name!r} ({c.type_sql}) that the source has: "
                f"add it, or drop the target table and let Sluicegate create it"
            )
        if target[c.name][1] != c.type_sql:
            raise UsageError(
                f"target table {table.qualified} column {c.name!r} is {target[c.name][1]}, the source's is "
                f"{c.type_sql}: make the types equal, or drop the target table and let Sluicegate create it"
            )
    source_names = set(table.column_names)
    for name, _, not_null, has_default in rows:
        if name not in source_names and not_null and not has_default:
            raise UsageError(
                f"target table {table.qualified} has a NOT NULL column {name!r} without default that the "
                f"source lacks: give it a default or make it nullable"
            )


def _ensure_enum(conn: psycopg.Connection, enum: EnumType) -> None:
    row = conn.execute(
        """SELECT array_agg(e.enumlabel ORDER BY e.enumsortorder) FROM pg_type t
           JOIN pg_namespace n ON n.oid = t.typnamespace LEFT JOIN pg_enum e ON e.enumtypid = t.oid
           WHERE n.nspname = %s AND t.typname = %s GROUP BY t.oid""",
        (enum.schema, enum.name),
    ).fetchone()
    if row is None:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(enum.schema)))
        conn.execute(
            sql.SQL("CREATE TYPE {} AS ENUM ({})").format(
                sql.Identifier(enum.schema, enum.name), sql.SQL(", ").join(map(sql.Literal, enum.labels))
            )
        )
    elif tuple(row[0] or ()) [: len(enum.labels)] != enum.labels:
        raise UsageError(
            f"target type {enum.schema}.{enum.name} has labels {list(row[0] or [])}, the source's are "
            f"{list(enum.labels)}: make them equal"
        )

"""The user types a table's columns use: found on the source, made (or checked) on the target.

A column's type is walked down to built-in types: arrays to their element, domains to their base, composites
to their attributes, multiranges to their range, ranges to their subtype. On the way:
- a type that belongs to an extension (pg_depend deptype 'e') needs that extension on the target, in the
  schema it has on the source (the type names the target table is made with carry that schema);
- enums, composite types, domains and range types are made on the target when it lacks them, dependencies
  first (a multirange comes with its range);
- any other user type (a range with a canonical function, a base type written in C, a table's row type)
  must already exist on the target.
Rows of every one of them move by their text form (Table.binary_copy_safe), so nothing here knows a value.

Everything is read with search_path = pg_catalog, so format_type() and pg_get_constraintdef() name user types
with their schema and run unchanged on the target.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..errors import UsageError

FIRST_USER_OID = 16384  # OIDs below this are built in, and equal on every server


@dataclass(frozen=True)
class EnumType:
    schema: str
    name: str
    labels: tuple[str, ...]


@dataclass(frozen=True)
class UserType:
    """A composite type (kind 'c'), a domain ('d') or a range type ('r') Sluicegate can make on the target."""

    kind: str
    schema: str
    name: str
    # composite: (attribute, type as format_type() gives it, (collation schema, name) or None)
    attributes: tuple[tuple[str, str, tuple[str, str] | None], ...] = ()
    base: str | None = None  # domain: its base type; range: its subtype (format_type())
    collation: tuple[str, str] | None = None  # domain: a collation other than its base type's; range: its own
    not_null: bool = False
    default: str | None = None  # domain: pg_get_expr of its default
    checks: tuple[tuple[str, str], ...] = ()  # domain: (name, pg_get_constraintdef)
    # range: its subtype's operator class when not the default, its subtype_diff function, its multirange
    opclass: tuple[str, str] | None = None
    subtype_diff: str | None = None
    multirange: str | None = None

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"

    def to_json(self) -> list:
        return [self.kind, self.schema, self.name, [[a, t, list(c) if c else None] for a, t, c in self.attributes],
                self.base, list(self.collation) if self.collation else None, self.not_null, self.default,
                [list(c) for c in self.checks], list(self.opclass) if self.opclass else None, self.subtype_diff,
                self.multirange]

    @classmethod
    def from_json(cls, d: list) -> UserType:
        kind, schema, name, attributes, base, collation, not_null, default, checks = d[:9]
        opclass, subtype_diff, multirange = (list(d[9:]) + [None, None, None])[:3]
        return cls(kind, schema, name, tuple((a, t, tuple(c) if c else None) for a, t, c in attributes), base,
                   tuple(collation) if collation else None, not_null, default, tuple(tuple(c) for c in checks),
                   tuple(opclass) if opclass else None, subtype_diff, multirange)


@dataclass(frozen=True)
class Extension:
    name: str
    schema: str  # the schema its objects are in on the source


@dataclass(frozen=True)
class TypeNeeds:
    """What a set of columns needs on the target, each in the order it is to be made."""

    enums: tuple[EnumType, ...] = ()
    types: tuple[UserType, ...] = ()  # composites, domains and ranges, dependencies first
    extensions: tuple[Extension, ...] = ()
    existing: tuple[tuple[str, str, str], ...] = ()  # (schema, name, what it is): the target must have these


_TYPE = """
SELECT t.typtype, n.nspname, t.typname, t.typelem, t.typlen, t.typbasetype,
       format_type(t.typbasetype, t.typtypmod), t.typnotnull, pg_get_expr(t.typdefaultbin, 0), t.typrelid,
       (SELECT c.relkind FROM pg_class c WHERE c.oid = t.typrelid),
       (SELECT ARRAY[e.extname::text, en.nspname::text] FROM pg_depend d
          JOIN pg_extension e ON e.oid = d.refobjid JOIN pg_namespace en ON en.oid = e.extnamespace
         WHERE d.classid = 'pg_type'::regclass AND d.objid = t.oid AND d.refclassid = 'pg_extension'::regclass
           AND d.deptype = 'e'),
       CASE WHEN t.typtype = 'd' AND t.typcollation <> 0 AND t.typcollation <> b.typcollation
            THEN ARRAY[cn.nspname::text, co.collname::text] END,
       (SELECT r.rngsubtype FROM pg_range r WHERE r.rngtypid = t.oid),
       (SELECT r.rngtypid FROM pg_range r WHERE r.rngmultitypid = t.oid)
FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
LEFT JOIN pg_type b ON b.oid = t.typbasetype
LEFT JOIN pg_collation co ON co.oid = t.typcollation LEFT JOIN pg_namespace cn ON cn.oid = co.collnamespace
WHERE t.oid = %s"""

_ATTRIBUTES = """
SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.atttypid,
       CASE WHEN a.attcollation <> 0 AND a.attcollation <> t.typcollation
            THEN ARRAY[cn.nspname::text, co.collname::text] END
FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_collation co ON co.oid = a.attcollation LEFT JOIN pg_namespace cn ON cn.oid = co.collnamespace
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum"""


def discover(conn: psycopg.Connection, type_oids) -> TypeNeeds:
    """The user types, extensions and enums that columns of these types need (autocommit or not: reads in a
    transaction of its own, or a savepoint of the caller's)."""
    type_oids = list(type_oids)
    if all(oid < FIRST_USER_OID for oid in type_oids):
        return TypeNeeds()  # built-in types only (most tables): no catalog walk, no savepoint
    walk = _Walk(conn)
    with catalog_names(conn):
        for oid in type_oids:
            walk.visit(oid)
    return TypeNeeds(tuple(walk.enums), tuple(walk.types), tuple(walk.extensions), tuple(walk.existing))


@contextmanager
def catalog_names(conn: psycopg.Connection):
    """search_path = pg_catalog within the block (format_type() then names every user type with its schema),
    the caller's again after it: a SET LOCAL in a savepoint would last until the caller's transaction ends."""
    with conn.transaction():
        before = conn.execute("SELECT current_setting('search_path')").fetchone()[0]
        conn.execute("SET LOCAL search_path = pg_catalog")
        yield
        conn.execute("SELECT set_config('search_path', %s, true)", (before,))


class _Walk:
    def __init__(self, conn: psycopg.Connection):
        self.conn = conn
        self.seen: set[int] = set()
        self.enums: list[EnumType] = []
        self.types: list[UserType] = []
        self.extensions: list[Extension] = []
        self.existing: list[tuple[str, str, str]] = []

    def visit(self, oid: int) -> None:
        if oid < FIRST_USER_OID or oid in self.seen:
            return
        self.seen.add(oid)
        (kind, schema, name, elem, length, base, base_sql, not_null, default, relid, relkind, extension,
         collation, subtype, range_of) = self.conn.execute(_TYPE, (oid,)).fetchone()
        if extension is not None:
            ext = Extension(*extension)
            if ext not in self.extensions:
                self.extensions.append(ext)
        elif elem and length == -1 and kind == "b":  # an array: its element is what matters
            self.visit(elem)
        elif kind == "e":
            labels = self.conn.execute("SELECT array_agg(enumlabel ORDER BY enumsortorder) FROM pg_enum "
                                       "WHERE enumtypid = %s", (oid,)).fetchone()[0]
            self.enums.append(EnumType(schema, name, tuple(labels or ())))
        elif kind == "d":
            self.visit(base)
            checks = self.conn.execute(
                "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint WHERE contypid = %s AND contype = 'c' "
                "ORDER BY conname", (oid,)).fetchall()
            self.types.append(UserType("d", schema, name, base=base_sql, not_null=not_null, default=default,
                                       collation=tuple(collation) if collation else None,
                                       checks=tuple(checks)))
        elif kind == "c" and relkind == "c":
            attributes = []
            for attname, type_sql, type_oid, coll in self.conn.execute(_ATTRIBUTES, (relid,)).fetchall():
                self.visit(type_oid)
                attributes.append((attname, type_sql, tuple(coll) if coll else None))
            self.types.append(UserType("c", schema, name, tuple(attributes)))
        elif kind == "r" and self._range(oid, schema, name, subtype):
            pass
        elif kind == "m" and range_of:
            self.visit(range_of)  # made with its range, or there already as the range must be
        else:
            what = {"c": "the row type of a table", "r": "a range type with a canonical function"}.get(kind, "a type")
            self.existing.append((schema, name, what))

    def _range(self, oid: int, schema: str, name: str, subtype: int) -> bool:
        """A range type, as Sluicegate can make it (no canonical function, which would have to be written in C
        or made around a shell type first); False when it cannot."""
        (canonical, subtype_sql, collation, opclass, default_opclass, diff, multirange) = self.conn.execute(
            """SELECT r.rngcanonical <> 0, format_type(r.rngsubtype, NULL),
                      CASE WHEN r.rngcollation <> 0 AND r.rngcollation <> st.typcollation
                           THEN ARRAY[cn.nspname::text, co.collname::text] END,
                      ARRAY[ocn.nspname::text, oc.opcname::text], oc.opcdefault,
                      CASE WHEN r.rngsubdiff <> 0 THEN r.rngsubdiff::regproc::text END, mt.typname
               FROM pg_range r JOIN pg_type st ON st.oid = r.rngsubtype
               JOIN pg_opclass oc ON oc.oid = r.rngsubopc JOIN pg_namespace ocn ON ocn.oid = oc.opcnamespace
               LEFT JOIN pg_collation co ON co.oid = r.rngcollation
               LEFT JOIN pg_namespace cn ON cn.oid = co.collnamespace
               LEFT JOIN pg_type mt ON mt.oid = r.rngmultitypid
               WHERE r.rngtypid = %s""", (oid,)).fetchone()
        if canonical:
            return False
        self.visit(subtype)
        self.types.append(UserType("r", schema, name, base=subtype_sql,
                                   collation=tuple(collation) if collation else None,
                                   opclass=None if default_opclass else tuple(opclass), subtype_diff=diff,
                                   multirange=multirange))
        return True


# -- the target -------------------------------------------------------------------------------------------
def extension_step(ext: Extension, installed_in: str | None, available: bool, target: str) -> bool:
    """Whether the target must CREATE EXTENSION `ext` (True), or already has it (False); refuses when it
    cannot have it as the source does. `installed_in`: the schema it is in on the target, None if absent;
    `available`: the target server can install it (pg_available_extensions); `target`: for messages."""
    if installed_in is None:
        if not available:
            raise UsageError(
                f"extension {ext.name} is not available on target {target}, and column types need it: install "
                f"the package that provides {ext.name} on the target server, then create the workflow again")
        return True
    if installed_in != ext.schema:
        raise UsageError(
            f"extension {ext.name} is in schema {installed_in} on target {target}, in {ext.schema} on the "
            f"source, and column types name that schema: ALTER EXTENSION {ext.name} SET SCHEMA {ext.schema} on "
            f"the target (or move it on the source)")
    return False


def ensure(conn: psycopg.Connection, needs: TypeNeeds, ensure_enum) -> None:
    """Make on the target what `needs` lists and it lacks, in the caller's transaction; refuse with one line
    what cannot be made or differs. `ensure_enum`: catalog's (enums are made as before)."""
    target = f"{conn.info.dbname} on {conn.info.host}:{conn.info.port}"
    for ext in needs.extensions:
        row = conn.execute(
            """SELECT (SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
                       WHERE e.extname = %s),
                      EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = %s)""",
            (ext.name, ext.name)).fetchone()
        if extension_step(ext, row[0], row[1], target):
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(ext.schema)))
            # CASCADE: what the extension requires (postgis_topology needs postgis) comes with it
            conn.execute(sql.SQL("CREATE EXTENSION IF NOT EXISTS {} SCHEMA {} CASCADE").format(
                sql.Identifier(ext.name), sql.Identifier(ext.schema)))
    for enum in needs.enums:
        ensure_enum(conn, enum)
    if needs.types:
        with catalog_names(conn):  # the target's own names for types, qualified as the source's are
            for t in needs.types:
                _ensure_type(conn, t)
    for schema, name, what in needs.existing:
        if _find(conn, schema, name) is None:
            raise UsageError(f"type {schema}.{name} ({what}) is missing on target {target}, and Sluicegate does "
                             f"not make it: create it on the target as it is on the source")


def _find(conn: psycopg.Connection, schema: str, name: str) -> tuple | None:
    return conn.execute(
        """SELECT t.typtype, t.typrelid, COALESCE(format_type(r.rngsubtype, NULL), format_type(t.typbasetype, t.typtypmod))
           FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace LEFT JOIN pg_range r ON r.rngtypid = t.oid
           WHERE n.nspname = %s AND t.typname = %s""",
        (schema, name)).fetchone()


def _ensure_type(conn: psycopg.Connection, t: UserType) -> None:
    found = _find(conn, t.schema, t.name)
    if found is None:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(t.schema)))
        conn.execute(create_type_sql(t))
        return
    kind, relid, base = found
    if kind != t.kind:
        have, want = _KINDS.get(kind, "type"), _KINDS[t.kind]
        raise UsageError(f"target type {t.qualified} is a {have}, the source's is a {want}: drop or rename it on "
                         f"the target, or make it the source's")
    if t.kind == "c":
        have = tuple((a, ty, tuple(c) if c else None) for a, ty, _, c in conn.execute(_ATTRIBUTES, (relid,)))
        if have != t.attributes:
            raise UsageError(
                f"target type {t.qualified} has attributes ({_attributes_text(have)}), the source's are "
                f"({_attributes_text(t.attributes)}): make them equal (ALTER TYPE), or drop the target type and "
                f"let Sluicegate create it")
    elif base != t.base:
        what = _KINDS[t.kind]
        raise UsageError(f"target {what} {t.qualified} is over {base}, the source's over {t.base}: make them "
                         f"equal, or drop the target {what} and let Sluicegate create it")


_KINDS = {"c": "composite type", "d": "domain", "e": "enum", "r": "range type", "m": "multirange type"}


def _attributes_text(attributes) -> str:
    return ", ".join(f"{a} {ty}" + (f' COLLATE "{c[0]}"."{c[1]}"' if c else "") for a, ty, c in attributes)


def create_type_sql(t: UserType) -> sql.Composed:
    name = sql.Identifier(t.schema, t.name)
    if t.kind == "c":
        attributes = []
        for attname, type_sql, collation in t.attributes:
            part = sql.SQL("{} {}").format(sql.Identifier(attname), sql.SQL(type_sql))  # format_type(): valid SQL
            if collation:
                part = sql.SQL("{} COLLATE {}").format(part, sql.Identifier(*collation))
            attributes.append(part)
        return sql.SQL("CREATE TYPE {} AS ({})").format(name, sql.SQL(", ").join(attributes))
    if t.kind == "r":
        options = [sql.SQL("SUBTYPE = {}").format(sql.SQL(t.base))]
        if t.opclass:
            options.append(sql.SQL("SUBTYPE_OPCLASS = {}").format(sql.Identifier(*t.opclass)))
        if t.collation:
            options.append(sql.SQL("COLLATION = {}").format(sql.Identifier(*t.collation)))
        if t.subtype_diff:
            options.append(sql.SQL("SUBTYPE_DIFF = {}").format(sql.SQL(t.subtype_diff)))  # regproc text: valid SQL
        if t.multirange:
            options.append(sql.SQL("MULTIRANGE_TYPE_NAME = {}").format(sql.Identifier(t.schema, t.multirange)))
        return sql.SQL("CREATE TYPE {} AS RANGE ({})").format(name, sql.SQL(", ").join(options))
    parts = [sql.SQL("CREATE DOMAIN {} AS {}").format(name, sql.SQL(t.base))]
    if t.collation:
        parts.append(sql.SQL("COLLATE {}").format(sql.Identifier(*t.collation)))
    if t.default is not None:
        parts.append(sql.SQL("DEFAULT {}").format(sql.SQL(t.default)))
    if t.not_null:
        parts.append(sql.SQL("NOT NULL"))
    for check, definition in t.checks:
        parts.append(sql.SQL("CONSTRAINT {} {}").format(sql.Identifier(check), sql.SQL(definition)))
    return sql.SQL(" ").join(parts)


# -- comparing values --------------------------------------------------------------------------------------
# Types with a default btree equality that is not equality of their values: a vdiff compares them by their
# text form. citext folds case ('A' = 'a'). PostGIS's `=` compared bounding boxes before 2.4 (it is exact in
# 3.3: tested), and its text form (EWKB, with the SRID) is exact in every version. (box, circle, lseg, line,
# path, point and polygon have `=` by area or none at all, and no btree ordering: they are compared as text
# for that already.)
TEXT_EQUALITY_NAMES = frozenset(("citext", "geometry", "geography", "box2d", "box3d"))
TEXT_EQUALITY_BUILTINS = frozenset((600, 601, 602, 603, 604, 628, 718))  # point lseg path box polygon line circle

_REACHED = """
WITH RECURSIVE reached(oid) AS (
    SELECT %s::oid
  UNION
    SELECT x FROM reached r JOIN pg_type t ON t.oid = r.oid
    CROSS JOIN LATERAL (
        SELECT t.typelem WHERE t.typelem <> 0 AND t.typlen = -1
        UNION ALL SELECT t.typbasetype WHERE t.typtype = 'd'
        UNION ALL SELECT a.atttypid FROM pg_attribute a
                  WHERE t.typtype = 'c' AND a.attrelid = t.typrelid AND a.attnum > 0 AND NOT a.attisdropped
        UNION ALL SELECT rngsubtype FROM pg_range WHERE rngtypid = t.oid
        UNION ALL SELECT rngtypid FROM pg_range WHERE rngmultitypid = t.oid) AS next(x)
)
SELECT EXISTS (SELECT 1 FROM reached r JOIN pg_type t ON t.oid = r.oid
               WHERE t.oid = ANY(%s) OR (t.oid >= 16384 AND t.typname = ANY(%s)))"""


def equality_is_not_value(conn: psycopg.Connection, type_oid: int) -> bool:
    """The type, or one it is made of (an array's element, a domain's base, a composite's attribute), has an
    equality that is not equality of values (TEXT_EQUALITY_*)."""
    return conn.execute(_REACHED, (type_oid, list(TEXT_EQUALITY_BUILTINS), list(TEXT_EQUALITY_NAMES))).fetchone()[0]

"""What a moved table needs beyond its columns, read from the source and made again on the target.

`read` takes a table's definition from the source's catalog — column defaults (a sequence default with its
sequence), identity and generated columns, CHECK and UNIQUE constraints, secondary indexes, foreign keys
between moved tables — and lists what is not carried over (triggers, policies, foreign keys to other tables,
exclusion constraints, comments, grants, …) as lines the user sees at `create`. Everything is read with
search_path = pg_catalog, so the server's own texts (pg_get_expr, pg_get_indexdef, pg_get_constraintdef,
format_type) name every object with its schema and run unchanged on the target.

`create_statements` makes the table (sequences, columns, key, checks, unique constraints, indexes) in the
caller's transaction; the copy then drops the indexes before its first cycle and builds them after it
(indexes.py), as it does the key. Foreign keys wait until every table is copied (`foreign_key_statements`,
run by the engine when the stream starts Running): added NOT VALID, then validated. The applier then runs
with session_replication_role = replica, so a child row applied before its parent within a batch is not
refused (the source checked the key when it committed).

`advance_sequences` sets every target sequence of moved tables past the source's: what a switch of traffic
to the target calls before the application writes there.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from .catalog import Named, Table

SEQUENCE_MARGIN = 1000  # values between the source's last one and the target's first: writes in flight


@dataclass(frozen=True)
class Sequence(Named):
    schema: str
    name: str
    type_sql: str
    start: int
    increment: int
    minvalue: int
    maxvalue: int
    cache: int
    cycle: bool
    owned_by: str | None = None  # the column of the table that owns it (serial), or None

    def options(self, with_type: bool = True) -> sql.Composed:
        parts = [sql.SQL("AS {}").format(sql.SQL(self.type_sql))] if with_type else []
        parts.append(sql.SQL("START WITH {} INCREMENT BY {} MINVALUE {} MAXVALUE {} CACHE {} {}").format(
            sql.Literal(self.start), sql.Literal(self.increment), sql.Literal(self.minvalue),
            sql.Literal(self.maxvalue), sql.Literal(self.cache), sql.SQL("CYCLE" if self.cycle else "NO CYCLE")))
        return sql.SQL(" ").join(parts)


@dataclass(frozen=True)
class ColumnDef:
    name: str
    type_sql: str  # format_type() with search_path = pg_catalog: user types carry their schema
    collation: tuple[str, str] | None  # (schema, name) of a non-default collation
    not_null: bool
    default: str | None = None  # pg_get_expr of the default (not of a generated column)
    identity: str = ""  # 'a' (ALWAYS), 'd' (BY DEFAULT), '' (none)
    identity_sequence: Sequence | None = None
    generated: str | None = None  # the expression of a STORED generated column


@dataclass(frozen=True)
class ForeignKey:
    name: str
    definition: str  # pg_get_constraintdef: 'FOREIGN KEY (a) REFERENCES s.t(id) …'
    references: str  # the referenced table, qualified


@dataclass(frozen=True)
class Partition:
    schema: str
    name: str
    parent: tuple[str, str]  # (schema, name) of the table it is a partition of
    bound: str  # pg_get_expr(relpartbound): "FOR VALUES FROM ('2023-01-01') TO ('2024-01-01')", "DEFAULT"
    partition_by: str | None = None  # pg_get_partkeydef of a partition partitioned in turn

    def statement(self) -> sql.Composed:
        sub = sql.SQL(" PARTITION BY {}").format(sql.SQL(self.partition_by)) if self.partition_by else sql.SQL("")
        return sql.SQL("CREATE TABLE {} PARTITION OF {} {}{}").format(
            sql.Identifier(self.schema, self.name), sql.Identifier(*self.parent), sql.SQL(self.bound), sub)


@dataclass(frozen=True)
class TableDefinition(Named):
    schema: str
    name: str
    columns: tuple[ColumnDef, ...]
    key: tuple[str, ...]
    key_name: str | None  # the primary key constraint's name on the source, if the key is one
    sequences: tuple[Sequence, ...]  # those the columns' defaults draw from
    constraints: tuple[tuple[str, str], ...]  # (name, pg_get_constraintdef) of CHECK and UNIQUE constraints
    indexes: tuple[str, ...]  # pg_get_indexdef of indexes no constraint owns
    foreign_keys: tuple[ForeignKey, ...]  # to moved tables: added after the copy
    not_carried: tuple[str, ...]  # lines for the user
    partition_by: str | None = None  # pg_get_partkeydef of a partitioned table: 'RANGE (created)'
    partitions: tuple[Partition, ...] = ()  # every level, parents before their partitions

    def create(self, conn: psycopg.Connection) -> None:
        """Make the table on the target `conn`, in the caller's transaction."""
        names = [s.qualified for s in self.sequences]
        have = {r[0] for r in conn.execute(
            """SELECT n.nspname || '.' || c.relname
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
               WHERE c.relkind = 'S' AND n.nspname || '.' || c.relname = ANY(%s)""", (names,))}
        for statement in create_statements(self, frozenset(have)):
            conn.execute(statement)


def read(conn: psycopg.Connection, tables: list[Table]) -> dict[str, TableDefinition]:
    """Qualified name -> definition of each of `tables` on the source `conn` (autocommit or not: reads in a
    transaction of its own, or a savepoint of the caller's)."""
    moved = {t.qualified for t in tables}
    with conn.transaction():
        conn.execute("SET LOCAL search_path = pg_catalog")
        return {t.qualified: _read_one(conn, t, moved) for t in tables}


def _read_one(conn: psycopg.Connection, table: Table, moved: set[str]) -> TableDefinition:
    oid, kind, rls, acl, options, replident = conn.execute(
        """SELECT c.oid, c.relkind, c.relrowsecurity, c.relacl IS NOT NULL, c.reloptions, c.relreplident
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s""",
        (table.schema, table.name),
    ).fetchone()
    note = _Notes(table.qualified)
    columns = []
    for (attnum, name, type_sql, coll, not_null, identity, generated, expr) in conn.execute(
        """SELECT a.attnum, a.attname, format_type(a.atttypid, a.atttypmod),
                  CASE WHEN a.attcollation <> 0 AND a.attcollation <> t.typcollation
                       THEN ARRAY[cn.nspname::text, co.collname::text] END,
                  a.attnotnull, a.attidentity, a.attgenerated, pg_get_expr(d.adbin, d.adrelid)
           FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
           LEFT JOIN pg_collation co ON co.oid = a.attcollation
           LEFT JOIN pg_namespace cn ON cn.oid = co.collnamespace
           LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
           WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum""",
        (oid,),
    ):
        seq = None
        if identity:
            seq = _sequences(conn, "SELECT objid FROM pg_depend WHERE classid = 'pg_class'::regclass AND "
                                   "refobjid = %s AND refobjsubid = %s AND deptype = 'i'", (oid, attnum))[0]
            if identity == "a" and name not in table.key:
                # The applier must write the column (an UPDATE of the source's value); ALWAYS refuses that.
                identity = "d"
                note.add(f"column {name} is GENERATED ALWAYS AS IDENTITY on the source, BY DEFAULT on the target "
                         f"so that changes can be applied: after the switch, ALTER TABLE {table.qualified} "
                         f"ALTER COLUMN {name} SET GENERATED ALWAYS")
        columns.append(ColumnDef(name, type_sql, tuple(coll) if coll else None, not_null,
                                 expr if not generated and not identity else None, identity, seq,
                                 expr if generated == "s" else None))
    owned = dict(conn.execute(
        """SELECT d.objid, a.attname FROM pg_depend d
           JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
           WHERE d.classid = 'pg_class'::regclass AND d.refobjid = %s AND d.deptype = 'a'""", (oid,)).fetchall())
    sequences = _sequences(
        conn, """SELECT DISTINCT dep.refobjid FROM pg_attrdef ad JOIN pg_depend dep
                 ON dep.classid = 'pg_attrdef'::regclass AND dep.objid = ad.oid AND dep.refclassid = 'pg_class'::regclass
                 JOIN pg_class s ON s.oid = dep.refobjid AND s.relkind = 'S' WHERE ad.adrelid = %s""", (oid,),
        owned)
    key_name, constraints, foreign_keys, constraint_indexes = None, [], [], set()
    for name, contype, definition, index, refers in conn.execute(
        """SELECT con.conname, con.contype, pg_get_constraintdef(con.oid), con.conindid,
                  CASE WHEN con.confrelid <> 0 THEN rn.nspname || '.' || r.relname END
           FROM pg_constraint con LEFT JOIN pg_class r ON r.oid = con.confrelid
           LEFT JOIN pg_namespace rn ON rn.oid = r.relnamespace
           WHERE con.conrelid = %s ORDER BY con.contype <> 'p', con.conname""",
        (oid,),
    ):
        constraint_indexes.add(index)
        if contype == "p":
            key_name = name if _index_columns(conn, index) == table.key else None
        elif contype == "c" or contype == "u" and (key_name is not None or _index_columns(conn, index) != table.key):
            constraints.append((name, definition))  # a unique key that is the replica identity is the target's key
        elif contype == "f":
            if refers in moved:
                foreign_keys.append(ForeignKey(name, definition, refers))
            else:
                note.add(f"foreign key {name} references {refers}, which this workflow does not move: not carried")
        elif contype == "x":
            note.add(f"exclusion constraint {name} ({definition}) not carried")
        elif contype == "t":
            note.add(f"constraint trigger {name} not carried")
    indexes = []
    for index, indexdef, valid, replica in conn.execute(
        """SELECT i.indexrelid, pg_get_indexdef(i.indexrelid), i.indisvalid, i.indisreplident
           FROM pg_index i JOIN pg_class ci ON ci.oid = i.indexrelid WHERE i.indrelid = %s ORDER BY ci.relname""",
        (oid,),
    ):
        if index in constraint_indexes:
            continue
        if replica and key_name is None and _index_columns(conn, index) == table.key:
            continue  # the replica identity that is the target's primary key
        if not valid:
            note.add(f"invalid index not carried: {indexdef}")
            continue
        # A partitioned table's index reads "ON ONLY t" (its partitions' indexes are attached one by one):
        # made on the target's partitioned table, it must cascade to the partitions made with it.
        indexes.append(indexdef.replace(" ON ONLY ", " ON ", 1) if kind == "p" else indexdef)
    for (name,) in conn.execute("SELECT tgname FROM pg_trigger WHERE tgrelid = %s AND NOT tgisinternal "
                                "ORDER BY tgname", (oid,)):
        note.add(f"trigger {name} not carried")
    for (name,) in conn.execute("SELECT rulename FROM pg_rewrite WHERE ev_class = %s ORDER BY rulename", (oid,)):
        note.add(f"rule {name} not carried")
    policies = [r[0] for r in conn.execute("SELECT polname FROM pg_policy WHERE polrelid = %s ORDER BY 1", (oid,))]
    if rls or policies:
        note.add("row-level security" + (f" and policies {', '.join(policies)}" if policies else "") + " not carried")
    for (name,) in conn.execute("SELECT stxname FROM pg_statistic_ext WHERE stxrelid = %s ORDER BY 1", (oid,)):
        note.add(f"extended statistics {name} not carried")
    partition_by, partitions = _partitioning(conn, oid, note) if kind == "p" else (None, ())
    for (parent,) in conn.execute("SELECT inhparent::regclass::text FROM pg_inherits WHERE inhrelid = %s", (oid,)):
        note.add(f"inheritance from {parent} not carried")
    if acl:
        note.add("grants not carried")
    if options:
        note.add(f"storage parameters ({', '.join(options)}) not carried")
    if replident == "f" and table.key:  # keyless: carried (create_statements), a reverse workflow needs it
        note.add("REPLICA IDENTITY FULL not carried")
    if conn.execute("SELECT EXISTS (SELECT 1 FROM pg_description WHERE objoid = %s AND classoid = 'pg_class'::regclass)",
                    (oid,)).fetchone()[0]:
        note.add("comments not carried")
    return TableDefinition(table.schema, table.name, tuple(columns), table.key, key_name, tuple(sequences),
                           tuple(constraints), tuple(indexes), tuple(foreign_keys), tuple(note.lines),
                           partition_by, partitions)


def _partitioning(conn: psycopg.Connection, oid: int, note: _Notes) -> tuple[str, tuple[Partition, ...]]:
    """A partitioned table's partition key and its partitions, at every level, parents first."""
    rows = conn.execute(
        """WITH RECURSIVE tree AS (
               SELECT inhrelid AS oid, inhparent AS parent, 1 AS depth FROM pg_inherits WHERE inhparent = %s
               UNION ALL
               SELECT i.inhrelid, i.inhparent, t.depth + 1 FROM pg_inherits i JOIN tree t ON i.inhparent = t.oid)
           SELECT n.nspname, c.relname, pn.nspname, p.relname, pg_get_expr(c.relpartbound, c.oid),
                  CASE WHEN c.relkind = 'p' THEN pg_get_partkeydef(c.oid) END, c.relkind
           FROM tree t JOIN pg_class c ON c.oid = t.oid JOIN pg_namespace n ON n.oid = c.relnamespace
           JOIN pg_class p ON p.oid = t.parent JOIN pg_namespace pn ON pn.oid = p.relnamespace
           ORDER BY t.depth, n.nspname, c.relname""", (oid,)).fetchall()
    partitions = []
    for schema, name, parent_schema, parent, bound, sub, kind in rows:
        if kind == "f":  # its rows live on another server; the copy reads them like the others'
            note.add(f"foreign table partition {schema}.{name} made as a plain partition on the target")
        partitions.append(Partition(schema, name, (parent_schema, parent), bound, sub))
    key = conn.execute("SELECT pg_get_partkeydef(%s)", (oid,)).fetchone()[0]
    return key, tuple(partitions)


class _Notes:
    def __init__(self, qualified: str):
        self.qualified, self.lines = qualified, []

    def add(self, what: str) -> None:
        self.lines.append(f"table {self.qualified}: {what}")


def _index_columns(conn: psycopg.Connection, index: int) -> tuple[str, ...]:
    row = conn.execute(
        """SELECT array_agg(a.attname ORDER BY k.ord) FROM pg_index i
           CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
           JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
           WHERE i.indexrelid = %s AND i.indexprs IS NULL AND i.indpred IS NULL AND k.ord <= i.indnkeyatts""", (index,)).fetchone()
    return tuple(row[0] or ()) if row else ()


def _sequences(conn: psycopg.Connection, which: str, params: tuple, owned: dict | None = None) -> list[Sequence]:
    """The sequences whose OIDs the query `which` returns, with their parameters."""
    rows = conn.execute(
        sql.SQL("""SELECT c.oid, n.nspname, c.relname, format_type(s.seqtypid, NULL), s.seqstart, s.seqincrement,
                          s.seqmin, s.seqmax, s.seqcache, s.seqcycle
                   FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid
                   JOIN pg_namespace n ON n.oid = c.relnamespace
                   WHERE s.seqrelid IN ({}) ORDER BY n.nspname, c.relname""").format(sql.SQL(which)),
        params,
    ).fetchall()
    return [Sequence(*r[1:], owned_by=(owned or {}).get(r[0])) for r in rows]


# -- the target ---------------------------------------------------------------------------------------------
def column_sql(c: ColumnDef) -> sql.Composed:
    parts = [sql.Identifier(c.name), sql.SQL(c.type_sql)]  # format_type() output is valid, quoted SQL
    if c.collation:
        parts.append(sql.SQL("COLLATE {}").format(sql.Identifier(*c.collation)))
    if c.generated is not None:
        parts.append(sql.SQL("GENERATED ALWAYS AS ({}) STORED").format(sql.SQL(c.generated)))
    elif c.identity:
        seq = c.identity_sequence
        options = sql.SQL(" ").join([sql.SQL("SEQUENCE NAME {}").format(seq.ident),
                                     seq.options(with_type=False)]) if seq else sql.SQL("")
        parts.append(sql.SQL("GENERATED {} AS IDENTITY ({})").format(
            sql.SQL("ALWAYS" if c.identity == "a" else "BY DEFAULT"), options))
    elif c.default is not None:
        parts.append(sql.SQL("DEFAULT {}").format(sql.SQL(c.default)))
    if c.not_null:
        parts.append(sql.SQL("NOT NULL"))
    return sql.SQL(" ").join(parts)


def create_statements(d: TableDefinition, existing_sequences: frozenset[str] = frozenset()) -> list[sql.Composed]:
    """What makes the table on the target, in order. `existing_sequences`: qualified names of sequences the
    target already has (a default then draws from that one, the target's own)."""
    out = [sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(d.schema))]
    for seq in d.sequences:
        if seq.qualified not in existing_sequences:
            out.append(sql.SQL("CREATE SEQUENCE {} {}").format(seq.ident, seq.options()))
    defs = [column_sql(c) for c in d.columns]
    if d.key:
        key = sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(map(sql.Identifier, d.key)))
        if d.key_name:
            key = sql.SQL("CONSTRAINT {} {}").format(sql.Identifier(d.key_name), key)
        defs.append(key)
    partitioned = sql.SQL(" PARTITION BY {}").format(sql.SQL(d.partition_by)) if d.partition_by else sql.SQL("")
    out.append(sql.SQL("CREATE TABLE {} ({}){}").format(d.ident, sql.SQL(", ").join(defs), partitioned))
    for part in d.partitions:
        out.append(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(part.schema)))
        out.append(part.statement())
    if not d.key:  # keyless: as on the source, so that the table can be a source itself after a switch
        out.append(sql.SQL("ALTER TABLE {} REPLICA IDENTITY FULL").format(d.ident))
    for seq in d.sequences:
        if seq.owned_by and seq.qualified not in existing_sequences:
            out.append(sql.SQL("ALTER SEQUENCE {} OWNED BY {}").format(
                seq.ident, sql.Identifier(d.schema, d.name, seq.owned_by)))
    for name, definition in d.constraints:
        out.append(sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} {}").format(
            d.ident, sql.Identifier(name), sql.SQL(definition)))
    out.extend(sql.SQL(i) for i in d.indexes)
    return out


def foreign_key_statements(table: str, fk: dict) -> list[sql.Composed]:
    """Add a foreign key to an already filled table: NOT VALID (no scan under the lock), then validated
    unless the source's is not valid itself. `table`: qualified; `fk`: ForeignKey as a dict."""
    schema, _, name = table.partition(".")
    ident = sql.Identifier(schema, name)
    definition = fk["definition"]
    valid = not definition.endswith(" NOT VALID")
    out = [sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} {}{}").format(
        ident, sql.Identifier(fk["name"]), sql.SQL(definition), sql.SQL(" NOT VALID" if valid else ""))]
    if valid:
        out.append(sql.SQL("ALTER TABLE {} VALIDATE CONSTRAINT {}").format(ident, sql.Identifier(fk["name"])))
    return out


def add_foreign_keys(conn: psycopg.Connection, pending: list[dict]) -> list[str]:
    """Add the pending foreign keys ([{"table", "name", "definition"}]) that are not there yet, in the
    caller's transaction; the qualified names of those added."""
    added = []
    for fk in pending:
        schema, _, name = fk["table"].partition(".")
        exists = conn.execute(
            """SELECT 1 FROM pg_constraint con JOIN pg_class c ON c.oid = con.conrelid
               JOIN pg_namespace n ON n.oid = c.relnamespace
               WHERE n.nspname = %s AND c.relname = %s AND con.conname = %s""", (schema, name, fk["name"])).fetchone()
        if exists:
            continue
        for statement in foreign_key_statements(fk["table"], fk):
            conn.execute(statement)
        added.append(f"{fk['table']}.{fk['name']}")
    return added


def may_apply_as_replica(conn: psycopg.Connection) -> bool:
    """Whether the target user may SET session_replication_role (a superuser, or PostgreSQL 15+'s GRANT SET
    ON PARAMETER): the applier needs it to write a child row before its parent with the key in place."""
    if conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()[0]:
        return True
    if conn.info.server_version < 150000:
        return False
    return conn.execute("SELECT has_parameter_privilege('session_replication_role', 'SET')").fetchone()[0]


# -- sequences at the switch ------------------------------------------------------------------------------
def table_sequences(conn: psycopg.Connection, schema: str, name: str) -> list[tuple[str, str, str]]:
    """(column, sequence schema, sequence name) of each sequence the table's columns draw from: identity,
    owned (serial) and default ones."""
    return conn.execute(
        """SELECT DISTINCT a.attname, sn.nspname, s.relname
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
           JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
           LEFT JOIN pg_attrdef ad ON ad.adrelid = c.oid AND ad.adnum = a.attnum
           JOIN pg_depend dep ON dep.refclassid = 'pg_class'::regclass AND (
                (dep.classid = 'pg_class'::regclass AND dep.refobjid = c.oid AND dep.refobjsubid = a.attnum
                 AND dep.deptype IN ('a', 'i'))
             OR (dep.classid = 'pg_attrdef'::regclass AND dep.objid = ad.oid))
           JOIN pg_class s ON s.oid = CASE WHEN dep.classid = 'pg_class'::regclass THEN dep.objid
                                           ELSE dep.refobjid END AND s.relkind = 'S'
           JOIN pg_namespace sn ON sn.oid = s.relnamespace
           WHERE n.nspname = %s AND c.relname = %s ORDER BY 1, 2, 3""",
        (schema, name),
    ).fetchall()


def _sequence_state(conn: psycopg.Connection, schema: str, name: str) -> tuple[int, bool, int]:
    """(last_value, is_called, increment) of a sequence, read from the sequence itself (pg_sequences hides
    last_value from users without the privilege to read it)."""
    last, called = conn.execute(sql.SQL("SELECT last_value, is_called FROM {}").format(
        sql.Identifier(schema, name))).fetchone()
    increment = conn.execute(
        """SELECT s.seqincrement FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid
           JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s""",
        (schema, name)).fetchone()[0]
    return last, called, increment


def next_value(source_last: int, source_called: bool, target_last: int, target_called: bool, increment: int,
               margin: int = SEQUENCE_MARGIN) -> int:
    """The value to setval (is_called = true) a target sequence to: `margin` steps past the source's last
    value, never behind the target's own. A sequence never called has handed out nothing yet."""
    step = margin * increment
    src = source_last + step if source_called else source_last + step - increment
    if not target_called:
        return src
    return max(src, target_last) if increment > 0 else min(src, target_last)


def advance_sequences(src_conn: psycopg.Connection, dst_conn: psycopg.Connection, tables,
                      margin: int = SEQUENCE_MARGIN, sides: tuple[str, str] = ("source", "target")) -> list[str]:
    """Set every sequence the target tables' columns draw from past the value of the source's sequence of the
    same column (`margin` steps beyond, never lower than the target's own), in `dst_conn`'s current
    transaction (the caller commits). `tables`: Tables or qualified names ('public.orders'). Returns a line
    per sequence saying what was set, or why not; `sides` names `src_conn`'s and `dst_conn`'s databases in
    them (a reverse switch advances the source's sequences from the target's)."""
    frm, to = sides
    lines = []
    for t in tables:
        schema, name = (t.schema, t.name) if isinstance(t, Table) else t.split(".", 1)
        source = {c: (s, q) for c, s, q in table_sequences(src_conn, schema, name)}
        for column, seq_schema, seq_name in table_sequences(dst_conn, schema, name):
            target_seq = f"{seq_schema}.{seq_name}"
            if column not in source:
                lines.append(f"sequence {target_seq} on the {to} ({schema}.{name}.{column}): the {frm}'s column "
                             f"has no sequence; left as it is")
                continue
            s_last, s_called, _ = _sequence_state(src_conn, *source[column])
            d_last, d_called, increment = _sequence_state(dst_conn, seq_schema, seq_name)
            value = next_value(s_last, s_called, d_last, d_called, increment, margin)
            dst_conn.execute("SELECT setval(%s::regclass, %s, true)",
                             (sql.Identifier(seq_schema, seq_name).as_string(dst_conn), value))
            lines.append(f"sequence {target_seq} on the {to} set to {value} ({frm} {source[column][0]}."
                         f"{source[column][1]} at {s_last if s_called else 'its start'})")
    return lines

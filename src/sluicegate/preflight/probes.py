"""The checks, one database at a time. Each returns Problems (report.py) and never stops at the first: an
operator fixes everything a run will need in one go. Facts come from the server (catalogs, has_*_privilege,
a real replication connection), never from a list of what a user "usually" has."""

from __future__ import annotations

import psycopg
from psycopg import sql

from ..errors import SluicegateError
from ..postgres import catalog
from ..postgres import needs as nd
from ..postgres.catalog import Table
from ..postgres.replication import check_replication_access
from .report import Problem


def _q(conn: psycopg.Connection, template: str, *names: str) -> str:
    """format(template, names…) by the server: identifiers quoted as a person would type them (%I)."""
    params = sql.SQL(", ").join(sql.Literal(a) for a in (template, *names))
    return conn.execute(sql.SQL("SELECT format({})").format(params)).fetchone()[0]


def role(conn: psycopg.Connection) -> tuple[str, bool, bool]:
    """(user, superuser, replication) of the session."""
    return conn.execute("SELECT current_user, rolsuper, rolreplication FROM pg_roles WHERE rolname = current_user"
                        ).fetchone()


def privileged(conn: psycopg.Connection, where: str, uses: set[str]) -> list[Problem]:
    """The needs.py calls a run makes here (by `uses`) that this user may not make."""
    user, superuser, _ = role(conn)
    if superuser:
        return []
    out = []
    for need in nd.needed(uses):
        if need.kind == "function":
            for signature, ok in conn.execute(
                    "SELECT oid::regprocedure::text, has_function_privilege(oid, 'EXECUTE') FROM pg_proc "
                    "WHERE proname = %s AND pronamespace = 'pg_catalog'::regnamespace ORDER BY 1",
                    (need.name,)).fetchall():
                if not ok:
                    out.append(Problem(where, f"user {user} may not execute {signature}, which {need.why}",
                                       _q(conn, "GRANT EXECUTE ON FUNCTION %s TO %I", signature, user)))
        elif need.kind == "role":
            if not conn.execute("SELECT pg_has_role(%s, 'USAGE')", (need.name,)).fetchone()[0]:
                out.append(Problem(where, f"user {user} is not a member of {need.name}, which {need.why}",
                                   _q(conn, "GRANT %I TO %I", need.name, user)))
        elif conn.info.server_version < 150000:
            out.append(Problem(where, f"user {user} may not SET {need.name} (PostgreSQL 14 lets only a superuser), "
                                      f"which {need.why}", action="connect as a superuser, or upgrade to 15+"))
        elif not conn.execute("SELECT has_parameter_privilege(%s, 'SET')", (need.name,)).fetchone()[0]:
            out.append(Problem(where, f"user {user} may not SET {need.name}, which {need.why}",
                               _q(conn, "GRANT SET ON PARAMETER %s TO %I", need.name, user)))
    return out


def settings(conn: psycopg.Connection, where: str, slots: int, lww: bool) -> list[Problem]:
    """A server that is read as a source: logical decoding, room for `slots` more slots and their senders,
    the WAL a stalled slot may hold; commit timestamps where last-writer-wins reads them."""
    out = []

    def problem(what: str, fix: str = "", **kw) -> None:
        out.append(Problem(where, what, fix, area="setting", **kw))

    version = conn.info.server_version
    if version < 140000:
        problem(f"PostgreSQL {version // 10000}: Sluicegate needs 14 or newer", action="upgrade the server")
    level, max_slots, max_senders, keep = (conn.execute(f"SHOW {p}").fetchone()[0] for p in (
        "wal_level", "max_replication_slots", "max_wal_senders", "max_slot_wal_keep_size"))
    if level != "logical":
        problem(f"wal_level = {level}: logical decoding needs wal_level = logical",
                "ALTER SYSTEM SET wal_level = logical", restart=True)
    used = conn.execute("SELECT count(*) FROM pg_replication_slots").fetchone()[0]
    if int(max_slots) - used < slots:
        problem(f"max_replication_slots = {max_slots} with {used} in use: the workflow needs {slots} more",
                f"ALTER SYSTEM SET max_replication_slots = {used + slots + 4}", restart=True)
    senders = conn.execute("SELECT count(*) FROM pg_stat_replication").fetchone()[0]
    if int(max_senders) - senders < slots:
        problem(f"max_wal_senders = {max_senders} with {senders} in use: each stream reads through one",
                f"ALTER SYSTEM SET max_wal_senders = {senders + slots + 4}", restart=True)
    if keep == "-1":
        problem("max_slot_wal_keep_size = -1: a stalled stream's slot may hold WAL until the disk is full "
                "(Replicate's --max-retained-wal caps it only while a consumer runs)",
                "ALTER SYSTEM SET max_slot_wal_keep_size = '100GB'", severity="warning",
                action="or a size the disk can spare, then reload the configuration")
    if version >= 170000 and not conn.execute("SHOW synchronized_standby_slots").fetchone()[0]:
        physical = [r[0] for r in conn.execute(
            "SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'physical' ORDER BY 1")]
        if physical:  # a standby streams from it: the one a failover would promote (README: source failover)
            problem(f"synchronized_standby_slots is empty while standbys stream from this server (physical slots "
                    f"{', '.join(physical)}): a stream may apply changes a standby does not have yet, and after "
                    f"a failover to that standby the target is ahead of it (and the slot may not be there)",
                    f"ALTER SYSTEM SET synchronized_standby_slots = '{','.join(physical)}'", severity="warning",
                    action="then reload the configuration; the standby also needs sync_replication_slots = on")
    if lww and conn.execute("SHOW track_commit_timestamp").fetchone()[0] != "on":
        problem("track_commit_timestamp = off: last-writer-wins compares the commit times of both sides' rows",
                "ALTER SYSTEM SET track_commit_timestamp = on", restart=True)
    return out


def replication_access(conn: psycopg.Connection, url: str, where: str) -> list[Problem]:
    """A real replication connection, as a stream opens one (pg_hba.conf, max_wal_senders), for a user that
    may open one at all (else source_role has said what it lacks)."""
    _, superuser, replication = role(conn)
    if not (superuser or replication):
        return []
    try:
        check_replication_access(url)
    except SluicegateError as exc:
        return [Problem(where, f"a replication connection fails: {exc}", area="connection")]
    return []


def source_role(conn: psycopg.Connection, where: str, tables: list[Table], publication: str | None) -> list[Problem]:
    """Reading as a source: a slot (REPLICATION), a publication (CREATE on the database, and owning each
    table it names), the copy (SELECT)."""
    user, superuser, replication = role(conn)
    if superuser:
        return []
    out = []
    if not replication:
        out.append(Problem(where, f"user {user} may not create replication slots or stream changes",
                           _q(conn, "ALTER ROLE %I REPLICATION", user)))
    db = conn.info.dbname
    exists = publication and conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s",
                                          (publication,)).fetchone()
    if not exists and not conn.execute("SELECT has_database_privilege(current_database(), 'CREATE')").fetchone()[0]:
        out.append(Problem(where, f"user {user} may not create the workflow's publication in database {db}",
                           _q(conn, "GRANT CREATE ON DATABASE %I TO %I", db, user)))
    for t in tables:
        owner, select = conn.execute(
            "SELECT pg_has_role(c.relowner, 'USAGE'), has_table_privilege(c.oid, 'SELECT') FROM pg_class c "
            "WHERE c.oid = %s::regclass", (t.ident.as_string(conn),)).fetchone()
        if not owner:
            out.append(Problem(where, f"user {user} does not own table {t.qualified}, which a publication takes",
                               _q(conn, "ALTER TABLE %I.%I OWNER TO %I", t.schema, t.name, user),
                               action="or connect as its owner"))
        elif not select:
            out.append(Problem(where, f"user {user} may not read table {t.qualified}",
                               _q(conn, "GRANT SELECT ON %I.%I TO %I", t.schema, t.name, user)))
    return out


def source_tables(conn: psycopg.Connection, where: str, names: list[str] | None,
                  exclude: list[str] | None) -> tuple[list[Table], list[Problem]]:
    """The tables named (all of schema public by default), described; one problem per table that cannot move
    (no key and no REPLICA IDENTITY FULL, UNLOGGED…), with its fix."""
    out: list[Problem] = []
    existing = catalog.list_tables(conn)
    chosen: list[tuple[str, str]] = [] if names else [t for t in existing if t[0] == "public"]
    for raw in names or []:
        try:
            if raw.strip().endswith(".*"):
                schema = catalog.split_name(raw.strip()[:-2] + ".x")[0]
                chosen += [t for t in existing if t[0] == schema and t not in chosen]
            else:
                chosen.append(catalog._resolve_or_explain(conn, existing, raw))
        except SluicegateError as exc:
            out.append(Problem(where, area="table", what=str(exc)))
    if not chosen and not out:
        out.append(Problem(where, area="table", what="no tables to move in schema public", action="name them with --tables"))
    tables = []
    for schema, name in chosen:
        try:
            tables.append(catalog.describe_table(conn, schema, name))
        except SluicegateError as exc:
            out.append(Problem(where, area="table", what=str(exc)))
        except psycopg.errors.InsufficientPrivilege:  # the user may not read it: source_role says so
            tables.append(Table(schema, name, (), ()))
    try:
        tables = catalog.exclude_tables(tables, exclude)
    except SluicegateError as exc:
        out.append(Problem(where, area="table", what=str(exc)))
    return tables, out


def target_rights(conn: psycopg.Connection, where: str, tables: list[Table], *, state: bool = True) -> list[Problem]:
    """Applying as a target: its state (schema sluicegate), each table made (CREATE on its schema or on the
    database for a new schema) or written (INSERT, UPDATE, DELETE, TRUNCATE, SELECT on an existing one), its
    key and indexes built after its first copy cycle (CREATE on the schema: PostgreSQL asks it of every new
    index)."""
    user, superuser, _ = role(conn)
    if superuser:
        return []
    out = []
    db = conn.info.dbname
    may_create_schema = conn.execute("SELECT has_database_privilege(current_database(), 'CREATE')").fetchone()[0]
    schemas = {"sluicegate"} if state else set()
    schemas |= {t.schema for t in tables}
    missing_schemas = []
    for schema in sorted(schemas):
        row = conn.execute("SELECT has_schema_privilege(oid, 'CREATE'), has_schema_privilege(oid, 'USAGE') "
                           "FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone()
        if row is None:
            missing_schemas.append(schema)
        elif not all(row):  # tables made there, or (existing ones) their indexes built again after a copy
            out.append(Problem(where, f"user {user} may not create tables and indexes in schema {schema}",
                               _q(conn, "GRANT USAGE, CREATE ON SCHEMA %I TO %I", schema, user)))
    if missing_schemas and not may_create_schema:
        out.append(Problem(where, f"user {user} may not create schema(s) {', '.join(missing_schemas)} in database "
                                  f"{db} (the workflow's state, and the tables' schemas)",
                           _q(conn, "GRANT CREATE ON DATABASE %I TO %I", db, user)))
    for t in tables:
        if not table_exists(conn, t):
            continue
        lacking = conn.execute(
            "SELECT array_agg(p) FROM unnest(ARRAY['SELECT','INSERT','UPDATE','DELETE','TRUNCATE']) p "
            "WHERE NOT has_table_privilege(%s::regclass, p)", (t.ident.as_string(conn),)).fetchone()[0]
        if lacking:
            out.append(Problem(where, f"user {user} may not {', '.join(p.lower() for p in lacking)} table "
                                      f"{t.qualified}, which the applier writes",
                               _q(conn, f"GRANT {', '.join(lacking)} ON %I.%I TO %I", t.schema, t.name, user)))
    return out


def table_exists(conn: psycopg.Connection, t: Table) -> bool:
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", (t.ident.as_string(conn),)).fetchone()[0]


def foreign_keys_between(conn: psycopg.Connection, tables: list[Table]) -> bool:
    """Whether any of `tables` has a foreign key to another of them (create carries those; the applier then
    writes with session_replication_role = replica)."""
    oids = [t.ident.as_string(conn) for t in tables]
    return bool(oids) and conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_constraint WHERE contype = 'f' AND conrelid = ANY(%s::regclass[]) "
        "AND confrelid = ANY(%s::regclass[]))", (oids, oids)).fetchone()[0]

"""Deferred index builds: a target table's indexes are dropped before its first copy cycle and built again in
the transaction that records the cycle, the order pg_restore loads in (VReplication's --defer-secondary-keys).

COPY into a table with its primary key maintains the B-tree row by row (and logs each entry); a sorted build
afterwards is far cheaper (bench/README.md, "Notes moved from the code"). Only tables nothing else leans on are deferred: no foreign key points at
them, they are plain (no partitions or inheritance), and their replica identity is not an index. Exclusion
constraints and invalid indexes stay as they are. The statements that build the indexes again come from the
server itself (pg_get_indexdef, pg_get_constraintdef) and are kept in the workflow's state, so a kill at any
point leaves either the indexes or the statements to make them.
"""

from __future__ import annotations

import logging

import psycopg
from psycopg import errors, sql

from . import locks
from .catalog import Table

log = logging.getLogger("sluicegate")


def defer(conn: psycopg.Connection, table: Table) -> list[dict]:
    """Drop the indexes of `table` (empty, in the caller's transaction) that can be built after the copy;
    returns them as [{"name", "create"}] for `build`, or [] when the table keeps its indexes."""
    found = _deferrable(conn, table)
    if not found:
        return []
    _own_statements(conn)
    rel = table.ident.as_string(conn)
    try:
        # A savepoint: a view that depends on the key, or no ownership, keeps them. A reader of the table holds
        # the drop up: the lock timeout says who, and the copy cycle is retried.
        with locks.guard(conn, f"dropping the indexes of {table.qualified} for its copy", [rel]):
            for name, constraint, _ in found:
                if constraint:
                    conn.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(table.ident,
                                                                                     sql.Identifier(name)))
                else:
                    conn.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(table.schema, name)))
    except (errors.DependentObjectsStillExist, errors.InsufficientPrivilege) as exc:
        log.info("indexes of %s are kept during its copy: %s", table.qualified, str(exc).splitlines()[0])
        return []
    return [{"name": name, "create": create} for name, _, create in found]


def build(conn: psycopg.Connection, table: Table, deferred: list[dict]) -> None:
    """Build the indexes `defer` dropped, in the caller's transaction."""
    _own_statements(conn)
    with locks.guard(conn, f"building the indexes of {table.qualified}", [table.ident.as_string(conn)], "ShareLock"):
        for index in deferred:
            log.info("building index %s of %s", index["name"], table.qualified)
            conn.execute(sql.SQL(index["create"]))  # the server's own definition, kept verbatim


def _deferrable(conn: psycopg.Connection, table: Table) -> list[tuple[str, bool, str]]:
    """(name, is a constraint, the statement that creates it) for each index that may be deferred."""
    row = conn.execute(
        """SELECT c.relkind = 'r' AND NOT c.relispartition AND c.relreplident <> 'i'
                  AND NOT EXISTS (SELECT 1 FROM pg_inherits WHERE inhparent = c.oid)
                  AND NOT EXISTS (SELECT 1 FROM pg_constraint WHERE confrelid = c.oid AND contype = 'f')
           FROM pg_class c WHERE c.oid = %s::regclass""",
        (table.ident.as_string(conn),),
    ).fetchone()
    if row is None or not row[0]:
        return []
    found = []
    for name, contype, indexdef, constraintdef in conn.execute(
        """SELECT COALESCE(con.conname, ci.relname), con.contype, pg_get_indexdef(i.indexrelid), pg_get_constraintdef(con.oid)
           FROM pg_index i JOIN pg_class ci ON ci.oid = i.indexrelid
           LEFT JOIN pg_constraint con ON con.conindid = i.indexrelid AND con.conrelid = i.indrelid
                                      AND con.contype IN ('p', 'u', 'x')
           WHERE i.indrelid = %s::regclass AND i.indisvalid AND i.indisready AND con.contype IS DISTINCT FROM 'x'
           ORDER BY con.contype = 'p' DESC NULLS LAST, ci.relname""",
        (table.ident.as_string(conn),),
    ):
        if contype is None:
            found.append((name, False, indexdef))
        else:  # a primary key or unique constraint: made again as the constraint, with its own index
            create = sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} {}").format(
                table.ident, sql.Identifier(name), sql.SQL(constraintdef))
            found.append((name, True, create.as_string(conn)))
    return found


def _own_statements(conn: psycopg.Connection) -> None:
    """Mark the transaction's DDL as Sluicegate's (unless the session is marked already): a DDL capture on this
    database (ddl/capture.py) leaves it out, so it never reaches a stream reading from here."""
    conn.execute("SELECT set_config('sluicegate.applying', 'sluicegate', true) "
                 "WHERE coalesce(current_setting('sluicegate.applying', true), '') = ''")

"""Identity columns GENERATED ALWAYS on a target: the source's values are the ones to keep.

PostgreSQL refuses an INSERT that gives such a column a value (SQLSTATE 428C9) unless the statement says
OVERRIDING SYSTEM VALUE; COPY writes the values as given. Every applier's INSERT into a target table asks here.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from ..postgres.catalog import Table


def writes_always_identity(conn: psycopg.Connection, table: Table) -> bool:
    """Whether the target's `table` has an identity column GENERATED ALWAYS among the columns written."""
    return conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = %s::regclass AND attidentity = 'a' "
        "AND attname = ANY(%s))", (table.ident.as_string(conn), list(table.column_names))).fetchone()[0]


def overriding_clause(always: bool) -> sql.Composable:
    """What goes between an INSERT's column list and its SELECT (or VALUES)."""
    return sql.SQL(" OVERRIDING SYSTEM VALUE" if always else "")

"""Whether a table's keys sort on the target as on the source.

A copy in several cycles walks the source's keys in the source's order, and compares them on the target (the
rows above a cycle's lastpk are cleared; a change is applied only at or below it). A key column of the default
collation sorts by each database's own default: where the two differ (a target made with another locale or
provider), a cycle's edge falls elsewhere on the target, and rows would be cleared or passed over.
"""

from __future__ import annotations

import psycopg

from .catalog import Table

DEFAULT_COLLATION = 100  # pg_collation's "default": the database's own
# What decides the database's default order (columns by version: daticulocale up to 16, datlocale from 17)
_LOCALE = ("datlocprovider", "datcollate", "daticulocale", "datlocale", "daticurules")
_DATABASE = "SELECT to_jsonb(d) FROM pg_database d WHERE datname = current_database()"
_DEFAULT_KEY = """SELECT EXISTS (SELECT 1 FROM pg_attribute
                  WHERE attrelid = to_regclass(%s) AND attname = ANY(%s) AND attcollation = %s)"""


def key_orders_differ(source: psycopg.Connection, target: psycopg.Connection, table: Table) -> bool:
    """A key column of the default collation, and the two databases' defaults are not the same."""
    if table.keyless or not source.execute(_DEFAULT_KEY, (table.ident.as_string(source), list(table.key),
                                                          DEFAULT_COLLATION)).fetchone()[0]:
        return False
    src, dst = (conn.execute(_DATABASE).fetchone()[0] for conn in (source, target))
    return any(src.get(k) != dst.get(k) for k in _LOCALE)

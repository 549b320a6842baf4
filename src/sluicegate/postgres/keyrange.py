"""Key ranges over a table's key in the source's own order, as SQL.

Key values travel as their text form (what `key::text` and pgoutput give) and are cast back to the
column's type on the server, so every key type — composite, text, uuid, timestamps — compares the way
PostgreSQL compares it, never the way Python would.
"""

from __future__ import annotations

from psycopg import sql

from .catalog import Table


def key_columns(table: Table, alias: str | None = None) -> sql.Composable:
    cols = [sql.Identifier(alias, k) if alias else sql.Identifier(k) for k in table.key]
    return cols[0] if len(cols) == 1 else sql.SQL("({})").format(sql.SQL(", ").join(cols))


def key_texts(table: Table) -> sql.Composable:
    """The key's values as text, aliased `_sg_k0, _sg_k1…`: an output column named like a key column would
    make ORDER BY sort by its text form instead of the column's order."""
    return sql.SQL(", ").join(sql.SQL("{}::text AS {}").format(sql.Identifier(k), sql.Identifier(f"_sg_k{i}"))
                              for i, k in enumerate(table.key))


def key_text_names(table: Table) -> sql.Composable:
    return sql.SQL(", ").join(sql.Identifier(f"_sg_k{i}") for i in range(len(table.key)))


def key_order(table: Table, direction: str = "") -> sql.Composable:
    """`k1, k2` (or `k1 DESC, k2 DESC`): the key's own order."""
    suffix = sql.SQL(f" {direction}" if direction in ("ASC", "DESC") else "")
    return sql.SQL(", ").join(sql.SQL("{}{}").format(sql.Identifier(k), suffix) for k in table.key)


def key_value(table: Table, values: list[str]) -> sql.Composable:
    cols = {c.name: c for c in table.columns}
    lits = []
    for k, v in zip(table.key, values):
        lit = sql.SQL("{}::{}").format(sql.Literal(v), sql.SQL(cols[k].type_sql))
        if cols[k].collation:  # so that two values (no column involved) also compare in the key's order
            lit = sql.SQL("{} COLLATE {}").format(lit, sql.Identifier(cols[k].collation))
        lits.append(lit)
    return lits[0] if len(lits) == 1 else sql.SQL("ROW({})").format(sql.SQL(", ").join(lits))


def compare(table: Table, op: str, values: list[str], alias: str | None = None) -> sql.Composable:
    """`key OP (values)`, e.g. `("order_id", "line_no") > ROW('5'::bigint, '2'::integer)`."""
    assert op in ("<", "<=", ">", ">=", "=")
    return sql.SQL("{} {} {}").format(key_columns(table, alias), sql.SQL(op), key_value(table, values))


def compare_values(table: Table, op: str, left: list[str], right: list[str]) -> sql.Composable:
    """`(left) OP (right)` for two key values, in the key columns' types and collations."""
    assert op in ("<", "<=", ">", ">=", "=")
    return sql.SQL("{} {} {}").format(key_value(table, left), sql.SQL(op), key_value(table, right))


def in_range(table: Table, lo: list[str] | None, hi: list[str] | None, alias: str | None = None) -> sql.Composable:
    """lo < key <= hi, either end open when None."""
    parts = []
    if lo is not None:
        parts.append(compare(table, ">", lo, alias))
    if hi is not None:
        parts.append(compare(table, "<=", hi, alias))
    return sql.SQL(" AND ").join(parts) if parts else sql.SQL("true")


def key_equal(table: Table, left: str, right: str) -> sql.Composable:
    return sql.SQL(" AND ").join(
        sql.SQL("{} = {}").format(sql.Identifier(left, k), sql.Identifier(right, k)) for k in table.key
    )

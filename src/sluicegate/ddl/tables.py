"""Which tables a workflow that moves schemas whole takes in (its options), read without a server.

A CREATE TABLE replayed in a schema the workflow moves whole joins the stream (workflow/ddl_tables.py does the
joining); a table left out by name at create never joins.
"""

from __future__ import annotations

from ..postgres import catalog

SCHEMAS = "whole_schemas"  # option: the schemas whose every table the workflow moves (new ones join)
EXCLUDED = "excluded_tables"  # option: tables of those schemas left out at create (they never join)


def joins(options: dict, schema: str, name: str) -> bool:
    """A table made in this schema joins the workflow: it moves the schema whole, and the table was not
    left out by name."""
    return schema in (options.get(SCHEMAS) or ()) and f"{schema}.{name}" not in (options.get(EXCLUDED) or ())


def whole_schemas(tables: list[str] | None) -> list[str]:
    """The schemas a MoveTables' --tables names whole: none given (schema public), or `SCHEMA.*`."""
    if not tables:
        return ["public"]
    out = []
    for raw in tables:
        raw = raw.strip()
        if raw.endswith(".*"):
            schema = catalog.split_name(raw[:-2] + ".x")[0]
            if schema not in out:
                out.append(schema)
    return out


def qualified_names(names: list[str]) -> list[str]:
    """'schema.name' of each name as a user wrote it (a bare name: schema public, as --exclude-tables reads it)."""
    out = []
    for raw in names:
        schema, name = catalog.split_name(raw.strip())
        out.append(f"{schema or 'public'}.{name}")
    return out

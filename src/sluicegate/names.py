"""Table names as SQL (and psql) writes them: quoted only where needed; the names of a workflow's objects. Pure:
imported by the CLI's output."""

from __future__ import annotations

import hashlib
import re


def quote_name(schema: str, name: str) -> str:
    """'public.orders', '"Sales Dept"."Order Items"': a qualified name as SQL (and psql) prints it."""
    return ".".join(_quote_ident(p) for p in (schema, name))


def shown(qualified: str) -> str:
    """A state key ('Sales Dept.Order Items') as SQL writes the name ('"Sales Dept"."Order Items"')."""
    schema, _, name = qualified.partition(".")
    return quote_name(schema, name) if name else qualified


def _quote_ident(part: str) -> str:
    plain = part and (part[0].isalpha() and part[0].islower() or part[0] == "_") and all(
        ch.islower() or ch.isdigit() or ch in "_$" for ch in part) and part.isascii()
    return part if plain else '"' + part.replace('"', '""') + '"'


def object_name(prefix: str, workflow: str) -> str:
    """Slot/publication name for a workflow: lowercase [a-z0-9_], <= 63 bytes, unique by a hash."""
    clean = re.sub(r"[^a-z0-9_]", "_", workflow.lower())[:40]
    digest = hashlib.sha1(workflow.encode()).hexdigest()[:8]
    return f"{prefix}_{clean}_{digest}"

"""Creating and deleting workflows: validate everything first, then create in one target transaction."""

from __future__ import annotations

from psycopg import sql

from ..errors import UsageError
from ..postgres import capture, catalog
from ..postgres.connect import connect
from . import state as st


def create_movetables(name: str, source_url: str, target_url: str, tables: list[str] | None,
                      rules: list[str], options: dict) -> list[str]:
    """Returns the qualified names of the moved tables. Creates nothing if anything is wrong."""
    if not name or len(name) > 100:
        raise UsageError("a workflow name is 1 to 100 characters")
    if rules:
        raise UsageError("--rule is not supported yet: move whole tables with --tables")
    with connect(source_url, role="source") as src:
        capture.check_source(src)
        described = catalog.resolve_tables(src, tables)
    with connect(target_url, role="target") as dst:
        if dst.info.server_version < 140000:
            raise UsageError(f"target runs PostgreSQL {dst.info.server_version // 10000}; Sluicegate needs 14 or newer")
        with dst.transaction():
            st.ensure_schema(dst)
            if dst.execute("SELECT 1 FROM sluicegate.workflows WHERE name = %s", (name,)).fetchone():
                raise UsageError(
                    f"workflow {name!r} already exists on this target: pick another name, or "
                    f"`sluicegate workflow delete {name}` first"
                )
            for t in described:
                if not catalog.prepare_target(dst, t):
                    has_rows = dst.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(t.ident)).fetchone()[0]
                    if has_rows:
                        raise UsageError(
                            f"target table {t.qualified} already has rows: MoveTables fills empty tables; "
                            f"empty it (TRUNCATE) or drop it first"
                        )
            st.create_workflow(dst, name, "MoveTables", source_url, options, described)
    return [t.qualified for t in described]


def delete_workflow(name: str, target_url: str) -> list[str]:
    """Drop the source's slot and publication, then the state. The target tables stay."""
    with connect(target_url, role="target") as dst:
        wf = st.load_workflow(dst, name)
    dropped: list[str] = []
    with connect(wf.source_url, role="source", autocommit=True) as src:
        for s in wf.streams:
            dropped += capture.drop_capture(src, s.slot_name, s.publication)
    with connect(target_url, role="target") as dst:
        st.delete_workflow(dst, name)
    return dropped

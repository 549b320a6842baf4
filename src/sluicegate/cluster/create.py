"""`replicate create`: check the source and every sink, decide each sink table's bootstrap, then create.

The decision for a new setup follows the seed's chart: a sink table that is missing (created now) or empty is
bootstrapped by a copy from the source; one that already holds rows is refused, naming the tables, unless the
user asked for them to be overwritten by the copy. Nothing is created anywhere unless every check passed on
every sink: each sink's state is made in its own transaction, and all of them commit at the end.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..errors import UsageError
from ..postgres import capture, catalog, locks, replication
from ..postgres.catalog import Table
from ..postgres.connect import connect, describe, first_line, strip_password
from ..postgres.identity import identify, same_database
from ..workflow import state as st
from ..workflow.create import (
    _check_no_leftovers,
    _check_source_role,
    _check_table_rights,
    check_not_the_source,
)
from .model import KIND, Cluster, slot_name


@dataclass(frozen=True)
class Decision:
    sink: str
    url: str
    table: str
    action: str  # "copy" or "refuse"
    reason: str

    def line(self) -> str:
        return f"sink {self.sink} ({describe(self.url)}), table {self.table}: {self.action} — {self.reason}"


def create_replicate(name: str, source_url: str, sink_urls: list[str], tables: list[str] | None,
                     exclude: list[str] | None, options: dict, *, overwrite: bool = False,
                     max_retained_wal: int | None = None, max_retention_age: float | None = None) -> list[Decision]:
    """The bootstrap decision per sink and table; raises UsageError (nothing created) if any check fails."""
    st.check_name(name)
    if not sink_urls:
        raise UsageError("replicate create needs at least one --sink URL")
    sinks = {f"s{i}": url for i, url in enumerate(sink_urls, 1)}
    with ExitStack() as stack:
        src = stack.enter_context(connect(source_url, role="source", autocommit=True))
        try:
            capture.check_source(src)
            superuser = _check_source_role(src)
            described = catalog.exclude_tables(catalog.resolve_tables(src, tables), exclude)
            if not superuser:
                _check_table_rights(src, described)
            replication.check_replication_access(source_url)
            for sink in sinks:
                _check_no_leftovers(src, name, slot_name(name, sink))
            _check_slots_available(src, len(sinks))
            identity = identify(src).to_json()
        except psycopg.Error as exc:
            raise UsageError(f"source {describe(source_url)}: {first_line(exc)}") from None
        conns: dict[str, psycopg.Connection] = {}
        for sink, url in sinks.items():
            conn = stack.enter_context(connect(url, role="target"))
            try:
                check_not_the_source(src, conn, f"sink {sink}", url)
                for other, seen in conns.items():
                    if same_database(seen, conn):
                        raise UsageError(f"sinks {other} ({describe(sinks[other])}) and {sink} ({describe(url)}) are "
                                         f"the same database: name each sink once")
                if conn.info.server_version < 140000:
                    raise UsageError(f"sink {sink} ({describe(url)}) runs PostgreSQL "
                                     f"{conn.info.server_version // 10000}; Sluicegate needs 14 or newer")
                conn.commit()  # the identity checks' snapshot: the sink's transaction below starts clean
            except psycopg.Error as exc:
                raise UsageError(f"sink {sink} ({describe(url)}): {first_line(exc)}") from None
            conns[sink] = conn
        decisions = []
        for sink, conn in conns.items():
            try:
                decisions += _sink_decisions(conn, name, sink, sinks[sink], described, overwrite)
            except psycopg.Error as exc:
                raise UsageError(f"sink {sink} ({describe(sinks[sink])}): {first_line(exc)}") from None
        refused = [d for d in decisions if d.action == "refuse"]
        if refused:
            by_sink: dict[str, list[str]] = {}
            for d in refused:
                by_sink.setdefault(f"sink {d.sink} ({describe(d.url)})", []).append(d.table)
            raise UsageError(
                "sink tables already hold rows: " + "; ".join(f"{s}: {', '.join(t)}" for s, t in by_sink.items())
                + ". A new replication copies into empty tables: empty them, or pass --overwrite to replace their "
                  "rows by the copy"
            )
        stored = {s: strip_password(u) for s, u in sinks.items()}
        for sink, conn in conns.items():
            cluster = Cluster(name, source_url, stored, sink, max_retained_wal, max_retention_age)
            try:
                st.insert_workflow(conn, name, KIND, source_url, {**options, "cluster": cluster.to_json()})
                st.add_stream(conn, name, "0", None, slot_name(name, sink), described, None, identity)
            except psycopg.Error as exc:
                raise UsageError(f"sink {sink} ({describe(sinks[sink])}): {first_line(exc)}") from None
        for conn in conns.values():  # every check passed on every sink: now commit them all
            conn.commit()
    return decisions


def _sink_decisions(conn: psycopg.Connection, name: str, sink: str, url: str, described: list[Table],
                    overwrite: bool) -> list[Decision]:
    """Create the sink's missing tables (in the caller's transaction) and decide each table's bootstrap."""
    rels = ["sluicegate.workflows", *(t.ident.as_string(conn) for t in described)]
    with locks.guard(conn, f"creating workflow {name} on sink {sink}", rels, then="try again"):
        st.ensure_schema(conn)
        st.check_new_name(conn, name)
        return decide_tables(conn, name, sink, url, described, overwrite)


def decide_tables(conn: psycopg.Connection, name: str, sink: str, url: str, described: list[Table],
            overwrite: bool) -> list[Decision]:
    """A new table's bootstrap on one sink: copy into a missing (created now) or empty table, or into one
    with rows only when --overwrite says so; else refuse."""
    writers = [(t, w) for t, w in st.workflows_writing(conn, [t.qualified for t in described]) if w != name]
    if writers:
        table, workflow = writers[0]
        raise UsageError(f"sink {sink} ({describe(url)}) is already the target of workflow {workflow!r}, which "
                         f"writes {table}: one workflow per sink table; delete {workflow!r} or leave the table out")
    out = []
    for t in described:
        if catalog.prepare_target(conn, t):
            out.append(Decision(sink, url, t.qualified, "copy", "new setup, sink table created"))
        elif not conn.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(t.ident)).fetchone()[0]:
            out.append(Decision(sink, url, t.qualified, "copy", "new setup, sink table empty"))
        elif overwrite:
            out.append(Decision(sink, url, t.qualified, "copy",
                                "new setup, sink rows will be replaced by the copy (--overwrite)"))
        else:
            out.append(Decision(sink, url, t.qualified, "refuse", "new setup, sink table holds rows"))
    return out


def _check_slots_available(src: psycopg.Connection, wanted: int) -> None:
    """A slot per sink: say so now if the source has no room for them, not at the first run."""
    limit, used = src.execute(
        "SELECT current_setting('max_replication_slots')::int, (SELECT count(*) FROM pg_replication_slots)"
    ).fetchone()
    if used + wanted > limit:
        raise UsageError(f"source has max_replication_slots = {limit} with {used} in use; this workflow needs "
                         f"{wanted} more (one per sink): raise max_replication_slots and restart the source")

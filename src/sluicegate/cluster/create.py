"""`replicate create`: check the source and every sink, decide each sink table's bootstrap, then create.

The decision for a new setup follows the seed's chart: a sink table that is missing (created now) or empty is
bootstrapped by a copy from the source; one that already holds rows is refused, naming the tables, unless the
user asked for them to be overwritten by the copy. Nothing is created anywhere unless every check passed on
every sink: each sink's state is made in its own transaction, and all of them commit at the end.

`--bidirectional` (one source A, one sink B) makes the two one-way directions of an active-active pair under
one name: A->B, state on B, which bootstraps B by a copy as above; and B->A, state on A, which copies nothing
(A is the copy's source) and replicates B's changes from a slot made on B now, so B's writes are kept from
this moment. Writes each direction applies carry its replication origin and the other direction's capture
drops them (postgres/origins.py): the copy's rows on B never come back to A.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, replace

import psycopg
from psycopg import sql

from .. import config
from ..appliers import lww
from ..ddl import capture as ddl_capture
from ..errors import UsageError
from ..postgres import capture, catalog, locks, replication, table_definition
from ..postgres.catalog import Table
from ..postgres.connect import connect, describe, first_line, strip_password, usage_errors
from ..postgres.identity import identify, same_database
from ..postgres.needs import BIDIRECTIONAL
from ..preflight.probes import privileged, table_exists
from ..preflight.report import refuse
from ..workflow import state as st
from ..workflow.create_checks import (
    check_no_leftovers,
    check_not_the_source,
    check_slots_available,
    check_source_role,
    check_source_tables,
    check_table_rights,
    workflows_reading,
)
from ..workflow.denial import deny
from . import schema_safety
from . import sinks as sink_kinds
from .model import KIND, Cluster, slot_name

CLUSTER_IDS = {"a": 1, "b": 2}  # a bidirectional pair's fixed ids: --source is a, --sink is b
CREATED = "new setup, sink table created"


@dataclass(frozen=True)
class Decision:
    sink: str
    url: str
    table: str
    action: str  # "copy", "refuse", or "replicate" (a bidirectional source: nothing to copy)
    reason: str

    def line(self) -> str:
        return f"sink {self.sink} ({describe(self.url)}), table {self.table}: {self.action} — {self.reason}"


def create_replicate(name: str, source_url: str, sink_urls: list[str], tables: list[str] | None,
                     exclude: list[str] | None, options: dict, *, overwrite: bool = False,
                     max_retained_wal: int | None = None, max_retention_age: float | None = None,
                     bidirectional: bool = False, allow_unsafe_schema: bool = False,
                     tombstone_retention: float | None = None, warn=None,
                     notes: list[str] | None = None) -> list[Decision]:
    """The bootstrap decision per sink and table; raises UsageError (nothing created) if any check fails.
    `warn`: told each check that --allow-unsafe-schema overrode, and each note on TOAST (schema_safety).
    `notes`: given a list, gets a line for each
    part of a source table's definition that a sink table made here does not get."""
    st.check_name(name)
    config.check_options(options)
    if not sink_urls:
        raise UsageError("replicate create needs at least one --sink URL")
    if bidirectional and len(sink_urls) != 1:
        raise UsageError(f"--bidirectional replicates between two clusters (--source and one --sink), "
                         f"{len(sink_urls) + 1} were given: name exactly one --sink")
    sinks = {"b": sink_urls[0]} if bidirectional else {f"s{i}": url for i, url in enumerate(sink_urls, 1)}
    order = list(sinks)
    sinks, others = sink_kinds.split(sinks)  # Delta sinks (delta:PATH): targets/delta/sink.py, through sinks.py
    if others and bidirectional:
        lake = next(iter(others.values()))
        raise UsageError(f"--bidirectional replicates back from the sink: a {sink_kinds.kind_of(lake).label} "
                         f"({lake}) cannot be a "
                         f"source; use a PostgreSQL sink, or leave out --bidirectional")
    others = {s: sink_kinds.kind_of(u).url(u) for s, u in others.items()}
    with ExitStack() as stack:
        src = stack.enter_context(connect(source_url, role="source", autocommit=True))
        with usage_errors(f"source {describe(source_url)}"):
            described = check_source_tables(src, source_url, tables, exclude)
            if bidirectional:
                catalog.refuse_keyless(described, "--bidirectional resolves conflicts by last writer wins per key; "
                                                  "add a primary key on the source, or leave the table out")
            for sink in [*sinks, *others]:
                check_no_leftovers(src, name, slot_name(name, sink))
            check_slots_available(src, len(sinks) + len(others))
            identity = identify(src).to_json()
            if notes is not None and (note := ddl_capture.missing_note(src, "source", options)):
                notes.append(note)
            source_lsn = capture.wal_insert_position(src)
            # One way, a sink table is made like its source table (postgres/table_definition.py); both ways,
            # the last-writer-wins applier takes sink tables of columns and key only.
            definitions = None if bidirectional else _definitions(src, described)
        conns = open_sinks(stack, sinks, [(src, "")], pair=name if bidirectional else None)
        if bidirectional:
            _check_pair(src, conns["b"], name, source_url, sinks["b"], described, allow_unsafe_schema, warn)
            # B is the source of B->A: a statement run there reaches A only through B's capture
            if notes is not None and (note := ddl_capture.missing_note(conns["b"], "sink", options)):
                notes.append(note)
        decisions = []
        for sink, conn in conns.items():
            with usage_errors(f"sink {sink} ({describe(sinks[sink])})"):
                decisions += _sink_decisions(conn, name, sink, sinks[sink], described, overwrite, definitions)
        for kind, group in sink_kinds.by_kind(others):
            decisions += kind.check_new(name, group, described, overwrite, source_lsn)
        decisions.sort(key=lambda d: order.index(d.sink))
        refuse_rows(decisions)
        if notes is not None and definitions:
            made = {d.table for d in decisions if d.reason == CREATED}
            notes.extend(dict.fromkeys(line for q in made for line in definitions[q].not_carried))
        peer = None
        if bidirectional:  # A is the sink of B->A: its state, checked before anything is written
            peer = stack.enter_context(connect(source_url, role="target"))
            with usage_errors(f"source {describe(source_url)}"):
                _prepare_peer(peer, name, source_url, described)
        every = {**sinks, **others}
        stored = {s: strip_password(every[s]) for s in order}
        for sink, conn in conns.items():
            cluster = Cluster(name, source_url, stored, sink, max_retained_wal, max_retention_age,
                              bidirectional, dict(CLUSTER_IDS) if bidirectional else {},
                              tombstone_retention if bidirectional else None)
            with usage_errors(f"sink {sink} ({describe(sinks[sink])})"):
                st.insert_workflow(conn, name, KIND, source_url, {**options, "cluster": cluster.to_json()})
                st.add_stream(conn, name, "0", None, slot_name(name, sink), described, None, identity)
                if bidirectional:  # the application's deletes on B leave tombstones (appliers/lww.py)
                    for t in described:
                        lww.install_tombstone_triggers(conn, t, CLUSTER_IDS[sink])
                    # Until a table's copy from A is done, a write on B would be cleared from B by the copy
                    # yet replicated to A: the sides would differ for good. Refused instead; the engine drops
                    # the denial in the commit that ends the table's copy.
                    deny(conn, described, cluster.origin,
                         f"it is being copied from {describe(source_url)} (active-active workflow {name}); write "
                         f"it there until `sluicegate workflow status {name}` on this side shows Running")
        if peer is not None:
            back = Cluster(name, sinks["b"], {"a": strip_password(source_url)}, "a", max_retained_wal,
                           max_retention_age, True, dict(CLUSTER_IDS), tombstone_retention)
            with usage_errors(f"source {describe(source_url)}"):
                st.insert_workflow(peer, name, KIND, sinks["b"], {**options, "cluster": back.to_json()})
                st.add_stream(peer, name, "0", None, slot_name(name, "a"), described, None,
                              identify(conns["b"]).to_json())
                # A is the copy's source: B->A has nothing to copy, only B's changes to replicate
                peer.execute("""UPDATE sluicegate.copy_state SET done = true WHERE stream_id IN
                                (SELECT id FROM sluicegate.streams WHERE workflow = %s)""", (name,))
                for t in described:
                    lww.install_tombstone_triggers(peer, t, CLUSTER_IDS["a"])
            decisions += [Decision("a", source_url, t.qualified, "replicate",
                                   "the copy's source: nothing copied, the sink's changes replicate back")
                          for t in described]
        # every check passed on every sink: the Delta sinks' tables and state, then the others' commits
        for kind, group in sink_kinds.by_kind(others):
            kind.create(name, source_url, group, stored, described, options, max_retained_wal, max_retention_age)
        for conn in conns.values():
            conn.commit()
        if peer is not None:
            peer.commit()
    if bidirectional:
        _capture_back(name, sinks["b"], described, warn)
    return decisions


def _check_pair(a: psycopg.Connection, b: psycopg.Connection, name: str, a_url: str, b_url: str,
                described: list[Table], allow_unsafe: bool, warn) -> None:
    """What a bidirectional pair needs beyond a one-way sink: B is a source too (of B->A), both keep commit
    timestamps and may use replication origins, no other workflow makes a loop with it, and no table's schema
    is unsafe with writes on both sides. `a` is in autocommit, `b` in a transaction (rolled back here)."""
    for side, conn, url in (("source", a, a_url), ("sink", b, b_url)):
        with usage_errors(f"{side} {describe(url)}"):
            if conn.execute("SHOW track_commit_timestamp").fetchone()[0] != "on":
                raise UsageError(f"{side} {describe(url)} has track_commit_timestamp = off; bidirectional "
                                 f"replication resolves conflicts by commit time: ALTER SYSTEM SET "
                                 f"track_commit_timestamp = on, then restart that server")
            # the origin functions and the settings both directions' appliers use (postgres/needs.py)
            refuse(privileged(conn, f"{side} {describe(url)}", {BIDIRECTIONAL}))
    try:  # B as the source of B->A
        capture.check_source(b)
        superuser = check_source_role(b)
        if not superuser:
            check_table_rights(b, [t for t in described if table_exists(b, t)])
        check_no_leftovers(b, name, slot_name(name, "a"))
        check_slots_available(b, 1)
        # A loop through another workflow: one that already writes B from A (B->A would send its rows back).
        loops = [w for w, _ in workflows_reading(b, a) if w != name]
        if loops:
            raise UsageError(f"workflow {loops[0]!r} already replicates the source {describe(a_url)} into the "
                             f"sink {describe(b_url)} (its state is on the sink): the direction back would carry "
                             f"its changes around in a loop; delete {loops[0]!r} first, or pair other clusters")
        unsafe = schema_safety.problems(a, b, ("source", "sink"), described)
        notes = [line for side, conn in (("source", a), ("sink", b))
                 for line in schema_safety.toast_notes(conn, side, [t for t in described
                                                                    if table_exists(conn, t)])]
    except psycopg.Error as exc:
        raise UsageError(f"sink {describe(b_url)}: {first_line(exc)}") from None
    finally:
        b.rollback()
    replication.check_replication_access(b_url)
    if unsafe and not allow_unsafe:
        raise UsageError(f"unsafe schema for active-active replication: {unsafe[0]}"
                         + (f" (and {len(unsafe) - 1} more)" if len(unsafe) > 1 else ""))
    if warn is not None:
        for line in unsafe:
            warn(f"--allow-unsafe-schema: {line.rsplit(', or pass --allow-unsafe-schema', 1)[0]}")
        for line in notes:
            warn(line)


def _prepare_peer(conn: psycopg.Connection, name: str, url: str, described: list[Table]) -> None:
    """A as the sink of B->A, in the caller's transaction: its state schema; the name free; no other workflow
    writing its tables."""
    with locks.guard(conn, f"creating workflow {name} on the source", ["sluicegate.workflows"],
                     then="try again"):
        st.ensure_schema(conn)
        st.check_new_name(conn, name)
        names = [t.qualified for t in described]
        writers = [(t, w) for t, w in st.workflows_writing(conn, names) if w != name]
        if writers:
            table, workflow = writers[0]
            raise UsageError(f"source {describe(url)} is the target of workflow {workflow!r}, which writes "
                             f"{table}: a bidirectional pair's tables take writes from it alone; delete "
                             f"{workflow!r} or leave the table out")


def _capture_back(name: str, b_url: str, described: list[Table], warn) -> None:
    """B's publication and slot for B->A, made now (after B's tables exist, committed): B's writes are kept
    from here on, whenever A's consumer first runs; and the copy into B, later, carries its origin."""
    slot = slot_name(name, "a")
    try:
        with connect(b_url, role="source", autocommit=True) as b:
            capture.ensure_publication(b, slot, described)
            capture.ensure_slot(b, slot)
    except (psycopg.Error, UsageError) as exc:  # the direction's Init makes them at its first run
        if warn is not None:
            why = first_line(exc) if isinstance(exc, psycopg.Error) else str(exc)
            warn(f"could not make replication slot {slot} on the sink yet ({why}); "
                 f"the source's consumer makes it at its first run, and the sink's writes before then are "
                 f"not replicated back")


def open_sinks(stack: ExitStack, sinks: dict[str, str], sources: list[tuple[psycopg.Connection, str]],
               pair: str | None = None) -> dict[str, psycopg.Connection]:
    """A transaction on each sink, checked first: not a source (`sources`: (connection, label for the
    message)), not another sink by another URL, PostgreSQL 14+. Nothing is written yet."""
    conns: dict[str, psycopg.Connection] = {}
    for sink, url in sinks.items():
        conn = stack.enter_context(connect(url, role="target"))
        with usage_errors(f"sink {sink} ({describe(url)})"):
            for src, label in sources:
                check_not_the_source(src, conn, f"sink {sink}{label}", url, pair=pair)
            for other, seen in conns.items():
                if same_database(seen, conn):
                    raise UsageError(f"sinks {other} ({describe(sinks[other])}) and {sink} ({describe(url)}) are "
                                     f"the same database: name each sink once")
            if conn.info.server_version < 140000:
                raise UsageError(f"sink {sink} ({describe(url)}) runs PostgreSQL "
                                 f"{conn.info.server_version // 10000}; Sluicegate needs 14 or newer")
            conn.commit()  # the identity checks' snapshot: the sink's transaction below starts clean
        conns[sink] = conn
    return conns


def refuse_rows(decisions: list[Decision]) -> None:
    """The chart's refusal: sink tables that hold rows, by sink, in one line; nothing has been created."""
    by_sink: dict[str, list[str]] = {}
    for d in decisions:
        if d.action == "refuse":
            by_sink.setdefault(f"sink {d.sink} ({describe(d.url)})", []).append(d.table)
    if by_sink:
        raise UsageError(
            "sink tables already hold rows: " + "; ".join(f"{s}: {', '.join(t)}" for s, t in by_sink.items())
            + ". A new replication copies into empty tables: empty them, or pass --overwrite to replace their "
              "rows by the copy")


def _definitions(src: psycopg.Connection, described: list[Table]) -> dict:
    """The source tables' definitions for sink tables made here, without foreign keys (listed instead): a
    bootstrap copies a sink's tables one at a time, so they would not hold between its copies."""
    out = {}
    for q, d in table_definition.read(src, described).items():
        lines = [f"table {q}: foreign key {fk.name} ({fk.definition}) not carried: Replicate does not carry "
                 f"foreign keys" for fk in d.foreign_keys]
        out[q] = replace(d, foreign_keys=(), not_carried=(*d.not_carried, *lines))
    return out


def _sink_decisions(conn: psycopg.Connection, name: str, sink: str, url: str, described: list[Table],
                    overwrite: bool, definitions: dict | None = None) -> list[Decision]:
    """Create the sink's missing tables (in the caller's transaction) and decide each table's bootstrap."""
    rels = ["sluicegate.workflows", *(t.ident.as_string(conn) for t in described)]
    with locks.guard(conn, f"creating workflow {name} on sink {sink}", rels, then="try again"):
        st.ensure_schema(conn)
        st.check_new_name(conn, name)
        return decide_tables(conn, name, sink, url, described, overwrite, definitions)


def decide_tables(conn: psycopg.Connection, name: str, sink: str, url: str, described: list[Table],
                  overwrite: bool, definitions: dict | None = None) -> list[Decision]:
    """A new table's bootstrap on one sink: copy into a missing (created now) or empty table, or into one
    with rows only when --overwrite says so; else refuse. `definitions`: TableDefinitions by qualified name,
    for sink tables made in full."""
    writers = [(t, w) for t, w in st.workflows_writing(conn, [t.qualified for t in described]) if w != name]
    if writers:
        table, workflow = writers[0]
        raise UsageError(f"sink {sink} ({describe(url)}) is already the target of workflow {workflow!r}, which "
                         f"writes {table}: one workflow per sink table; delete {workflow!r} or leave the table out")
    out = []
    for t in described:
        created = catalog.prepare_target(conn, t, (definitions or {}).get(t.qualified))
        empty = created or not conn.execute(
            sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(t.ident)).fetchone()[0]
        out.append(new_table_decision(sink, url, t.qualified, created, empty, overwrite))
    return out


def new_table_decision(sink: str, url: str, table: str, created: bool, empty: bool, overwrite: bool,
                       noun: str = "sink table") -> Decision:
    """The chart for a new setup's table: copy into one made now or empty, into one with rows only under
    --overwrite; else refuse. `noun`: what the sink's table is called in the reason."""
    if created:
        return Decision(sink, url, table, "copy", CREATED.replace("sink table", noun))
    if empty:
        return Decision(sink, url, table, "copy", f"new setup, {noun} empty")
    if overwrite:
        return Decision(sink, url, table, "copy", f"new setup, {noun} rows will be replaced by the copy "
                                                  f"(--overwrite)")
    return Decision(sink, url, table, "refuse", f"new setup, {noun} holds rows")


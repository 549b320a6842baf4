"""A planned workflow and what it asks of each database it touches.

A MoveTables or Reshard is made to switch traffic: from then on its target is read as a source (its slot and
publication) and its source is written as a target (the reverse stream's state), so both are checked for both
roles. An active-active Replicate's two clusters are each source and sink too. A Delta sink asks nothing of a
database but its source's."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import psycopg

from ..ddl import capture as ddl_capture
from ..errors import SluicegateError
from ..names import object_name
from ..postgres import needs as nd
from ..postgres.catalog import Table
from ..postgres.connect import connect, describe, first_line
from . import probes
from .report import Problem

SWITCHES = ("MoveTables", "Reshard")  # kinds whose traffic switches to the target (workflow/traffic.py)


@dataclass
class Plan:
    kind: str  # MoveTables, Materialize, Reshard, Replicate
    sources: list[str]  # a source's URL, or a keyspace's shards'
    targets: list[str]  # target or sink URLs: PostgreSQL, or delta:…
    tables: list[str] | None = None  # as --tables/--schemas give them; None: all of schema public
    exclude: list[str] | None = None
    rules: bool = False  # rules transform rows: no foreign keys carried, no switch of traffic
    bidirectional: bool = False
    workflow: str | None = None  # its publication may already exist (add-tables, a second sink)
    # (schema, name) of the tables written on the target when they are not the source's (rules' targets)
    target_tables: list[tuple[str, str]] | None = None
    on_ddl: str = "stop"  # --on-ddl: anything but stop needs the source's DDL capture (ddl/capture.py)
    target_standbys: bool = False  # confirms only what the targets' standbys flushed (postgres/standby_flush.py)
    unprobed: frozenset[str] = frozenset()  # targets that are no database to probe (targets/: Target.probed)
    # The tables as the caller has just described them on its one source (create does): not described again,
    # a dozen catalog queries a table
    described: list[Table] | None = None

    @property
    def switches(self) -> bool:
        return self.kind in SWITCHES and not self.rules

    def slots_per_source(self) -> int:
        """Slots a source gives the workflow: one per sink (Replicate) or per target shard (Reshard)."""
        return max(1, len(self.targets)) if self.kind in ("Replicate", "Reshard") else 1


def check(plan: Plan) -> list[Problem]:
    """Every problem of the plan, on every database, sources first."""
    problems: list[Problem] = []
    tables: list[Table] = []
    fks = False
    publication = object_name("sg", plan.workflow) if plan.workflow else None
    for url in plan.sources:
        where = f"source {describe(url)}"
        conn = _connect(url, "source", where, problems)
        if conn is None:
            continue
        with conn, _reported(where, problems):
            if plan.described is not None and len(plan.sources) == 1:
                found, p = plan.described, []
            else:
                found, p = probes.source_tables(conn, where, plan.tables, plan.exclude)
            tables = tables or found
            fks = fks or (plan.kind != "Replicate" and not plan.rules and probes.foreign_keys_between(conn, found))
            p += probes.settings(conn, where, plan.slots_per_source(), plan.bidirectional)
            p += probes.source_role(conn, where, found, publication)
            p += probes.replication_access(conn, url, where)
            if plan.bidirectional or plan.switches:  # written as a target too: its state (it owns the tables)
                p += probes.target_rights(conn, where, [])
            p += probes.privileged(conn, where, _uses(plan, fks))
            p += _ddl_capture(conn, where, plan.on_ddl)
            problems += p
    for url in plan.targets:
        if url in plan.unprobed:
            continue
        where = f"{'sink' if plan.kind == 'Replicate' else 'target'} {describe(url)}"
        conn = _connect(url, "target", where, problems)
        if conn is None:
            continue
        with conn, _reported(where, problems):
            written = tables if plan.target_tables is None else [Table(s, n, (), ()) for s, n in plan.target_tables]
            p = probes.target_rights(conn, where, written)
            uses = _uses(plan, fks)
            p += _fk_problems(conn, where, uses) if nd.REPLICA_ROLE in uses and not plan.bidirectional else \
                probes.privileged(conn, where, uses)
            if plan.target_standbys:
                p += probes.privileged(conn, where, {nd.TARGET_STANDBYS})
            if plan.bidirectional or plan.switches:  # read as a source too
                existing = [t for t in tables if probes.table_exists(conn, t)]
                p += probes.settings(conn, where, 1, plan.bidirectional)
                p += probes.source_role(conn, where, existing, publication)
                p += probes.replication_access(conn, url, where)
            problems += p
    return _merged(problems)


def _merged(problems: list[Problem]) -> list[Problem]:
    """One problem per fix and database (a GRANT CREATE ON DATABASE serves the publication and the state)."""
    out: dict[tuple, Problem] = {}
    for p in problems:
        key = (p.database, p.fix) if p.fix else (p.database, p.what)
        if key in out:
            first = out[key]
            out[key] = replace(first, what=f"{first.what}; and {p.what.split(': ', 1)[-1]}"
                               if p.what != first.what else first.what)
        else:
            out[key] = p
    return list(out.values())


def _uses(plan: Plan, fks: bool) -> set[str]:
    return {use for use, on in ((nd.BIDIRECTIONAL, plan.bidirectional), (nd.REPLICA_ROLE, fks)) if on}


def _fk_problems(conn: psycopg.Connection, where: str, uses: set[str]) -> list[Problem]:
    """A MoveTables without session_replication_role runs, without the foreign keys: create leaves them out
    (with a note), so this is a warning."""
    return [replace(p, what=f"{p.what}; without it `create` leaves the foreign keys between the moved tables "
                    "out", severity="warning") for p in probes.privileged(conn, where, uses)]


@contextmanager
def _reported(where: str, problems: list[Problem]):
    """A database error that stops the checks of one database is a problem of that database, not a crash."""
    try:
        yield
    except psycopg.Error as exc:
        problems.append(Problem(where, f"checking stopped: {first_line(exc)}", area="connection"))


def _connect(url: str, role: str, where: str, problems: list[Problem]) -> psycopg.Connection | None:
    try:
        return connect(url, role=role, autocommit=True, connect_timeout=10)
    except SluicegateError as exc:
        problems.append(Problem(where, f"cannot connect: {exc}", area="connection"))
        return None


def _ddl_capture(conn, where: str, on_ddl: str) -> list[Problem]:
    """--on-ddl other than stop acts only on statements the source captures: its event triggers, which only a
    superuser can install."""
    if on_ddl == "stop" or ddl_capture.installed(conn):
        return []
    return [Problem(where, f"--on-ddl {on_ddl}: the source captures no DDL statements (no Sluicegate event "
                           f"trigger); schema changes would meet only the Relation handling",
                    action="run `sluicegate ddl install --source URL` as a superuser (event triggers need one)",
                    severity="warning", area="setting")]

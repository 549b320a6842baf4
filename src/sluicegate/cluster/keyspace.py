"""`replicate create --source-shard RANGE=URL …`: a source that is a keyspace of shards (as in Reshard).

Each sink is one database that receives every shard's rows: it has one stream per source shard, with that
shard's own slot and publication on the shard (`slot_name(W, "SINK/RANGE")`). Each stream's tables carry a
moves-only rule keeping the rows of its shard's key range (Reshard's), so a copy cycle clears only that
shard's rows of the shared sink table, and a stray row on a shard cannot land twice. The sink's consumer runs
its streams as Reshard does (one Engine per stream), and its safe time is the minimum over them.

`replicate add-tables` gives the new tables the same rules (keyrange_rules; cluster/add_tables.py).
A column added on the source goes through the rule path, which stops the stream on column changes.
"""

from __future__ import annotations

from contextlib import ExitStack

import psycopg
from psycopg import sql

from .. import config
from ..errors import UsageError
from ..postgres import capture, catalog, replication
from ..postgres.catalog import Table
from ..postgres.connect import connect, describe, strip_password, usage_errors
from ..postgres.identity import identify
from ..sharding.keyrange import KeyRange
from ..workflow import state as st
from ..workflow.create_checks import (
    check_no_leftovers,
    check_same_tables,
    check_slots_available,
    check_source_role,
    check_table_rights,
)
from ..workflow.reshard import _identity, _sharding_columns
from .create import Decision, _sink_decisions, open_sinks, refuse_rows
from .model import KIND, Cluster

STRAY_SAMPLE = 10_000  # rows read per table and shard to catch a wrong sharding column


def keyrange_rules(sources: dict[str, psycopg.Connection], described: list[Table],
                   shard_keys: dict[str, str]) -> dict[str, dict]:
    """Per source shard, per table: the moves-only rule keeping the rows of that shard's key range. Refused
    when a shard holds rows outside its range by the sharding column: they would never be replicated."""
    columns = _sharding_columns(described, shard_keys)
    check_no_stray_rows(sources, described, columns)
    identity = {t.qualified: _identity(t) for t in described}
    rules = {}
    for shard in sources:
        r = KeyRange.parse(shard)
        rules[shard] = {t.qualified: identity[t.qualified].with_keyrange(c, r.lo, r.hi).to_json()
                        for t, c in zip(described, columns)}
    return rules


def check_no_stray_rows(sources: dict[str, psycopg.Connection], described: list[Table], columns: list[int]) -> None:
    """The first STRAY_SAMPLE rows of each table on each shard fall in that shard's range. A row outside it is
    skipped by every shard's rule, so a wrong --shard-key (the default is the first key column) would lose
    rows silently: it is refused here, before anything is made."""
    for t, c in zip(described, columns):
        column = t.column_names[c]
        for shard, conn in sources.items():
            query = sql.SQL("SELECT count(*) FILTER (WHERE NOT ({})), count(*) FROM (SELECT {} FROM {} LIMIT {}) s")
            with usage_errors(f"source shard {shard}, table {t.qualified}"):
                outside, seen = conn.execute(query.format(KeyRange.parse(shard).pg_filter(column),
                                                          sql.Identifier(column), t.scan,
                                                          sql.Literal(STRAY_SAMPLE))).fetchone()
            if outside:
                raise UsageError(
                    f"{outside} of the first {seen} rows of {t.qualified} on source shard {shard} lie outside its "
                    f"key range by column {column!r}, and would not be replicated: name the column the keyspace "
                    f"is sharded by with --shard-key {t.name}=COLUMN, or move those rows to their shard")


def create_keyspace_replicate(name: str, source_shards: dict[str, str], sink_urls: list[str],
                              tables: list[str] | None, exclude: list[str] | None, shard_keys: dict[str, str],
                              options: dict, *, overwrite: bool = False, max_retained_wal: int | None = None,
                              max_retention_age: float | None = None) -> list[Decision]:
    """As create_replicate, with a stream per (sink, source shard); nothing created unless every check passed."""

    st.check_name(name)
    config.check_options(options)
    if not sink_urls:
        raise UsageError("replicate create needs at least one --sink URL")
    if max_retention_age is not None:  # its samples date one server's WAL, and the shards are several
        raise UsageError("--max-retention-age is not supported with --source-shard yet: cap the WAL each "
                         "shard's slot holds with --max-retained-wal")
    sinks = {f"s{i}": url for i, url in enumerate(sink_urls, 1)}
    stored_shards = {s: strip_password(u) for s, u in source_shards.items()}
    probe = Cluster(name, "", {s: "" for s in sinks}, "", source_shards=stored_shards)
    first = next(iter(source_shards))
    with ExitStack() as stack:
        sources: dict[str, psycopg.Connection] = {}
        for shard, url in source_shards.items():
            conn = stack.enter_context(connect(url, role="source", autocommit=True))
            with usage_errors(f"source shard {shard} ({describe(url)})"):
                capture.check_source(conn)
                if shard == first:
                    described = catalog.exclude_tables(catalog.resolve_tables(conn, tables), exclude)
                    catalog.refuse_keyless(described, "a keyspace's shards are told apart by a key range; add "
                                                      "a primary key on the source, or leave the table out")
                check_same_tables(shard, conn, described, first)
                if not check_source_role(conn):
                    check_table_rights(conn, described)
                replication.check_replication_access(url)
                for sink in sinks:
                    check_no_leftovers(conn, name, probe.slot(sink, shard))
                check_slots_available(conn, len(sinks))
            sources[shard] = conn
        rules = keyrange_rules(sources, described, shard_keys)
        identities = {shard: identify(conn).to_json() for shard, conn in sources.items()}
        conns = open_sinks(stack, sinks, [(src, f" (source shard {shard})") for shard, src in sources.items()])
        decisions = []
        for sink, conn in conns.items():
            with usage_errors(f"sink {sink} ({describe(sinks[sink])})"):
                decisions += _sink_decisions(conn, name, sink, sinks[sink], described, overwrite)
        refuse_rows(decisions)
        stored = {s: strip_password(u) for s, u in sinks.items()}
        for sink, conn in conns.items():
            cluster = Cluster(name, stored_shards[first], stored, sink, max_retained_wal, max_retention_age,
                              source_shards=stored_shards)
            with usage_errors(f"sink {sink} ({describe(sinks[sink])})"):
                st.insert_workflow(conn, name, KIND, source_shards[first], {**options, "cluster": cluster.to_json()})
                for shard, url in source_shards.items():
                    st.add_stream(conn, name, shard, url, cluster.slot(sink, shard), described, rules[shard],
                                  identities[shard])
        for conn in conns.values():  # every check passed on every sink: now commit them all
            conn.commit()
    return decisions

"""`replicate create --source-shard RANGE=URL …`: a source that is a keyspace of shards (as in Reshard).

Each sink is one database that receives every shard's rows: it has one stream per source shard, with that
shard's own slot and publication on the shard (`slot_name(W, "SINK/RANGE")`). Each stream's tables carry a
moves-only rule keeping the rows of its shard's key range (Reshard's), so a copy cycle clears only that
shard's rows of the shared sink table, and a stray row on a shard cannot land twice. The sink's consumer runs
its streams as Reshard does (one Engine per stream), and its safe time is the minimum over them.

A column added on the source goes through the rule path, which stops the stream on column changes.
"""

from __future__ import annotations

from contextlib import ExitStack

import psycopg

from ..errors import UsageError
from ..postgres import capture, catalog, replication
from ..postgres.connect import connect, describe, first_line, strip_password
from ..postgres.identity import identify
from ..sharding.keyrange import KeyRange
from ..workflow import state as st
from ..workflow.create import (
    _check_no_leftovers,
    _check_source_role,
    _check_table_rights,
)
from ..workflow.reshard import _check_same_tables, _identity, _sharding_columns
from .create import Decision, _check_slots_available, _sink_decisions, open_sinks, refuse_rows
from .model import KIND, Cluster


def create_keyspace_replicate(name: str, source_shards: dict[str, str], sink_urls: list[str],
                              tables: list[str] | None, exclude: list[str] | None, shard_keys: dict[str, str],
                              options: dict, *, overwrite: bool = False, max_retained_wal: int | None = None,
                              max_retention_age: float | None = None) -> list[Decision]:
    """As create_replicate, with a stream per (sink, source shard); nothing created unless every check passed."""

    st.check_name(name)
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
            try:
                capture.check_source(conn)
                if shard == first:
                    described = catalog.exclude_tables(catalog.resolve_tables(conn, tables), exclude)
                _check_same_tables(shard, conn, described, first)
                if not _check_source_role(conn):
                    _check_table_rights(conn, described)
                replication.check_replication_access(url)
                for sink in sinks:
                    _check_no_leftovers(conn, name, probe.slot(sink, shard))
                _check_slots_available(conn, len(sinks))
            except psycopg.Error as exc:
                raise UsageError(f"source shard {shard} ({describe(url)}): {first_line(exc)}") from None
            sources[shard] = conn
        columns = _sharding_columns(described, shard_keys)
        identity = {t.qualified: _identity(t) for t in described}
        rules = {}
        for shard in source_shards:
            r = KeyRange.parse(shard)
            rules[shard] = {t.qualified: identity[t.qualified].with_keyrange(c, r.lo, r.hi).to_json()
                            for t, c in zip(described, columns)}
        identities = {shard: identify(conn).to_json() for shard, conn in sources.items()}
        conns = open_sinks(stack, sinks, [(src, f" (source shard {shard})") for shard, src in sources.items()])
        decisions = []
        for sink, conn in conns.items():
            try:
                decisions += _sink_decisions(conn, name, sink, sinks[sink], described, overwrite)
            except psycopg.Error as exc:
                raise UsageError(f"sink {sink} ({describe(sinks[sink])}): {first_line(exc)}") from None
        refuse_rows(decisions)
        stored = {s: strip_password(u) for s, u in sinks.items()}
        for sink, conn in conns.items():
            cluster = Cluster(name, stored_shards[first], stored, sink, max_retained_wal, max_retention_age,
                              source_shards=stored_shards)
            try:
                st.insert_workflow(conn, name, KIND, source_shards[first], {**options, "cluster": cluster.to_json()})
                for shard, url in source_shards.items():
                    st.add_stream(conn, name, shard, url, cluster.slot(sink, shard), described, rules[shard],
                                  identities[shard])
            except psycopg.Error as exc:
                raise UsageError(f"sink {sink} ({describe(sinks[sink])}): {first_line(exc)}") from None
        for conn in conns.values():  # every check passed on every sink: now commit them all
            conn.commit()
    return decisions

"""`replicate add-tables`: new tables joined to a running workflow, on every sink, nothing lost or doubled.

The hand-off that lost changes in YugabyteDB (their issue 16355) is a table whose changes start flowing at one
point while its copy reflects another. Here the order makes the two meet exactly, by the copy algorithm's own
rules: (1) the tables join every sink's publication on the source, so every change committed after that is
decoded for them; (2) each sink records them as not yet copied, and its stream goes back to Copying; a running
consumer skips their changes until their first copy cycle; (3) each table is then copied from its own snapshot,
taken after (1): everything committed before the snapshot is in the copy, everything after is replayed once,
for the rows copied so far (catchup and fast-forward, as for any table). The other tables keep replicating
between the copy's cycles. From a keyspace, each (sink, source shard) stream takes the tables with its shard's
key-range rule (keyspace.py), and (1) widens that shard's publication. A Delta sink takes the same steps on
its state document (targets/delta/sink.py: append_tables); there the other tables wait during the copy, which the lake
engine runs before it replays again.
"""

from __future__ import annotations

from contextlib import ExitStack

import psycopg

from ..errors import UsageError
from ..position import parse_lsn
from ..postgres import capture, catalog
from ..postgres.connect import connect, describe, usage_errors
from ..workflow import state as st
from ..workflow.create_checks import check_same_tables, check_source_role, check_table_rights
from .create import Decision, decide_tables, refuse_rows
from .keyspace import keyrange_rules
from .model import Cluster
from .sinks import AddedTables, kind_of


def add_tables(workflow: str, any_sink_url: str, tables: list[str], *, overwrite: bool = False,
               shard_keys: dict[str, str] | None = None) -> list[Decision]:
    """`shard_keys`: the new tables' sharding columns (TABLE=COLUMN), for a keyspace source (default: the
    key's first column, as at create)."""
    kind = kind_of(any_sink_url)
    if kind is not None:
        cluster = kind.cluster(any_sink_url, workflow)
    else:
        with connect(any_sink_url, role="target") as conn:
            cluster = Cluster.of(st.load_workflow(conn, workflow))
    if shard_keys and not cluster.source_shards:
        raise UsageError(f"--shard-key names a keyspace's sharding columns, and workflow {workflow!r} "
                         f"replicates one source database: leave it out")
    with ExitStack() as stack:
        # every source: the one database, or each shard of a keyspace (stream.source_shard names it)
        sources: dict[str, psycopg.Connection] = {}
        for shard, url in cluster.sources.items():
            where = f"source shard {shard} ({describe(url)})" if cluster.source_shards else f"source {describe(url)}"
            with usage_errors(where):
                conn = stack.enter_context(connect(url, role="source", autocommit=True))
                if not sources:
                    first = shard
                    new = catalog.resolve_tables(conn, tables)
                    if cluster.bidirectional:
                        catalog.refuse_keyless(new, "--bidirectional resolves conflicts by last writer wins "
                                                    "per key; add a primary key on the source, or leave it out")
                    elif cluster.source_shards:
                        catalog.refuse_keyless(new, "a keyspace's shards are told apart by a key range; add a "
                                                    "primary key on the source, or leave it out")
                else:
                    check_same_tables(shard, conn, new, first)
                if not check_source_role(conn):
                    check_table_rights(conn, new)
            sources[shard] = conn
        src = sources[first]
        sinks = {}
        others: dict[str, AddedTables] = {}  # Delta sinks (targets/delta/sink.py): what to do once every check passed
        decisions = []
        on_sinks: dict[str, list[str]] = {}  # table -> the sinks that already have it

        def not_on(sink: str, have: set[str]) -> list:
            """The new tables this sink does not have yet (one an earlier add-tables did not bring to every
            sink); those it has are noted in on_sinks."""
            for t in new:
                if t.qualified in have:
                    on_sinks.setdefault(t.qualified, []).append(sink)
            return [t for t in new if t.qualified not in have]

        for sink, url in cluster.sinks.items():
            kind = kind_of(url)
            if kind is not None:
                def source_lsn() -> int:
                    return parse_lsn(src.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])

                found, others[sink] = kind.add_tables(workflow, sink, url, new, not_on, source_lsn, overwrite)
                decisions += found
                continue
            conn = stack.enter_context(connect(url, role="target"))
            with usage_errors(f"sink {sink} ({describe(url)})"):
                for s in st.load_workflow(conn, workflow).streams:
                    st.lock_stream(conn, s.id)  # a running batch finishes first; the next one sees the change
                # Read again under the locks: a copy that finished (Running) or a run that created the slot
                # meanwhile must be seen, or the stream would stay Running with a table never copied.
                wf = st.load_workflow(conn, workflow)
                wanted = not_on(sink, {t.table.qualified for s in wf.streams for t in s.tables})
                decisions += decide_tables(conn, workflow, sink, url, wanted, overwrite)
            sinks[sink] = (conn, wf, wanted)
        everywhere = [t for t, where in on_sinks.items() if len(where) == len(cluster.sinks)]
        if everywhere:
            raise UsageError(f"{', '.join(everywhere)} already replicated by workflow {workflow!r} on every sink: "
                             f"leave {'it' if len(everywhere) == 1 else 'them'} out of --tables")
        refuse_rows(decisions)
        # the key-range rules last among the checks (they start Spark); nothing is committed before them
        rules = keyrange_rules(sources, new, shard_keys or {}) if cluster.source_shards else {}
        # (1) publications first: a sink that records the tables can rely on their changes being decoded
        for sink, (conn, wf, wanted) in sinks.items():
            for s in wf.streams:
                shard_src = sources[s.source_shard]
                if wanted and (capture.slot_info(shard_src, s.slot_name) is not None or s.position is not None):
                    capture.ensure_publication(shard_src, s.publication, [t.table for t in s.tables] + wanted)
        for added in others.values():
            # Add-only, whether or not the stream has started: its Init adds its tables the same way, so
            # neither it nor another add-tables racing this one can take ours out (targets/delta/engine.py)
            if added.wanted:
                capture.ensure_publication(src, added.publication, added.published, add_only=True)
        # (2) each Delta sink: its new tables made, then recorded (targets/delta/sink.py: append_tables)
        for added in others.values():
            if added.wanted:
                added.commit()
        # (2) every PostgreSQL sink, each in its own transaction (a sink that fails here is fixed by running this again)
        for sink, (conn, wf, wanted) in sinks.items():
            for s in wf.streams:
                if not wanted:
                    continue
                st.append_tables(conn, s.id, wanted, rules.get(s.source_shard))
                if s.state == st.RUNNING:
                    st.set_state(conn, s.id, st.COPYING, "")
            conn.commit()
    return decisions

"""`replicate add-tables`: new tables joined to a running workflow, on every sink, nothing lost or doubled.

The hand-off that lost changes in YugabyteDB (their issue 16355) is a table whose changes start flowing at one
point while its copy reflects another. Here the order makes the two meet exactly, by the copy algorithm's own
rules: (1) the tables join every sink's publication on the source, so every change committed after that is
decoded for them; (2) each sink records them as not yet copied, and its stream goes back to Copying; a running
consumer skips their changes until their first copy cycle; (3) each table is then copied from its own snapshot,
taken after (1): everything committed before the snapshot is in the copy, everything after is replayed once,
for the rows copied so far (catchup and fast-forward, as for any table). The other tables keep replicating
between the copy's cycles. A Delta sink takes the same steps on its state document (lake_sink.append_tables);
there the other tables wait during the copy, which the lake engine runs before it replays again.
"""

from __future__ import annotations

from contextlib import ExitStack

import psycopg

from ..errors import UsageError
from ..position import parse_lsn
from ..postgres import capture, catalog
from ..postgres.connect import connect, describe, first_line
from ..workflow import state as st
from ..workflow.create import _check_source_role, _check_table_rights
from .create import Decision, decide_tables, refuse_rows
from .model import Cluster


def add_tables(workflow: str, any_sink_url: str, tables: list[str], *, overwrite: bool = False) -> list[Decision]:
    from ..lake import location
    from ..lake.state import is_lake, open_store
    from . import lake_sink

    if is_lake(any_sink_url):
        cluster = Cluster.of(open_store(any_sink_url).load(workflow))
    else:
        with connect(any_sink_url, role="target") as conn:
            cluster = Cluster.of(st.load_workflow(conn, workflow))
    if cluster.source_shards:  # its tables need a key-range rule per shard, which this does not make yet
        raise UsageError(f"workflow {workflow!r} replicates a keyspace (--source-shard): add-tables does not "
                         f"support it yet; create another Replicate workflow for the new tables")
    with ExitStack() as stack:
        src = stack.enter_context(connect(cluster.source_url, role="source", autocommit=True))
        try:
            new = catalog.resolve_tables(src, tables)
            if not _check_source_role(src):
                _check_table_rights(src, new)
        except psycopg.Error as exc:
            raise UsageError(f"source {describe(cluster.source_url)}: {first_line(exc)}") from None
        sinks = {}
        lakes = {}  # Delta sinks (lake_sink.py): their state document, the tables they do not have yet
        decisions = []
        on_sinks: dict[str, list[str]] = {}  # table -> the sinks that already have it
        source_lsn = parse_lsn(src.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
        for sink, url in cluster.sinks.items():
            if is_lake(url):
                lake_sink.check_mappable(new)
                store = open_store(url)
                wf = store.load(workflow)
                have = {t.qualified for t in wf.tables}
                for t in new:
                    if t.qualified in have:
                        on_sinks.setdefault(t.qualified, []).append(sink)
                wanted = [t for t in new if t.qualified not in have]
                decisions += lake_sink.table_decisions(workflow, sink, url, wanted, overwrite, source_lsn)
                lakes[sink] = (store, wf, wanted)
                continue
            conn = stack.enter_context(connect(url, role="target"))
            try:
                for s in st.load_workflow(conn, workflow).streams:
                    st.lock_stream(conn, s.id)  # a running batch finishes first; the next one sees the change
                # Read again under the locks: a copy that finished (Running) or a run that created the slot
                # meanwhile must be seen, or the stream would stay Running with a table never copied.
                wf = st.load_workflow(conn, workflow)
                have = {t.table.qualified for s in wf.streams for t in s.tables}
                for t in new:
                    if t.qualified in have:
                        on_sinks.setdefault(t.qualified, []).append(sink)
                # A table some sinks have already: an earlier add-tables that did not reach every sink
                wanted = [t for t in new if t.qualified not in have]
                decisions += decide_tables(conn, workflow, sink, url, wanted, overwrite)
            except psycopg.Error as exc:
                raise UsageError(f"sink {sink} ({describe(url)}): {first_line(exc)}") from None
            sinks[sink] = (conn, wf, wanted)
        everywhere = [t for t, where in on_sinks.items() if len(where) == len(cluster.sinks)]
        if everywhere:
            raise UsageError(f"{', '.join(everywhere)} already replicated by workflow {workflow!r} on every sink: "
                             f"leave {'it' if len(everywhere) == 1 else 'them'} out of --tables")
        refuse_rows(decisions)
        # (1) publications first: a sink that records the tables can rely on their changes being decoded
        for sink, (conn, wf, wanted) in sinks.items():
            for s in wf.streams:
                if wanted and (capture.slot_info(src, s.slot_name) is not None or s.position is not None):
                    capture.ensure_publication(src, s.publication, [t.table for t in s.tables] + wanted)
        for sink, (store, wf, wanted) in lakes.items():
            if wanted and (capture.slot_info(src, wf.slot) is not None or wf.position is not None):
                capture.ensure_publication(src, wf.publication, [t.spec for t in wf.tables] + wanted)
        # (2) each Delta sink: its new tables made, then recorded (lake_sink.append_tables)
        for sink, (store, wf, wanted) in lakes.items():
            if wanted:
                lake_sink.make_tables(location.parse(cluster.sinks[sink]), wanted)
                lake_sink.append_tables(store, workflow, wanted)
        # (2) every PostgreSQL sink, each in its own transaction (a sink that fails here is fixed by running this again)
        for sink, (conn, wf, wanted) in sinks.items():
            for s in wf.streams:
                if not wanted:
                    continue
                st.append_tables(conn, s.id, wanted)
                if s.state == st.RUNNING:
                    st.set_state(conn, s.id, st.COPYING, "")
            conn.commit()
    return decisions

"""`replicate bootstrap`: re-copy, from the source, what a sink cannot resume — and only that.

If the sink's slot can no longer supply every change after the sink's checkpoint (gone, invalidated, consumed
past it), every table of that stream needs a copy: its slot and publication are made again and the stream
starts over from Init, each table copied (the copy replaces the sink's rows). If the slot is healthy, only the
tables named with --tables are re-copied, by the usual copy cycles, while the stream's other tables keep
replicating between them. Other sinks are never touched.
"""

from __future__ import annotations

import psycopg

from ..errors import SluicegateError, UsageError
from ..postgres import capture, catalog
from ..postgres.connect import connect, describe
from ..workflow import state as st
from .model import Cluster


def bootstrap(workflow: str, sink_url: str, tables: list[str] | None) -> list[str]:
    """What was decided, one line per stream or table; the sink's state changed accordingly."""
    lines = []
    with connect(sink_url, role="target") as conn:
        wf = st.load_workflow(conn, workflow)
        cluster = Cluster.of(wf)
        here = f"sink {cluster.sink} ({describe(sink_url)})"
        several = len(wf.streams) > 1
        for s in wf.streams:
            st.lock_stream(conn, s.id)
        # Read again under the locks: a running consumer may have committed (and confirmed on the slot) a
        # position since the first read, and a slot confirmed past a stale position looks consumed by another.
        wf = st.load_workflow(conn, workflow)
        for s in wf.streams:  # each stream's own source: a keyspace source has one per shard
            with connect(s.source_url, role="source", autocommit=True) as src:
                names = {t.table.qualified for t in s.tables}
                chosen = _resolve(tables, names) if tables else None
                why = _cannot_resume(src, s, cluster)
                if several:
                    here = f"sink {cluster.sink} ({describe(sink_url)}), source shard {s.source_shard}"
                if why is None and s.state == st.INIT:
                    lines.append(f"{here}: nothing to bootstrap: the stream has not started; `workflow run` copies")
                elif why is not None:
                    # A slot that cannot supply the stream is of no use: dropped with its publication (and
                    # the governor's note); the stream's Init makes both again, and copies from the new slot.
                    capture.drop_capture(src, s.slot_name, s.publication)
                    _reset(conn, s.id, sorted(names))
                    st.restart_stream(conn, s.id, f"re-bootstrap: {why}")
                    lines += [f"{here}, table {t}: copy (re-bootstrap: {why})" for t in sorted(names)]
                    if chosen and set(chosen) != names:
                        lines.append(f"{here}: every table is re-copied, not only {', '.join(chosen)}: the slot "
                                     f"lost changes to all of them")
                elif chosen:
                    _reset(conn, s.id, chosen)
                    st.set_state(conn, s.id, st.COPYING, "")
                    lines += [f"{here}, table {t}: copy (re-bootstrap asked for)" for t in chosen]
                    others = sorted(names - set(chosen))
                    if others:
                        lines.append(f"{here}: {', '.join(others)} resume from checkpoint (the slot can supply them)")
                else:
                    lines.append(f"{here}: nothing to bootstrap: every table resumes from checkpoint (the slot "
                                 f"can supply them); name tables with --tables to re-copy them anyway")
        conn.commit()
    return lines


def _cannot_resume(src: psycopg.Connection, s: st.Stream, cluster: Cluster) -> str | None:
    if s.position is None:
        # Init: nothing to resume yet. Anything else without a position (a stream put in Error before its
        # first position was saved) has no checkpoint to resume from.
        return None if s.state == st.INIT else f"stream is {s.state} with no checkpoint"
    try:
        capture.check_slot(src, s.slot_name, s.position, "", consumer="the sink's checkpoint")
    except SluicegateError as exc:
        return str(exc).rstrip("; ")
    return None


def _resolve(tables: list[str], names: set[str]) -> list[str]:
    existing = [tuple(n.split(".", 1)) for n in sorted(names)]
    chosen = []
    for raw in tables:
        try:
            schema, name = catalog.resolve_name(existing, raw)
        except UsageError:
            raise UsageError(f"table {raw!r} is not replicated by this workflow (it has: {', '.join(sorted(names))}); "
                             f"add it with `sluicegate replicate add-tables`") from None
        chosen.append(f"{schema}.{name}")
    return chosen


def _reset(conn: psycopg.Connection, stream_id: int, tables: list[str]) -> None:
    # deferred_indexes stays: a first cycle that did not finish dropped those indexes, and only this record
    # has them built again (the re-copy empties the table and builds them after its first cycle)
    conn.execute(
        """UPDATE sluicegate.copy_state SET lastpk = NULL, rows_copied = 0, done = false
           WHERE stream_id = %s AND table_name = ANY(%s)""", (stream_id, tables))

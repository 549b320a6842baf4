"""The seed's bootstrap chart for an existing setup, decided when a sink's consumer starts, and printed.

An existing setup resumes from the sink's checkpoint if the source can still supply every change after it:
the sink's slot exists, its WAL was not removed, and it was not consumed past the checkpoint. Otherwise the
stream goes to Error with the exact `replicate bootstrap` command; nothing is re-copied without being asked.
(A new setup's decision, copy or refuse, was taken and printed by `create`.)
"""

from __future__ import annotations

from ..errors import SluicegateError, TerminalError
from ..position import format_lsn
from ..postgres import capture
from ..postgres.connect import connect
from ..sizes import format_size
from ..workflow import state as st
from .model import Cluster


def at_start(target_url: str, workflow: str) -> list[str]:
    """One line per stream of this sink: what its consumer is about to do, and why."""
    with connect(target_url, role="target") as conn:
        wf = st.load_workflow(conn, workflow)
        # Under the streams' locks, read again: another consumer of this sink (one started twice) may commit and
        # confirm a position meanwhile, and a slot confirmed past a stale one would look consumed by another.
        for s in wf.streams:
            st.lock_stream(conn, s.id)
        wf = st.load_workflow(conn, workflow)
        cluster = Cluster.of(wf)
        here = f"sink {cluster.sink}"
        lines = []
        for s in wf.streams:
            if len(wf.streams) > 1:  # a keyspace source: each stream reads its own shard
                here = f"sink {cluster.sink}, source shard {s.source_shard}"
            try:
                src = connect(s.source_url, role="source", autocommit=True, connect_timeout=10)
            except SluicegateError as exc:
                lines.append(f"{here}: cannot ask the source yet ({exc}); the consumer retries")
                continue
            with src:
                pending = [t.table.qualified for t in s.tables if not t.done]
                if s.state == st.INIT:
                    if s.message.startswith("re-bootstrap"):  # `replicate bootstrap` sent it back here
                        lines.append(f"{here}: {s.message}: copying {len(s.tables)} table(s) from the source again")
                    else:
                        lines.append(f"{here}: new setup: bootstrap by a copy of {len(s.tables)} table(s) from "
                                     f"the source")
                    continue
                if s.state in (st.STOPPED, st.ERROR):
                    lines.append(f"{here}: stream is {s.state}{': ' + s.message if s.message else ''}")
                    continue
                try:
                    info = capture.check_slot(src, s.slot_name, s.position, cluster.way_out(),
                                              consumer=f"sink {cluster.sink}'s checkpoint")
                except TerminalError as exc:
                    st.set_state(conn, s.id, st.ERROR, str(exc))  # committed with the locks, on leaving
                    lines.append(f"{here}: cannot resume: {exc}")
                    continue
                held, _ = capture.retained_wal(src, s.slot_name)
                resume = (f"resume from checkpoint {format_lsn(s.position)}: slot {s.slot_name} present, WAL kept "
                          f"from {format_lsn(info.restart_lsn)} ({format_size(held or 0)})")
                if pending:
                    resume += f"; copying {', '.join(pending)} (bootstrap in progress)"
                lines.append(f"{here}: {resume}")
    return lines

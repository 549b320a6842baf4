"""`workflow status|stop|start|set|delete` of a workflow whose target is PostgreSQL (every target shard of a
Reshard; the stream that carries the writes of a MoveTables whose traffic is switched)."""

from __future__ import annotations

from collections.abc import Callable

from ...ddl import modes
from ...errors import UsageError
from ...postgres import needs, standby_flush
from ...postgres.connect import connect, describe
from ...preflight import probes
from ...workflow import state as st
from ...workflow.shards import load_all
from ...workflow.status import merge_status, slot_facts, workflow_status


def status(name: str, target: str, wal_warning: int) -> dict:
    """A workflow's state, driver, position, lag, the WAL its slots hold and per-table copy progress."""

    shards = load_all(name, target)
    out = merge_status([(shard, workflow_status(wf, slots=slot_facts(wf), wal_warning=wal_warning))
                        for shard, _, wf in shards])
    if shards[0][2].kind == "Replicate":  # safe time at the top level; every sink's slot on the source
        from ...cluster.status import cluster_status

        extra = cluster_status(shards[0][2], target)
        out = {**{k: v for k, v in out.items() if k != "warnings"}, **extra,
               "warnings": out["warnings"] + extra["warnings"]}
    if shards[0][2].kind == "MoveTables":  # which side takes writes (workflow/traffic.py)
        from ...workflow.traffic import traffic_status

        out["traffic"] = traffic_status(shards[0][2], target)
    return out


def set_state(name: str, target: str, verb: str) -> str:
    state = ""
    for _, url, _ in load_all(name, target):
        state = _set_shard_state(name, url, verb)
    return state


def _set_shard_state(name: str, target: str, verb: str) -> str:
    with connect(target, role="target") as conn:
        wf = st.load_workflow(conn, name)
    if wf.kind == "MoveTables" and wf.traffic.state == "switched":
        # The reverse workflow carries the writes; the forward stream stays stopped (its source now holds the
        # reverse workflow's writes: replaying them would loop) until `movetables reverse-traffic`.
        from ...workflow.traffic import set_reverse_state

        state = set_reverse_state(name, target, verb)
        if state is not None:
            return state
    with connect(target, role="target") as conn:
        wf = st.load_workflow(conn, name)
        for s in wf.streams:
            st.lock_stream(conn, s.id)
            if verb == "stop":
                st.set_state(conn, s.id, st.STOPPED, "stopped by user")
            elif wf.traffic.state == "switched":
                raise UsageError(f"workflow {name}: traffic is switched to the target, so its stream stays "
                                 f"stopped; `sluicegate movetables reverse-traffic {name}` resumes it")
            else:
                if s.position is None:
                    new = st.INIT
                elif any(not t.done for t in s.tables):
                    new = st.COPYING
                else:
                    new = st.RUNNING
                st.set_state(conn, s.id, new)
        return wf.streams[0].state


# Settings only a Delta target's player reads (config.py): refused here rather than kept and never used.
_NOT_HERE = ("stage_rows", "stage_bytes")


def configure(name: str, target: str, on_ddl: str | None, target_standbys: str | None,
              settings: dict) -> list[str]:
    for key in settings:
        if key in _NOT_HERE:
            raise UsageError(f"workflow {name}: {key} is a Delta target's setting; this target is PostgreSQL")
    urls = [url for _, url, _ in load_all(name, target)]  # a Reshard's every target shard: each reads its own
    for url in urls if target_standbys == "on" else ():     # (all checked before any is changed)
        with connect(url, role="target") as conn:
            for problem in probes.privileged(conn, f"target {describe(url)}", {needs.TARGET_STANDBYS}):
                raise UsageError(problem.line())
    for url in urls:
        with connect(url, role="target") as conn:
            if on_ddl is not None:
                modes.set_mode(conn, name, on_ddl)
            if target_standbys is not None:
                standby_flush.set_enabled(conn, name, target_standbys == "on")
            if settings:
                st.set_options(conn, name, settings)
            conn.commit()
    changed = [f"on-ddl {on_ddl}"] if on_ddl else []
    changed += [f"confirm-after-target-standbys {target_standbys}"] if target_standbys else []
    return changed + [f"{k} {'default' if v is None else v}" for k, v in settings.items()]


def delete(name: str, target: str, drop_tables: bool, say: Callable[[str], None]) -> list[str]:
    from ...workflow.create import delete_workflow

    dropped = []
    shards = load_all(name, target)
    if shards[0][2].kind == "MoveTables" and shards[0][2].traffic.state == "switched":
        raise UsageError(f"workflow {name}: traffic is switched to the target, and its reverse workflow and the "
                         f"source's write denials would stay behind: `sluicegate movetables complete {name}`")
    if drop_tables:  # as `movetables|materialize|reshard cancel` (workflow/traffic.py)
        from ...workflow.traffic import cancel_workflow

        dropped = cancel_workflow(name, target)
    else:
        for _, url, _ in shards:
            dropped += delete_workflow(name, url)
    if shards[0][2].kind == "Replicate":  # the other sinks stop governing and showing this one
        from ...cluster.forget import forget_sink
        from ...cluster.model import Cluster

        missed = forget_sink(Cluster.of(shards[0][2]))
        if missed:
            say(f"warning: sinks {', '.join(missed)} could not be told and still list this one")
    return dropped

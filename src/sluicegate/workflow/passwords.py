"""No secrets at rest: passwords come from libpq (pgpass file, service file, PGPASSWORD), never from state.

A URL given on the command line may hold a password; it serves that command. What Sluicegate stores and what
it hands to Spark tasks is the URL without it, whenever libpq can find the password by itself.

Workflows created by an older Sluicegate have the source password stored on the target. They keep working:
`workflow run` removes it from the state as soon as libpq finds it elsewhere (the URL without it connects),
and until then warns, as status does, at every run.
"""

from __future__ import annotations

import logging

from ..errors import SluicegateError
from ..postgres.connect import connect, describe, has_password, strip_password
from . import state as st

log = logging.getLogger("sluicegate")


def libpq_finds_password(url: str, role: str) -> bool:
    """Whether the URL without its password connects (libpq found the password, or none is needed)."""
    try:
        connect(strip_password(url), role=role, connect_timeout=5).close()
        return True
    except SluicegateError:
        return False


def task_url(url: str, role: str) -> str:
    """The URL Spark tasks get: without the password when libpq supplies it on its own, else as given (the
    executors then need no file of their own, but the password is in the tasks)."""
    if not has_password(url) or libpq_finds_password(url, role):
        return strip_password(url)
    log.warning("the %s password of %s goes to Spark's tasks: put it in a pgpass file (PGPASSFILE) instead",
                role, describe(url))
    return url


def retire_stored_passwords(target_url: str, name: str, loaded: st.Workflow | None = None) -> list[str]:
    """Remove the source passwords an older Sluicegate stored for workflow `name` on `target_url` where libpq
    finds them elsewhere; a warning for each one it cannot remove yet. `loaded`: the workflow as just read
    from that target (nothing to connect for when it holds no password)."""
    if loaded is not None and not any(has_password(u) for u in stored_urls(loaded)):
        return []
    with connect(target_url, role="target") as conn:
        wf = st.load_workflow(conn, name)
        stored = [u for u in stored_urls(wf) if has_password(u)]
        if not stored:
            return []
        removable = {u for u in dict.fromkeys(stored) if libpq_finds_password(u, "source")}
        warnings = [f"the password of {describe(u)} is stored on the target (by an older Sluicegate) and libpq "
                    f"finds none elsewhere: put it in a pgpass file (PGPASSFILE), and the next `workflow run` "
                    f"removes it from the target" for u in dict.fromkeys(stored) if u not in removable]
        if removable:
            _strip(conn, wf, removable)
            conn.commit()
            log.warning("removed %d stored password(s) of workflow %s from the target: libpq supplies them",
                        len(removable), name)
        return warnings


def stored_urls(wf: st.Workflow) -> list[str]:
    """Every URL the workflow's state holds (a Reshard's keyspace lists its shards')."""
    keyspace = wf.options.get("keyspace") or {}
    return [wf.source_url, *(s.source_url for s in wf.streams),
            *keyspace.get("source_shards", {}).values(), *keyspace.get("target_shards", {}).values()]


def _strip(conn, wf: st.Workflow, urls: set[str]) -> None:
    if wf.source_url in urls:
        conn.execute("UPDATE sluicegate.workflows SET source_url = %s WHERE name = %s",
                     (strip_password(wf.source_url), wf.name))
    for url in urls:
        conn.execute("UPDATE sluicegate.streams SET source_url = %s WHERE workflow = %s AND source_url = %s",
                     (strip_password(url), wf.name, url))
    keyspace = wf.options.get("keyspace")
    if keyspace:
        for side in ("source_shards", "target_shards"):
            keyspace[side] = {k: strip_password(u) if u in urls else u for k, u in keyspace.get(side, {}).items()}
        st.set_options(conn, wf.name, {"keyspace": keyspace})

"""The workflow's `--on-ddl` mode (Vitess's OnDDL): what the stream does with a captured DDL statement on a
table it moves. Kept in the workflow's options ("on_ddl"), read by the player when it meets a statement, so
`workflow set W --on-ddl MODE` takes effect for the next statement without restarting `workflow run`."""

from __future__ import annotations

import psycopg

STOP, IGNORE, EXEC, EXEC_IGNORE = "stop", "ignore", "exec", "exec-ignore"
MODES = (STOP, IGNORE, EXEC, EXEC_IGNORE)
DEFAULT = STOP
OPTION = "on_ddl"


def of(options: dict) -> str:
    return options.get(OPTION) or DEFAULT


def current(conn: psycopg.Connection, workflow: str) -> str:
    """The mode as the target stores it now (in the caller's transaction)."""
    row = conn.execute("SELECT options ->> %s FROM sluicegate.workflows WHERE name = %s",
                       (OPTION, workflow)).fetchone()
    return (row and row[0]) or DEFAULT


def set_mode(conn: psycopg.Connection, workflow: str, mode: str) -> bool:
    """Store the mode; False when there is no such workflow."""
    if mode not in MODES:
        raise ValueError(f"--on-ddl {mode}: one of {', '.join(MODES)}")
    cur = conn.execute("UPDATE sluicegate.workflows SET options = options || jsonb_build_object(%s::text, %s::text) "
                       "WHERE name = %s", (OPTION, mode, workflow))
    return cur.rowcount == 1


# A statement that stopped a stream under `stop`: the user applies it by hand and starts the workflow again;
# when the stream meets it again (same position) it passes it. Kept per stream in the workflow's options.
PASSED = "ddl_applied_by_hand"


def passed(conn: psycopg.Connection, workflow: str, stream_id: int) -> str | None:
    row = conn.execute("SELECT options -> %s ->> %s FROM sluicegate.workflows WHERE name = %s",
                       (PASSED, str(stream_id), workflow)).fetchone()
    return row[0] if row else None


def record_stop(conn: psycopg.Connection, workflow: str, stream_id: int, lsn: str) -> None:
    conn.execute(
        "UPDATE sluicegate.workflows SET options = jsonb_set(options, %s, coalesce(options -> %s, '{}') || "
        "jsonb_build_object(%s::text, %s::text)) WHERE name = %s",
        ([PASSED], PASSED, str(stream_id), lsn, workflow))

"""The source's DDL capture: an event trigger that emits each DDL statement into the WAL (`ddl install`).

Its function calls `pg_logical_emit_message(true, 'sluicegate.ddl', json)`: a *transactional* message, so
logical decoding hands it over in commit order, inside the transaction that ran the statement, between that
transaction's row changes (rows before it in the old shape, rows after it in the new). The workflow player
asks pgoutput for messages (`messages 'true'`) and replays them as the workflow's `--on-ddl` says (replay.py).

Two events: `ddl_command_end` for every command but DROP (pg_event_trigger_ddl_commands() names what it made
or changed, and the table each object belongs to), and `sql_drop` for DROP commands (that function says
nothing about them; pg_event_trigger_dropped_objects() does). An ALTER TABLE … DROP COLUMN fires both: only
`ddl_command_end` emits it (by tag), so each statement is one message. The trigger fires only for the command
tags below: everything else runs exactly as before.

Sluicegate's own statements are not captured: a session that marks itself with the setting
`sluicegate.applying` (the players, the copy's sessions, index builds: postgres/indexes.py) runs DDL that a
stream put there or that restores what the source has, and on a database that is both a target and a source
(active-active, a reverse stream) sending it on would echo it back. The players also replay under
session_replication_role = replica, in which an event trigger enabled the default way does not fire.

Without the trigger nothing is emitted and the stream behaves as it always did (Relation messages: an added
column follows, anything else stops). Creating an event trigger takes a superuser (PostgreSQL 14–18); the
function runs as whoever runs the DDL, and pg_logical_emit_message is executable by every role, so the
application's migrations need no grant. A failure inside the function would fail the user's DDL: it only
reads the event's own functions and the catalog.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from ..errors import TerminalError
from ..postgres.connect import connect
from . import modes
from .message import FORMAT, PREFIX

SCHEMA = "sluicegate_ddl"
FUNCTION = "emit"
TRIGGERS = ("sluicegate_ddl_command_end", "sluicegate_ddl_sql_drop")
# The commands captured: what `--on-ddl exec` replays now (ALTER TABLE, CREATE/DROP INDEX) and what later
# stages will (tables, types, sequences): a statement of these on a table the workflow does not move is
# passed over by the player.
TAGS = ("ALTER TABLE", "CREATE INDEX", "DROP INDEX", "ALTER INDEX", "CREATE TABLE", "DROP TABLE",
        "CREATE TYPE", "ALTER TYPE", "DROP TYPE", "CREATE SEQUENCE", "ALTER SEQUENCE", "DROP SEQUENCE")

# Everything qualified with pg_catalog: the function runs under the caller's search_path (which it records).
_FUNCTION = """
CREATE OR REPLACE FUNCTION {schema}.{function}() RETURNS event_trigger LANGUAGE plpgsql AS $body$
DECLARE
    objects jsonb;
BEGIN
    IF pg_catalog.current_setting('sluicegate.applying', true) OPERATOR(pg_catalog.<>) '' THEN
        RETURN;  -- Sluicegate's own statement (a replayed one, a copy's index build): not the application's
    END IF;
    IF TG_EVENT OPERATOR(pg_catalog.=) 'sql_drop' THEN
        IF NOT pg_catalog.starts_with(TG_TAG, 'DROP ') THEN
            RETURN;  -- e.g. ALTER TABLE … DROP COLUMN: its ddl_command_end message says it
        END IF;
        SELECT pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object(
                   'object_type', d.object_type, 'schema', d.schema_name, 'name', d.object_name,
                   'identity', d.object_identity, 'table', NULL))
          INTO objects
          FROM pg_catalog.pg_event_trigger_dropped_objects() d
         WHERE d.original AND NOT d.is_temporary;
    ELSE
        SELECT pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object(
                   'object_type', c.object_type, 'schema', c.schema_name, 'identity', c.object_identity,
                   'table', CASE WHEN r.oid IS NULL THEN NULL
                                 ELSE pg_catalog.jsonb_build_array(n.nspname, r.relname) END))
          INTO objects
          FROM pg_catalog.pg_event_trigger_ddl_commands() c
          LEFT JOIN pg_catalog.pg_class k
                 ON c.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
                AND k.oid OPERATOR(pg_catalog.=) c.objid
          LEFT JOIN pg_catalog.pg_index i ON i.indexrelid OPERATOR(pg_catalog.=) k.oid
          LEFT JOIN pg_catalog.pg_class r ON r.oid OPERATOR(pg_catalog.=) COALESCE(i.indrelid, k.oid)
          LEFT JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) r.relnamespace
         WHERE NOT c.in_extension
           AND COALESCE(r.relpersistence, 'p') OPERATOR(pg_catalog.<>) 't';
    END IF;
    IF objects IS NULL THEN
        RETURN;
    END IF;
    PERFORM pg_catalog.pg_logical_emit_message(true, {prefix}, pg_catalog.jsonb_build_object(
        'format', {format}, 'event', TG_EVENT, 'tag', TG_TAG, 'statement', pg_catalog.current_query(),
        'search_path', pg_catalog.current_setting('search_path'), 'objects', objects)::text);
END
$body$"""


def install_statements() -> list[sql.Composable]:
    schema, function = sql.Identifier(SCHEMA), sql.Identifier(FUNCTION)
    tags = sql.SQL(", ").join(sql.Literal(t) for t in TAGS)
    drops = sql.SQL(", ").join(sql.Literal(t) for t in TAGS if t.startswith("DROP "))
    out: list[sql.Composable] = [sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(schema),
                                 sql.SQL(_FUNCTION).format(schema=schema, function=function,
                                                           prefix=sql.Literal(PREFIX), format=sql.Literal(FORMAT))]
    for trigger, event, which in zip(TRIGGERS, ("ddl_command_end", "sql_drop"), (tags, drops)):
        out.append(sql.SQL("DROP EVENT TRIGGER IF EXISTS {}").format(sql.Identifier(trigger)))
        out.append(sql.SQL("CREATE EVENT TRIGGER {} ON {} WHEN TAG IN ({}) EXECUTE FUNCTION {}.{}()").format(
            sql.Identifier(trigger), sql.SQL(event), which, schema, function))
    return out


def remove_statements() -> list[sql.Composable]:
    return [*(sql.SQL("DROP EVENT TRIGGER IF EXISTS {}").format(sql.Identifier(t)) for t in TRIGGERS),
            sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA))]


def _need_superuser(conn: psycopg.Connection, verb: str) -> None:
    row = conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()
    if not (row and row[0]):
        raise TerminalError(f"{verb} the DDL capture takes a superuser (PostgreSQL lets only superusers create "
                            f"or drop event triggers): run `sluicegate ddl {verb.lower()}` with a superuser's "
                            f"URL, or have one run the SQL of `sluicegate ddl {verb.lower()} --print`")


def run(url: str, statements: list[sql.Composable], verb: str) -> None:
    with connect(url, role="source") as conn:
        _need_superuser(conn, verb)
        for s in statements:
            conn.execute(s)
        conn.commit()


def script(statements: list[sql.Composable], conn: psycopg.Connection) -> str:
    return "".join(s.as_string(conn) + ";\n" for s in statements)


def installed(conn: psycopg.Connection) -> bool:
    """Both event triggers are there and enabled."""
    row = conn.execute("SELECT count(*) FROM pg_event_trigger WHERE evtname = ANY(%s) AND evtenabled <> 'D'",
                       (list(TRIGGERS),)).fetchone()
    return row[0] == len(TRIGGERS)


def missing_note(conn: psycopg.Connection, side: str, options: dict) -> str | None:
    """A create's note when its --on-ddl mode needs the capture and `side` (the workflow's source) lacks it."""
    mode = modes.of(options)
    if mode == modes.STOP or installed(conn):
        return None
    return (f"--on-ddl {mode}: the {side} captures no DDL statements yet: run `sluicegate ddl install --source "
            f"URL` on it as a superuser (event triggers need one); until then a schema change meets the Relation "
            f"handling (added columns follow, anything else stops the stream)")

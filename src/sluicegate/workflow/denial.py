"""Denial triggers: writes to a table refused with a message naming where writes go now, except those of one
workflow's applier: switch-traffic and reverse-traffic put them on the side that gave up writes, a
bidirectional Replicate on sink B's tables until their copy from A is done. Below traffic.py, create.py and
the engine, which set or drop them."""

from __future__ import annotations

import psycopg
from psycopg import sql

from ..postgres.catalog import Table

TRIGGER = "sluicegate_denied"
TRUNCATE_TRIGGER = "sluicegate_denied_truncate"

DENY_FUNCTION = """
CREATE OR REPLACE FUNCTION sluicegate.deny_write() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
    -- TG_ARGV[0]: the workflow whose applier may write; TG_ARGV[1]: the error for everyone else
    IF coalesce(current_setting('sluicegate.applying', true), '') = TG_ARGV[0] THEN
        IF TG_OP = 'DELETE' THEN RETURN OLD; END IF;
        RETURN NEW;
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'read_only_sql_transaction',
        MESSAGE = format('table %I.%I: %s', TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_ARGV[1]);
END
$f$
"""


def deny(conn: psycopg.Connection, tables: list[Table], allowed: str, message: str) -> None:
    """Triggers that make writes to `tables` fail with `message`, except the applier of workflow `allowed`;
    in the caller's transaction."""
    conn.execute("CREATE SCHEMA IF NOT EXISTS sluicegate")
    conn.execute(DENY_FUNCTION)
    for t in tables:
        for trigger, when in ((TRIGGER, "INSERT OR UPDATE OR DELETE ON {} FOR EACH ROW"),
                              (TRUNCATE_TRIGGER, "TRUNCATE ON {} FOR EACH STATEMENT")):
            conn.execute(sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(sql.Identifier(trigger), t.ident))
            conn.execute(sql.SQL("CREATE TRIGGER {} BEFORE " + when + " EXECUTE FUNCTION sluicegate.deny_write({}, {})")
                         .format(sql.Identifier(trigger), t.ident, sql.Literal(allowed), sql.Literal(message)))


def undeny(conn: psycopg.Connection, tables: list[Table]) -> list[str]:
    """Drop the denial triggers of `tables` (those that exist); what was dropped."""
    dropped = []
    for t in tables:
        for trigger in (TRIGGER, TRUNCATE_TRIGGER):
            exists = conn.execute("SELECT 1 FROM pg_trigger WHERE tgrelid = to_regclass(%s) AND tgname = %s",
                                  (t.ident.as_string(conn), trigger)).fetchone()
            if exists:
                conn.execute(sql.SQL("DROP TRIGGER {} ON {}").format(sql.Identifier(trigger), t.ident))
                dropped.append(f"trigger {trigger} on {t.qualified}")
    return dropped

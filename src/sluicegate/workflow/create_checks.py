"""The checks every create runs before it writes anything (MoveTables, Materialize, Reshard, Replicate and its
keyspace source, `replicate add-tables`, a Delta target): the source's role, rights and room for slots, the
tables, no leftovers of a same-named workflow, and no loop back into the source. Each raises a UsageError that
names the object and the way out."""

from __future__ import annotations

import psycopg

from ..errors import SluicegateError, UsageError
from ..postgres import capture, catalog, replication
from ..postgres.catalog import Table
from ..postgres.connect import connect, describe
from ..postgres.identity import DatabaseIdentity, identify, same_database
from . import state as st


def check_not_the_source(src: psycopg.Connection, dst: psycopg.Connection, what: str, target_url: str,
                         pair: str | None = None) -> None:
    """Refuse a target that is the source database itself, or the source of a workflow that writes into this
    source (a loop), before anything is created on it. By the servers' identity, not by URL text. `pair`: a
    bidirectional workflow's name, whose own direction back is no loop (its origins stop the changes)."""
    if same_database(src, dst):
        ident = identify(dst)
        raise UsageError(
            f"{what} {describe(target_url)} is the source database itself (database {ident.database!r} of server "
            f"{ident.system_identifier or 'at the same address'}): a workflow copies into another database; "
            f"name a different target"
        )
    loops = [(w, u) for w, u in workflows_reading(src, dst) if w != pair]
    if loops:
        workflow, _ = loops[0]
        raise UsageError(
            f"{what} {describe(target_url)} is the source of workflow {workflow!r}, whose target is this source "
            f"({describe(src.info.dsn)}): a workflow back would carry every change around in a loop; name a "
            f"different target, or delete workflow {workflow!r} first"
        )


def workflows_reading(src: psycopg.Connection, dst: psycopg.Connection) -> list[tuple[str, str]]:
    """(workflow, its source URL) for each workflow recorded on `src` (it is their target) whose source is the
    database `dst` reaches."""
    if not st.has_schema(src):
        return []
    try:
        rows = src.execute(
            """SELECT s.workflow, COALESCE(s.source_url, w.source_url), to_jsonb(s) -> 'source_identity'
               FROM sluicegate.streams s JOIN sluicegate.workflows w ON w.name = s.workflow ORDER BY s.id"""
        ).fetchall()
    except psycopg.errors.InsufficientPrivilege:  # another user's state: not ours to judge
        return []
    target = identify(dst)
    found = []
    for workflow, url, recorded in rows:
        known = DatabaseIdentity.from_json(recorded)
        if known is not None and not known.may_be(target):
            continue
        # A possible match (or made before identities were recorded): ask that source itself.
        try:
            with connect(url, role="source", autocommit=True, connect_timeout=3) as other:
                same = same_database(other, dst)
        except (SluicegateError, psycopg.Error):
            same = known is not None  # unreachable: the recorded identity decides, if there is one
        if same:
            found.append((workflow, url))
    return found


def check_source_tables(src: psycopg.Connection, source_url: str, tables: list[str] | None,
                        exclude: list[str] | None) -> list[Table]:
    """A create's source checks for tables moved whole (Replicate, a Delta target): logical decoding, the
    user's rights on the tables, replication access; the tables named (all, less `exclude`), described."""
    capture.check_source(src)
    superuser = check_source_role(src)
    described = catalog.exclude_tables(catalog.resolve_tables(src, tables), exclude)
    if not superuser:
        check_table_rights(src, described)
    replication.check_replication_access(source_url)  # pg_hba.conf, REPLICATION, max_wal_senders
    return described


def check_source_role(src: psycopg.Connection) -> bool:
    """The first run creates a publication and a logical slot on the source: may this user? True if superuser."""
    user, superuser, replication, may_create = src.execute(
        """SELECT current_user, rolsuper, rolreplication, has_database_privilege(current_database(), 'CREATE')
           FROM pg_roles WHERE rolname = current_user"""
    ).fetchone()
    if superuser:
        return True
    if not replication:
        raise UsageError(
            f"source user {user} may not create replication slots: ALTER ROLE {user} REPLICATION "
            f"(as a superuser on the source), or connect as a user that may"
        )
    if not may_create:
        raise UsageError(
            f"source user {user} may not create a publication in database {src.info.dbname}: "
            f"GRANT CREATE ON DATABASE {src.info.dbname} TO {user}"
        )
    return False


def check_table_rights(src: psycopg.Connection, tables: list[Table]) -> None:
    """Adding a table to a publication takes its owner; copying it takes SELECT."""
    user = src.info.user
    for t in tables:
        owner, can_select = src.execute(
            """SELECT pg_has_role(c.relowner, 'USAGE'), has_table_privilege(c.oid, 'SELECT')
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
               WHERE n.nspname = %s AND c.relname = %s""",
            (t.schema, t.name),
        ).fetchone()
        if not owner:
            raise UsageError(
                f"source user {user} does not own table {t.qualified}, which its publication needs: "
                f"connect as the owner, or ALTER TABLE {t.qualified} OWNER TO {user}"
            )
        if not can_select:
            raise UsageError(
                f"source user {user} may not read table {t.qualified}: GRANT SELECT ON {t.qualified} TO {user}"
            )


def check_no_leftovers(src: psycopg.Connection, name: str, slot: str | None = None) -> None:
    """The workflow's slot and publication names derive from its name alone: one that exists belongs to a
    same-named workflow of another target (or was left behind), and must not be shared or adopted."""
    slot = publication = slot or st.object_name("sg", name)
    row = src.execute("SELECT database FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    if row:
        raise UsageError(
            f"source server already has replication slot {slot} (database {row[0]}), made for a workflow named "
            f"{name!r} on another target or left behind: pick another workflow name, or drop the slot if "
            f"nothing uses it: SELECT pg_drop_replication_slot('{slot}')"
        )
    if src.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (publication,)).fetchone():
        raise UsageError(
            f"source already has publication {publication}, made for a workflow named {name!r} on another "
            f"target or left behind: pick another workflow name, or DROP PUBLICATION {publication} if nothing "
            f"uses it"
        )


def check_same_tables(shard: str, conn: psycopg.Connection, described: list[Table], first: str) -> None:
    existing = set(catalog.list_tables(conn))
    for t in described:
        other = catalog.describe_table(conn, t.schema, t.name) if (t.schema, t.name) in existing else None
        shape = [(c.name, c.type_sql, c.not_null, c.collation) for c in t.columns]  # OIDs differ by server
        if other is None or [(c.name, c.type_sql, c.not_null, c.collation) for c in other.columns] != shape \
                or other.key != t.key:
            raise UsageError(f"table {t.qualified} on source shard {shard} differs from the one on shard {first} "
                             f"(or is missing): the shards of a keyspace have the same schema")


def check_slots_available(src: psycopg.Connection, wanted: int) -> None:
    """A slot per sink: say so now if the source has no room for them, not at the first run."""
    limit, used = src.execute(
        "SELECT current_setting('max_replication_slots')::int, (SELECT count(*) FROM pg_replication_slots)"
    ).fetchone()
    if used + wanted > limit:
        raise UsageError(f"source has max_replication_slots = {limit} with {used} in use; this workflow needs "
                         f"{wanted} more (one per sink): raise max_replication_slots and restart the source")

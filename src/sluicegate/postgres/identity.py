"""Whether two connections reach the same database, decided by the servers, never by URL text.

Two URLs can name one database (`localhost` and `127.0.0.1`, a port written out or not, a socket directory),
and two different databases can share a URL's text (a tunnel). A database is identified by its server's
system identifier (pg_control_system(), fixed at initdb) and its OID. Different identifiers settle it: two
databases. Equal ones are not proof: clusters copied from one data directory (a restored base backup, a
template) share the system identifier and their databases' OIDs. So equality is confirmed live: a session
of one side takes an advisory lock with a random key and the other side looks for that very lock, held by
that very backend, in its own pg_locks (which shows every database's locks of its server, to every user).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import psycopg


@dataclass(frozen=True)
class DatabaseIdentity:
    system_identifier: str | None  # None: pg_control_system() is not granted to the user
    database_oid: int
    database: str

    def to_json(self) -> dict:
        return {"system_identifier": self.system_identifier, "database_oid": self.database_oid,
                "database": self.database}

    @classmethod
    def from_json(cls, data: dict | None) -> DatabaseIdentity | None:
        if not data:
            return None
        return cls(data.get("system_identifier"), int(data["database_oid"]), data.get("database") or "")

    def may_be(self, other: DatabaseIdentity) -> bool:
        """False when the two are certainly different databases; True when they may be one."""
        if self.database_oid != other.database_oid:
            return False
        return (self.system_identifier is None or other.system_identifier is None
                or self.system_identifier == other.system_identifier)


def identify(conn: psycopg.Connection) -> DatabaseIdentity:
    oid, name = conn.execute("SELECT oid::bigint, datname FROM pg_database WHERE datname = current_database()"
                             ).fetchone()
    try:
        with conn.transaction():  # a savepoint inside the caller's transaction: a refusal leaves it usable
            system_id = conn.execute("SELECT system_identifier::text FROM pg_control_system()").fetchone()[0]
    except psycopg.errors.InsufficientPrivilege:  # revoked by some providers: the live check decides alone
        system_id = None
    return DatabaseIdentity(system_id, int(oid), name)


def same_database(a: psycopg.Connection, b: psycopg.Connection) -> bool:
    """Whether sessions `a` and `b` are connected to one database of one running server."""
    if not identify(a).may_be(identify(b)):
        return False
    return _sees_lock_of(b, a)


def _sees_lock_of(looker: psycopg.Connection, holder: psycopg.Connection) -> bool:
    # Two int4 keys, positive so that pg_locks shows them (as oid) unchanged.
    k1, k2 = secrets.randbelow(2**31 - 1) + 1, secrets.randbelow(2**31 - 1) + 1
    holder.execute("SELECT pg_advisory_lock(%s, %s)", (k1, k2))  # session level: kept across its transactions
    try:
        return looker.execute(
            """SELECT EXISTS (SELECT 1 FROM pg_locks
                              WHERE locktype = 'advisory' AND classid = %s AND objid = %s AND objsubid = 2
                                AND pid = %s AND granted
                                AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))""",
            (k1, k2, holder.info.backend_pid),
        ).fetchone()[0]
    finally:
        holder.execute("SELECT pg_advisory_unlock(%s, %s)", (k1, k2))

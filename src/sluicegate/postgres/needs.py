"""The calls a run makes that PostgreSQL does not allow every user, and when a run makes them.

Functions whose EXECUTE is not granted to PUBLIC, and parameters only a superuser (or a GRANT SET ON PARAMETER,
PostgreSQL 15+) may set. `check` and `create` ask the server about each need that a planned workflow has; the
appliers name the same grants when a call is refused anyway. tests/integration/test_preflight.py scans the
code for every `pg_…(` call and every SET, asks a real server which of them are privileged, and fails on one
this list does not hold: so a new privileged call cannot reach a run unchecked.

Creating replication slots and opening replication connections take the REPLICATION attribute, not a grant:
probes.py checks that by the role and a real replication connection.
"""

from __future__ import annotations

from dataclasses import dataclass

# When a run makes the call (Plan.uses gives a database's):
BIDIRECTIONAL = "bidirectional"  # an active-active workflow's appliers and its delete, on both clusters
REPLICA_ROLE = "replica_role"  # an applier with foreign keys in place between the tables it writes
TARGET_STANDBYS = "target_standbys"  # a target's standbys' flush positions gate confirmation (standby_flush.py)


@dataclass(frozen=True)
class Need:
    kind: str  # "function" (by name: every overload the server has), "parameter", or "role" (a member of it)
    name: str
    uses: frozenset[str]
    why: str


NEEDS: tuple[Need, ...] = (
    Need("function", "pg_replication_origin_oid", frozenset({BIDIRECTIONAL}),
         "finds the replication origin that marks the changes a direction applies"),
    Need("function", "pg_replication_origin_create", frozenset({BIDIRECTIONAL}),
         "makes that replication origin"),
    Need("function", "pg_replication_origin_session_setup", frozenset({BIDIRECTIONAL}),
         "marks the applier's session with it, so the other direction does not send its writes back"),
    Need("function", "pg_replication_origin_xact_setup", frozenset({BIDIRECTIONAL}),
         "stamps each applied transaction with its source's commit time (last-writer-wins)"),
    Need("function", "pg_replication_origin_drop", frozenset({BIDIRECTIONAL}),
         "`workflow delete` drops the origins"),
    Need("parameter", "session_replication_role", frozenset({BIDIRECTIONAL, REPLICA_ROLE}),
         "the applier writes with session_replication_role = replica (foreign keys and the application's "
         "triggers leave its writes alone)"),
    Need("parameter", "deadlock_timeout", frozenset({BIDIRECTIONAL}),
         "the applier sets deadlock_timeout = 20ms, so a lock cycle with the application aborts the applier's "
         "batch (retried), never the application's transaction"),
    Need("role", "pg_read_all_stats", frozenset({TARGET_STANDBYS}),
         "lets the applier read the target's standbys' flush positions in pg_stat_replication "
         "(--confirm-after-target-standbys)"),
)


def needed(uses: set[str]) -> list[Need]:
    return [n for n in NEEDS if n.uses & uses]


def names(kind: str, uses: set[str] | None = None) -> tuple[str, ...]:
    return tuple(n.name for n in NEEDS if n.kind == kind and (uses is None or n.uses & uses))

"""The PostgreSQL applier's table plans, kept across the batches of one play task (workflow/player.py).

A batch is one target transaction, and the player builds a new PostgresApplier for each; made per applier, a
table's plan (a catalog query, the staging columns, CREATE TEMP TABLE) was made again every batch. Kept here,
a plan and its staging table (ON COMMIT DELETE ROWS: it outlives commits, emptied by them) serve every batch
until one of these invalidates them:

- what the plan was made for changes: the table's description (columns, their types, the key), its mode or
  lastpk. A followed Relation message or a replayed statement gives the applier a new description
  (`_retable`, `reshape`), which forgets the plan at once; so do `forget_plan` and `drop_table`;
- the target facts the plan read change: its columns' names, types and identity, its indexes (a unique one
  besides the key makes upserts go through a savepoint), the foreign keys that reference it (a delete would
  cascade), the session's replication role; or its staging table is not the one made for it (a rollback undid
  its creation, or undid a drop and brought back an older one). These are read again, for every kept plan in
  one query, once a transaction before its first flush, and again after anything else used the connection
  (PostgresApplier.sync: a replayed statement may have changed any table). A plan whose facts differ is made
  again: nothing but these facts and the description goes into one.

Between that check and the transaction's first write to the table, a statement of another session could still
change it, as it could between the plan made per batch and the first write before.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

# Every staging table is emptied at each commit that touched a temporary table (ON COMMIT DELETE ROWS): keeping
# at most this many bounds that cost (bench/README.md); the least recently used one gives its place up.
CAPACITY = 64

# A target table's facts a plan depends on, as one text (NULL: no such table); {rel}: an SQL expression of
# its oid (the query that makes a plan reads them too).
FACTS = """CASE WHEN {rel} IS NOT NULL THEN md5(concat_ws('|',
    (SELECT string_agg(concat_ws(',', a.attname, a.atttypid, a.atttypmod, a.attidentity), ';' ORDER BY a.attnum)
       FROM pg_attribute a WHERE a.attrelid = {rel} AND a.attnum > 0 AND NOT a.attisdropped),
    (SELECT string_agg(concat_ws(',', i.indexrelid, i.indisunique, i.indisprimary), ';' ORDER BY i.indexrelid)
       FROM pg_index i WHERE i.indrelid = {rel}),
    -- a foreign key that references the table has its triggers on it (pg_constraint has no index on confrelid)
    (SELECT string_agg(g.tgconstraint::text, ';' ORDER BY g.oid) FROM pg_trigger g
      WHERE g.tgrelid = {rel} AND g.tgisinternal AND g.tgconstraint <> 0),
    current_setting('session_replication_role'))) END"""

_CHECK = ("SELECT v.n, " + FACTS.format(rel="c.r") + """, to_regclass(v.stage)::oid
FROM unnest(%s::text[], %s::text[]) WITH ORDINALITY AS v(rel, stage, n)
CROSS JOIN LATERAL (SELECT to_regclass(v.rel)::oid AS r) c""")


@dataclass
class Kept:
    made_for: tuple  # (Table, mode, lastpk)
    plan: dict
    target: str  # the target table, quoted
    stage: str  # its staging table, quoted, in pg_temp
    facts: str | None
    stage_oid: int
    used: int = 0  # the transaction (applier) that last used it


class TablePlans:
    """The plans of one play task's batches, by table (applier key), on one connection."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self.kept: dict[tuple, Kept] = {}
        self.numbers: dict[tuple, int] = {}  # key -> its staging table's number (sg_stage_N), kept when forgotten
        self.serial = 0
        self.made = 0  # plans made (for a test and the bench's accounting)

    def begin(self) -> int:
        """A new applier (transaction): its serial number."""
        self.serial += 1
        return self.serial

    def use(self, key: tuple, made_for: tuple, serial: int) -> dict | None:
        kept = self.kept.get(key)
        if kept is None or kept.made_for != made_for:
            return None
        kept.used = serial
        return kept.plan

    def forget(self, key: tuple) -> None:
        self.kept.pop(key, None)

    def number(self, key: tuple, serial: int) -> int:
        """The staging table's number for key: its own, else a free one, else the least recently used table's
        (not one used in this transaction: that applier may still stage into it)."""
        if key in self.numbers:
            return self.numbers[key]
        taken = set(self.numbers.values())
        if len(self.numbers) >= self.capacity:
            idle = [k for k in self.numbers if k not in self.kept]
            idle = idle or sorted((k for k, v in self.kept.items() if v.used != serial),
                                  key=lambda k: self.kept[k].used)
            if idle:
                victim = idle[0]
                self.kept.pop(victim, None)
                self.numbers[key] = self.numbers.pop(victim)
                return self.numbers[key]
        n = next(i for i in range(len(taken) + 1) if i not in taken)
        self.numbers[key] = n
        return n

    def keep(self, key: tuple, kept: Kept) -> None:
        self.kept[key] = kept
        self.made += 1

    def check(self, conn: psycopg.Connection) -> None:
        """Forget every kept plan whose facts or staging table differ from those it was made with."""
        if not self.kept:
            return
        keys = list(self.kept)
        rows = conn.execute(_CHECK, ([self.kept[k].target for k in keys],
                                     [self.kept[k].stage for k in keys])).fetchall()
        for n, facts, stage_oid in rows:
            key = keys[n - 1]
            kept = self.kept[key]
            if facts is None or facts != kept.facts or stage_oid != kept.stage_oid:
                del self.kept[key]

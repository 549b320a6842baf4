"""Rules that only move columns, as a replicator (Drizzle's term), inside a play task: row changes of such a
table pass through its rule on the way to the applier; other tables' changes go straight through. (A Spark
SQL rule runs in Spark: workflow/rule_player.py.)

Changes are collected per source key (net effect, as the applier does), then the rule runs once over the
rows that are upserted: a row the rule keeps is upserted on the target in the rule's shape, a row it
drops is deleted there by key (so an update that moves a row into or out of the filter becomes an insert
or a delete), and a delete is a delete. The key passes through unchanged, so the target key is the source's.
"""

from __future__ import annotations

from ..appliers.postgres import PostgresApplier, TargetTable, check_columns
from ..errors import TerminalError
from ..postgres.assembler import Change
from ..postgres.pgoutput import UNCHANGED, Relation
from .evaluate import MovesOnly, raw_table, target_columns


class _Ruled:
    def __init__(self, runner: MovesOnly, target: TargetTable):
        self.runner, self.target = runner, target
        self.rule = runner.rule
        self.staged: dict[tuple, tuple[str, tuple | None]] = {}  # source key -> ('U', values) | ('D', None)
        self.checked: set[int] = set()


class RuleReplicator:
    def __init__(self, applier: PostgresApplier, ruled: dict[tuple[str, str], tuple[MovesOnly, TargetTable]]):
        self.applier = applier
        self.ruled = {name: _Ruled(runner, target) for name, (runner, target) in ruled.items()}
        self.pending = 0

    def change(self, ch: Change) -> None:
        r = self.ruled.get((ch.relation.schema, ch.relation.name))
        if r is None:
            self.applier.change(ch)
            return
        if r.target.mode == "skip":
            return
        self._check(r, ch.relation)
        idx = r.rule.source.key_indices
        if ch.kind == "D":
            r.staged[tuple(ch.old[i] for i in idx)] = ("D", None)
        else:
            new = ch.new
            key = tuple(new[i] for i in idx)
            if ch.old is not None:
                old_key = tuple(ch.old[i] for i in idx)
                if old_key != key:
                    r.staged[old_key] = ("D", None)
            if UNCHANGED in new:
                new = self._resolve(r, key, ch.old, new)
            r.staged[key] = ("U", new)
        self.pending += 1
        if self.pending >= self.applier.chunk_rows:
            self.flush_rules()

    def truncate(self, relations: tuple[Relation, ...]) -> None:
        ruled = [self.ruled[(rel.schema, rel.name)] for rel in relations if (rel.schema, rel.name) in self.ruled]
        others = tuple(rel for rel in relations if (rel.schema, rel.name) not in self.ruled)
        self.flush_rules()
        whole = [r.target for r in ruled if r.target.mode != "skip" and r.rule.keyrange is None]
        self.applier.truncate_tables(whole)
        for r in ruled:  # a shard's stream shares the target table with other streams: only its own rows go
            if r.target.mode != "skip" and r.rule.keyrange is not None:
                self.applier.delete_where(r.target, r.rule.target_keyrange())
        if others:
            self.applier.truncate(others)

    def flush(self) -> None:
        self.flush_rules()
        self.applier.flush()

    # -- evaluating --------------------------------------------------------------------------------------
    def flush_rules(self) -> None:
        for r in self.ruled.values():
            if r.staged:
                self._evaluate(r)
                r.staged.clear()
        self.pending = 0

    def _evaluate(self, r: _Ruled) -> None:
        rule, target = r.rule, r.target
        n_target = len(rule.target.columns)
        key_positions = rule.target.key_indices
        upserts = [(k, v) for k, (op, v) in r.staged.items() if op == "U"]
        kept: set[tuple] = set()
        if upserts:
            for _, values in upserts:
                for i in rule.needs:
                    if values[i] is UNCHANGED:
                        needs_full(rule, i)
            result = r.runner.apply(raw_table(rule, [tuple(None if v is UNCHANGED else v for v in values)
                                                     for _, values in upserts]))
            staged = dict(upserts)
            columns = [c.to_pylist() for c in target_columns(rule, result)]
            src_key = rule.source.key_indices
            raw_keys = list(zip(*(result.column(i).to_pylist() for i in src_key)))
            for j, key in enumerate(raw_keys):
                values = staged[key]
                row = [col[j] for col in columns]
                keep = [c for c, (kind, ref) in enumerate(rule.outputs) if kind == "raw" and values[ref] is UNCHANGED]
                self.applier.put(target, "U", key, tuple(row), keep or None)
                kept.add(key)
        for key in r.staged:
            if key not in kept:  # deleted, or no longer selected by the rule: gone from the target
                row = [None] * n_target
                for pos, v in zip(key_positions, key):
                    row[pos] = v
                self.applier.put(target, "D", key, tuple(row))

    # -- helpers -----------------------------------------------------------------------------------------
    def _check(self, r: _Ruled, rel: Relation) -> None:
        if rel.oid not in r.checked:
            check_columns(rel, r.rule.source, f"the rule for {r.rule.source.qualified}")
            r.checked.add(rel.oid)

    @staticmethod
    def _resolve(r: _Ruled, key: tuple, old: tuple | None, new: tuple) -> tuple:
        """Unchanged TOAST values from the full old row (REPLICA IDENTITY FULL) or an earlier change here."""
        prev = r.staged.get(key)
        values = list(new)
        for i, v in enumerate(values):
            if v is UNCHANGED:
                if old is not None and old[i] is not None and old[i] is not UNCHANGED:
                    values[i] = old[i]
                elif prev is not None and prev[0] == "U" and prev[1][i] is not UNCHANGED:
                    values[i] = prev[1][i]
        return tuple(values)


def needs_full(rule, i: int) -> None:
    """A rule reads column i, which a change left unchanged as a TOASTed value it does not carry."""
    col = rule.source.columns[i].name
    raise TerminalError(
        f"rule {rule.rule.split(':', 1)[0]!r} reads column {col!r} of {rule.source.qualified}, and an update "
        f"left it unchanged as a large (TOASTed) value the change does not carry: run ALTER TABLE "
        f"{rule.source.qualified} REPLICA IDENTITY FULL on the source so changes carry it, then re-create "
        f"the workflow"
    )

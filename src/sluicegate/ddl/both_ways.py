"""Which captured statements an active-active pair replays (pure, no server).

Both sides take writes. A statement run on side A reaches B in A's stream; until it does, B goes on writing
rows in the old shape, and those reach A after A changed. A statement is replayed both ways only when rows of
the old shape still apply to the new table, and rows of the new shape to the old one until the statement gets
there: a nullable column or one with a default added (old rows take its default on either side), a non-unique
index made or any index dropped, a default set or dropped, NOT NULL dropped, a constraint dropped, storage
settings. Anything else is refused, as `replicate create --bidirectional` refuses a secondary unique index:
- a unique index or constraint: each side accepts rows the other's index would refuse, and the stream could
  never apply them (the YugabyteDB seed's unsafe combination);
- a dropped, renamed or retyped column, NOT NULL set, a CHECK or foreign key added: the other side's rows
  written meanwhile in the old shape would not apply;
- CREATE/DROP/RENAME of a table: the pair's tables are fixed at create.
A statement the two sides ran differently shows itself when one side's replays it: it fails on the target (a
column that exists already, of another type) and the stream stops as `--on-ddl exec` says.

Loops cannot happen: the player replays a statement under session_replication_role = replica, in which the
capture's event triggers (enabled the default way, on origin) do not fire, so it is never captured again.
"""

from __future__ import annotations

from itertools import pairwise

from .statement import Statement, alter_actions, words

# ALTER TABLE … ALTER [COLUMN] c <these>: rows of either shape apply to the other
_SAFE_COLUMN_CHANGES = (("SET", "DEFAULT"), ("DROP", "DEFAULT"), ("DROP", "NOT"), ("SET", "STATISTICS"),
                        ("SET", "STORAGE"), ("SET", "COMPRESSION"))
_CONSTRAINT_WORDS = {"CONSTRAINT", "PRIMARY", "UNIQUE", "CHECK", "REFERENCES", "FOREIGN", "EXCLUDE"}


def refusal(stmt: Statement) -> str | None:
    """Why the statement is not replayed between two sides that both take writes; None: it is."""
    if stmt.kind == "create index":
        if "UNIQUE" in words(stmt.text, 3):
            return ("a unique index under active-active lets each side accept rows the other's index refuses, "
                    "which the stream could then never apply")
        return None
    if stmt.kind == "drop index":
        return None
    if stmt.kind == "create type":
        return None  # no row uses it before a column does
    if stmt.kind == "alter type":
        return None if stmt.adds_value else "an ALTER TYPE other than ADD VALUE is not replayed under active-active"
    if stmt.kind.endswith(" sequence"):
        return ("each side of an active-active pair keeps its own sequences (apart, as create advises): make "
                "and change them on each side")
    if stmt.kind == "drop type":
        return "a DROP TYPE is not replayed under active-active: drop it on each side"
    if stmt.kind in ("create table", "drop table"):
        return f"active-active replicates the tables it was created with: a {stmt.kind.upper()} is not replayed"
    if stmt.kind != "alter table":
        return f"{' '.join(words(stmt.text, 2))} is not replayed under active-active"
    if stmt.renames_table is not None:
        return "a renamed table: active-active replicates the tables it was created with"
    for action in alter_actions(stmt.text):
        why = _action_refusal([w for w, _ in action])
        if why:
            return why
    return None


def _action_refusal(action: list[str | None]) -> str | None:
    head = action[:1]
    if head == ["ADD"]:
        rest = action[2:] if action[1:2] == ["COLUMN"] else action[1:]
        if action[1:2] and action[1] in _CONSTRAINT_WORDS or _CONSTRAINT_WORDS & set(rest):
            return ("a constraint added under active-active: rows the other side writes meanwhile may break it, "
                    "and a unique one lets each side accept rows the other refuses")
        if ("NOT", "NULL") in pairwise(rest) and "DEFAULT" not in rest:
            return ("a NOT NULL column without a default: rows the other side writes meanwhile carry no value "
                    "for it")
        return None
    if head == ["ALTER"]:
        rest = action[2:] if action[1:2] == ["COLUMN"] else action[1:]
        change = tuple(rest[1:3])  # past the column's name
        if any(change[:len(safe)] == safe for safe in _SAFE_COLUMN_CHANGES):
            return None
        return ("a column's type or NOT NULL changed under active-active: rows the other side writes meanwhile in "
                "the old shape may not apply")
    if head == ["DROP"]:
        if action[1:2] == ["CONSTRAINT"]:
            return None
        return "a dropped column under active-active: rows the other side writes meanwhile still carry it"
    if head == ["RENAME"]:
        return "a renamed column under active-active: rows the other side writes meanwhile carry the old name"
    if head in (["SET"], ["RESET"]) and action[1:2] not in (["SCHEMA"], ["LOGGED"], ["UNLOGGED"]):
        return None  # storage parameters, SET WITHOUT CLUSTER, …
    return f"ALTER TABLE … {' '.join(w or '…' for w in action[:2])} is not replayed under active-active"

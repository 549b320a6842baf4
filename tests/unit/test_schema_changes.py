"""Classifying a Relation message against the stream's description of a table (workflow/schema_changes.py):
added columns at the end follow; drops, renames, type changes, columns added again and key changes stop."""

from __future__ import annotations

import pytest

from sluicegate.appliers.postgres import check_columns, same_columns
from sluicegate.errors import TerminalError
from sluicegate.postgres.catalog import Table
from sluicegate.postgres.pgoutput import Column, Relation
from sluicegate.workflow.schema_changes import classify

INT4, INT8, TEXT, VARCHAR = 23, 20, 25, 1043

TABLE = Table.from_json({"schema": "public", "name": "items", "key": ["id"], "columns": [
    ["id", "bigint", INT8, True, None, -1], ["qty", "integer", INT4, False, None, -1],
    ["name", "character varying(10)", VARCHAR, False, None, 14]]})


def rel(*cols, identity: str = "d") -> Relation:
    """Columns as (name, type oid[, typmod]); `id` is the key."""
    return Relation(16400, "public", "items", identity,
                    tuple(Column(int(c[0] == "id"), c[0], c[1], c[2] if len(c) > 2 else -1) for c in cols))


SAME = (("id", INT8), ("qty", INT4), ("name", VARCHAR, 14))

# (Relation's columns, what classify says: describe(all_added=True), whether the change follows)
CASES = {
    "unchanged": (SAME, [], False),
    "added one": ((*SAME, ("note", TEXT)), ["column note was added"], True),
    "added two": ((*SAME, ("note", TEXT), ("at", 1184)),
                  ["column note was added", "column at was added"], True),
    "dropped": ((("id", INT8), ("name", VARCHAR, 14)), ["column qty was dropped"], False),
    "dropped the last": ((("id", INT8), ("qty", INT4)), ["column name was dropped"], False),
    "renamed": ((("id", INT8), ("amount", INT4), ("name", VARCHAR, 14)),
                ["column qty was renamed to amount"], False),
    "retyped": ((("id", INT8), ("qty", INT8), ("name", VARCHAR, 14)),
                ["column qty changed type from integer to bigint"], False),
    "typmod": ((("id", INT8), ("qty", INT4), ("name", VARCHAR, 24)),
               ["column name changed type from character varying(10) to character varying"], False),
    "dropped, then added": ((("id", INT8), ("name", VARCHAR, 14), ("note", TEXT)),
                            ["column qty was dropped", "column note was added"], False),
    "added again": ((("id", INT8), ("name", VARCHAR, 14), ("qty", INT4)),
                    ["column qty was dropped and added again"], False),
}


@pytest.mark.parametrize("name", CASES)
def test_classify(name):
    cols, said, follows = CASES[name]
    change = classify(rel(*cols), TABLE)
    assert change.describe(all_added=True) == said
    assert change.only_added is follows
    assert change.unchanged is (not said)
    assert same_columns(rel(*cols), TABLE) is (not said)


def test_added_columns_keep_their_types_and_order():
    change = classify(rel(*SAME, ("note", TEXT), ("n", 1700, 655366)), TABLE)
    assert [(c.name, c.type_oid, c.typmod) for c in change.added] == [("note", TEXT, -1), ("n", 1700, 655366)]
    assert change.describe() == []  # alone, added columns are no news


def test_key_change():
    moved = Relation(16400, "public", "items", "d", (Column(0, "id", INT8, -1), Column(1, "qty", INT4, -1),
                                                     Column(0, "name", VARCHAR, 14)))
    change = classify(moved, TABLE)
    assert change.describe() == ["the key changed from (id) to (qty)"]
    assert not change.only_added and not same_columns(moved, TABLE)
    # under REPLICA IDENTITY FULL every column is flagged: no key to compare
    full = Relation(16400, "public", "items", "f", tuple(Column(1, c.name, c.type_oid, c.typmod)
                                                         for c in moved.columns))
    assert classify(full, TABLE).unchanged and same_columns(full, TABLE)


def test_description_without_typmods_compares_types_only():
    """A description stored before typmods were kept: a typmod change cannot be told, a type change can."""
    old = Table.from_json({"schema": "public", "name": "items", "key": ["id"], "columns": [
        ["id", "bigint", INT8, True, None], ["name", "character varying(10)", VARCHAR, False, None]]})
    assert classify(rel(("id", INT8), ("name", VARCHAR, 24)), old).unchanged
    retyped = classify(rel(("id", INT8), ("name", TEXT)), old).retyped
    assert retyped == (("name", "character varying(10)", TEXT, -1),)


def test_names_a_type_through_the_callers_catalog():
    change = classify(rel(("id", INT8), ("qty", 16500), ("name", VARCHAR, 14)), TABLE)
    assert change.describe() == ["column qty changed type from integer to type 16500"]
    assert change.describe(lambda oid, typmod: "money_amount") == [
        "column qty changed type from integer to money_amount"]


def test_check_columns_names_the_change_and_the_rule():
    with pytest.raises(TerminalError, match=r"public\.items changed \(column qty was dropped\).*re-create"):
        check_columns(rel(("id", INT8), ("name", VARCHAR, 14)), TABLE)
    with pytest.raises(TerminalError, match=r"note was added\); the rule for public\.items does not select"):
        check_columns(rel(*SAME, ("note", TEXT)), TABLE, "the rule for public.items")
    check_columns(rel(*SAME), TABLE)  # unchanged: no error

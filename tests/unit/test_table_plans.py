"""The kept plans' bookkeeping (appliers/plans.py), without a server: what a plan is found by, and which staging
table a new one takes when the session already keeps as many as it may."""

from __future__ import annotations

from sluicegate.appliers.plans import Kept, TablePlans


def kept(made_for, used: int) -> Kept:
    return Kept(made_for, {"copy": "…"}, "t", "s", "facts", 1, used)


def test_a_plan_is_used_only_for_what_it_was_made_for():
    plans = TablePlans()
    serial = plans.begin()
    assert plans.number(("a",), serial) == 0 and plans.number(("b",), serial) == 1
    plans.keep(("a",), kept(("table a", "all", None), serial))
    later = plans.begin()
    assert plans.use(("a",), ("table a", "all", None), later) == {"copy": "…"}
    assert plans.kept[("a",)].used == later
    assert plans.use(("a",), ("table a", "upto", ["5"]), later) is None  # another mode: made again
    assert plans.use(("b",), ("table b", "all", None), later) is None
    plans.forget(("a",))
    assert plans.use(("a",), ("table a", "all", None), later) is None
    assert plans.number(("a",), later) == 0  # its staging table's name stays its own


def test_at_capacity_the_least_recently_used_staging_table_is_taken_never_one_in_use():
    plans = TablePlans(capacity=3)
    first = plans.begin()
    for name in "abc":
        plans.keep((name,), kept(name, first))
        plans.number((name,), first)
    second = plans.begin()
    plans.use(("a",), "a", second)
    plans.use(("c",), "c", second)
    # b is the least recently used: d takes its staging table, and b's plan is gone with it
    assert plans.number(("d",), second) == 1
    assert ("b",) not in plans.kept and ("b",) not in plans.numbers
    plans.keep(("d",), kept("d", second))
    # every table is in use in this transaction: one more is made beyond the capacity rather than taking one
    assert plans.number(("e",), second) == 3
    third = plans.begin()
    plans.forget(("a",))  # a table without a plan gives its place up first
    assert plans.number(("f",), third) == 0

"""The order in which the PostgreSQL applier writes a chunk's staged rows: the target's key order, read from
the keys' text by their type (appliers/postgres.py sort_by_key)."""

from __future__ import annotations

from sluicegate.appliers.postgres import dense_range, key_order_getter, sort_by_key
from sluicegate.postgres.catalog import Table


def table(*key_types: tuple[str, str, int]) -> Table:
    cols = [[name, type_sql, oid, True, None] for name, type_sql, oid in key_types]
    return Table.from_json({"schema": "public", "name": "t", "key": [c[0] for c in cols],
                            "columns": cols + [["v", "text", 25, False, None]]})


def staged(keys: list[tuple]) -> dict:
    return {k: ("U", (*k, f"v{i}"), None) for i, k in enumerate(keys)}


def keys_after(t: Table, keys: list[tuple]) -> list[tuple]:
    return [row[1][:-1] for row in sort_by_key(staged(keys), key_order_getter(t))[0]]


def test_integers_sort_by_value_not_by_text():
    t = table(("id", "bigint", 20))
    keys = [("10",), ("9",), ("-3",), ("100",), ("0",)]
    assert keys_after(t, keys) == [("-3",), ("0",), ("9",), ("10",), ("100",)]


def test_numeric_and_float_sort_by_value():
    assert keys_after(table(("n", "numeric", 1700)), [("10.5",), ("9.75",), ("-1",), ("NaN",)]) == \
        [("-1",), ("9.75",), ("10.5",), ("NaN",)]
    floats = [("1e3",), ("NaN",), ("-Infinity",), ("20",)]
    expected = [("-Infinity",), ("20",), ("1e3",), ("NaN",)]
    assert keys_after(table(("f", "double precision", 701)), floats) == expected


def test_other_types_sort_by_their_text():
    t = table(("u", "uuid", 2950))
    keys = [("c0a80101-0000-0000-0000-000000000002",), ("0a000001-0000-0000-0000-000000000001",)]
    assert keys_after(t, keys) == sorted(keys)


def test_a_composite_key_sorts_column_by_column():
    t = table(("a", "integer", 23), ("b", "text", 25))
    keys = [("2", "a"), ("10", "a"), ("2", "B"), ("1", "z")]
    assert keys_after(t, keys) == [("1", "z"), ("2", "B"), ("2", "a"), ("10", "a")]


def test_rows_already_in_order_stay_as_they_are():
    t = table(("id", "integer", 23))
    rows = staged([(str(i),) for i in range(1, 1000)])
    assert sort_by_key(rows, key_order_getter(t))[0] == list(rows.values())


def test_keys_that_do_not_read_keep_the_order_they_came_in():
    # a value not in its type's text form (a rule's output may carry other Python values): order is only
    # for speed, so the rows go as they came rather than fail the chunk
    t = table(("id", "integer", 23))
    keys = [("3",), ("x",), ("1",)]
    assert keys_after(t, keys) == keys
    assert keys_after(t, [(3,), (None,), (1,)]) == [(3,), (None,), (1,)]


def test_dense_range_is_a_span_at_most_twice_the_keys():
    # 1000 keys in a row, every other key, every third: the span of the keys against how many there are
    assert dense_range((1, 1000), 1000)
    assert dense_range((1, 1999), 1000)
    assert not dense_range((1, 2998), 1000)
    assert not dense_range((1, 100), 100)  # too few rows to be worth the planner settings' round trips
    assert not dense_range((1, 1000), 0)  # a statement that joins no rows
    assert not dense_range(None, 1000)  # keys of another type, or that do not sort

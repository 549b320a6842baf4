"""Table names as users write them on the command line: SQL quoting, lists, schemas."""

import pytest

from sluicegate.errors import UsageError
from sluicegate.postgres.catalog import quote_name, split_list, split_name, with_schemas


@pytest.mark.parametrize("raw, expected", [
    ("orders", (None, "orders")),
    ("sales.orders", ("sales", "orders")),
    ("Sales Dept.Order Items", ("Sales Dept", "Order Items")),  # as written: not folded
    ('"Sales Dept"."Order Items"', ("Sales Dept", "Order Items")),
    ('"Order Items"', (None, "Order Items")),
    ('sales."a.b"', ("sales", "a.b")),
    ('"x""y".t', ('x"y', "t")),
    ('"a.b"', (None, "a.b")),
])
def test_split_name(raw, expected):
    assert split_name(raw) == expected


@pytest.mark.parametrize("raw", ['"open', '"a"b', 'a."b"."c"', '"".t'])
def test_split_name_refuses_malformed(raw):
    with pytest.raises(UsageError):
        split_name(raw)


def test_split_list_keeps_quoted_commas():
    assert split_list('a, "b,c".d ,, e') == ["a", '"b,c".d', "e"]


def test_with_schemas():
    assert with_schemas(None, None) is None
    assert with_schemas(["t"], ['"Sales Dept"']) == ["t", '"Sales Dept".*']


@pytest.mark.parametrize("schema, name, shown", [
    ("public", "orders", "public.orders"),
    ("Sales Dept", "Order Items", '"Sales Dept"."Order Items"'),
    ("public", "Orders", 'public."Orders"'),
    ("public", 'a"b', 'public."a""b"'),
    ("public", "_t1$", "public._t1$"),
])
def test_quote_name(schema, name, shown):
    assert quote_name(schema, name) == shown

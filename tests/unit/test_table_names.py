"""Table names as users write them on the command line: SQL quoting, lists, schemas."""

import pytest

from sluicegate.errors import UsageError
from sluicegate.postgres.catalog import quote_name, split_list, split_name, with_schemas
from sluicegate.vdiff.report import shown_name


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


@pytest.mark.parametrize("label, shown", [
    ("public.accounts", "public.accounts"),
    ("Sales Dept.Order Items", '"Sales Dept"."Order Items"'),
    ("public.accounts <- -80", "public.accounts <- -80"),  # a keyspace source's shard, after the name
    ("Sales Dept.Order Items <- 80-", '"Sales Dept"."Order Items" <- 80-'),
])
def test_a_vdiff_report_shows_names_as_sql_writes_them(label, shown):
    assert shown_name(label) == shown

"""The pure parts of user type handling: the extension decision, the CREATE statements, the JSON form."""

from __future__ import annotations

import pytest

from sluicegate.errors import UsageError
from sluicegate.postgres.catalog import Column, Table
from sluicegate.postgres.types import EnumType, Extension, UserType, create_type_sql, extension_step

HSTORE = Extension("hstore", "public")


def test_extension_missing_and_available_is_created():
    assert extension_step(HSTORE, None, True, "db on h:5432") is True


def test_extension_present_in_the_same_schema_is_left_alone():
    assert extension_step(HSTORE, "public", True, "db on h:5432") is False
    assert extension_step(HSTORE, "public", False, "db on h:5432") is False  # installed, package gone: fine


def test_extension_unavailable_is_refused_in_one_line():
    with pytest.raises(UsageError) as exc:
        extension_step(Extension("postgis", "gis"), None, False, "app on db2:5432")
    text = str(exc.value)
    assert "\n" not in text
    assert "extension postgis" in text and "target app on db2:5432" in text
    assert "install the package" in text


def test_extension_in_another_schema_is_refused_with_the_fix():
    with pytest.raises(UsageError) as exc:
        extension_step(HSTORE, "extensions", True, "app on db2:5432")
    assert "ALTER EXTENSION hstore SET SCHEMA public" in str(exc.value)
    assert "\n" not in str(exc.value)


def test_create_composite_and_domain_statements():
    comp = UserType("c", "My Schema", "pair", (("a", "integer", None), ("Label", "text", ("pg_catalog", "C")),
                                                ("tags", "public.hstore[]", None)))
    assert create_type_sql(comp).as_string(None) == (
        'CREATE TYPE "My Schema"."pair" AS ("a" integer, "Label" text COLLATE "pg_catalog"."C", '
        '"tags" public.hstore[])')
    dom = UserType("d", "public", "posint", base="integer", not_null=True, default="1",
                   checks=(("posint_check", "CHECK ((VALUE > 0))"),))
    assert create_type_sql(dom).as_string(None) == (
        'CREATE DOMAIN "public"."posint" AS integer DEFAULT 1 NOT NULL CONSTRAINT "posint_check" CHECK ((VALUE > 0))')


def test_create_range_statement():
    rng = UserType("r", "public", "textrange", base="text", collation=("pg_catalog", "C"), subtype_diff="float8mi",
                   opclass=("public", "my_ops"), multirange="Text Ranges")
    assert create_type_sql(rng).as_string(None) == (
        'CREATE TYPE "public"."textrange" AS RANGE (SUBTYPE = text, SUBTYPE_OPCLASS = "public"."my_ops", '
        'COLLATION = "pg_catalog"."C", SUBTYPE_DIFF = float8mi, MULTIRANGE_TYPE_NAME = "public"."Text Ranges")')
    assert UserType.from_json(rng.to_json()) == rng


def test_table_keeps_its_types_through_json():
    table = Table("public", "t", (Column("k", "pair", 16500, True, None, -1),), ("k",),
                  (EnumType("public", "mood", ("a", "b")),), 10,
                  (UserType("c", "public", "pair", (("a", "integer", None),)),
                   UserType("d", "public", "posint", base="integer", collation=("pg_catalog", "C"),
                            checks=(("c1", "CHECK (true)"),))),
                  (HSTORE,), (("public", "r", "a range type"),))
    assert Table.from_json(table.to_json()) == table
    old = table.to_json()
    for k in ("types", "extensions", "existing_types"):
        del old[k]  # a description stored before these were kept
    assert Table.from_json(old).types == ()


@pytest.mark.parametrize("oid, safe", [(23, True), (142, True), (3615, False), (3645, False), (1033, False), (16500, False)])
def test_binary_copy_only_for_types_that_round_trip(oid, safe):
    table = Table("public", "t", (Column("k", "integer", 23, True, None), Column("v", "x", oid, False, None)), ("k",))
    assert table.binary_copy_safe is safe

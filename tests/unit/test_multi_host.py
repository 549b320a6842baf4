"""Source URLs that list several hosts (libpq multi-host): which keywords Sluicegate adds, how they are named."""

from __future__ import annotations

import pytest

from sluicegate.postgres.connect import describe, primary_only


@pytest.fixture(autouse=True)
def _no_libpq_env(monkeypatch):
    for name in ("PGHOST", "PGHOSTADDR", "PGTARGETSESSIONATTRS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("url", [
    "postgresql://u@h1:5432,h2:5433/db",
    "host=h1,h2 port=5432,5433 dbname=db",
    "postgresql://u@h1,h2/db?sslmode=require",
])
def test_several_hosts_without_session_attrs_ask_for_the_primary(url):
    assert primary_only(url) == {"target_session_attrs": "read-write"}


@pytest.mark.parametrize("url", [
    "postgresql://u@h1:5432/db",
    "host=h1 dbname=db",
    "postgresql://u@h1,h2/db?target_session_attrs=any",  # the user's choice is kept
    "host=h1,h2 target_session_attrs=prefer-standby",
    "not a conninfo = = =",
])
def test_one_host_or_an_explicit_choice_is_left_alone(url):
    assert primary_only(url) == {}


def test_the_environment_counts_as_the_url(monkeypatch):
    monkeypatch.setenv("PGHOST", "h1,h2")
    assert primary_only("dbname=db") == {"target_session_attrs": "read-write"}
    monkeypatch.setenv("PGTARGETSESSIONATTRS", "any")
    assert primary_only("dbname=db") == {}


@pytest.mark.parametrize("url, shown", [
    ("postgresql://u:secret@h1:5432,h2:5433/db", "h1:5432,h2:5433/db"),
    ("host=h1,h2 port=6000 dbname=db", "h1:6000,h2:6000/db"),
    ("postgresql://u@h1/db", "h1:5432/db"),
])
def test_describe_pairs_each_host_with_its_port(url, shown):
    assert describe(url) == shown

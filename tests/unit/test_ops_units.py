"""Pure pieces of the operations work: passwords out of conninfo, sizes, names, the heartbeat's verdict."""

from __future__ import annotations

import pytest

from sluicegate.errors import UsageError
from sluicegate.postgres.connect import connect_failure, has_password, redact, strip_password
from sluicegate.sizes import format_size, parse_size
from sluicegate.workflow.heartbeat import STALE_AFTER, is_running
from sluicegate.workflow.state import Driver, check_name

STRIPPED = [
    ("postgresql://u:pw@h:5432/db", "postgresql://u@h:5432/db"),
    ("postgres://u:p%40ss@h1:5,h2:6/db?sslmode=require&password=x&application_name=a",
     "postgres://u@h1:5,h2:6/db?sslmode=require&application_name=a"),
    ("postgresql://:pw@h/db", "postgresql://h/db"),
    ("postgresql:///db?host=/tmp&password=z", "postgresql:///db?host=/tmp"),
    ("postgresql://u@h/db", "postgresql://u@h/db"),
    ("postgresql://u:p@ss@h/db", "postgresql://u@h/db"),  # an unescaped @ in the password
    ("host=h port=5 user=u password='a b' dbname=d", "host=h port=5 user=u dbname=d"),
    ("host=h dbname=d", "host=h dbname=d"),
    # TLS files are paths and stay; a client key's sslpassword is a secret and goes
    ("postgresql://u:p@h/db?sslmode=verify-full&sslrootcert=/etc/ca.crt&sslcert=c.crt&sslkey=c.key&sslpassword=k",
     "postgresql://u@h/db?sslmode=verify-full&sslrootcert=/etc/ca.crt&sslcert=c.crt&sslkey=c.key"),
    ("host=h sslrootcert=/etc/ca.crt sslpassword=k", "host=h sslrootcert=/etc/ca.crt"),
]


def test_redact_hides_a_client_keys_password():
    assert redact("host=h sslpassword=hush sslmode=verify-full") == "host=h sslpassword=*** sslmode=verify-full"
    assert "hush" not in redact("postgresql://h/db?sslpassword=hush&sslrootcert=/x")


@pytest.mark.parametrize(("url", "stripped"), STRIPPED)
def test_strip_password_keeps_everything_else(url, stripped):
    got = strip_password(url)
    if "=" in url and "://" not in url:  # key=value: the same settings, in libpq's own order
        assert sorted(got.split()) == sorted(stripped.split())
    else:
        assert got == stripped
    assert has_password(url) == (url != stripped)
    assert strip_password(got) == got


def test_a_missing_password_names_the_pgpass_way_and_no_password():
    err = connect_failure("source", "postgresql://app:secret@db.example:5433/shop",
                          "fe_sendauth: no password supplied")
    text = str(err)
    assert isinstance(err, UsageError) and "secret" not in text
    assert text.startswith("no password for source db.example:5433/shop (user app): add it to a pgpass file")
    assert "secret" not in redact("cannot connect: postgresql://app:secret@h/db password=secret")


@pytest.mark.parametrize(("text", "size"), [("1GB", 1 << 30), ("512 MB", 512 << 20), ("10kB", 10 << 10),
                                            ("1048576", 1 << 20), ("1.5GiB", 3 << 29)])
def test_sizes(text, size):
    assert parse_size(text) == size


def test_bad_size_and_format():
    with pytest.raises(UsageError, match="size '1 parsec' not understood"):
        parse_size("1 parsec")
    assert format_size(6_815_744) == "6.5 MB" and format_size(12) == "12 bytes"


@pytest.mark.parametrize("name", ["wf", "_x", "orders.v2", "a-b_c", "W" * 100])
def test_good_names(name):
    check_name(name)


@pytest.mark.parametrize("name", ["", "1wf", "a b", "w;rm", "w'x", "W" * 101, "-v", "$(x)"])
def test_bad_names(name):
    with pytest.raises(UsageError, match="is not allowed"):
        check_name(name)


def test_driver_is_running_only_with_a_fresh_beat_and_a_pid():
    assert is_running(Driver(1.0, 42, "h"))
    assert not is_running(Driver(STALE_AFTER + 1, 42, "h"))  # killed: its beats stopped
    assert not is_running(Driver(1.0, None, "h"))  # a clean exit clears the pid
    assert not is_running(Driver(None, None, None))  # never seen

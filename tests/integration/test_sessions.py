"""Sluicegate's sessions keep their own settings whatever the database's defaults say."""

from __future__ import annotations

import time

import psycopg
import pytest
from psycopg import sql

from sluicegate.postgres.connect import connect


def test_server_timeouts_meant_for_applications_do_not_cut_snapshots_or_copies(pair):
    ident = sql.Identifier(pair.name)
    pair.src(sql.SQL("ALTER DATABASE {} SET idle_in_transaction_session_timeout = '50ms'").format(ident))
    pair.src(sql.SQL("ALTER DATABASE {} SET statement_timeout = '50ms'").format(ident))
    pair.src(sql.SQL("ALTER DATABASE {} SET TimeZone = 'America/New_York'").format(ident))
    with connect(pair.source, role="source") as conn:
        # a snapshot holder idles in its transaction while Spark tasks import the snapshot
        conn.execute("SELECT pg_export_snapshot()")
        time.sleep(0.2)  # idle in the transaction for longer than the database's default allows
        conn.execute("SELECT pg_sleep(0.1)")  # and a statement longer than its statement_timeout
        assert conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()[0] == "0"
        assert conn.execute("SHOW statement_timeout").fetchone()[0] == "0"
        assert conn.execute("SHOW TimeZone").fetchone()[0] == "UTC"
    # the same session without Sluicegate's settings is cut off: the test above shows something
    with psycopg.connect(pair.source) as plain:
        plain.execute("SELECT 1")
        time.sleep(0.2)
        with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
            plain.execute("SELECT 1")


def test_replicated_values_do_not_depend_on_the_source_servers_date_and_time_defaults(pair, spark):
    """pgoutput's text values are formatted by the walsender's session: it gets Sluicegate's settings too."""
    from sluicegate.workflow.create import create_movetables

    from ..conftest import EngineThread, wait_for
    from .helpers import caught_up

    ident = sql.Identifier(pair.name)
    pair.src(sql.SQL("ALTER DATABASE {} SET DateStyle = 'SQL, DMY'").format(ident))
    pair.src(sql.SQL("ALTER DATABASE {} SET TimeZone = 'Asia/Kolkata'").format(ident))
    pair.src("CREATE TABLE events (id int PRIMARY KEY, day date, at timestamptz, span interval)")
    pair.src("INSERT INTO events VALUES (1, '2024-02-03', '2024-02-03 04:05:06+00', '1 day 2 hours')")
    create_movetables("dates", pair.source, pair.target, None, [], {})
    with EngineThread(spark, pair.target, "dates"):
        wait_for(lambda: caught_up(pair, "dates"), what="caught up")
        pair.src("INSERT INTO events VALUES (2, '2024-12-01', '2024-12-01 23:30:00+00', '3 mons')")
        pair.src("UPDATE events SET day = '2025-01-13' WHERE id = 1")
        wait_for(lambda: caught_up(pair, "dates"), what="caught up after the changes")
    rows = []
    for url in (pair.source, pair.target):  # both read with the same (Sluicegate's) settings
        with connect(url, role="source") as conn:
            rows.append(conn.execute("SELECT e::text FROM events e ORDER BY id").fetchall())
    assert rows[0] == rows[1] and len(rows[0]) == 2
    assert pair.dst("SELECT day::text FROM events ORDER BY id") == [("2025-01-13",), ("2024-12-01",)]

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

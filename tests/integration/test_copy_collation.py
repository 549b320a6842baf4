"""A copy in several cycles between databases whose default orders of text differ: a text key's cycle edges
are compared on the target, so such a table is copied in one cycle (copier.py, postgres/collation.py)."""

from __future__ import annotations

import pytest
from psycopg import sql

from sluicegate.workflow.create import create_movetables

from ..conftest import EngineThread, wait_for
from .helpers import caught_up, stream_row

pytestmark = pytest.mark.spark


def test_text_keys_copied_whole_where_the_targets_default_order_differs(pair, spark):
    # The target database again, with the other of two orders: 'B' < 'a' byte-wise (C), not in ICU's root
    c_order = pair.src("SELECT 'B' < 'a'")[0][0]
    locale = "LOCALE_PROVIDER icu ICU_LOCALE 'und'" if c_order else "LOCALE 'C'"
    pair.target_server.drop_database(pair.name)
    made = sql.SQL("CREATE DATABASE {} TEMPLATE template0 " + locale).format(sql.Identifier(pair.name))
    pair.target_server.psql(made)
    assert pair.dst("SELECT 'B' < 'a'")[0][0] != c_order
    pair.src("CREATE TABLE words (w text PRIMARY KEY, n int)")
    pair.src("INSERT INTO words SELECT chr(CASE WHEN g % 2 = 0 THEN 65 ELSE 97 END + g % 26) || g, g "
             "FROM generate_series(1, 60) g")
    create_movetables("words", pair.source, pair.target, ["words"], [], {"cycle_rows": 5})
    with EngineThread(spark, pair.target, "words"):
        wait_for(lambda: caught_up(pair, "words"), what="copied", describe=lambda: stream_row(pair, "words"))
        pair.src("UPDATE words SET n = -n WHERE n % 7 = 0")
        wait_for(lambda: caught_up(pair, "words"), what="caught up",
                 describe=lambda: stream_row(pair, "words"))
        rows = "SELECT w, n FROM words"  # (each side lists them in its own order)
        assert sorted(pair.dst(rows)) == sorted(pair.src(rows)) and len(pair.src(rows)) == 60
    assert pair.dst("SELECT count(*) FROM sluicegate.copy_state WHERE table_name = 'public.words' AND done") \
        == [(1,)]

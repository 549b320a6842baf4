"""Errors that end (issue 34): a rule that fails on a row stops the stream in Error at once, naming the table,
the row's key and the value, with a short log; create refuses a rule whose output a lossy cast would make."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sluicegate.errors import UsageError
from sluicegate.workflow.create import create_materialize, create_movetables

from ..conftest import EngineThread, wait_for
from .helpers import caught_up, reap_group, stream_row

pytestmark = pytest.mark.spark


def test_a_rule_that_fails_at_a_copied_row_ends_in_error_within_one_retry(pair, tmp_path):
    pair.src("CREATE TABLE notes (id int PRIMARY KEY, note text)")
    pair.src("INSERT INTO notes SELECT g, g::text FROM generate_series(1, 400) g")
    pair.src("UPDATE notes SET note = 'x' WHERE id = 270")  # row N: in the second copy cycle
    create_materialize("castfail", pair.source, pair.target,
                       ["notes_n: SELECT id, CAST(note AS INT) AS n FROM notes"],
                       {"cycle_rows": 200, "chunk_rows": 100}, {})
    log = tmp_path / "run.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sluicegate.cli.main", "workflow", "run", "castfail",
                                 "--target", pair.target], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            wait_for(lambda: proc.poll() is not None, timeout=180, what="workflow run to end",
                     describe=lambda: (stream_row(pair, "castfail"), log.read_text()[-2000:]))
        finally:
            reap_group(proc)
    text = log.read_text()
    row = stream_row(pair, "castfail")
    assert row["state"] == "Error", (row, text[-3000:])
    message = row["message"]
    assert "public.notes" in message and "(id)=(270)" in message and "'x'" in message, message
    assert "try_cast" in message, message  # the way out
    # Nothing past the last committed cycle: rows 1..200, and the copy's lastpk there.
    assert pair.dst("SELECT count(*), max(id) FROM notes_n") == [(200, 200)]
    assert pair.dst("SELECT lastpk::text FROM sluicegate.copy_state WHERE table_name = 'public.notes'") == \
        [('["200"]',)]
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert sum("retrying" in ln for ln in lines) <= 1, text
    assert len(lines) < 20, f"{len(lines)} log lines:\n{text}"
    assert "\tat " not in text and "[Stage" not in text, text  # no Java stack trace, no stage bars
    print(f"{len(lines)} log lines:\n{text}")


def test_create_refuses_a_computed_column_a_lossy_cast_would_make(pair, spark):
    pair.src("CREATE TABLE orders (id int PRIMARY KEY, total numeric, qty int)")
    pair.src("INSERT INTO orders VALUES (1, 12.50, 3)")
    with pytest.raises(UsageError) as err:
        create_materialize("gross", pair.source, pair.target,
                           ["orders_gross: SELECT id, total * qty AS gross FROM orders"], {}, {})
    text = str(err.value)
    assert "gross" in text and "total" in text and "CAST(total AS DECIMAL" in text, text
    assert pair.dst("SELECT to_regclass('public.orders_gross')") == [(None,)]  # nothing created
    # the CAST it names is accepted, and makes a numeric column
    create_materialize("gross", pair.source, pair.target,
                       ["orders_gross: SELECT id, CAST(total AS DECIMAL(38,10)) * qty AS gross FROM orders"], {}, {})
    assert pair.dst("SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = "
                    "'public.orders_gross'::regclass AND attname = 'gross'") == [("numeric(38,6)",)]
    # an existing target column the output would not fit: refused with the CAST that fits it
    pair.dst("CREATE TABLE orders_n (id int PRIMARY KEY, n integer)")
    with pytest.raises(UsageError) as err:
        create_materialize("n", pair.source, pair.target,
                           ["orders_n: SELECT id, CAST(qty AS DOUBLE) * 1.5 AS n FROM orders"], {}, {})
    assert "orders_n" in str(err.value) and "CAST(... AS INT)" in str(err.value), str(err.value)
    # a wider one takes the values as they are: the rule writes the table's type
    pair.dst("CREATE TABLE orders_q (id int PRIMARY KEY, q2 numeric)")
    create_materialize("q", pair.source, pair.target, ["orders_q: SELECT id, qty * 2 AS q2 FROM orders"], {}, {})


def test_a_row_the_target_refuses_ends_in_error_naming_the_row_and_the_way_out(pair, spark):
    # An applier's error, not a rule's: the target's own CHECK refuses a replicated row (SQLSTATE 23514).
    pair.src("CREATE TABLE stock (id int PRIMARY KEY, qty int)")
    pair.src("INSERT INTO stock SELECT g, g FROM generate_series(1, 50) g")
    pair.dst("CREATE TABLE stock (id int PRIMARY KEY, qty int CHECK (qty >= 0))")
    create_movetables("chk", pair.source, pair.target, ["stock"], [], {})
    with EngineThread(spark, pair.target, "chk") as run:
        wait_for(lambda: caught_up(pair, "chk"), what="caught up", describe=lambda: stream_row(pair, "chk"))
        pair.src("INSERT INTO stock VALUES (51, 51), (52, -7)")
        wait_for(lambda: stream_row(pair, "chk")["state"] == "Error", what="Error",
                 describe=lambda: stream_row(pair, "chk"))
        run.thread.join(timeout=60)
    message = stream_row(pair, "chk")["message"]
    assert "stock" in message and "(52, -7)" in message and "SQLSTATE 23514" in message, message
    assert "constraint of the target" in message, message  # the way out
    assert run.engine.recovering is False  # it never retried
    assert pair.dst("SELECT count(*), max(id) FROM stock") == [(50, 50)]  # nothing of that transaction

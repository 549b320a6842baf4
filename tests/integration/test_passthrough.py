"""The copy's COPY passthrough (postgres/passthrough.py) on real servers: rows, and each side's failure; and
dropping a slot that a lingering reader holds."""

from __future__ import annotations

import threading

import pytest

from sluicegate.errors import TerminalError
from sluicegate.postgres import passthrough

SELECT = "COPY (SELECT id, 100 / (id - %d) AS v FROM generate_series(1, %d) id) TO STDOUT (FORMAT binary)"


@pytest.fixture(autouse=True, params=["c", "python"])
def pump(request, monkeypatch):
    """Each test with the C row pump and with the Python pipe (SLUICEGATE_COPY_PUMP=python)."""
    if request.param == "python":
        monkeypatch.setattr(passthrough, "_c_pump", lambda: (None, None))
    elif passthrough._c_pump()[0] is None:
        pytest.skip("the C row pump is not built here")
    return request.param


def _pipe(pair, select, insert):
    src, dst = passthrough.connect(pair.source, "source"), passthrough.connect(pair.target, "target")
    try:
        return passthrough.pipe(src, select, dst, insert), dst
    except BaseException:
        dst.close()
        raise
    finally:
        src.close()


def test_rows_pass_through_and_commit_is_the_callers(pair):
    pair.dst("CREATE TABLE t (id int PRIMARY KEY, v int)")
    rows, dst = _pipe(pair, SELECT % (0, 200_000), "COPY t FROM STDIN (FORMAT binary)")
    assert rows == 200_000
    assert pair.dst("SELECT count(*) FROM t")[0][0] == 0  # not committed yet
    dst.commit()
    dst.close()
    assert pair.dst("SELECT count(*), sum(v) FROM t")[0] == (200_000, sum(100 // i for i in range(1, 200_001)))


def test_a_target_that_refuses_rows_part_way_is_named_and_nothing_hangs(pair):
    pair.dst("CREATE TABLE t (id int PRIMARY KEY, v int CHECK (id < 150000))")
    threads = threading.active_count()
    with pytest.raises(TerminalError, match=r"copy from/to target .*violates check constraint"):
        _pipe(pair, SELECT % (0, 200_000), "COPY t FROM STDIN (FORMAT binary)")
    assert threading.active_count() == threads  # the source's thread ended with the pipe
    assert pair.dst("SELECT count(*) FROM t")[0][0] == 0


def test_a_source_that_fails_part_way_is_named_and_the_target_keeps_nothing(pair):
    pair.dst("CREATE TABLE t (id int PRIMARY KEY, v int)")
    with pytest.raises(TerminalError, match=r"copy from/to source .*division by zero"):
        _pipe(pair, SELECT % (150_000, 200_000), "COPY t FROM STDIN (FORMAT binary)")
    assert pair.dst("SELECT count(*) FROM t")[0][0] == 0


def test_unreachable_sides_are_connect_errors(pair):
    from sluicegate.errors import ConnectError

    with pytest.raises(ConnectError, match="cannot connect to target 127.0.0.1:1/") as err:
        passthrough.connect("postgresql://u:secret@127.0.0.1:1/db", "target")
    assert "secret" not in str(err.value)


def test_dropping_a_slot_that_a_lingering_reader_still_holds(pair):
    """`workflow delete` right after a driver stopped: the cancelled task's walsender may still hold the slot.
    The drop ends that reader and waits for the slot to be free instead of failing with "is active"."""
    import psycopg

    from sluicegate.postgres import capture
    from sluicegate.postgres.replication import ChangeStream

    pair.src("CREATE TABLE t (id int PRIMARY KEY)")
    with psycopg.connect(pair.source, autocommit=True) as c:
        c.execute("CREATE PUBLICATION lingering FOR TABLE t")
        start = capture.ensure_slot(c, "lingering")
        reader = ChangeStream(pair.source, "lingering", "lingering", start)
        try:
            assert capture.slot_info(c, "lingering").active_pid is not None
            assert capture.drop_capture(c, "lingering", "lingering") == ["replication slot lingering",
                                                                        "publication lingering"]
            assert capture.slot_info(c, "lingering") is None
        finally:
            reader.close()

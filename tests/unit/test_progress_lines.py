"""Progress lines of `workflow run` (cli/progress.py) and the log setup (cli/logsetup.py), without servers."""

from __future__ import annotations

import logging
import re

import pytest
from click.testing import CliRunner

from sluicegate.cli.logsetup import configure
from sluicegate.cli.progress import LineState, progress_lines


def stream(state, tables, *, applied=0, lag=None, position="0/16B3748", message=""):
    return {
        "label": "stream 1",
        "state": state,
        "message": message,
        "lag_seconds": lag,
        "position": position,
        "rows_applied": applied,
        "tables": [
            {"table": t, "state": s, "rows_copied": n, "rows_total": total} for t, s, n, total in tables
        ],
    }


def test_copy_then_replicate_lines():
    seen = LineState()
    assert progress_lines(
        [stream("Copying", [("public.a", "Copying", 1000, 4000), ("public.b", "Pending", 0, 10)])],
        100.0,
        seen,
    ) == ["stream 1: Copying", "copy public.a: 1,000/4,000 rows (25%)"]
    # ten seconds later: a rate, and only the table being copied
    assert progress_lines(
        [stream("Copying", [("public.a", "Copying", 3000, 4000), ("public.b", "Pending", 0, 10)])],
        110.0,
        seen,
    ) == ["copy public.a: 3,000/4,000 rows (75%), 200 rows/s"]
    # a finished table gets its last line, its rate over the whole time it was seen copying (3,000 rows in
    # 20 s), not the last interval's; the next one is the one being copied
    assert progress_lines(
        [stream("Copying", [("public.a", "Copied", 4000, 4000), ("public.b", "Copying", 5, 10)])], 120.0, seen
    ) == ["copied public.a: 4,000/4,000 rows, 150 rows/s", "copy public.b: 5/10 rows (50%), 0 rows/s"]
    assert progress_lines(
        [
            stream(
                "Running",
                [("public.a", "Copied", 4000, 4000), ("public.b", "Copied", 10, 10)],
                applied=7,
                lag=0.25,
            )
        ],
        130.0,
        seen,
    ) == [
        "stream 1: Running (was Copying)",
        "copied public.b: 10/10 rows, 0 rows/s",
        "replicate stream 1: lag 0.2s, position 0/16B3748, 7 rows applied since the last line, 1 rows/s",
    ]
    assert progress_lines(
        [stream("Running", [("public.a", "Copied", 4000, 4000)], applied=507, lag=1.5)], 140.0, seen
    ) == ["replicate stream 1: lag 1.5s, position 0/16B3748, 500 rows applied since the last line, 50 rows/s"]
    assert progress_lines(
        [
            stream(
                "Error",
                [("public.a", "Copied", 4000, 4000)],
                applied=507,
                message="replication slot gone: re-bootstrap",
            )
        ],
        150.0,
        seen,
    ) == ["stream 1: Error (was Running): replication slot gone: re-bootstrap"]


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for logger in (root, logging.getLogger("sluicegate.progress")):
        for h in [h for h in logger.handlers if getattr(h, "_sluicegate", False)]:
            logger.removeHandler(h)
            h.close()
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)
    for name in ("py4j", "pyspark", "urllib3", "grpc"):
        logging.getLogger(name).setLevel(logging.NOTSET)


def test_log_lines_levelled_named_quiet_and_redacted(tmp_path, restore_logging):
    path = tmp_path / "sg.log"
    configure(logging.INFO, str(path))
    logging.getLogger("sluicegate").info("connecting to %s", "postgresql://u:secret@h/db")
    logging.getLogger("py4j.clientserver").info("Command to send: c")  # noise below WARNING
    logging.getLogger("py4j.clientserver").warning("the gateway went away")
    logging.getLogger("sluicegate").debug("not at info")
    text = path.read_text()
    line = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}"
    assert re.fullmatch(
        rf"{line} INFO sluicegate: connecting to postgresql://u:\*\*\*@h/db\n"
        rf"{line} WARNING py4j.clientserver: the gateway went away\n",
        text,
    ), text
    configure(logging.DEBUG, str(path))
    logging.getLogger("py4j.clientserver").debug("Command to send: c")
    assert path.read_text().endswith("DEBUG py4j.clientserver: Command to send: c\n")


def test_log_options_before_and_after_the_subcommand(tmp_path, restore_logging):
    from sluicegate.cli.main import cli

    path = tmp_path / "cli.log"
    runner = CliRunner()
    result = runner.invoke(
        cli,
        [
            "workflow",
            "list",
            "--target",
            "postgresql://127.0.0.1:1/x?connect_timeout=1",
            "--log-level",
            "debug",
            "--log-file",
            str(path),
        ],
    )
    assert result.exit_code == 1
    assert logging.getLogger().level == logging.DEBUG
    assert logging.getLogger("py4j").level == logging.NOTSET
    result = runner.invoke(cli, ["-v", "workflow", "list", "--target", "postgresql://127.0.0.1:1/x"])
    assert logging.getLogger().level == logging.INFO and logging.getLogger("py4j").level == logging.WARNING
    result = runner.invoke(cli, ["--log-level", "bogus", "workflow", "list"])
    assert result.exit_code == 2 and "bogus" in result.output


class Counter:
    """What a Spark accumulator offers the driver: its value so far."""

    def __init__(self, value=0):
        self.value = value


def test_percent_of_a_copy():
    from sluicegate.cli.progress import percent

    assert percent(1000, 4000, False) == 25.0
    assert percent(6938, 23_200, True) == 100.0  # a finished filtered copy: all of it, whatever the estimate
    assert percent(0, 0, True) == 100.0 and percent(0, 0, False) == 0.0
    assert f"{percent(3995, 4000, False):.0f}" == "99"  # never 100% before it is done
    assert percent(4200, 4000, False) == 100.0  # more rows than the estimate, not yet recorded


def test_rate_is_rows_over_wall_time():
    from sluicegate.workflow.live import copy_rate

    assert copy_rate(2_000_000, 10.0, None, 17.5) == pytest.approx(266_667, rel=1e-4)
    assert copy_rate(2_000_000, 10.0, 17.5, 30.0) == copy_rate(2_000_000, 10.0, 17.5, 17.5)  # ended: fixed
    assert copy_rate(0, 10.0, None, 10.0) == 0.0 and copy_rate(5, 10.0, None, 10.0) == 0.0


def test_a_one_cycle_copy_moves_every_line_at_its_true_rate():
    """2M rows in one cycle at 270k rows/s: the view adds the cycle's finished tasks (the accumulator) and its
    running COPYs (in flight) to copy_state's 0, and the rate stays rows over wall time, never a jump."""
    from sluicegate.cli.progress import with_live
    from sluicegate.workflow.live import TableCopy

    finished = Counter()
    entry = TableCopy(started=100.0, base=0, cycle_base=0, finished=finished, label="sluicegate copy x")
    seen = LineState()
    status = {"table": "public.big", "state": "Pending", "rows_copied": 0, "rows_total": 1_999_994}

    def at(now, in_flight, table=status):
        shown = with_live(table, entry, {"sluicegate copy x": in_flight}, now)
        return progress_lines([{**stream("Copying", []), "tables": [shown]}], now, seen)

    assert at(101.0, 270_000) == ["stream 1: Copying", "copy public.big: 270,000/1,999,994 rows (14%), 270,000 rows/s"]
    assert at(102.0, 540_000) == ["copy public.big: 540,000/1,999,994 rows (27%), 270,000 rows/s"]
    # one task of two ended: its rows left pg_stat_progress_copy before they reached the accumulator
    assert at(103.0, 310_000) == ["copy public.big: 540,000/1,999,994 rows (27%), 180,000 rows/s"]
    finished.value = 1_000_000
    assert at(104.0, 80_000) == ["copy public.big: 1,080,000/1,999,994 rows (54%), 270,000 rows/s"]
    # past the estimate before the cycle is recorded: the total follows, below 100%
    finished.value = 2_000_000
    assert at(107.0, 0) == ["copy public.big: 2,000,000/2,000,000 rows (100%), 285,714 rows/s"]
    entry.ended, entry.recorded = 107.4, 2_000_000  # recorded (indexes built): the rate ends with the copy
    done = {**status, "state": "Copied", "rows_copied": 2_000_000, "rows_total": 2_000_000}
    assert at(108.0, 0, done) == ["copied public.big: 2,000,000/2,000,000 rows, 270,270 rows/s"]
    assert at(109.0, 0, done) == []
    # status read just before the cycle's commit, the entry just after: what the cycle recorded
    assert with_live(status, entry, {}, 110.0)["rows_copied"] == 2_000_000


def test_rows_read_by_running_tasks_from_their_session_names_and_copies():
    from sluicegate.workflow.live import reads, source_label

    a, b = "sluicegate copy 0123456789ab", "sluicegate copy ba9876543210"
    sessions = [(source_label(a, 20_000), 0), (source_label(a, 0), 40_000), (source_label(b, 5), 7),
                ("sluicegate copy x", 9), ("sluicegate", 11), (a, 13)]
    assert reads(sessions) == {a: 60_000, b: 12}
    assert len(source_label(a, 10**12)) <= 63  # PostgreSQL keeps 63 bytes of an application_name


def test_lines_without_applied_rows_and_after_a_switch():
    seen = LineState()
    delta = {**stream("Running", [("public.a", "Copied", 10, 10)], lag=0.5), "rows_applied": None}
    assert progress_lines([delta], 1.0, seen) == [
        "stream 1: Running",
        "replicate stream 1: lag 0.5s, position 0/16B3748",
    ]


def test_terminal_table_of_a_finished_filtered_copy():
    """The live table on a terminal: a copied table whose rule kept 6,938 of ~23,200 source rows is 100%."""
    from rich.console import Console

    from sluicegate.cli.progress import ProgressView

    console = Console(record=True, width=100, force_terminal=False)
    view = ProgressView("postgresql://unused", "m", console)
    streams = [{**stream("Running", [("public.orders", "Copied", 6938, 6938)], lag=0.5), "label": "stream 1"}]
    console.print(view.render("m", streams))
    text = console.export_text()
    assert "workflow m: Running" in text
    row = next(line for line in text.splitlines() if "public.orders" in line)
    assert [c.strip() for c in row.split("│")[1:-1]] == ["public.orders", "Copied", "6,938/6,938", "100", "-",
                                                         "-"], row

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
    # a finished table gets its last line; the next one is the one being copied
    assert progress_lines(
        [stream("Copying", [("public.a", "Copied", 4000, 4000), ("public.b", "Copying", 5, 10)])], 120.0, seen
    ) == ["copied public.a: 4,000/4,000 rows, 100 rows/s", "copy public.b: 5/10 rows (50%), 0 rows/s"]
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

"""cli/output.py: one JSON document per --json command, human rendering, and errors the same way under --json."""

from __future__ import annotations

import io
import json
import uuid
from datetime import date, datetime, timezone
from decimal import Decimal

import click
from click.testing import CliRunner
from rich.console import Console

from sluicegate.cli.output import document, emit, friendly, line, print_workflows
from sluicegate.errors import SluicegateError


def test_a_document_keeps_key_order_and_prints_what_json_lacks_as_str():
    when = datetime(2026, 11, 27, 14, 31, 35, 250000, tzinfo=timezone.utc)
    result = {"workflow": "w", "state": "Running", "at": when, "day": date(2026, 11, 27),
              "rows": Decimal("12.50"), "id": uuid.UUID(int=1), "position": "0/16B3748", "streams": [{"lag": None}]}
    text = document(result)
    assert list(json.loads(text)) == list(result)  # the order the command built, not sorted
    assert '"at": "2026-11-27 14:31:35.250000+00:00"' in text  # what `status --json` has always printed
    assert '"day": "2026-11-27"' in text and '"rows": "12.50"' in text  # a Decimal's digits exactly
    assert '"id": "00000000-0000-0000-0000-000000000001"' in text
    assert text.startswith('{\n  "workflow": "w",\n') and '    {\n      "lag": null\n    }' in text
    assert text == json.dumps(result, indent=2, default=str)


def test_a_line_is_one_compact_document():
    assert line({"heartbeat": {"position": "0/1", "time_us": 7}}) == '{"heartbeat":{"position":"0/1","time_us":7}}'
    assert "\n" not in line({"text": "a\nb", "at": date(2026, 1, 2)})


def _command(result, fault: Exception | None = None, code: int = 1) -> click.Command:
    @click.command()
    @click.option("--json", "as_json", is_flag=True)
    @friendly(code=code)
    def cmd(as_json):
        if fault is not None:
            raise fault
        emit(result, as_json, lambda r: click.echo(f"{len(r['workflows'])} workflow(s)"))

    return cmd


def test_emit_prints_json_or_the_human_rendering_never_both():
    cmd = _command({"workflows": [{"workflow": "w", "lag_seconds": 0.5}]})
    out = CliRunner().invoke(cmd, ["--json"])
    assert out.exit_code == 0 and json.loads(out.stdout) == {"workflows": [{"workflow": "w", "lag_seconds": 0.5}]}
    assert "workflow(s)" not in out.stdout
    out = CliRunner().invoke(cmd, [])
    assert out.exit_code == 0 and out.stdout == "1 workflow(s)\n"


def test_human_rendering_of_a_small_result():
    buf = io.StringIO()
    console = Console(file=buf, width=200, highlight=False)
    rows = [{"workflow": "orders[1]", "kind": "MoveTables", "state": "Running", "lag_seconds": 0.25,
             "driver": {"running": True, "pid": 42, "host": "h1", "last_seen_seconds": 3.0}},
            {"workflow": "w2", "kind": "Materialize", "state": "Stopped", "lag_seconds": None,
             "driver": {"running": False, "pid": None, "host": None, "last_seen_seconds": None}}]
    print_workflows(console, rows)
    text = buf.getvalue()
    assert "orders[1]" in text  # rich markup escaped, not eaten
    assert "0.25s" in text and "running (pid 42 on h1, seen 3 s ago)" in text
    assert "no driver running (never seen)" in text
    buf.truncate(0)
    print_workflows(console, [])
    assert "no workflows on this target" in buf.getvalue()


def test_an_error_under_json_is_one_line_on_stderr_and_nothing_on_stdout():
    fault = SluicegateError("cannot reach postgresql://u:secret@h/db:\n  connection refused")
    out = CliRunner().invoke(_command(None, fault), ["--json"])
    assert out.exit_code == 1 and out.stdout == ""
    assert out.stderr == "error: cannot reach postgresql://u:***@h/db: connection refused\n"
    # vdiff's exit status for an error is 2, whatever went wrong
    out = CliRunner().invoke(_command(None, SluicegateError("no such workflow w"), code=2), ["--json"])
    assert (out.exit_code, out.stdout, out.stderr) == (2, "", "error: no such workflow w\n")
    out = CliRunner().invoke(_command(None, KeyError("k"), code=2), ["--json"])
    assert (out.exit_code, out.stdout, out.stderr) == (2, "", "error: unexpected KeyError: 'k'\n")
    out = CliRunner().invoke(_command(None, KeyError("k")), ["--json"])
    assert (out.exit_code, out.stdout) == (1, "")
    assert out.stderr == "error: unexpected KeyError: 'k' (run with -v for the traceback)\n"
    out = CliRunner().invoke(_command(None, KeyboardInterrupt()), ["--json"])
    assert (out.exit_code, out.stderr) == (130, "error: interrupted\n")

"""The traffic commands' surface: registered under movetables, durations checked before anything connects."""

from __future__ import annotations

from click.testing import CliRunner

from sluicegate.cli.main import cli
from sluicegate.cli.output import make_console, print_status


def test_movetables_lists_the_traffic_commands():
    out = CliRunner().invoke(cli, ["movetables", "--help"])
    assert out.exit_code == 0
    for command in ("switch-traffic", "reverse-traffic", "complete", "cancel"):
        assert command in out.output


def test_a_zero_or_unreadable_duration_is_a_usage_error():
    runner = CliRunner()
    out = runner.invoke(cli, ["movetables", "switch-traffic", "w", "--target", "postgresql://x/y",
                              "--lock-timeout", "0"])
    assert out.exit_code == 2 and "above zero" in out.output
    out = runner.invoke(cli, ["movetables", "reverse-traffic", "w", "--target", "postgresql://x/y",
                              "--timeout", "soon"])
    assert out.exit_code == 2 and "not understood" in out.output


def test_status_text_shows_the_traffic_and_an_interrupted_command(capsys):
    status = {"workflow": "w", "kind": "MoveTables", "state": "Stopped", "message": "", "driver": None,
              "streams": [], "warnings": [],
              "traffic": {"state": "switched", "interrupted": "run `sluicegate movetables switch-traffic w` again",
                          "reverse": {"workflow": "w_reverse", "state": "Running", "message": "",
                                      "position": "0/16B3748", "lag_seconds": 0.25, "slot": "sg_w_reverse"}}}
    print_status(make_console(), status)
    text = capsys.readouterr().out
    assert "traffic: switched" in text
    assert "reverse workflow w_reverse: Running at 0/16B3748, lag 0.25s" in text
    assert "switch-traffic w` again" in text


def test_the_report_prints_each_sequence_line_once(capsys):
    from sluicegate.cli.traffic import _report
    from sluicegate.workflow.traffic import SwitchResult

    line = "sequence public.customers_id_seq on the source set to 1001 (target public.customers_id_seq at 900)"
    _report(SwitchResult("w", "reversed", 0x16B3748, 0.01, 0.0, [line]), as_json=False)
    text = capsys.readouterr().out
    assert f"\n  {line}\n" in text and "sequence sequence" not in text


def test_replicate_refuses_target_standbys_for_a_delta_sink(tmp_path):
    out = CliRunner().invoke(cli, ["replicate", "create", "--workflow", "w", "--source", "postgresql://127.0.0.1:1/x",
                                   "--sink", f"delta:{tmp_path}/lake", "--confirm-after-target-standbys"])
    assert out.exit_code != 0 and "--confirm-after-target-standbys is for PostgreSQL sinks" in out.output
    assert "Traceback" not in out.output and not (tmp_path / "lake").exists()

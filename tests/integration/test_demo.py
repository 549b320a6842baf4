"""`sluicegate demo` end to end, as a user runs it: a subprocess with real servers and real Spark."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sluicegate.procs import pid_alive

pytestmark = pytest.mark.spark


def test_demo_copies_under_live_writes_and_cleans_up(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sluicegate.cli.main", "demo", "--rows", "20000", "--workdir", str(tmp_path)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=540,
        env={**os.environ, "COLUMNS": "160"}, check=False,
    )
    out = proc.stdout
    context = f"exit {proc.returncode}\n--- stdout ---\n{out[-6000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, context
    assert "source and target are equal: 4 tables" in out, context
    assert re.search(r"workflow demo is Running after", out), context
    # the writer really wrote while the workflow copied and replicated
    writes = re.search(r"writer stopped after ([\d,]+) transactions", out)
    assert writes and int(writes.group(1).replace(",", "")) > 0, context
    assert "DIFFERENT" not in out, context

    servers = re.findall(r"(source|target) PostgreSQL \S+ up: pid (\d+), port \d+, data (\S+)", out)
    assert sorted(side for side, _, _ in servers) == ["source", "target"], context
    for side, pid, datadir in servers:
        assert not pid_alive(int(pid)), f"{side} PostgreSQL (pid {pid}) still running after the demo\n{context}"
        assert not Path(datadir).exists(), f"{side} data dir {datadir} left behind\n{context}"
        assert Path(datadir).is_relative_to(tmp_path), context
    assert list(tmp_path.iterdir()) == [], f"left in --workdir: {list(tmp_path.iterdir())}"

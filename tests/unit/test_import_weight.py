"""What `workflow run` and a copy task's worker import: the imports kept lazy so that Spark's start and the
first copy task do not wait for them (pyarrow for rules, psycopg 3 in a worker) stay lazy."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("pyarrow", "psycopg", "pyspark")


def loaded(*modules: str, heavy: tuple[str, ...] = HEAVY) -> list[str]:
    """Which of `heavy` a fresh interpreter has imported after importing `modules`."""
    code = (f"import sys, json; import {', '.join(modules)}; "
            f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)


def test_workflow_run_without_rules_imports_no_pyarrow():
    # cli.main and the engine load while Spark's JVM starts on the same cores (session.start_in_background).
    assert "pyarrow" not in loaded("sluicegate.cli.main", "sluicegate.workflow.engine")


def test_a_copy_task_imports_neither_psycopg_3_nor_pyarrow():
    # What a Python worker imports to run its first copy task.
    assert loaded("sluicegate.workflow.copy_task", "sluicegate.spark.runner") == []


def test_the_command_line_loads_neither_protobuf_nor_rich_before_a_command_needs_them():
    # `workflow run` reads its workflow, then spawns Spark's JVM: everything imported before that waits.
    assert loaded("sluicegate.cli.main", heavy=("google.protobuf", "rich")) == []

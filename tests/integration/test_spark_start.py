"""What a `workflow run` driver loads while Spark starts: Spark's start is on the copy's critical path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

DRIVER = """
import json, sys
from sluicegate.spark.session import get_spark_context
sc = get_spark_context()
sc.parallelize(range(4), 2).map(lambda x: x + 1).collect()
loaded = [m for m in ("pandas", "numpy", "pyarrow") if m in sys.modules]
import numpy as np
# Once NumPy is loaded, its arrays still reach the JVM as Java arrays (PySpark's converter, unwrapped).
length = sc._jvm.java.lang.reflect.Array.getLength(np.array([1, 2, 3], dtype=np.int64))
sc.stop()
print(json.dumps({"loaded": loaded, "length": length}))
"""


def test_starting_spark_and_running_a_python_job_loads_no_pandas_numpy_or_pyarrow():
    # PySpark's NumPy converters import pandas, NumPy and pyarrow (~0.36 s of CPU) at the first Py4J call
    # with arguments, the start's SparkConf; session.py makes them ask whether NumPy is loaded first.
    out = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"loaded": [], "length": 3}


KEPT_DRIVER = """
import json, os
from sluicegate.spark.session import get_spark_context
sc = get_spark_context()
seeds = sc.parallelize(range(2), 2).map(lambda _: os.environ.get("PYTHONHASHSEED")).collect()
marked = sc._jvm.java.lang.System.getProperty("sluicegate.test.kept")
sc.stop()
print(json.dumps({"seeds": seeds, "marked": marked}))
"""


def _start(env: dict) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-c", KEPT_DRIVER], capture_output=True, text=True, timeout=300,
                         env=env, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def _kept_env(tmp_path) -> dict:
    # The kept commands live beside the class archive: here a directory of the test's own (and no archive).
    return {**os.environ, "SLUICEGATE_SPARK_CLASS_ARCHIVE": str(tmp_path / "classes.jsa"),
            "SLUICEGATE_SPARK_DIRECT_LAUNCH": ""}


def test_spark_starts_from_the_command_its_launcher_wrote_last_time(tmp_path):
    env = _kept_env(tmp_path)
    first, _ = _start(env)  # through Spark's launcher, whose command is kept
    kept = list((tmp_path / "launch").glob("*.json"))
    assert len(kept) == 1
    cmd = json.loads(kept[0].read_text())
    assert "org.apache.spark.deploy.SparkSubmit" in cmd and cmd[-1] == "pyspark-shell"
    # Mark the kept command: the next start runs it as it is, not the launcher's new one.
    at = cmd.index("org.apache.spark.deploy.SparkSubmit")
    kept[0].write_text(json.dumps(cmd[:at] + ["-Dsluicegate.test.kept=1"] + cmd[at:]))
    second, _ = _start(env)
    assert first == {"seeds": ["0", "0"], "marked": None}
    # The scripts' environment is the driver's too: Python workers hash strings alike (PYTHONHASHSEED=0).
    assert second == {"seeds": ["0", "0"], "marked": "1"}


def test_a_kept_command_whose_jvm_exits_is_forgotten_and_spark_starts_the_usual_way(tmp_path):
    env = _kept_env(tmp_path)
    _start(env)
    [kept] = (tmp_path / "launch").glob("*.json")
    cmd = json.loads(kept.read_text())
    at = cmd.index("org.apache.spark.deploy.SparkSubmit")
    # The last -Xmx counts: the JVM cannot start.
    kept.write_text(json.dumps(cmd[:at] + ["-Xmx1k"] + cmd[at:]))
    result, stderr = _start(env)
    assert result == {"seeds": ["0", "0"], "marked": None}
    assert "heap" not in stderr  # the abandoned start says nothing
    assert not kept.exists()  # forgotten: the next start asks Spark's launcher again


SPAWN_ORDER_DRIVER = """
import json, subprocess, sys
spawned = []  # for each driver JVM started: was PySpark imported by then?

class Spy(subprocess.Popen):
    def __init__(self, args, *rest, **kwargs):
        if "org.apache.spark.deploy.SparkSubmit" in args and "org.apache.spark.launcher.Main" not in args:
            spawned.append("pyspark" in sys.modules)
        super().__init__(args, *rest, **kwargs)

subprocess.Popen = Spy
from sluicegate.spark.session import get_spark_context
sc = get_spark_context()
squares = sc.parallelize(range(3), 2).map(lambda x: x * x).collect()
sc.stop()
print(json.dumps({"spawned": spawned, "squares": squares}))
"""


def test_a_kept_command_spawns_the_jvm_before_pyspark_is_imported(tmp_path):
    # PySpark's import (~75 ms of the GIL) runs while the JVM boots, not before it on the critical path.
    env = _kept_env(tmp_path)
    for _ in range(2):  # the first start asks Spark's launcher for the command, the second reads it kept
        out = subprocess.run([sys.executable, "-c", SPAWN_ORDER_DRIVER], capture_output=True, text=True,
                             timeout=300, env=env, check=False)
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout.strip().splitlines()[-1]) == {"spawned": [False], "squares": [0, 1, 4]}


def test_without_direct_launch_spark_starts_through_spark_submit(tmp_path):
    env = {**_kept_env(tmp_path), "SLUICEGATE_SPARK_DIRECT_LAUNCH": "off"}
    result, _ = _start(env)
    assert result == {"seeds": ["0", "0"], "marked": None}
    assert not (tmp_path / "launch").exists()

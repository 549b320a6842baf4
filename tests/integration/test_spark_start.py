"""Spark started the standard way (spark-submit, Spark's own configuration); the executor check at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv

import pytest

from sluicegate import __version__
from sluicegate.workflow.create import create_movetables

pytestmark = pytest.mark.spark

DRIVER = """
import json, sys
from sluicegate.spark.session import get_spark_context
sc = get_spark_context()
sc.parallelize(range(4), 2).map(lambda x: x + 1).collect()
workers = sc.parallelize(range(2), 2).map(lambda _: __import__("pyspark").__file__).collect()
loaded = [m for m in ("pandas", "numpy", "pyarrow") if m in sys.modules]
import numpy as np
# Once NumPy is loaded, its arrays still reach the JVM as Java arrays (PySpark's converter, unwrapped).
length = sc._jvm.java.lang.reflect.Array.getLength(np.array([1, 2, 3], dtype=np.int64))
conf = {k: sc.getConf().get(k) for k in ("spark.master", "spark.driver.host", "spark.driver.bindAddress",
                                         "spark.app.name")}
sc.stop()
print(json.dumps({"loaded": loaded, "length": length, "conf": conf, "workers": workers}))
"""


def test_a_local_start_binds_to_loopback_and_loads_no_pandas_numpy_or_pyarrow():
    # PySpark's NumPy converters import pandas, NumPy and pyarrow at the first Py4J call with arguments, the
    # start's SparkConf; session.py makes them ask whether NumPy is loaded first.
    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_LOCAL_IP", "SLUICEGATE_SPARK_MASTER")}
    out = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, timeout=300, env=env,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # Python workers import pyspark from its package (compiled code cached), not from Spark's pyspark.zip
    import pyspark
    assert result.pop("workers") == [pyspark.__file__] * 2
    assert result == {"loaded": [], "length": 3, "conf": {
        "spark.master": "local[*]", "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
        "spark.app.name": "sluicegate"}}


SETTINGS_DRIVER = """
import json, sys
from sluicegate.spark.session import get_spark_context
flags = {"spark.sluicegate.test.flag": "from-conf", "spark.sluicegate.test.both": "from-conf"}
sc = get_spark_context(conf=flags, light_jvm=True)
keys = ["spark.sluicegate.test.defaults", "spark.sluicegate.test.flag", "spark.sluicegate.test.both",
        "spark.sql.shuffle.partitions", "spark.ui.enabled", "spark.driver.host", "spark.driver.bindAddress",
        "spark.app.name"]
conf = {k: sc.getConf().get(k) for k in keys}
args = list(sc._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
sc.stop()
print(json.dumps({"conf": conf, "jvm_args": args}))
"""


def test_spark_defaults_conf_beats_our_defaults_and_conf_flags_beat_it(tmp_path):
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "spark-defaults.conf").write_text(
        "spark.sluicegate.test.defaults  from-defaults\n"
        "spark.sluicegate.test.both      from-defaults\n"
        "spark.sql.shuffle.partitions    3\n"
        # The case: a driver host of the user's must reach the running context.
        "spark.driver.host               localhost\n"
        "spark.driver.extraJavaOptions   -Dsluicegate.test.opt=from-defaults -XX:TieredStopAtLevel=1\n")
    (conf_dir / "log4j2.properties").write_text("rootLogger.level = error\n")
    # SPARK_LOCAL_IP (scripts/env.sh sets it) is only Spark's default for the driver's address: it must not
    # override the host spark-defaults.conf gives.
    env = {**os.environ, "SPARK_CONF_DIR": str(conf_dir), "SPARK_LOCAL_IP": "127.0.0.1"}
    env.pop("SLUICEGATE_SPARK_MASTER", None)
    out = subprocess.run([sys.executable, "-c", SETTINGS_DRIVER], capture_output=True, text=True, timeout=300,
                         env=env, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["conf"] == {
        "spark.sluicegate.test.defaults": "from-defaults",
        "spark.sluicegate.test.flag": "from-conf",
        "spark.sluicegate.test.both": "from-conf",     # --conf beats spark-defaults.conf
        "spark.sql.shuffle.partitions": "3",           # spark-defaults.conf beats our 8
        "spark.ui.enabled": "false",                   # ours: nobody set it
        "spark.driver.host": "localhost",
        "spark.driver.bindAddress": None,              # Spark binds to the user's host, not our loopback
        "spark.app.name": "sluicegate",
    }
    args = result["jvm_args"]
    # Our JVM options come first, the user's extraJavaOptions after them (so theirs win where both set one).
    assert "-Dsluicegate.test.opt=from-defaults" in args
    ours, theirs = args.index("-XX:TieredStopAtLevel=1"), args.index("-Dsluicegate.test.opt=from-defaults")
    assert ours < theirs
    # The user's log4j2.properties in SPARK_CONF_DIR is Spark's configuration, not ours.
    assert not any(a.startswith("-Dlog4j2.configurationFile=") for a in args)


def sluicegate(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluicegate.cli.main", *args], capture_output=True,
                          text=True, env=env, timeout=300, stdin=subprocess.DEVNULL, check=False)


NOWHERE = "postgresql://127.0.0.1:1/none"  # (--conf is read before anything connects)


@pytest.mark.parametrize(("command", "status"), [
    (["workflow", "run", "w", "--target", NOWHERE], 1),
    (["vdiff", "w", "--target", NOWHERE], 2),  # vdiff's exit status for an error
    (["movetables", "create", "--workflow", "w", "--source", NOWHERE, "--target", NOWHERE], 1),
])
def test_a_malformed_conf_flag_is_a_one_line_usage_error(command, status):
    run = sluicegate(*command, "--conf", "spark.executor.memory", env=dict(os.environ))
    assert run.returncode == status
    assert run.stderr == ("error: --conf 'spark.executor.memory': expected KEY=VALUE, "
                          "e.g. --conf spark.executor.memory=4g\n")


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A Python of the driver's version without Sluicegate (nor anything else installed)."""
    home = tmp_path_factory.mktemp("bare-venv")
    venv.create(home, with_pip=False)
    return str(home / "bin" / "python")


def _workflow(pair, name: str) -> None:
    pair.src("CREATE TABLE items (id bigint PRIMARY KEY, note text)")
    pair.src("INSERT INTO items SELECT g, md5(g::text) FROM generate_series(1, 50) g")
    create_movetables(name, pair.source, pair.target, None, [], {})


def _assert_one_line_error(run: subprocess.CompletedProcess, *needles: str) -> None:
    assert run.returncode == 1, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: executor on "), run.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0]


def test_executors_without_sluicegate_are_a_one_line_error_naming_the_fix(pair, bare_python):
    _workflow(pair, "bare")
    env = {**os.environ, "PYSPARK_PYTHON": bare_python}
    run = sluicegate("workflow", "run", "bare", "--target", pair.target, "--spark-master", "local[1]",
                     "--no-progress", env=env)
    _assert_one_line_error(run, f"(Python {bare_python}) cannot import sluicegate (ModuleNotFoundError",
                           f"install sluicegate=={__version__} on every worker, or ship a packed virtual "
                           "environment with --conf spark.archives=")
    assert pair.dst("SELECT count(*) FROM items") == [(0,)]  # no copy task ran


def test_executors_with_another_sluicegate_version_are_a_one_line_error(pair, tmp_path):
    _workflow(pair, "other")
    other = tmp_path / "other" / "sluicegate"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text('__version__ = "0.0.1"\n')
    run = sluicegate("workflow", "run", "other", "--target", pair.target, "--spark-master", "local[1]",
                     "--conf", f"spark.executorEnv.PYTHONPATH={other.parent}", "--no-progress",
                     env=dict(os.environ))
    _assert_one_line_error(run, f"has sluicegate 0.0.1, the driver {__version__}: "
                                f"install sluicegate=={__version__} on every worker")


def test_executors_that_never_start_are_a_one_line_error_not_a_hang(pair):
    # Executors of 2 cores on a worker of 1 never start: Spark's job would wait for ever, logging a warning.
    _workflow(pair, "stuck")
    run = sluicegate("workflow", "run", "stuck", "--target", pair.target,
                     "--spark-master", "local-cluster[1,1,1024]", "--conf", "spark.executor.cores=2",
                     "--conf", "spark.sluicegate.executorCheckTimeout=5", "--no-progress",
                     env=dict(os.environ))
    assert run.returncode == 1, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr[-2000:]
    assert lines[0].startswith(
        "error: no executor ran Sluicegate's check task within 5s (master local-cluster[1,1,1024]): "
        "check that the workers have free cores and memory and can reach the driver at 127.0.0.1:")

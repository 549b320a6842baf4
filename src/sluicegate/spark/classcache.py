"""A class-data-sharing archive of Spark's classes for the driver JVM: Spark starts sooner.

A JVM spends most of a Spark start-up loading and verifying some 10,000 classes. The JVM can instead map them
from an archive written by an earlier run (JDK 13+ dynamic CDS: `-XX:ArchiveClassesAtExit` to write it,
`-XX:SharedArchiveFile` to use it). The archive belongs to one Java build and one set of jars, so it lives in
the virtual environment next to PySpark; an archive the JVM cannot use (another Java, a changed jar) is
ignored by it, silently, and Spark starts the slow way. It is plain JVM configuration: `-XX:SharedArchiveFile`
among the driver's options in SPARK_SUBMIT_OPTS (session.driver_java_options, with session.archive_path and
java_options: what reads the archive), which Spark's launcher puts before a user's spark.driver.extraJavaOptions.

`python -m sluicegate.spark.classcache` writes it (scripts/env.sh does after installing): a child process
starts Spark with the archive option, runs a small job of each kind Sluicegate runs, and exits; the archive is
renamed into place only once complete. SLUICEGATE_SPARK_CLASS_ARCHIVE names another path, or `off`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import config
from .session import QUIET, archive_path, get_spark


def build(path: Path, timeout: float = 300) -> bool:
    """Write the archive to `path` (replacing one there); whether it worked."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=".spark-classes-", suffix=".jsa", dir=path.parent)
    os.close(fd)
    os.unlink(partial)  # the JVM creates it at exit
    env = {**os.environ, config.env_var("spark_class_archive"): "off"}
    try:
        proc = subprocess.run([sys.executable, "-m", "sluicegate.spark.classcache", "--child", partial],
                              env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                              check=False)
        if proc.returncode or not os.path.isfile(partial) or os.path.getsize(partial) == 0:
            return False
        os.replace(partial, path)
        return True
    except subprocess.TimeoutExpired:
        return False
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _child(partial: str) -> None:
    """Start Spark so that its JVM writes the archive when it exits; load what a workflow loads."""
    from pyspark import SparkContext

    spark = get_spark(archive_options=f"-XX:ArchiveClassesAtExit={partial} {QUIET}")
    spark.sparkContext.parallelize(range(4), 2).map(lambda x: x + 1).collect()  # Python tasks (copy, play)
    spark.range(1000).selectExpr("id", "cast(id AS string) AS s").where("id % 2 = 0").collect()  # Spark SQL (rules)
    spark.stop()
    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if proc is not None:
        # The gateway JVM exits when its stdin closes; it writes the archive on the way out.
        proc.stdin.close()
        proc.wait(120)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--child":
        _child(argv[1])
        return 0
    path = archive_path()
    if path is None:
        print("Spark class archive: turned off (SLUICEGATE_SPARK_CLASS_ARCHIVE=off)", file=sys.stderr)
        return 0
    if path.is_file() and "--force" not in argv:
        return 0
    started = time.monotonic()
    if build(path):
        print(f"» Spark class archive written ({path.stat().st_size >> 20} MB, {time.monotonic() - started:.0f}s): "
              f"Spark starts faster", file=sys.stderr)
    else:
        print("» Spark class archive not written (this Java cannot make one): Spark starts without it",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The Python worker daemon of Sluicegate's Spark applications (`spark.python.daemon.module`): PySpark's own,
with pyspark imported from its installed package rather than from `$SPARK_HOME/python/lib/pyspark.zip`.

Spark puts that zip first on its Python workers' path, and Python keeps no compiled code for a module it
imports from a zip: every worker the daemon forks compiles `pyspark.worker` and all it imports again, about
a second of CPU before its first task. A pip-installed PySpark is its own SPARK_HOME, so the zip and the
package are one release: the zip then goes behind the package. Any other layout (a cluster's own Spark
installation) keeps Spark's path as it is.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import PathFinder


def installed_first(path: list[str], spark_home: str | None, installed: str | None) -> list[str]:
    """`path` with SPARK_HOME's zips (python/lib/*.zip) moved behind the other entries, when `installed`
    (the folder of the pyspark package found without them) is SPARK_HOME itself; else `path` unchanged."""
    if not spark_home or not installed or os.path.realpath(installed) != os.path.realpath(spark_home):
        return path
    lib = os.path.realpath(os.path.join(spark_home, "python", "lib"))
    zips = [p for p in path if p.endswith(".zip") and os.path.realpath(os.path.dirname(p)) == lib]
    return [p for p in path if p not in zips] + zips


def _installed_pyspark(path: list[str]) -> str | None:
    """The folder of the pyspark package on `path` outside any zip, or None."""
    spec = PathFinder.find_spec("pyspark", [p for p in path if not p.endswith(".zip")])
    return os.path.dirname(spec.origin) if spec is not None and spec.origin else None


def main() -> None:
    sys.path[:] = installed_first(sys.path, os.environ.get("SPARK_HOME"), _installed_pyspark(sys.path))
    from pyspark.daemon import manager

    manager()


if __name__ == "__main__":
    main()

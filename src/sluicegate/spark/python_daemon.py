"""Spark's Python daemon (`spark.python.daemon.module`), run on the installed PySpark rather than its zipped copy.

Spark puts `$SPARK_HOME/python/lib/pyspark.zip` (and py4j's zip) first on its Python workers' path. With a pip
installed PySpark those zips are copies of the package beside them, but Python compiles every module imported
from a zip afresh (no bytecode cache), and each new worker re-reads the zips' directories: the first Python
task of a session started 1.25 s after its job on 2 cores, against ~0.1 s with the installed package. When the
zips are the installed PySpark's own, they leave the path before PySpark is imported; otherwise (a cluster's
SPARK_HOME) nothing changes.

The daemon forks every Python worker, so it also imports what a copy task needs (workflow/copy_task.py and
psycopg2) before its first fork: the workers of a job's first wave start with it imported instead of each
importing it at once, on the cores the copy is about to need. The play task's modules stay out (another
~0.25 s before the first copy task could start); a worker imports them once, when it first plays.
"""

from __future__ import annotations

import os
import sys


def _drop_bundled_zips() -> None:
    for entry in sys.path:
        if not os.path.isfile(os.path.join(entry, "pyspark", "__init__.py")):
            continue
        bundled = os.path.join(os.path.realpath(entry), "pyspark", "python", "lib") + os.sep
        zips = [p for p in sys.path if p.endswith(".zip") and os.path.realpath(p).startswith(bundled)]
        for p in zips:
            sys.path.remove(p)
            sys.path_importer_cache.pop(p, None)
        return


if __name__ == "__main__":
    _drop_bundled_zips()
    from pyspark.daemon import manager

    import sluicegate.spark.runner
    import sluicegate.workflow.copy_task  # noqa: F401

    manager()

"""Where the workers' daemon takes pyspark from (spark/daemon.py): pure path arithmetic, no Spark."""

from __future__ import annotations

from sluicegate.spark.daemon import installed_first

HOME = "/venv/lib/python3.11/site-packages/pyspark"
ZIP, PY4J = f"{HOME}/python/lib/pyspark.zip", f"{HOME}/python/lib/py4j-0.10.9.9-src.zip"
PATH = ["", ZIP, PY4J, "/work", "/venv/lib/python3.11/site-packages"]


def test_a_pip_installed_pyspark_is_imported_from_its_package():
    assert installed_first(PATH, HOME, HOME) == ["", "/work", "/venv/lib/python3.11/site-packages", ZIP, PY4J]
    assert installed_first(PATH, HOME + "/", HOME) == ["", "/work", "/venv/lib/python3.11/site-packages",
                                                       ZIP, PY4J]


def test_another_spark_installation_keeps_sparks_path():
    # a cluster's own Spark: its zip is the release the JVM runs, whatever pyspark the Python has
    assert installed_first(PATH, "/opt/spark", HOME) == PATH
    assert installed_first(PATH, HOME, None) == PATH  # no pyspark outside the zip
    assert installed_first(PATH, None, HOME) == PATH


def test_zips_of_other_folders_stay_where_they_are():
    path = ["/jobs/deps.zip", ZIP, "/venv/lib/python3.11/site-packages"]
    assert installed_first(path, HOME, HOME) == ["/jobs/deps.zip", "/venv/lib/python3.11/site-packages", ZIP]

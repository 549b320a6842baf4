"""What a kept driver command (spark/launch.py) is kept under: any input of Spark's launcher changes it."""

from __future__ import annotations

import pytest

from sluicegate.spark import launch


@pytest.fixture
def conf_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    monkeypatch.delenv("SLUICEGATE_SPARK_DIRECT_LAUNCH", raising=False)
    for name in ("PYSPARK_SUBMIT_ARGS", "SPARK_TESTING", "PYSPARK_GATEWAY_PORT"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def digest(settings: dict) -> str:
    return launch._digest(launch.spark_home(), launch.submit_args(settings))


def test_the_same_inputs_give_the_same_digest(conf_dir):
    assert digest({"spark.master": "local[*]"}) == digest({"spark.master": "local[*]"})


def test_settings_spark_environment_and_configuration_files_each_change_it(conf_dir, monkeypatch):
    base = digest({"spark.master": "local[*]"})
    assert digest({"spark.master": "local[2]"}) != base
    monkeypatch.setenv("SPARK_DRIVER_MEMORY", "4g")
    with_memory = digest({"spark.master": "local[*]"})
    assert with_memory != base
    (conf_dir / "spark-defaults.conf").write_text("spark.driver.memory 2g\n")
    assert digest({"spark.master": "local[*]"}) not in (base, with_memory)
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")  # what the launcher does not read does not count
    assert digest({"spark.master": "local[*]"}) == digest({"spark.master": "local[*]"})


def test_a_spark_env_script_or_submit_args_mean_the_usual_way(conf_dir, monkeypatch):
    assert launch.usable()
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", "--driver-memory 2g pyspark-shell")
    assert not launch.usable()
    monkeypatch.delenv("PYSPARK_SUBMIT_ARGS")
    (conf_dir / "spark-env.sh").write_text("export SPARK_LOCAL_DIRS=/scratch\n")
    assert not launch.usable()
    (conf_dir / "spark-env.sh").unlink()
    monkeypatch.setenv("SLUICEGATE_SPARK_DIRECT_LAUNCH", "off")
    assert not launch.usable()

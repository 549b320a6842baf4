"""What a `workflow run` driver loads while Spark starts: Spark's start is on the copy's critical path."""

from __future__ import annotations

import json
import subprocess
import sys

DRIVER = """
import json, sys
from sluicegate.spark.session import get_spark_context
sc = get_spark_context()
sc.parallelize(range(4), 2).map(lambda x: x + 1).collect()
loaded = [m for m in ("pandas", "numpy", "pyarrow") if m in sys.modules]
import numpy as np
# Once NumPy is loaded, its arrays still reach the JVM as Java arrays (PySpark's converter, unwrapped).
length = sc._jvm.java.lang.reflect.Array.getLength(np.array([1, 2, 3], dtype=np.int64))
sc.stop()
print(json.dumps({"loaded": loaded, "length": length}))
"""


def test_starting_spark_and_running_a_python_job_loads_no_pandas_numpy_or_pyarrow():
    # PySpark's NumPy converters import pandas, NumPy and pyarrow (~0.36 s of CPU) at the first Py4J call
    # with arguments, the start's SparkConf; session.py makes them ask whether NumPy is loaded first.
    out = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"loaded": [], "length": 3}

"""Python functions a rule may call: `--udf NAME=module:function[:TYPE]`, registered in each rule's Spark session.

TYPE is a Spark type (`int`, `decimal(12,2)`, `string`: the default); a function already made with
`pyspark.sql.functions.udf(returnType=…)` keeps its own. The function travels to Spark's Python workers by
value, so its module need only be importable where the command runs.
"""

from __future__ import annotations

import importlib

from ..errors import UsageError


def parse_udfs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, eq, ref = item.partition("=")
        if not eq or not name.strip().isidentifier() or ref.count(":") not in (1, 2):
            raise UsageError(f"--udf {item!r}: expected NAME=module:function[:SPARK_TYPE]")
        out[name.strip()] = ref.strip()
    for name, ref in out.items():
        load(name, ref)  # fail now, not when the workflow runs
    return out


def load(name: str, ref: str):
    module_name, _, rest = ref.partition(":")
    function_name, _, return_type = rest.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        raise UsageError(f"--udf {name}: cannot import {module_name} ({type(exc).__name__}: {exc})") from None
    fn = getattr(module, function_name, None)
    if not callable(fn):
        raise UsageError(f"--udf {name}: {module_name} has no function {function_name!r}")
    return module, fn, return_type or None


def register(session, udfs: dict[str, str]) -> None:
    if not udfs:
        return
    from pyspark import cloudpickle

    for name, ref in udfs.items():
        module, fn, return_type = load(name, ref)
        cloudpickle.register_pickle_by_value(module)  # workers need not import it
        if hasattr(fn, "asNondeterministic"):  # made with functions.udf(): it has its return type
            session.udf.register(name, fn)
        else:
            session.udf.register(name, fn, return_type or "string")

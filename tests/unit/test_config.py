"""The one configuration (sluicegate/config.py): unknown keys, the environment's values and their precedence, and
that every `SLUICEGATE_*` name and every key the code keeps in a workflow's options is declared there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from sluicegate import config
from sluicegate.config import Settings, check_options, from_env, resolve
from sluicegate.errors import TerminalError, UsageError

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "sluicegate"


# -- unknown keys -------------------------------------------------------------------------------------------
def test_an_unknown_key_is_refused_with_the_closest_known_one():
    with pytest.raises(UsageError, match=r"^unknown setting 'cycle_row'; did you mean 'cycle_rows'\?$"):
        check_options({"cycle_rows": 5, "cycle_row": 5})
    with pytest.raises(UsageError, match=r"unknown setting 'zzz'; known: cycle_rows, chunk_rows"):
        check_options({"zzz": 1})


def test_a_running_workflow_with_an_unknown_key_stops_in_error_naming_it():
    # TerminalError: the engine puts the stream in Error (a retry would read the same options).
    with pytest.raises(TerminalError, match=r"^workflow w: unknown setting 'batch_change'; did you mean "
                                            r"'batch_changes'\? \(.*remove the key"):
        Settings.from_options({"batch_change": 10}, "workflow w")


def test_an_environment_variable_is_not_a_workflow_option():
    with pytest.raises(UsageError, match="unknown setting 'lock_timeout'"):
        check_options({"lock_timeout": 2})


def test_options_are_parsed_by_their_declared_type():
    s = Settings.from_options({"cycle_rows": 5, "commit_every": 1, "defer_indexes": False, "on_ddl": "exec",
                               "traffic": "switched", "cluster": {"sinks": {}}})
    assert (s.cycle_rows, s.commit_every, s.defer_indexes, s.chunk_rows) == (5, 1.0, False, 1_000_000)
    assert isinstance(s.commit_every, float) and s.slice_seconds is None
    with pytest.raises(UsageError, match=r"^workflow w: setting 'cycle_rows' = 'many': not an integer$"):
        check_options({"cycle_rows": "many"}, where="workflow w")
    with pytest.raises(UsageError, match="'defer_indexes' = 'maybe': not a boolean"):
        check_options({"defer_indexes": "maybe"})


# -- the environment ------------------------------------------------------------------------------------------
def test_environment_values_are_parsed_by_type_with_a_clear_error():
    assert from_env("lock_timeout", {"SLUICEGATE_LOCK_TIMEOUT": "2.5"}) == 2.5
    assert from_env("driver_pid", {"SLUICEGATE_DRIVER_PID": "42"}) == 42
    assert from_env("wal_warning", {"SLUICEGATE_WAL_WARNING": "2MB"}) == 2 << 20
    assert from_env("all_tests", {"SLUICEGATE_ALL_TESTS": "1"}) is True
    with pytest.raises(UsageError, match=r"^SLUICEGATE_DRIVER_PID=abc: not an integer$"):
        from_env("driver_pid", {"SLUICEGATE_DRIVER_PID": "abc"})
    with pytest.raises(UsageError, match=r"^SLUICEGATE_LOCK_TIMEOUT=soon: not a number$"):
        from_env("lock_timeout", {"SLUICEGATE_LOCK_TIMEOUT": "soon"})
    with pytest.raises(UsageError, match=r"^SLUICEGATE_WAL_WARNING=lots: not a size"):
        from_env("wal_warning", {"SLUICEGATE_WAL_WARNING": "lots"})


def test_precedence_default_then_environment_then_flag():
    env = {"SLUICEGATE_PROGRESS_INTERVAL": "2"}
    assert resolve("progress_interval", environ={}) == 10.0  # the declared default
    assert resolve("progress_interval", environ={"SLUICEGATE_PROGRESS_INTERVAL": ""}) == 10.0  # empty: unset
    assert resolve("progress_interval", environ=env) == 2.0
    assert resolve("progress_interval", "5", environ=env) == 5.0
    assert resolve("spark_master", None, {"SLUICEGATE_SPARK_MASTER": "local[2]"}) == "local[2]"
    assert resolve("spark_master", "yarn", {"SLUICEGATE_SPARK_MASTER": "local[2]"}) == "yarn"
    assert config.declared("spark_master").sources == (config.ENV, config.FLAG)
    assert config.declared("cycle_rows").sources == (config.OPTION, config.FLAG)


def test_the_modules_that_read_the_environment_ask_config(monkeypatch):
    from sluicegate.postgres import locks
    from sluicegate.spark import classcache
    from sluicegate.vstream import security

    monkeypatch.setenv("SLUICEGATE_LOCK_TIMEOUT", "7")
    assert locks.timeout_seconds() == 7.0
    monkeypatch.setenv("SLUICEGATE_LOCK_TIMEOUT", "x")  # was silently 3 s
    with pytest.raises(UsageError, match="SLUICEGATE_LOCK_TIMEOUT=x: not a number"):
        locks.timeout_seconds()
    monkeypatch.setenv("SLUICEGATE_SPARK_CLASS_ARCHIVE", "off")
    assert classcache.archive_path() is None
    monkeypatch.setenv("SLUICEGATE_VSTREAM_TOKEN", "t0ken")
    assert security.load_token(None) == "t0ken"


# -- everything is declared ---------------------------------------------------------------------------------
def _python_files():
    return sorted(p for p in SRC.rglob("*.py") if "_pb2" not in p.name)


def test_every_sluicegate_variable_is_declared():
    used = set()
    for top in ("src", "tests", "scripts", "bench", "docs", "README.md"):
        paths = [ROOT / top] if top.endswith(".md") else (ROOT / top).rglob("*")
        for path in paths:
            if path.is_file() and path.suffix in ("", ".py", ".sh", ".md"):
                used |= set(re.findall(r"\bSLUICEGATE_[A-Z][A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")))
    assert {"SLUICEGATE_TARGET", "SLUICEGATE_FAULT_PAUSE", "SLUICEGATE_ALL_TESTS"} <= used  # the scan works
    assert used - set(config.ENV_NAMES) == set()


def test_no_module_reads_a_sluicegate_variable_but_config():
    reads = re.compile(r"(environ|getenv|envvar=).{0,40}SLUICEGATE_")
    offenders = []
    for path in _python_files():
        rel = path.relative_to(SRC).as_posix()
        if rel == "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            # a string that is exactly a variable's name is a read (or a write) of it; help texts mention names
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.fullmatch(r"SLUICEGATE_[A-Z0-9_]+", node.value):
                offenders.append(f"{rel}:{node.lineno}")
        text = path.read_text()
        offenders += [f"{rel}: {m.group(0)}" for m in reads.finditer(text)]
    assert offenders == []


# What the scan below reads as a workflow's options though it is another mapping called `options`.
NOT_WORKFLOW_OPTIONS = {
    "cli/main.py": {"_log_option", "_configure_logging", "_log_options", "_vdiff"},  # log flags; a vdiff's request
    "vdiff": None,  # a vdiff request's options (sample, range_rows)
    "postgres/replication.py": None,  # START_REPLICATION's plugin options
    "postgres/connect.py": None,  # libpq's options
    "changes": None,  # applier and replicator specs
    "spark": None,  # Spark's own options and the streaming source's
    "vstream": None,  # gRPC channel options
}


def _excluded(rel: str, function: str | None) -> bool:
    for prefix, functions in NOT_WORKFLOW_OPTIONS.items():
        if rel == prefix or rel.startswith(prefix + "/"):
            return functions is None or function in functions
    return False


class _Keys(ast.NodeVisitor):
    """The keys a module reads from or writes into something called `options` (a workflow's options):
    subscripts and .get/.pop of it, dict literals and (key, value) pairs in a statement that names it, keyword
    arguments of `_set_options`, and the parameters of SQL that changes `options`. A key given by a constant
    (modes.OPTION, ddl_tables.SCHEMAS) is looked up where it is defined."""

    def __init__(self, rel: str, source: str, constants: dict):
        self.rel, self.source, self.constants = rel, source, constants
        self.tree = ast.parse(source)
        self.imports: dict[str, tuple[str, str | None]] = {}  # local name -> (module stem, name in it)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if node.module:  # from ..ddl.modes import OPTION
                        self.imports[alias.asname or alias.name] = (node.module.rsplit(".", 1)[-1], alias.name)
                    else:  # from ..ddl import tables as ddl_tables
                        self.imports[alias.asname or alias.name] = (alias.name, None)
        self.stem = Path(rel).stem
        self.function: str | None = None
        self.found: list[tuple[str, int, str]] = []

    def resolve(self, node) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.List):
            return [k for e in node.elts for k in self.resolve(e)]
        if isinstance(node, ast.Name):
            if (self.stem, node.id) in self.constants:
                return self.constants[(self.stem, node.id)]
            stem, name = self.imports.get(node.id, (None, None))
            return self.constants.get((stem, name), []) if name else []
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            stem, name = self.imports.get(node.value.id, (node.value.id, None))
            return self.constants.get((stem if name is None else name, node.attr), [])
        return []

    def add(self, node, key_node):
        for key in self.resolve(key_node):
            self.found.append((self.rel, node.lineno, key))

    @staticmethod
    def is_options(node) -> bool:
        return (isinstance(node, ast.Name) and node.id in ("options", "opts")) or \
            (isinstance(node, ast.Attribute) and node.attr == "options")

    def visit_FunctionDef(self, node):
        outer, self.function = self.function, node.name
        self.generic_visit(node)
        self.function = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Subscript(self, node):
        if self.is_options(node.value) and not _excluded(self.rel, self.function):
            self.add(node, node.slice)
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        if not _excluded(self.rel, self.function):
            if isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and self.is_options(f.value) \
                    and node.args:
                self.add(node, node.args[0])
            if isinstance(f, ast.Name) and f.id == "_set_options" or \
                    isinstance(f, ast.Attribute) and f.attr == "_set_options":
                for kw in node.keywords:
                    if kw.arg:
                        self.found.append((self.rel, node.lineno, kw.arg))
            if isinstance(f, ast.Attribute) and f.attr == "execute" and len(node.args) > 1 and \
                    re.search(r"\boptions\b", ast.get_source_segment(self.source, node.args[0]) or "") and \
                    isinstance(node.args[1], (ast.Tuple, ast.List)):
                for param in node.args[1].elts:
                    self.add(node, param)
        self.generic_visit(node)

    def generic_visit(self, node):
        if not _excluded(self.rel, self.function):
            for value in filter(None, self._written(node)):
                for sub in ast.walk(value):
                    if isinstance(sub, ast.Dict):
                        for key in sub.keys:
                            if key is not None:
                                self.add(sub, key)
                    elif isinstance(sub, ast.Tuple) and len(sub.elts) == 2:
                        self.add(sub, sub.elts[0])  # (("cycle_rows", cycle_rows), ...): pairs made a dict
        super().generic_visit(node)

    def _written(self, node) -> list:
        """What `node` makes into options: the value assigned to `options` (or `w.options`), what a function
        named *options returns, a dict that merges `**options`, the value of an `options=` argument."""
        if isinstance(node, ast.Assign) and any(self.is_options(t) for t in node.targets) or \
                isinstance(node, ast.AnnAssign) and self.is_options(node.target):
            return [node.value]
        if isinstance(node, ast.Return) and (self.function or "").endswith("options") and node.value:
            return [node.value]
        if isinstance(node, ast.Dict) and any(k is None and self.is_options(v) for k, v in zip(node.keys,
                                                                                              node.values)):
            return [ast.Tuple([ast.Tuple([k, k], lineno=k.lineno) for k in node.keys if k is not None])]
        if isinstance(node, ast.keyword) and node.arg == "options":
            return [node.value]
        return []


def _option_keys() -> list[tuple[str, int, str]]:
    constants: dict[tuple[str, str], list[str]] = {}  # (module stem, NAME) -> its string value(s)
    sources = {}
    for path in _python_files():
        rel = path.relative_to(SRC).as_posix()
        sources[rel] = path.read_text()
        for node in ast.parse(sources[rel]).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                    isinstance(node.value.value, str):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        constants.setdefault((path.stem, target.id), []).append(node.value.value)
    found = []
    for rel, source in sources.items():
        if rel == "config.py" or _excluded(rel, None):
            continue
        visitor = _Keys(rel, source, constants)
        visitor.visit(visitor.tree)
        found += visitor.found
    return found


def test_every_key_the_code_keeps_in_a_workflows_options_is_declared():
    found = _option_keys()
    keys = {k for _, _, k in found}
    # the scan sees each way of writing one: pairs (cli), a constant (ddl/modes.py), keywords (traffic.py),
    # a dict merged in (cluster/create.py), a subscript (workflow/create.py), SQL parameters (standby_flush.py)
    assert {"cycle_rows", "on_ddl", "ddl_applied_by_hand", "epoch", "cluster", "apply_as_replica",
            "confirm_after_target_standbys", "whole_schemas", "excluded_tables", "keyspace"} <= keys
    undeclared = sorted({f"{rel}:{line}: {key}" for rel, line, key in found
                         if key not in config.OPTION_NAMES})
    assert undeclared == []


def test_lake_housekeeping_keys_are_declared_settings():
    from sluicegate.targets.delta.state import HOUSEKEEPING_DEFAULTS

    assert set(HOUSEKEEPING_DEFAULTS) <= set(config.OPTION_NAMES)
    assert Settings().commit_every == HOUSEKEEPING_DEFAULTS["commit_every"]


def test_the_scan_finds_a_new_key():
    source = ('def f(options, wf):\n    options["new_key"] = 1\n    wf.options.get("read_key")\n'
              '    return {**options, "merged_key": 2}\n')
    visitor = _Keys("x.py", source, {})
    visitor.visit(visitor.tree)
    assert {k for _, _, k in visitor.found} == {"new_key", "read_key", "merged_key"}


def test_workflow_set_takes_only_what_a_workflow_may_change():
    tuned = config.tuned({"batch_changes": "5000", "stage_bytes": "32MB", "idle_poll": "0.5",
                          "slice_seconds": "default"}, "workflow w")
    assert tuned == {"batch_changes": 5000, "stage_bytes": 32 << 20, "idle_poll": 0.5, "slice_seconds": None}
    with pytest.raises(UsageError, match="workflow w: unknown setting 'batch_change'; did you mean"):
        config.tuned({"batch_change": "5"}, "workflow w")
    # set at create only (an index dropped before the copy, not after), or by a flag of its own
    with pytest.raises(UsageError, match="defer_indexes is chosen at create only; KEY=VALUE changes cycle"):
        config.tuned({"defer_indexes": "false"}, "workflow w")
    with pytest.raises(UsageError, match="on_ddl is changed by `workflow set --on-ddl`"):
        config.tuned({"on_ddl": "exec"}, "workflow w")
    with pytest.raises(UsageError, match="commit_every is changed by `sluicegate lake schedule`"):
        config.tuned({"commit_every": "5"}, "workflow w")
    with pytest.raises(UsageError, match="unknown setting 'traffic'"):  # a record the code keeps
        config.tuned({"traffic": "{}"}, "workflow w")
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(UsageError, match=f"workflow w: idle_poll={bad}: must be above zero, and finite"):
            config.tuned({"idle_poll": bad}, "workflow w")
    with pytest.raises(UsageError, match="batch_changes=many: not an integer"):
        config.tuned({"batch_changes": "many"}, "workflow w")


def test_a_size_a_run_works_in_is_above_zero_wherever_it_comes_from():
    with pytest.raises(UsageError, match="must be above zero"):
        check_options({"cycle_rows": -1})
    with pytest.raises(TerminalError, match="workflow w: setting 'chunk_rows' = 0: must be above zero"):
        Settings.from_options({"chunk_rows": 0}, "workflow w")
    assert check_options({"slice_seconds": None}) == {"slice_seconds": None}  # (none: until interrupted)

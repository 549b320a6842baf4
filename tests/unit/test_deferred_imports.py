"""An import of a Sluicegate module inside a function is there to keep a start light (issue 35), read from the source
with `ast`: nothing is imported, no server started.

No import circle is left (test_import_graph.py), so deferring an import breaks none. It may still keep a module
from loading a third-party package it does not need at its start (pyarrow, deltalake, pyspark, grpc, rich), or keep
what an entry point loads before Spark's JVM starts small. An import that does neither belongs at the module's top.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from functools import cache

from .test_import_graph import SRC, _modules, import_origin

# What starts on the clock: the command line (before Spark's JVM starts), the engine (while it starts), and a
# copy task in a Python worker.
ENTRY_POINTS = ("sluicegate.cli.main", "sluicegate.workflow.engine", "sluicegate.workflow.copy_task",
                "sluicegate.spark.runner")

# (module, name) imported inside functions on purpose though nothing heavier loads with it: the reason.
KNOWN: dict[tuple[str, str], str] = {}


def _runs_at_import(tree: ast.Module):
    """The import statements a module runs when it is imported (not those under `if TYPE_CHECKING:`)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        elif isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", []) + [
                s for h in getattr(node, "handlers", []) for s in h.body]


@cache
def _parsed() -> dict[str, tuple[ast.Module, bool]]:
    return {name: (ast.parse(path.read_text(), filename=str(path)), package)
            for name, (path, package) in _modules().items()}


@cache
def _direct() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Per module: the Sluicegate modules and the third-party packages its import runs import directly
    (its parent packages count: importing a module runs them)."""
    modules = _parsed()
    inner: dict[str, set[str]] = defaultdict(set)
    outer: dict[str, set[str]] = defaultdict(set)
    for here, (tree, package) in modules.items():
        parts = here.split(".")
        inner[here] |= {".".join(parts[:i]) for i in range(2, len(parts))}
        for node in _runs_at_import(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("sluicegate")):
                origin = import_origin(here, package, node)
                for alias in node.names:
                    name = f"{origin}.{alias.name}"
                    inner[here].add(name if name in modules else origin)
            else:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for name in names:
                    top = name.partition(".")[0]
                    if top == "sluicegate":
                        inner[here].add(name)
                    elif top not in sys.stdlib_module_names and not top.startswith("_"):
                        outer[here].add(top)
    return inner, outer


@cache
def closure(module: str) -> frozenset[str]:
    """The Sluicegate modules importing `module` runs, itself included."""
    inner, _ = _direct()
    seen, todo = {module}, [module]
    while todo:
        for nxt in inner[todo.pop()]:
            while nxt and nxt not in _parsed():  # `import sluicegate.x.attr`
                nxt = nxt.rpartition(".")[0]
            if nxt and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return frozenset(seen)


def loads(module: str) -> set[str]:
    """The third-party packages importing `module` imports by name."""
    _, outer = _direct()
    return set().union(*(outer[m] for m in closure(module)))


def movable_imports() -> list[str]:
    """Imports inside functions (statements of a function's own body) that could stand at the module's top:
    they load no third-party package the module does not, and nothing an entry point's start does not."""
    modules = _parsed()
    starts = {entry: closure(entry) for entry in ENTRY_POINTS}
    found = []
    for here, (tree, package) in sorted(modules.items()):
        assigned = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
        assigned |= {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
        assigned |= {n.name for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        sources: dict[str, set[str]] = defaultdict(set)
        candidates = []
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in fn.body:
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("sluicegate")):
                    origin = import_origin(here, package, node)
                    candidates.append((node, origin))
                    for alias in node.names:
                        sources[alias.asname or alias.name].add(f"{origin}.{alias.name}")
        mine = loads(here)
        for node, origin in candidates:
            if origin == here:  # a package's own submodules, from its __init__
                continue
            names = [alias.asname or alias.name for alias in node.names]
            if any(n in assigned or len(sources[n]) > 1 or (here, n) in KNOWN for n in names):
                continue  # the name means something else elsewhere in the module, or is known
            targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in node.names]
            if any(not loads(t) <= mine for t in targets):
                continue  # keeps a third-party package out of the module's start
            if any(here in start and not closure(t) <= start for t in targets for start in starts.values()):
                continue  # keeps an entry point's start small
            path = _modules()[here][0].relative_to(SRC)
            found.append(f"{path}:{node.lineno}: from {'.' * node.level}{node.module or ''} import "
                         f"{', '.join(names)}")
    return found


def test_imports_inside_functions_keep_a_start_light():
    found = movable_imports()
    assert not found, ("these imports load nothing the module's start does not load already: move them to the "
                       "module's top (or, if a test patches the name, list it in KNOWN with why):\n"
                       + "\n".join(found))


def test_the_reader_sees_what_an_import_loads():
    # against modules as they are today: the Delta target loads deltalake's bindings through its modules,
    # the command line loads no pyarrow, and a module's import runs its parent packages
    assert "pyarrow" in loads("sluicegate.targets.delta.apply")
    assert "pyarrow" not in loads("sluicegate.cli.main")
    assert "sluicegate.targets" in closure("sluicegate.targets.delta.apply")
    assert not [k for k in KNOWN if k[0] not in _parsed()]

"""No import circle between Sluicegate's packages, nor between its modules (issue 35), read from the source with
`ast`: nothing is imported, no server started.

A package node is a first-level package below src/sluicegate (`workflow`, `cluster`, `lake`, ...) or a top-level
module (`errors`, `faults`, ...). An import inside a function is a dependency all the same: deferring it hides a
circle from Python, not from the reader. `if TYPE_CHECKING:` imports count too.

The circles that remain are listed as the edges that close them (KNOWN_*_EDGES), each with why it is still
there. The graph without them must have no cycle. The lists only shrink: an edge that no longer exists, or no
longer closes a cycle, fails the test until its line is deleted.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "sluicegate"

# (importer, imported) between packages: the imports that close the package cycles left.
KNOWN_PACKAGE_EDGES: dict[tuple[str, str], str] = {}

# (importer, imported) between modules: the imports that close the module cycles left.
KNOWN_MODULE_EDGES: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, tuple[Path, bool]]:
    """'sluicegate.x.y' -> (its file, whether it is a package's __init__)."""
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


@cache  # (read once for all the tests; none changes it)
def import_origin(here: str, package: bool, imp: ast.ImportFrom) -> str:
    """The module a `from ... import` in module `here` (a package's __init__ when `package`) names: relative
    ones from the importer's package, one level up per extra dot."""
    if not imp.level:
        return imp.module or ""
    base = here.split(".") if package else here.split(".")[:-1]
    return ".".join(base[:len(base) - (imp.level - 1)] + ([imp.module] if imp.module else []))


def module_edges() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) modules of sluicegate, without the 'sluicegate.' prefix -> the places of each import
    ('cluster/create.py:23', '... (in def)')."""
    modules = _modules()
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for here, (path, package) in sorted(modules.items()):
        tree = ast.parse(path.read_text(), filename=str(path))
        in_def = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))}
        for imp in ast.walk(tree):
            if isinstance(imp, ast.Import):
                names = [alias.name for alias in imp.names]
            elif isinstance(imp, ast.ImportFrom):
                origin = import_origin(here, package, imp)
                # `from .x import name`: module x, or x.name when that is a module (`from . import state`)
                names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in imp.names]
            else:
                continue
            where = f"{path.relative_to(SRC)}:{imp.lineno}" + (" (in def)" if id(imp) in in_def else "")
            for name in names:
                while name and name not in modules:  # `import sluicegate.x.y.attr`
                    name = name.rpartition(".")[0]
                if name and name != here and name != "sluicegate" and not here.startswith(name + "."):
                    places = edges[(here.removeprefix("sluicegate."), name.removeprefix("sluicegate."))]
                    if where not in places:
                        places.append(where)
    return dict(edges)


@cache
def package_edges() -> dict[tuple[str, str], list[str]]:
    """module_edges between first-level packages (and top-level modules) of sluicegate."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for (a, b), places in module_edges().items():
        pa, pb = a.partition(".")[0], b.partition(".")[0]
        if pa != pb:
            edges[(pa, pb)] += places
    return dict(edges)


def _graph(edges) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    return graph


def _path(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A shortest path from start to goal, both included."""
    came: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        step = []
        for node in frontier:
            for nxt in sorted(graph.get(node, ())):
                if nxt in came:
                    continue
                came[nxt] = node
                if nxt == goal:
                    path = [goal]
                    while came[path[-1]] is not None:
                        path.append(came[path[-1]])
                    return path[::-1]
                step.append(nxt)
        frontier = step
    return None


def cycles(edges) -> list[list[str]]:
    """A shortest cycle through each edge that is on one, without repeats (a cycle as its nodes in order)."""
    graph = _graph(edges)
    found: dict[frozenset, list[str]] = {}
    for a, b in sorted(edges):
        back = _path(graph, b, a)
        if back is not None:
            cycle = [a] + back[:-1]
            found.setdefault(frozenset(zip(cycle, cycle[1:] + cycle[:1], strict=True)), cycle)
    return sorted(found.values(), key=lambda c: (len(c), c))


def describe(cycle: list[str], edges: dict[tuple[str, str], list[str]]) -> str:
    """A cycle with one example import per edge, so that its reader knows where to cut."""
    lines = [" -> ".join(cycle + cycle[:1])]
    for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
        places = edges[(a, b)]
        more = f" (and {len(places) - 1} more)" if len(places) > 1 else ""
        lines.append(f"    {a} -> {b}: {places[0]}{more}")
    return "\n".join(lines)


def _new_cycles(edges, known) -> str:
    new = cycles({edge: places for edge, places in edges.items() if edge not in known})
    return "\n".join(describe(c, edges) for c in new)


def _stale(edges, known) -> list[str]:
    graph = _graph(edges)
    return ([f"{a} -> {b}: no such import any more" for a, b in known if (a, b) not in edges]
            + [f"{a} -> {b}: closes no cycle any more" for a, b in known
               if (a, b) in edges and _path(graph, b, a) is None])


HOW = ("cut one edge of each: move what both sides use down to the lower one, or have the caller pass a "
       "callback or register an implementation, instead of importing upward (an import inside a function "
       "counts too)")


def test_no_import_cycle_between_packages_but_the_known_ones():
    found = _new_cycles(package_edges(), KNOWN_PACKAGE_EDGES)
    assert not found, f"import cycles between packages ({HOW}):\n{found}"


def test_no_import_cycle_between_modules_but_the_known_ones():
    found = _new_cycles(module_edges(), KNOWN_MODULE_EDGES)
    assert not found, f"import cycles between modules ({HOW}):\n{found}"


def test_the_known_cycles_only_shrink():
    stale = _stale(package_edges(), KNOWN_PACKAGE_EDGES) + _stale(module_edges(), KNOWN_MODULE_EDGES)
    assert not stale, "delete these lines from KNOWN_PACKAGE_EDGES / KNOWN_MODULE_EDGES:\n" + "\n".join(stale)


def test_the_reader_sees_relative_deferred_and_submodule_imports():
    # What the checks above rely on, against imports that exist today (errors.py: `from .redact import ...`;
    # cli/main.py: `from .demo import run_demo` inside the demo command; workflow/engine.py: `from . import state`).
    edges = module_edges()
    assert ("errors", "redact") in edges
    assert any(p.endswith("(in def)") for p in edges[("cli.main", "cli.demo")])
    assert ("workflow.engine", "workflow.state") in edges
    assert ("errors", "redact") in package_edges() and ("workflow", "postgres") in package_edges()
    # and the cycle finder, on a made-up graph
    toy = {("a", "b"): ["a.py:1"], ("b", "c"): ["b.py:2"], ("c", "a"): ["c.py:3 (in def)"], ("c", "d"): ["c.py:4"]}
    assert cycles(toy) == [["a", "b", "c"]]
    assert describe(["a", "b", "c"], toy).splitlines()[-1] == "    c -> a: c.py:3 (in def)"
    assert _stale(toy, {("c", "d"): ""}) == ["c -> d: closes no cycle any more"]

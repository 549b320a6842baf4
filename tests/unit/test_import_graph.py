"""No import circle between Sluicegate's packages (issue 35), read from the source with `ast`, nothing imported.

A node is a package below src/sluicegate (`workflow`, `cluster`, `lake`, ...) or a top-level module (`errors`,
`position`, ...). An import inside a function is a dependency all the same: deferring it hides a circle from
Python, not from the reader. `if TYPE_CHECKING:` imports count too.

The circles that remain today are listed below as the edges that close them: KNOWN_UPWARD_EDGES, each an import
from a package of a lower layer into one of a higher layer. The graph without them must have no cycle. The list
only shrinks: an edge that no longer exists, or no longer closes any cycle, fails the test until it is deleted."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "sluicegate"

# (importer, imported): the imports that close the package cycles left today, and why each is still there.
# Removing one is progress: delete its line. Adding one needs a reason a reviewer accepts.
KNOWN_UPWARD_EDGES = {
    # the workflow's player (workflow/player.py, being edited elsewhere) asks the vdiff store for a stop position
    # every batch; goes with issue 35 stage 1 (a durable stop position in the stream's state)
    ("workflow", "vdiff"): "workflow/player.py: vdiff.store",
    # DDL replay runs through the workflow's state and player (ddl/*, being edited elsewhere)
    ("ddl", "workflow"): "ddl/replay.py, ddl/tables.py",
}


def _module_of(path: Path) -> tuple[list[str], bool]:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        return parts[:-1], True
    return parts, False


def _node(module: str) -> str | None:
    """The package (or top-level module) of sluicegate a dotted module name falls in, if any."""
    parts = module.split(".")
    if parts[0] != "sluicegate" or len(parts) < 2:
        return None
    name = parts[1]
    return name if (SRC / name).is_dir() or (SRC / f"{name}.py").is_file() else None


def import_edges() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) → the places ('cluster/create.py:23', '... (in def)') of each import between nodes."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(SRC.rglob("*.py")):
        module, is_package = _module_of(path)
        here = _node(".".join(module)) if len(module) > 1 else None
        if here is None:
            continue  # sluicegate/__init__.py
        tree = ast.parse(path.read_text(), filename=str(path))
        in_def: set[int] = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_def.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
        for imp in ast.walk(tree):
            if isinstance(imp, ast.Import):
                targets = [alias.name for alias in imp.names]
            elif isinstance(imp, ast.ImportFrom):
                if imp.level:  # relative: from the importer's package, one level up per extra dot
                    base = module if is_package else module[:-1]
                    base = base[:len(base) - (imp.level - 1)]
                    origin = ".".join(base + ([imp.module] if imp.module else []))
                else:
                    origin = imp.module or ""
                # `from . import errors` / `from .. import lake`: the names are the modules
                targets = [origin] if imp.module else [f"{origin}.{alias.name}" for alias in imp.names]
            else:
                continue
            where = f"{path.relative_to(SRC)}:{imp.lineno}" + (" (in def)" if id(imp) in in_def else "")
            for target in targets:
                there = _node(target)
                if there and there != here and where not in edges[(here, there)]:
                    edges[(here, there)].append(where)
    return dict(edges)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _shortest_path(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    came: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        step = []
        for node in frontier:
            for nxt in sorted(graph.get(node, ())):
                if nxt not in came:
                    came[nxt] = node
                    if nxt == goal:
                        path = [goal]
                        while came[path[-1]] is not None:
                            path.append(came[path[-1]])
                        return path[::-1]
                    step.append(nxt)
        frontier = step
    return None


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """One shortest cycle through each edge that is on a cycle, without repeats (a cycle as its node list)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    found: dict[frozenset, list[str]] = {}
    for a, b in sorted(edges):
        back = _shortest_path(graph, b, a)
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


def test_no_import_cycle_between_packages_but_the_known_ones():
    edges = import_edges()
    rest = {edge: places for edge, places in edges.items() if edge not in KNOWN_UPWARD_EDGES}
    new = cycles(rest)
    assert not new, ("import cycles between packages (cut one edge of each: move the code used by both sides "
                     "down, or pass a callback instead of importing upward):\n"
                     + "\n".join(describe(c, edges) for c in new))


def test_the_known_cycles_only_shrink():
    edges = import_edges()
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    gone = [edge for edge in KNOWN_UPWARD_EDGES if edge not in edges]
    harmless = [edge for edge in KNOWN_UPWARD_EDGES if edge in edges and edge[0] not in _reachable(graph, edge[1])]
    assert not gone and not harmless, (
        f"delete from KNOWN_UPWARD_EDGES: {gone} (no such import any more) {harmless} (closes no cycle any more)")


def test_the_graph_sees_imports_in_functions_and_relative_imports():
    # the reader itself: a deferred import and a relative one are edges, a standard-library one is not
    edges = import_edges()
    assert ("errors", "redact") in edges
    assert all(not place.startswith("redact.py") for (a, _), places in edges.items() for place in places)
    assert any(place.endswith("(in def)") for places in edges.values() for place in places)

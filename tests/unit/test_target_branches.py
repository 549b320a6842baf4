"""Nothing outside a target kind's folder asks which kind a URL or a connection is (issue 35): the --target URL
is resolved once (targets.resolve) and the commands call the Target it gives. Pure: reads the source.

Counted as a branch on a kind: `x.startswith("delta…")`, a call of `is_delta`, a comparison with "delta" or
"postgres" (a kind's name), and `isinstance(x, psycopg.Connection)`. Allowed where the kinds live: targets/.
And no package below the CLI imports a kind's folder: cluster/ and workflow/ reach other kinds through the
registries their composer (cli/) fills."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "src" / "sluicegate"
KIND_HOMES = ("targets",)
COMPOSERS = ("targets", "cli", "lake")  # may import targets.<kind> (lake/: the public read path)
KIND_NAMES = {"delta", "postgres"}


def _branches(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            args = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if name == "startswith" and any(a.startswith("delta") for a in args):
                out.append((node.lineno, "startswith('delta…')"))
            elif name == "is_delta":
                out.append((node.lineno, "is_delta()"))
            elif name == "isinstance" and len(node.args) == 2 and any(
                    getattr(n, "attr", getattr(n, "id", None)) == "Connection" for n in ast.walk(node.args[1])):
                out.append((node.lineno, f"isinstance(…, {ast.unparse(node.args[1])})"))
        elif isinstance(node, ast.Compare):
            consts = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
            if any(isinstance(c, str) and c in KIND_NAMES for c in consts):
                out.append((node.lineno, f"compares with {ast.unparse(node)}"))
    return out


def kind_branches() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in KIND_HOMES:
            continue
        for line, what in _branches(ast.parse(path.read_text(), str(rel))):
            found.append(f"{rel}:{line}: {what}")
    return found


def test_no_branch_on_a_target_kind_outside_its_folder():
    assert kind_branches() == []


def test_the_scan_finds_each_shape():
    source = ('def f(url, conn, t):\n    if url.startswith("delta:"): pass\n    if is_delta(url): pass\n'
              '    if isinstance(conn, psycopg.Connection): pass\n    if t.kind == "delta": pass\n')
    assert [w for _, w in _branches(ast.parse(source))] == [
        "startswith('delta…')", "is_delta()", "isinstance(…, psycopg.Connection)", "compares with t.kind == 'delta'"]


def kind_imports() -> list[str]:
    """Imports of targets/<kind>/ from outside targets/ and cli/ (absolute or relative)."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in COMPOSERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(rel))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level else [(node.module or "").removeprefix("sluicegate.")]
                names += [f"{names[0]}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name.removeprefix("sluicegate.") for a in node.names]
            else:
                continue
            if any(n.startswith("targets.") for n in names):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_package_below_the_cli_imports_a_target_kind():
    assert kind_imports() == []

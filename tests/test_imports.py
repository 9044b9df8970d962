"""The import structure the registry relies on, read from the source (no imports run).

``ops.py`` (the operator registry) stands on the floor :mod:`mirage_cli.semantics` and
must import nothing from the passes above it (``search``, ``verifier``, ``codegen``),
directly or through anything it imports; and no module of the package takes part in
an import cycle, counting imports inside functions too (a deferred import hides a
cycle from Python, not from the design).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "mirage_cli"
PASSES = ("mirage_cli.search", "mirage_cli.verifier", "mirage_cli.codegen")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _targets(node: ast.AST, here: str, known: set[str], is_pkg: bool) -> list[str]:
    """The package modules an import statement names (``from a import b`` names
    ``a.b`` when that is a module, else ``a``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = here.split(".") if is_pkg else here.split(".")[:-1]
        anchor = anchor[:len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    out = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
    if len(out) < len(node.names) and base in known:
        out.append(base)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its body (under
    ``TYPE_CHECKING`` excluded: those never run)."""
    mods = _modules()
    known = set(mods)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skip.update(id(n) for b in node.body for n in ast.walk(b))
        graph[name] = {t for node in ast.walk(tree) if id(node) not in skip
                       for t in _targets(node, name, known, path.name == "__init__.py")
                       if t != name}
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        for n in graph.get(m, ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (as a path that returns to its start), or None."""
    colour: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        colour[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if colour.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in colour and (found := visit(n)) is not None:
                return found
        stack.pop()
        colour[m] = 2
        return None

    for m in sorted(graph):
        if m not in colour and (found := visit(m)) is not None:
            return found
    return None


def test_the_graph_sees_real_imports() -> None:
    """Guard against a walker that finds nothing (which would pass every check)."""
    g = import_graph()
    assert "mirage_cli.semantics.terms" in g["mirage_cli.ops"]
    assert "mirage_cli.ops" in g["mirage_cli.search.abstract"]
    assert "mirage_cli.semantics.field" in g["mirage_cli.semantics.values"]


def test_ops_imports_nothing_from_the_passes() -> None:
    g = import_graph()
    upward = sorted(m for m in _reachable(g, "mirage_cli.ops") if m.startswith(PASSES))
    assert upward == [], f"ops.py reaches {upward}"


def test_the_semantics_floor_does_not_import_the_registry() -> None:
    g = import_graph()
    floor = [m for m in g if m.startswith("mirage_cli.semantics")]
    for m in floor:
        assert "mirage_cli.ops" not in _reachable(g, m), m


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle or [])


@pytest.mark.parametrize("graph, has_cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
    ({"a": {"a2"}, "a2": set(), "b": {"b"}}, True),
])
def test_the_cycle_finder_finds_cycles(graph: dict[str, set[str]], has_cycle: bool) -> None:
    assert (find_cycle(graph) is not None) == has_cycle

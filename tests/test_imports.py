"""No import cycles among zeroedu's modules, counting imports inside functions too (a function-level import
hides a cycle from Python at import time, not from a reader). The graph is built from the source with `ast`,
so the test imports nothing it checks."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "zeroedu"

# Cycles tolerated for now (each a set of modules); a cycle may shrink below a known one, never grow or appear
# anew. None is left: engine <- stages <- extras <- compose is one-way, and __version__ lives in zeroedu._version.
KNOWN_CYCLES: list[frozenset[str]] = []


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the zeroedu modules it imports anywhere in its source (top level or inside a function)."""
    mods = modules()
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name in mods}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x, from ..y import z
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for alias in node.names:  # `from pkg import submodule` imports the submodule, else pkg itself
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in mods else base)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan), each a set of mutually importing modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while (w := stack.pop()) != v:
                component.add(w)
            component.add(v)
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(component: frozenset[str], graph: dict[str, set[str]]) -> str:
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & component))}" for m in sorted(component))


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    assert "zeroedu.launch" in graph["zeroedu.doctor"]  # doctor's check_ranks imports launch inside the function
    assert "zeroedu.sysinfo" in graph["zeroedu.launch"]


def test_no_import_cycles():
    graph = import_graph()
    new = [c for c in cycles(graph) if not any(c <= known for known in KNOWN_CYCLES)]
    assert not new, "import cycles: " + " | ".join(describe(c, graph) for c in new)


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert cycles({"a": {"b"}, "b": set()}) == []

"""nvrar's own modules import each other without a cycle: every import statement of nvrar/**.py
(at the top or inside a function, absolute or relative) is an edge of the graph, and the graph
must be acyclic (a cycle works only by the accident of which module is imported first)."""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "nvrar")


def modules() -> Dict[str, str]:
    """Module name -> source path; the native modules (their .pyi stubs) are leaves."""
    out = {}
    for base, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".pyi"):
                out[os.path.relpath(os.path.join(base, f), ROOT)[:-4].replace(os.sep, ".")] = ""
            elif f.endswith(".py"):
                rel = os.path.relpath(os.path.join(base, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(base, f)
    return out


def edges(mods: Dict[str, str]) -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        if not path:
            continue
        is_pkg = path.endswith("__init__.py")
        package = mod if is_pkg else mod.rsplit(".", 1)[0]
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:  # nvrar.x.y -> nvrar.x where y is a name, not a module
                    t = t.rsplit(".", 1)[0] if "." in t else ""
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(m: str) -> List[str]:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def test_the_import_graph_has_no_cycle():
    graph = edges(modules())
    assert "nvrar.settings" in graph and "nvrar.env" in graph["nvrar.communicator"]
    cycle = find_cycle(graph)
    assert not cycle, "import cycle in nvrar/: " + " -> ".join(cycle)


def test_settings_is_below_env_and_selector():
    graph = edges(modules())
    assert graph["nvrar.settings"] <= {"nvrar._C"}, graph["nvrar.settings"]
    assert "nvrar.settings" in graph["nvrar.env"] and "nvrar.settings" in graph["nvrar.selector"]


def test_the_check_finds_the_old_circle():
    """The circle as it was: settings imported env and selector (inside functions), both imported
    settings."""
    graph = {"nvrar.settings": {"nvrar.env", "nvrar.selector"}, "nvrar.env": {"nvrar.settings"},
             "nvrar.selector": {"nvrar.settings", "nvrar._C"}, "nvrar._C": set()}
    assert find_cycle(graph)[0] == find_cycle(graph)[-1]

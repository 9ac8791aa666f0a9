"""The packages' layering and the modules' import graph.

Packages stack `schemas` <- `sidindex` <- `runtime` <- `pipelines`, `sidindex_cli`, `bench`: none
imports a package above it (tests/ may import anything). And no two modules import each other,
directly or through others. Every import is read from the source (ast): at module level, inside a
function (a lazy import) and under TYPE_CHECKING alike, since each is a dependency all the same. An
edge goes to the module an import names (`import a.b`, or `from a import b` where a.b is a module),
not to the packages above it that Python also runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK = {"schemas": 0, "sidindex": 1, "runtime": 2, "pipelines": 3, "sidindex_cli": 3, "bench": 3}
# runtime's rooms, lowest first (runtime/__init__.py): a room imports only rooms of a lower rank
ROOMS = {"runtime.ops": 0, "runtime.index": 1, "runtime.result": 1, "runtime.requests": 2, "runtime.scorers": 2,
         "runtime.search": 3, "runtime.serving": 4, "runtime.server": 5, "runtime.studies": 5}


def project_modules() -> dict[str, Path]:
    """Every module of the packages by dotted name (a package's __init__ by the package's name)."""
    out = {}
    for package in RANK:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(source: str, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` (a package's __init__ when `is_package`) imports,
    wherever in `source` the import stands."""

    def module(dotted: str) -> str | None:  # the module itself, else the nearest package above it
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(module(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package, up level - 1 more
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found.update(module(f"{base}.{a.name}") if f"{base}.{a.name}" in known else module(base)
                         for a in node.names)
    return found - {None, name}


def import_graph() -> dict[str, set[str]]:
    mods = project_modules()
    known = set(mods)
    return {name: imports_of(path.read_text(), name, path.name == "__init__.py", known)
            for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(component)
    return out


def test_no_package_imports_one_above_it():
    rank = {name: RANK[name.partition(".")[0]] for name in project_modules()}
    upward = sorted(f"{m} imports {d}" for m, deps in import_graph().items() for d in deps if rank[d] > rank[m])
    assert not upward, "a package imports one above it (schemas <- sidindex <- runtime <- pipelines, " \
                       "sidindex_cli, bench):\n" + "\n".join(upward)


def room(module: str) -> str | None:
    """The runtime room `module` is in (runtime.search.beam -> runtime.search); None outside them."""
    return next((r for r in ROOMS if module == r or module.startswith(r + ".")), None)


def test_no_runtime_room_imports_one_above_it():
    rooms = {m: room(m) for m in project_modules() if m.startswith("runtime.")}
    assert None not in rooms.values(), "a runtime module outside every room: " + \
        ", ".join(m for m, r in rooms.items() if r is None)
    upward = sorted(f"{m} imports {d}" for m, deps in import_graph().items() if m in rooms for d in deps
                    if d in rooms and rooms[m] != rooms[d] and ROOMS[rooms[d]] >= ROOMS[rooms[m]])
    assert not upward, "a runtime room imports one at or above its rank (runtime/__init__.py):\n" + "\n".join(upward)


def test_no_import_cycle():
    graph = import_graph()
    found = [", ".join(sorted(c)) + ": " + "; ".join(f"{m} -> {d}" for m in sorted(c) for d in sorted(graph[m] & c))
             for c in cycles(graph)]
    assert not found, "modules that import each other (directly or through others):\n" + "\n".join(found)


def test_every_kind_of_import_is_an_edge():
    """The graph counts lazy, type-only and relative imports, and a submodule imported by name."""
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.sub", "pkg.sub.e"}
    source = """
from typing import TYPE_CHECKING
import numpy
from pkg import a, CONSTANT
if TYPE_CHECKING:
    from pkg.b import B
def f():
    from pkg.c import g
from ..d import h
from . import e
import pkg.sub.e.missing
"""
    assert imports_of(source, "pkg.sub.x", False, known) == {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.sub.e"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []

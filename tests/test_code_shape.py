"""Facts about the code any reader can check, kept true by the suite.

- No import cycle between spikeguard's modules, function-local imports included (a lazy
  import is still a dependency; tests/test_import_direction.py checks the rooms' order,
  this the modules inside a room).
- Every module of the package under 400 lines.
- No function over 80 lines in the rooms that decide memory: plan/, runtime/, sim/.

    .venv/bin/python -m pytest tests/test_code_shape.py -q
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_import_direction import PACKAGE, imports_of

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
SHORT_FUNCTION_ROOMS = ("plan", "runtime", "sim")


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (`from a.b import c` is a.b.c where that
    is a module, else a.b)."""
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    graph = {}
    for name, path in paths.items():
        targets = set()
        for _, module in imports_of(path):
            while module not in paths and "." in module:
                module = module.rsplit(".", 1)[0]
            if module in paths and module != name:
                targets.add(module)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_every_module_under_400_lines():
    long = [f"{p.relative_to(PACKAGE)}: {n} lines" for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) >= MAX_FILE_LINES]
    assert long == []


def test_no_long_function_where_memory_is_decided():
    long = []
    for room in SHORT_FUNCTION_ROOMS:
        for path in sorted((PACKAGE / room).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} "
                                    f"{node.name}: {lines} lines")
    assert long == []

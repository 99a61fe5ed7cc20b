"""Narrow doors into the guard (issue 23 item 3): no room below runtime, and not the
pipeline's trainer in parallel/, assigns to a guard's attributes or reaches through it to
assign to one of its parts. What they change about a guard goes through a runtime function
(spikeguard.runtime.pipeline_view: `use_schedule`, `no_output_head`)."""

from __future__ import annotations

import ast

from test_import_direction import PACKAGE, ROOMS, room_of

CHECKED = set(ROOMS[:ROOMS.index("runtime")]) | {"parallel"}


def _root(node: ast.AST):
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def guard_writes(source: str) -> list[int]:
    """Lines that assign to `guard.<...>` (any depth) in `source`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Attribute) and _root(t) in ("guard", "g"):
                    lines.append(node.lineno)
    return lines


def test_the_check_sees_a_reach_through():
    assert guard_writes("guard.forecast.residency = r\nx = guard.ledger\n") == [1]
    assert guard_writes("for g in gs:\n    g.full_recompute = True\n") == [2]


def test_no_room_below_runtime_and_not_parallel_writes_into_a_guard():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if len(path.relative_to(PACKAGE).parts) > 1 and room_of(path) in CHECKED:
            found += [f"{path.relative_to(PACKAGE)}:{n}" for n in guard_writes(path.read_text())]
    assert found == []

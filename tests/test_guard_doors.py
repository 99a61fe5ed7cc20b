"""Narrow doors into the guard (issue 23 item 3).

- No room below runtime, and not the pipeline's trainer in parallel/, assigns to a guard's
  attributes or reaches through it to assign to one of its parts. What they change about a
  guard goes through a runtime function (spikeguard.runtime.pipeline_view: `use_schedule`,
  `no_output_head`).
- The safety net (runtime/net.py) and the expert-path windows (integrations/builtin.py,
  hf_window.py, titan_blocks.py) take the guard's door (spikeguard.runtime.doors), never the
  guard: no parameter or name `guard` there, and what they read of a door is what the door
  names. The doors the guard builds hold its parts, not the guard.

    .venv/bin/python -m pytest tests/test_guard_doors.py -q
"""

from __future__ import annotations

import ast
import dataclasses

import pytest

from test_import_direction import PACKAGE, ROOMS, room_of

import spikeguard
from spikeguard.model import build_model, model_config
from spikeguard.runtime.doors import NetDoor, WindowDoor
from spikeguard.runtime.guard import Guard

pytestmark = pytest.mark.timeout(120)

CHECKED = set(ROOMS[:ROOMS.index("runtime")]) | {"parallel"}
GUARD_NAMES = ("guard", "guards", "g")
# The modules behind a door, and the door each one's functions take.
DOOR_MODULES = {"runtime/net.py": NetDoor, "integrations/builtin.py": WindowDoor,
                "integrations/hf_window.py": WindowDoor,
                "integrations/titan_blocks.py": WindowDoor}
DOOR_NAMES = ("door", "d")   # a door's parameter, and the net's `d = self.door`


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
                if isinstance(t, ast.Attribute) and _root(t) in GUARD_NAMES:
                    lines.append(node.lineno)
    return lines


def guard_reaches(source: str, door: type) -> list[str]:
    """Where `source` takes or names a guard (a parameter, a name or an attribute `guard`,
    `guards`, `g`), or reads of a door (`door.x`, `d.x`, `self.door.x`) what the class
    `door` does not name (its fields, properties and methods)."""
    names = {f.name for f in dataclasses.fields(door)} | {
        k for k, v in vars(door).items() if isinstance(v, property) or callable(v)}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.arg) and node.arg in GUARD_NAMES:
            found.append(f"{node.lineno}: takes {node.arg}")
        elif isinstance(node, ast.Name) and node.id in GUARD_NAMES:
            found.append(f"{node.lineno}: names {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in GUARD_NAMES:
            found.append(f"{node.lineno}: reads .{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr not in names and (
                isinstance(node.value, ast.Name) and node.value.id in DOOR_NAMES
                or isinstance(node.value, ast.Attribute) and node.value.attr == "door"):
            found.append(f"{node.lineno}: reads {node.attr} of the door")
    return found


def test_the_check_sees_a_reach_through():
    assert guard_writes("guard.forecast.residency = r\nx = guard.ledger\n") == [1]
    assert guard_writes("for g in gs:\n    g.full_recompute = True\n") == [2]
    assert guard_reaches("def f(guard, x):\n    return x\n", WindowDoor) == ["1: takes guard"]
    assert guard_reaches("x = self.guard.meter\n", NetDoor) == ["1: reads .guard"]
    assert guard_reaches("g = self.net\n", NetDoor) == ["1: names g"]
    assert guard_reaches("door.ledger\ndoor.planner\nself.door.window\n", WindowDoor) == [
        "2: reads planner of the door", "3: reads window of the door"]


def test_no_room_below_runtime_and_not_parallel_writes_into_a_guard():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if len(path.relative_to(PACKAGE).parts) > 1 and room_of(path) in CHECKED:
            found += [f"{path.relative_to(PACKAGE)}:{n}" for n in guard_writes(path.read_text())]
    assert found == []


def test_the_net_and_the_windows_take_a_door_not_the_guard():
    found = []
    for name, door in DOOR_MODULES.items():
        found += [f"{name}:{where}" for where in guard_reaches((PACKAGE / name).read_text(),
                                                                  door)]
    assert found == []


def test_the_doors_a_guard_builds_hold_its_parts_not_the_guard():
    model = build_model(model_config("tiny"), seed=0)
    guard = spikeguard.attach(model, budget="1GiB", policy="adaptive")
    try:
        for door in (guard.net.door, guard.window_door):
            held = {f.name: getattr(door, f.name) for f in dataclasses.fields(door)}
            assert not [k for k, v in held.items() if isinstance(v, Guard)]
            with pytest.raises(dataclasses.FrozenInstanceError):
                door.ledger = None   # nothing is set through a door
        assert guard.net.door.ledger is guard.ledger
        assert guard.window_door.tracker is guard.tracker
        # The built-in blocks' windows are bound to the door, not to the guard.
        runners = [b.expert_runner for b in guard.moe_blocks]
        assert runners and all(r.args == (guard.window_door,) for r in runners)
    finally:
        guard.detach()

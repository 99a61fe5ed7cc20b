"""The rooms of the package follow the data flow and their imports point one way: a room
may import the rooms before it in ROOMS, never one after it. Function-local imports count
(a lazy import is still a dependency). The package's facade (`spikeguard.attach`, which
registers the block adapters) counts as the top: only the rooms from train on use it."""

from __future__ import annotations

import ast
from pathlib import Path

import spikeguard

PACKAGE = Path(spikeguard.__file__).parent
ROOMS = ["errors", "extras", "names", "files", "model", "memory", "plan", "runtime", "parallel", "integrations",
         "routing", "data", "train", "sim", "bench", "cli", "__main__"]
FACADE_FROM = ROOMS.index("train")


def room_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else path.stem


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import of spikeguard in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "spikeguard" else \
                [f"spikeguard.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out += [(node.lineno, n) for n in names if n == "spikeguard" or n.startswith("spikeguard.")]
    return out


def upward_imports() -> list[str]:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent == PACKAGE and path.stem == "__init__":
            continue   # the facade
        room = room_of(path)
        assert room in ROOMS, f"{path.relative_to(PACKAGE)}: room {room!r} is not in ROOMS"
        mine = ROOMS.index(room)
        for line, module in imports_of(path):
            target = module.split(".")[1] if "." in module else ""
            where = f"{path.relative_to(PACKAGE)}:{line} imports {module}"
            if target in ROOMS:
                if ROOMS.index(target) > mine:
                    wrong.append(where)
            elif mine < FACADE_FROM:   # the facade or one of its names (attach, errors ...)
                wrong.append(where + " (the facade)")
    return wrong


def test_no_room_imports_a_later_room():
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check itself can fail: a runtime module importing integrations is caught."""
    fake = tmp_path / "spikeguard"
    (fake / "runtime").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "runtime" / "x.py").write_text(
        "def f():\n    from spikeguard.integrations import find_adapter\n")
    (fake / "plan").mkdir()
    (fake / "plan" / "y.py").write_text("import spikeguard.model.config\nfrom spikeguard import attach\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert upward_imports() == ["plan/y.py:2 imports spikeguard.attach (the facade)",
                                "runtime/x.py:2 imports spikeguard.integrations"]

"""Reading a run's settings: the TOML file, its sections, and the one place a setting's
type is checked (from the dataclasses' annotations), so that every section's
`__post_init__` may then compare and do arithmetic on what it gets. A TOML file can hold
any type anywhere; the command line gives argparse's (int, float, str, True).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Optional, Union

from spikeguard.errors import UsageError

def read_toml(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"--config {path} is a folder, not a TOML file")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"--config {path} does not exist") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise UsageError(f"--config {path} is not a config file (TOML): "
                         f"{str(err).splitlines()[0]}") from None


def check_sections(data: Any, sections: tuple[str, ...]) -> None:
    if not isinstance(data, dict):
        raise UsageError("a run configuration is a table of sections")
    unknown = set(data) - set(sections)
    if unknown:
        raise UsageError(f"unknown section(s) {', '.join(sorted(map(str, unknown)))}; the "
                         f"sections are {', '.join(sections)}")
    for section, values in data.items():
        if not isinstance(values, dict):
            raise UsageError(f"[{section}] must be a table of settings, got "
                             f"{type(values).__name__} {values!r:.40}")


_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
          dict: "a table", frozenset: "a list of step numbers or a string like '3,7'"}


def _fits(value: Any, hint: Any) -> bool:
    import typing

    if hint is Any:
        return True
    if typing.get_origin(hint) is Union:
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return is_real(value)
    if hint is frozenset:
        return isinstance(value, str) or (
            isinstance(value, (list, tuple, set, frozenset))
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value))
    return isinstance(value, typing.get_origin(hint) or hint)


def _describe(hint: Any) -> str:
    import typing

    if typing.get_origin(hint) is Union:
        parts = [_describe(h) for h in typing.get_args(hint) if h is not type(None)]
        return " or ".join(parts)
    return _KINDS.get(hint, getattr(hint, "__name__", str(hint)))


def check_types(kind: type, values: dict, section: str,
                described: Optional[dict[str, str]] = None) -> None:
    """UsageError naming the first setting of `values` whose type is not its field's;
    `described[name]` says what a setting must be where its annotation does not say it
    well (a path, a budget)."""
    import typing

    hints = typing.get_type_hints(kind)
    for name, value in values.items():
        hint = hints.get(name)
        if hint is None or name == "overrides":
            continue
        if not _fits(value, hint):
            what = (described or {}).get(name) or _describe(hint)
            raise UsageError(f"{section}.{name} must be {what}, got "
                             f"{type(value).__name__} {value!r:.40}")


def is_real(value: Any) -> bool:
    """An int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)

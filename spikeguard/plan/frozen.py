"""Frozen dataclasses that every decision builds, built at a plain dataclass's cost.

A frozen dataclass's generated `__init__` sets each field through `object.__setattr__`
(its own `__setattr__` refuses): on CPython 3.11 three to four times a plain dataclass's
time. The decision procedure (plan/decide.py) builds several per layer, WindowState with
its 17 fields twice where it evicts first; the simulator's adaptive walk of `1t` makes
~150k layer decisions per run (docs/simulator.md "## Speed").

`quick_init` gives such a class an `__init__` of the same signature that fills the
instance's `__dict__` in one update. Nothing else changes: setting or deleting a field
still raises FrozenInstanceError, and eq, hash, repr, `dataclasses.replace` and pickling
read the same attributes. Classes whose generated `__init__` does more than set fields
(a `__post_init__`, an init-only or keyword-only field, a default factory, slots) are
refused, so the shortcut cannot skip anything.

    @quick_init
    @dataclass(frozen=True)
    class Seen: ...
"""

from __future__ import annotations

import dataclasses


def quick_init(cls: type) -> type:
    """`cls` (a frozen dataclass) with an `__init__` that sets its fields at once."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen:
        raise TypeError(f"quick_init: {cls.__name__} is not a frozen dataclass")
    fields = dataclasses.fields(cls)
    if (hasattr(cls, "__post_init__") or "__slots__" in cls.__dict__
            or any(not f.init or f.kw_only or f.default_factory is not dataclasses.MISSING
                   for f in fields)):
        raise TypeError(f"quick_init: {cls.__name__}'s __init__ does more than set its "
                        f"fields; keep the generated one")
    defaults, args = {}, []
    for f in fields:
        if f.default is dataclasses.MISSING:
            args.append(f.name)
        else:
            defaults[f"_default_{f.name}"] = f.default
            args.append(f"{f.name}=_default_{f.name}")
    items = ", ".join(f"{f.name!r}: {f.name}" for f in fields)
    source = f"def __init__(self, {', '.join(args)}):\n    self.__dict__.update({{{items}}})\n"
    scope: dict = {}
    exec(source, defaults, scope)   # as dataclasses builds its own __init__
    init = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__annotations__ = dict(cls.__init__.__annotations__)
    cls.__init__ = init
    return cls

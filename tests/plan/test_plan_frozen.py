"""`quick_init` (spikeguard.plan.frozen): the same objects as the generated __init__ builds.

    .venv/bin/python -m pytest tests/plan/test_plan_frozen.py -q
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from spikeguard.plan.catalogue import POLICY_PLANS
from spikeguard.plan.decide import LayerDecision
from spikeguard.plan.frozen import quick_init
from spikeguard.plan.planner import Decision
from spikeguard.plan.room import EntryState, Room, Seen, WindowState


def _twin(cls: type) -> type:
    """The same frozen dataclass with the generated __init__ (not decorated)."""
    fields = [(f.name, f.type, dataclasses.field(default=f.default)
               if f.default is not dataclasses.MISSING else dataclasses.field())
              for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(cls.__name__, fields, frozen=True)


def _values(cls: type) -> list:
    """A distinct value per field (so a field set from another's argument shows)."""
    return [f"{f.name}-{i}" for i, f in enumerate(dataclasses.fields(cls))]


DECORATED = [Seen, WindowState, Room, EntryState, Decision, LayerDecision]


@pytest.mark.parametrize("cls", DECORATED, ids=lambda c: c.__name__)
def test_same_fields_as_the_generated_init(cls):
    twin = _twin(cls)
    fields = dataclasses.fields(cls)
    values = _values(cls)
    required = [f for f in fields if f.default is dataclasses.MISSING]
    calls = [
        (values, {}),                                                  # all positional
        ([], dict(zip([f.name for f in fields], values))),             # all by keyword
        (values[:len(required)], {}),                                  # defaults taken
        (values[:1], {f.name: v for f, v in zip(fields[1:], values[1:])}),
    ]
    for args, kwargs in calls:
        ours, theirs = cls(*args, **kwargs), twin(*args, **kwargs)
        assert vars(ours) == vars(theirs)
        assert dataclasses.astuple(ours) == dataclasses.astuple(theirs)
        assert ours == dataclasses.replace(ours) and hash(ours) == hash(dataclasses.replace(ours))
        assert pickle.loads(pickle.dumps(ours)) == ours
    with pytest.raises(TypeError):
        cls(*values, "one too many")
    if required:
        with pytest.raises(TypeError):
            cls(*values[:len(required) - 1])


@pytest.mark.parametrize("cls", DECORATED, ids=lambda c: c.__name__)
def test_still_frozen(cls):
    obj = cls(*_values(cls))
    name = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, name, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        delattr(obj, name)


def test_real_values():
    plan = POLICY_PLANS["none"]
    d = Decision(plan, 10, 0.5)
    assert (d.plan, d.device_bytes, d.added_s, d.evict_bytes) == (plan, 10, 0.5, 0)
    assert Seen().after(7, 40, 10) == Seen(7, 4.0, 0.7)


def test_refuses_what_it_would_skip():
    @dataclasses.dataclass
    class Plain:
        a: int

    @dataclasses.dataclass(frozen=True)
    class Post:
        a: int

        def __post_init__(self):
            pass

    @dataclasses.dataclass(frozen=True)
    class Factory:
        a: list = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class KwOnly:
        a: int

    @dataclasses.dataclass(frozen=True)
    class NoInit:
        a: int = dataclasses.field(default=0, init=False)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Slots:
        a: int

    for cls in (Plain, Post, Factory, KwOnly, NoInit, Slots):
        with pytest.raises(TypeError):
            quick_init(cls)

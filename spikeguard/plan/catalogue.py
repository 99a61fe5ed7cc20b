"""Operator catalogue of the MoE expert path: what each operator keeps for backward.

N = routed token copies on this process, D = model width, F = expert hidden width,
b = bytes per element. The expert path, stage by stage (spikeguard.model.experts):

    x_ND --gate_up--> h_N2F --silu(h[:, :F])--> s_NF --(* h[:, F:])--> a_NF --down--> y_ND

Each operator is named for the tensor it produces, and each of those tensors is kept for
backward by some later operator. Bytes are exact and linear in N, because the counts are
known after routing:

    op        tensor   bytes      who keeps it               actions
    dispatch  x_ND     N*D*b      gate_up (weight grad)      save, offload
    gate_up   h_N2F    N*2F*b     silu and mul (both halves) save, recompute, offload
    silu      s_NF     N*F*b      mul                        save, recompute, offload
    act       a_NF     N*F*b      down (weight grad)         save, recompute, offload
    down      y_ND     N*D*b      combine (weighting)        save, offload
    combine   yw_ND,w_N N*(D*b+b) combine (weighted rows,    save (always kept)
                                  weights)

The operators are declared once, in `OPERATORS` below (name, tensor, the stage inputs,
the actions allowed, the elements per copy, the work a rate-based cost reads); every table
of operators the package reads is derived from them (`derived_tables`), and the model's
stage functions are checked against them (tests/plan/test_plan_operators.py).

`combine`'s weighted rows are kept by torch's `index_add` backward (torch 2.13 saves
its source), so they are counted although only their shape is read. Combine's int64 index
is not: dispatch's gather already keeps it, so it is in use before the decision window.

`dispatch` is never recomputed: under expert parallelism it is an all-to-all output, and
recomputing it would repeat a collective. `down` is not recomputed: that would put the
combine inside the recomputed region.

RECOMPUTE is applied with selective activation checkpointing over the smallest region
that contains the recomputed tensors and their consumers. A tensor inside such a region
that is not recomputed is cached by SAC on the device, so it can only be SAVE there:
that is the one structural constraint `region_of` and `valid_plans` enforce.
"""

from __future__ import annotations

import enum
import functools
import itertools
from dataclasses import dataclass
from typing import Callable, Optional


class Action(enum.Enum):
    SAVE = "save"
    RECOMPUTE = "recompute"
    OFFLOAD = "offload"


@dataclass(frozen=True)
class Operator:
    """One operator of the expert path, declared once: every table of operators in the
    package (the plan menu, the bytes, the executor's stage inputs, the cost model's
    rates, the simulator's storages, the hookless attribution) is derived from these
    declarations or checked against them (tests/plan/test_plan_operators.py)."""

    name: str
    tensor: str                  # the tensor it produces, shape letters as in the table
    inputs: tuple[str, ...]      # operators whose tensors its stage reads (dispatch: none,
                                 # its rows are made before the expert path)
    allowed: tuple[Action, ...]  # what a plan may do with its tensor
    elements: Callable[[int, int], int]   # its tensor's elements per routed copy, of (D, F)
    # The stage's work per routed copy for a rate-based cost (the simulator): GEMM FLOPs
    # (2 per multiply-add) or, element-wise, the elements it reads and writes.
    flops: Optional[Callable[[int, int], int]] = None
    traffic: Optional[Callable[[int, int], int]] = None

    @property
    def is_stage(self) -> bool:
        """Computed inside the expert path (dispatch's rows come from outside it)."""
        return bool(self.inputs)


OPERATORS = (
    Operator("dispatch", "x_ND", (), (Action.SAVE, Action.OFFLOAD), lambda D, F: D),
    Operator("gate_up", "h_N2F", ("dispatch",), tuple(Action), lambda D, F: 2 * F,
             flops=lambda D, F: 4 * D * F),
    Operator("silu", "s_NF", ("gate_up",), tuple(Action), lambda D, F: F,
             traffic=lambda D, F: 2 * F),                       # reads F, writes F
    Operator("act", "a_NF", ("silu", "gate_up"), tuple(Action), lambda D, F: F,
             traffic=lambda D, F: 3 * F),                       # reads 2F, writes F
    # Not recomputed: that would put combine, which reads it, inside the region.
    Operator("down", "y_ND", ("act",), (Action.SAVE, Action.OFFLOAD), lambda D, F: D,
             flops=lambda D, F: 2 * F * D),
)


def derived_tables(operators=OPERATORS) -> dict:
    """The operator tables the package reads, from the declarations (a function of them,
    so a test can add an operator and see where it appears)."""
    names = tuple(op.name for op in operators)
    return {"OPS": names,
            "EXPERT_STAGES": tuple(op.name for op in operators if op.is_stage),
            "STAGE_INPUTS": {op.name: op.inputs for op in operators if op.is_stage},
            "CONSUMERS": {n: tuple(op.name for op in operators if n in op.inputs)
                          for n in names},
            "ALLOWED": {op.name: op.allowed for op in operators}}


_TABLES = derived_tables()
# Stages in execution order and the ops whose tensors they consume (for region building).
OPS: tuple[str, ...] = _TABLES["OPS"]
EXPERT_STAGES: tuple[str, ...] = _TABLES["EXPERT_STAGES"]
STAGE_INPUTS: dict[str, tuple[str, ...]] = _TABLES["STAGE_INPUTS"]
CONSUMERS: dict[str, tuple[str, ...]] = _TABLES["CONSUMERS"]
ALLOWED: dict[str, tuple[Action, ...]] = _TABLES["ALLOWED"]
OPERATOR = {op.name: op for op in OPERATORS}


@dataclass(frozen=True)
class ExpertShape:
    """What the byte arithmetic needs: widths and element sizes."""

    d_model: int
    d_expert: int
    elem_bytes: int = 4
    weight_bytes: int = 4
    # Expert parallelism: `down`'s output goes back through an all-to-all before combine,
    # so what combine keeps is sized by the tokens this rank sent (T*K), not by the routed
    # copies its experts received; the forecast reserves it per token instead, and `down`
    # keeps nothing itself (its output is consumed by the gather before the exchange).
    # What combine does keep per received row is the int64 index of that gather
    # (index_select saves its index for backward).
    combine_after_exchange: bool = False
    index_bytes: int = 8

    def bytes_per_token(self) -> dict[str, int]:
        """Bytes kept per routed token copy, per operator (the slope of the linear model),
        and combine's, which is always kept. A new dict each call (the caller may change
        it), copied from one worked out once per shape (read at every layer's decision)."""
        return dict(self._per_token)

    @functools.cached_property
    def _per_token(self) -> dict[str, int]:
        D, F, b = self.d_model, self.d_expert, self.elem_bytes
        per = {op.name: op.elements(D, F) * b for op in OPERATORS}
        if self.combine_after_exchange:
            per["down"], combine = 0, self.index_bytes
        else:
            combine = D * b + self.weight_bytes
        return {**per, "combine": combine}

    def predict(self, num_routed: int) -> dict[str, int]:
        """Exact bytes each operator keeps for `num_routed` token copies, all saved."""
        return {op: num_routed * per for op, per in self._per_token.items()}


@dataclass(frozen=True)
class LayerPlan:
    """An action per operator of one MoE layer's expert path."""

    actions: tuple[Action, ...]   # aligned with OPS

    @staticmethod
    def of(**by_op: Action) -> "LayerPlan":
        return LayerPlan(tuple(by_op.get(op, Action.SAVE) for op in OPS))

    def action(self, op: str) -> Action:
        return self.actions[OPS.index(op)]

    def as_dict(self) -> dict[str, Action]:
        return dict(zip(OPS, self.actions))

    def recomputed(self) -> tuple[str, ...]:
        return tuple(op for op, a in zip(OPS, self.actions) if a is Action.RECOMPUTE)

    def region(self) -> tuple[str, ...]:
        return region_of(self.recomputed())

    def describe(self) -> str:
        return " ".join(f"{op}={a.value[:3]}" for op, a in zip(OPS, self.actions))


def region_of(recomputed: tuple[str, ...]) -> tuple[str, ...]:
    """Stages that must run under one checkpoint so the `recomputed` tensors can be dropped:
    from the first producer to the last consumer (empty when nothing is recomputed)."""
    if not recomputed:
        return ()
    stages = set(recomputed) | {c for op in recomputed for c in CONSUMERS[op]}
    idx = [EXPERT_STAGES.index(s) for s in stages]
    return EXPERT_STAGES[min(idx): max(idx) + 1]


def is_valid(plan: LayerPlan) -> bool:
    """Allowed actions per op, and only SAVE for non-recomputed tensors inside the region."""
    by_op = plan.as_dict()
    if any(a not in ALLOWED[op] for op, a in by_op.items()):
        return False
    region = plan.region()
    # Tensors produced inside the region (not its last stage, whose output leaves it).
    inner = region[:-1]
    return all(by_op[op] is not Action.OFFLOAD for op in inner)


def valid_plans() -> list[LayerPlan]:
    """Every valid plan of one layer (a few dozen): the planner's menu. A fresh list of
    the same (frozen) plan objects at every call, so that what is remembered per plan
    object is shared by every planner: the simulator's 16 stages x 7 policies of walkers
    on `1t` each had their own menu, and each worked out the same layer figures again."""
    return list(_valid_plans())


@functools.cache
def _valid_plans() -> tuple[LayerPlan, ...]:
    menu = []
    for actions in itertools.product(*(ALLOWED[op] for op in OPS)):
        plan = LayerPlan(tuple(actions))
        if is_valid(plan):
            menu.append(plan)
    return tuple(menu)


ALL_SAVE = LayerPlan.of()
EXPERTS_RECOMPUTE = LayerPlan.of(gate_up=Action.RECOMPUTE, silu=Action.RECOMPUTE,
                                 act=Action.RECOMPUTE)
ALL_OFFLOAD = LayerPlan(tuple(Action.OFFLOAD for _ in OPS))

# The static policies' plan for every layer, the one table the runtime and the simulator
# read. "full" recomputes each layer whole (its expert path runs inside the recompute as
# in the plain layer: saved, then freed); "ceiling" is the simulator's unlimited device.
POLICY_PLANS = {"ceiling": ALL_SAVE, "none": ALL_SAVE, "full": ALL_SAVE,
                "experts": EXPERTS_RECOMPUTE, "offload": ALL_OFFLOAD}

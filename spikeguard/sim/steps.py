"""One policy's steps: every distinct step walked once, every repeat of it looked up.

A step's figures (the slowest stage's busy time, crash, peaks, decisions) are a pure
function of its loads (one per load group, with how many ranks have each) and of the
state each (stage, load group) carries into it (`walk.StepState`). A 1,000-step run at
12,288 devices has a few hundred distinct steps per policy: on CUDA the state is the
same from the second step on, and the loads are rounded (`workload.load_resolution`).
So each distinct step is summed over its stages and groups once (`StepFigures`), and the
engine's loop over steps is a dictionary lookup per policy and step, not a loop over
stages and groups hashing every state (that loop, and the hashing, were 2-3 s of a 1t
run's 7 policies).

States are interned to small integers (`StateIds`): a state is hashed once, when a walk
returns it, never again per step. The figures are those the engine summed before, added
in the same order (stages, then groups), so they are the same bit for bit.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from spikeguard.extras import require

np = require("numpy", "sim", "spikeguard simulate")   # the `sim` extra


@dataclass(frozen=True, eq=False)
class StepFigures:
    """One distinct step of one policy, over every stage and load group (hashed by
    identity: `PolicySteps.uses` counts each one's steps)."""

    slowest_s: float           # the slowest stage's busy time (the slowest rank of it)
    crashed: bool
    peak: int                  # the worst device's peak
    peak_by_stage: tuple       # each stage's worst device (0: no group)
    decisions: Counter         # every rank's, in the engine's order (stages, then groups)
    states: tuple              # the state id each (stage, group) carries out, in order


class StateIds:
    """StepState <-> a small integer, so that a state is hashed once per walk."""

    def __init__(self):
        self.states: list = []
        self._ids: dict = {}

    def of(self, state) -> int:
        sid = self._ids.get(state)
        if sid is None:
            sid = self._ids[state] = len(self.states)
            self.states.append(state)
        return sid


def load_key(load, stage) -> object:
    """What a stage's walk depends on of a load: an int, or the stage's layers' counts."""
    if isinstance(load, (int, np.integer)):
        return int(load)
    layers = [x for chunk in stage.chunks for x in chunk]
    return load[:, layers].tobytes()


class PolicySteps:
    """The walks and distinct steps of one policy, over the stages of the run."""

    def __init__(self, stages: list, walkers: list):
        self.stages, self.walkers = stages, walkers
        self.ids = StateIds()
        self.walks: dict = {}       # (stage, load key, state id) -> WalkResult
        self.figures: dict = {}     # (loads, ranks, state ids) -> StepFigures
        self.carried: dict = {}     # (stage, group) -> state id
        self.uses: dict = {}        # StepFigures -> steps that had it, in order of first use

    def step(self, groups: list) -> StepFigures:
        """The figures of the next step, whose load groups are `groups` [(load, ranks)]."""
        pairs = [(st.stage, g) for st in self.stages for g in range(len(groups))]
        carried = tuple(self.carried.get(pair, -1) for pair in pairs)
        key = (tuple(_step_load(load) for load, _ in groups),
               tuple(n for _, n in groups), carried)
        figures = self.figures.get(key)
        if figures is None:
            figures = self.figures[key] = self._walk_step(groups, carried)
        self.carried.update(zip(pairs, figures.states))
        self.uses[figures] = self.uses.get(figures, 0) + 1
        return figures

    def _walk_step(self, groups: list, carried: tuple) -> StepFigures:
        """The engine's sum over stages and groups, as it always did it."""
        busy, crashed, peak, by_stage, decisions, out = [], False, 0, [], Counter(), []
        it = iter(carried)
        for st, walker in zip(self.stages, self.walkers):
            worst, stage_peak = 0.0, 0
            for load, num_ranks in groups:
                sid = next(it)
                if sid < 0:
                    sid = self.ids.of(walker.initial_state())
                key = (st.stage, load_key(load, st), sid)
                res = self.walks.get(key)
                if res is None:
                    res = self.walks[key] = walker.walk(load, self.ids.states[sid])
                out.append(self.ids.of(res.state))
                worst = max(worst, res.seconds)
                crashed |= res.crashed
                peak = max(peak, res.peak_bytes)
                stage_peak = max(stage_peak, res.peak_bytes)
                decisions.update({k: v * num_ranks for k, v in res.decisions.items()})
            busy.append(worst)
            by_stage.append(stage_peak)
        return StepFigures(max(busy), bool(crashed), peak, tuple(by_stage), decisions,
                           tuple(out))

    def total_decisions(self) -> Counter:
        """Every step's decisions added up, keys in the order they first appeared."""
        total: Counter = Counter()
        for figures, n in self.uses.items():
            total.update({k: v * n for k, v in figures.decisions.items()})
        return total


def _step_load(load) -> object:
    if isinstance(load, (int, np.integer)):
        return int(load)
    return (load.shape, load.dtype.str, load.tobytes())

"""Routing-skew injection: production-like load spikes on demand, for benchmarks and tests.

    .venv/bin/python -m spikeguard.routing.skew --steps 2000 --ep-size 4

T = tokens in the micro-batch, E = experts, K = top-k, R = expert-parallel ranks (ep_size),
H = experts per rank (E / R), J = min(K, H) hot copies a token can give at most.

Why: a freshly built (or well balanced) model almost never spikes, but the memory guard
exists for the iterations that do (DESIGN.md: 97.1% of iterations under 1.2x max/mean
load, 2.9% up to 2.6x). `SkewSchedule` says, for every step, whether it is a spike, which
rank is hot and what max/mean tokens-per-rank ratio to reach; `SkewInjector` makes the
routers of a model reach it by setting their selection-only `expert_bias_E`.

The bias is +b on the hot rank's experts and 0 elsewhere (on top of the router's own
bias; ranks that are heavier than the target by nature also get a negative one, see
SkewInjector). It only changes which experts are picked, never the combine weights (TopKRouter
takes them from the unbiased scores), so gradients stay well defined and the model code
is untouched. b is the exact solution of the monotone search "hot copies as a function of
b": for each token the j-th hot expert displaces the (K-j+1)-th cold one once b exceeds
their score gap, so the hot copy count is the number of such gaps below b. Sorting the
T*J gaps gives every reachable count at once: one sort and a host sync or two per layer
(a balanced router), instead of the ~30 top-k calls and syncs of a bisection over b, with
the same answer (tests/bench/test_bench_skew.py checks every count is reached exactly).

Expert parallelism: rank r owns experts [r*H, (r+1)*H). The schedule is a pure function of
(seed, step), so every rank computes the same target without communication, and each rank
steers its own tokens to the same share, so the hot rank also receives that share of the
all-to-all. One process simulates R ranks by expert groups: only the router and R are
needed.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from spikeguard.errors import UsageError
from spikeguard.model.moe import MoEBlock
from spikeguard.model.router import Routing, TopKRouter
from spikeguard.names import PATTERNS  # re-exported: the skew patterns' names


@dataclass(kw_only=True)
class SkewConfig:
    """When spikes come, how large they are and which rank they hit.

    Patterns:
      production    each step independently a spike with `spike_probability`, on a random rank;
      one-hot-rank  as production, but always on `hot_rank`;
      rotating      one spike per window of round(1/p) steps, at a random step of the window;
                    the hot rank advances by one each spike, starting at `hot_rank`;
      burst         one run of `burst_length` consecutive spike steps per window of
                    round(burst_length/p) steps, at a random offset, on a random rank.
    rotating and burst place spikes in windows so that `target(step)` stays O(1) for any
    step (counting earlier i.i.d. spikes would be O(step)); their spike fraction is
    1/window resp. burst_length/window, p up to rounding, and runs never touch.
    """

    seed: int = 0
    spike_probability: float = 0.029
    calm_max_ratio: float = 1.2    # calm steps draw a ratio uniform in [1, calm_max_ratio)
    spike_min_ratio: float = 1.2   # spike steps draw a ratio uniform in [min, max]
    spike_max_ratio: float = 2.6
    pattern: str = "production"
    hot_rank: int = 0
    burst_length: int = 4

    def __post_init__(self) -> None:
        for name in ("seed", "hot_rank", "burst_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise UsageError(f"skew.{name} must be an integer, got {value!r}")
        if self.hot_rank < 0:
            raise UsageError(f"skew.hot_rank must be >= 0, got {self.hot_rank}")
        if self.burst_length < 1:
            raise UsageError(f"skew.burst_length must be >= 1, got {self.burst_length}")
        for name in ("spike_probability", "calm_max_ratio", "spike_min_ratio", "spike_max_ratio"):
            value = getattr(self, name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not math.isfinite(value)):
                raise UsageError(f"skew.{name} must be a finite number, got {value!r}")
        if not 0.0 <= self.spike_probability <= 1.0:
            raise UsageError(f"skew.spike_probability must be in [0, 1], got {self.spike_probability}")
        if self.calm_max_ratio <= 1.0:
            raise UsageError(f"skew.calm_max_ratio must be > 1 (max/mean is at least 1), "
                             f"got {self.calm_max_ratio}")
        if self.spike_min_ratio < self.calm_max_ratio:
            raise UsageError(f"skew.spike_min_ratio ({self.spike_min_ratio}) must be >= "
                             f"calm_max_ratio ({self.calm_max_ratio}), or spikes look calm")
        if self.spike_max_ratio < self.spike_min_ratio:
            raise UsageError(f"skew.spike_max_ratio ({self.spike_max_ratio}) must be >= "
                             f"spike_min_ratio ({self.spike_min_ratio})")
        if self.pattern not in PATTERNS:
            raise UsageError(f"unknown skew.pattern {self.pattern!r}; choose one of "
                             f"{', '.join(PATTERNS)}")
        if self.pattern in ("rotating", "burst"):
            run = 1 if self.pattern == "rotating" else self.burst_length
            if self.spike_probability <= 0 or round(run / self.spike_probability) < run + 1:
                raise UsageError(
                    f"skew.spike_probability {self.spike_probability} does not fit pattern "
                    f"{self.pattern!r}: it needs a window of at least {run + 1} steps per run "
                    f"of {run}, i.e. 0 < p <= {run / (run + 1):.3f}")

    def to_dict(self) -> dict:
        return asdict(self)


class SkewSchedule:
    """The per-step target, a pure function of (config.seed, step): O(1), any order."""

    def __init__(self, config: SkewConfig, ep_size: int):
        if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 2:
            raise UsageError(f"ep_size must be an integer >= 2 (one rank cannot be skewed), "
                             f"got {ep_size!r}")
        if config.spike_max_ratio > ep_size:
            raise UsageError(f"skew.spike_max_ratio {config.spike_max_ratio} is unreachable with "
                             f"ep_size {ep_size}: max/mean over {ep_size} ranks is at most {ep_size}")
        if config.hot_rank >= ep_size:
            raise UsageError(f"skew.hot_rank {config.hot_rank} must be < ep_size {ep_size}")
        self.config = config
        self.ep_size = ep_size
        run = config.burst_length if config.pattern == "burst" else 1
        self._run_length = run
        windowed = config.pattern in ("rotating", "burst")
        self._window = round(run / config.spike_probability) if windowed else 0

    def _rng(self, kind: str, index: int) -> random.Random:
        # String seeds go through SHA-512 in CPython's random (version 2 seeding): stable
        # across processes and PYTHONHASHSEED, and neighbouring steps are uncorrelated.
        return random.Random(f"spikeguard.skew:{kind}:{self.config.seed}:{index}")

    def draw(self, step: int) -> tuple[bool, int, float]:
        """(spike?, hot rank, max/mean ratio) of `step`: a pure function of the seed and
        the step, so every rank and a resumed run draw the same."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise UsageError(f"step must be a non-negative integer, got {step!r}")
        cfg = self.config
        rng = self._rng("step", step)
        u_spike, u_rank, u_ratio = rng.random(), rng.random(), rng.random()
        if cfg.pattern in ("production", "one-hot-rank"):
            spike = u_spike < cfg.spike_probability
            hot = cfg.hot_rank if cfg.pattern == "one-hot-rank" else int(u_rank * self.ep_size)
        else:
            window, pos = divmod(step, self._window)
            wrng = self._rng("window", window)
            offset = wrng.randrange(self._window - self._run_length)  # last step stays calm
            spike = offset <= pos < offset + self._run_length
            if cfg.pattern == "rotating":
                hot = (cfg.hot_rank + window) % self.ep_size
            else:
                hot = wrng.randrange(self.ep_size)
        if spike:
            ratio = cfg.spike_min_ratio + (cfg.spike_max_ratio - cfg.spike_min_ratio) * u_ratio
        else:
            ratio = 1.0 + (cfg.calm_max_ratio - 1.0) * u_ratio
        return spike, hot, ratio

    def target(self, step: int) -> tuple[int, float]:
        """(hot_rank, max/mean tokens-per-rank ratio) for `step`.

        On calm steps hot_rank is the rank the pattern would use; the injector ignores it.
        """
        _, hot, ratio = self.draw(step)
        return hot, ratio

    def is_spike(self, step: int) -> bool:
        return self.draw(step)[0]


def rank_ratio(topk_idx_TK: torch.Tensor, num_experts: int, ep_size: int) -> float:
    """max/mean routed token copies per rank (rank r owns a contiguous block of experts)."""
    counts_R = torch.bincount(topk_idx_TK.reshape(-1) // (num_experts // ep_size), minlength=ep_size)
    return counts_R.max().item() * ep_size / max(topk_idx_TK.numel(), 1)


def bias_for_hot_copies(eff_TE: torch.Tensor, hot: slice, top_k: int, target_copies: int) -> float:
    """The b that makes top-k of eff_TE + b*[hot] pick as close to target_copies hot copies as
    possible (exact, no search). eff_TE = scores plus the router's own bias."""
    hot_TH = eff_TE[:, hot]
    cold_TC = torch.cat([eff_TE[:, :hot.start], eff_TE[:, hot.stop:]], dim=1)
    num_tokens, num_hot = hot_TH.shape
    j_max = min(top_k, num_hot)
    hot_TJ = hot_TH.sort(dim=1, descending=True).values[:, :j_max]
    cold_TC = cold_TC.sort(dim=1, descending=True).values
    if cold_TC.shape[1] < top_k:  # too few cold experts: some hot picks are forced
        pad = cold_TC.new_full((num_tokens, top_k - cold_TC.shape[1]), -math.inf)
        cold_TC = torch.cat([cold_TC, pad], dim=1)
    # the j-th best hot expert (j = 1..J) is picked iff b > (the (K-j+1)-th best cold) - h_j
    gap_TJ = cold_TC[:, [top_k - j for j in range(1, j_max + 1)]] - hot_TJ
    gaps = gap_TJ.reshape(-1).sort().values.double().cpu()
    forced = int(torch.isneginf(gaps).sum())
    want = min(max(int(target_copies), forced), gaps.numel())
    if 0 < want < gaps.numel() and gaps[want - 1] == gaps[want]:
        # tied gaps move together: take the reachable count nearest the target
        tie = gaps[want]
        below = int(torch.searchsorted(gaps, tie, right=False))
        upto = int(torch.searchsorted(gaps, tie, right=True))
        want = below if want - below <= upto - want else upto
    lower = gaps[want - 1].item() if want > 0 else -math.inf
    upper = gaps[want].item() if want < gaps.numel() else math.inf
    if math.isinf(lower) and math.isinf(upper):
        return 0.0
    if math.isinf(lower):
        return upper - 1.0
    if math.isinf(upper):
        return lower + 1.0
    return 0.5 * (lower + upper)


class SkewInjector:
    """Steers every TopKRouter of a model to the schedule's target for the current step.

    Spike steps set the hot rank to the drawn ratio (b of either sign). Calm steps keep the
    natural routing (bias untouched, so bit-identical to no injector) when its ratio is
    already under calm_max_ratio; otherwise the ranks above the drawn calm ratio are pulled
    down to it (negative b), capped so that rounding stays under calm_max_ratio. On either
    kind of step a rank other than the hot one that is above the target by nature is pulled
    down too; a balanced router needs none of that. The bias is recomputed from the input
    at every router call (micro-batches, recompute in backward) and the router's own bias is
    put back right after the call, so the buffer holds the injected bias only inside it.
    `last_ratios` is measured on the routing the router really returned.

    `spike_from_layer` L: a spike step spikes the layers from L on only; the layers before
    it route as on a calm step (a spike that starts mid-depth, which the guard's per-layer
    routed history cannot foresee: runtime/routed_history.py). A router's layer is its
    MoEBlock's `layer_idx` (a pipeline stage's routers keep their global layer).
    """

    def __init__(self, schedule: SkewSchedule, ep_size: int, spike_from_layer: int = 0):
        if ep_size != schedule.ep_size:
            raise UsageError(f"ep_size {ep_size} differs from the schedule's {schedule.ep_size}")
        if not isinstance(spike_from_layer, int) or isinstance(spike_from_layer, bool) \
                or spike_from_layer < 0:
            raise UsageError(f"spike_from_layer must be an integer >= 0, got {spike_from_layer!r}")
        self.schedule = schedule
        self.ep_size = ep_size
        self.spike_from_layer = spike_from_layer
        self._layers: list[int] = []   # each router's layer, in model order
        self._routers: list[TopKRouter] = []
        self._handles: list = []
        self._pending: dict[int, torch.Tensor] = {}  # router index -> its own bias, mid-forward
        self._target: Optional[tuple[bool, int, float]] = None
        self._ratios: dict[int, float] = {}

    @property
    def last_ratios(self) -> list[float]:
        """Achieved max/mean tokens-per-rank of each router's last forward, in model order."""
        return [self._ratios[i] for i in sorted(self._ratios)]

    def set_step(self, step: int) -> None:
        self._target = self.schedule.draw(step)

    def hold(self, ratio: float, hot_rank: int = 0) -> None:
        """Steer `hot_rank` to exactly `ratio` until the next set_step (e.g. the calm
        maximum, to measure what the worst calm step needs)."""
        if not 1.0 <= ratio <= self.ep_size or not 0 <= hot_rank < self.ep_size:
            raise UsageError(f"hold needs 1 <= ratio <= {self.ep_size} and a rank below "
                             f"{self.ep_size}, got {ratio!r} on rank {hot_rank!r}")
        self._target = (True, hot_rank, float(ratio))

    def attach(self, model) -> "SkewInjector":
        """Hook the routers of `model` (one model, or a pipeline rank's stage modules)."""
        if self._routers:
            raise UsageError("this SkewInjector is already attached; detach() first")
        modules = [model] if isinstance(model, nn.Module) else list(model)
        routers = [m for module in modules for m in module.modules() if isinstance(m, TopKRouter)]
        if not routers:
            raise UsageError("the model has no TopKRouter to inject skew into")
        layer_of = {id(m.router): m.layer_idx for module in modules for m in module.modules()
                    if isinstance(m, MoEBlock)}
        layers = [layer_of.get(id(r), i) for i, r in enumerate(routers)]
        cfg = self.schedule.config
        for router in routers:
            num_experts = router.gate.out_features
            if num_experts % self.ep_size:
                raise UsageError(f"{num_experts} experts cannot be split over ep_size {self.ep_size}")
            reachable = self.ep_size * min(router.top_k, num_experts // self.ep_size) / router.top_k
            if cfg.spike_max_ratio > reachable + 1e-9:
                raise UsageError(
                    f"skew.spike_max_ratio {cfg.spike_max_ratio} is unreachable: with top_k "
                    f"{router.top_k} and {num_experts // self.ep_size} experts per rank the hot "
                    f"rank takes at most ratio {reachable:g}")
        for i, router in enumerate(routers):
            self._handles.append(router.register_forward_pre_hook(self._pre_hook(i)))
            self._handles.append(router.register_forward_hook(self._post_hook(i)))
        self._routers, self._layers = routers, layers
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        for i, own_E in self._pending.items():  # a forward that raised mid-router
            with torch.no_grad():
                self._routers[i].expert_bias_E.copy_(own_E)
        self._handles, self._routers, self._pending, self._layers = [], [], {}, []

    def _pre_hook(self, i: int):
        def hook(router: TopKRouter, args) -> None:
            if self._target is None:
                raise UsageError("call SkewInjector.set_step(step) before the forward")
            with torch.no_grad():
                if i in self._pending:  # the previous forward raised before the post-hook
                    router.expert_bias_E.copy_(self._pending.pop(i))
                own_E = router.expert_bias_E.clone()
                self._pending[i] = own_E
                delta_E = self._bias(router, args[0], own_E, self._layers[i])
                if delta_E is not None:
                    router.expert_bias_E.add_(delta_E)
        return hook

    def _post_hook(self, i: int):
        def hook(router: TopKRouter, args, routing: Routing) -> None:
            with torch.no_grad():
                router.expert_bias_E.copy_(self._pending.pop(i))
            self._ratios[i] = rank_ratio(routing.topk_idx_TK, router.gate.out_features, self.ep_size)
        return hook

    def _bias(self, router: TopKRouter, x_TD: torch.Tensor, own_E: torch.Tensor,
              layer: int) -> Optional[torch.Tensor]:
        """The bias to add for the current target, or None to keep the natural routing."""
        spike, hot_rank, ratio = self._target
        if spike and layer < self.spike_from_layer:   # the spike starts later: calm here
            spike, ratio = False, self.schedule.config.calm_max_ratio
        num_experts, k, num_ranks = router.gate.out_features, router.top_k, self.ep_size
        per_rank = num_experts // num_ranks
        # same arithmetic as TopKRouter.forward; F.linear skips hooks on the gate
        scores_TE = torch.softmax(F.linear(x_TD, router.gate.weight, router.gate.bias).float(), dim=-1)
        eff_TE = scores_TE + own_E
        num_copies = x_TD.shape[0] * k
        counts_R = _copies_per_rank(eff_TE, k, per_rank, num_ranks)
        cap = round(ratio * num_copies / num_ranks)
        if not spike:
            calm_max = self.schedule.config.calm_max_ratio
            if max(counts_R) * num_ranks < calm_max * num_copies:
                return None
            hot_rank = None
            cap = min(cap, math.ceil(calm_max * num_copies / num_ranks) - 1)  # stay calm after rounding
        delta_R = [0.0] * num_ranks

        def per_expert(values_R: list[float]) -> torch.Tensor:
            return torch.tensor(values_R, dtype=own_E.dtype, device=own_E.device).repeat_interleave(per_rank)

        def solve(rank: int) -> None:
            delta_R[rank] = 0.0
            hot = slice(rank * per_rank, (rank + 1) * per_rank)
            delta_R[rank] = bias_for_hot_copies(eff_TE + per_expert(delta_R), hot, k, cap)

        def recount() -> list[int]:
            return _copies_per_rank(eff_TE + per_expert(delta_R), k, per_rank, num_ranks)

        # Coordinate passes: set the hot rank to exactly `cap` copies, then pull any other
        # rank that is above `cap` down to it. With a balanced router (the production case)
        # the first pass ends with +b on the hot rank and 0 elsewhere; the pull-downs are
        # for routers that are skewed by nature (an untrained model: 1.4-1.5x at ep 4),
        # where a lone hot-rank bias would leave calm steps at up to 1.47x.
        for _ in range(4 * num_ranks):
            if hot_rank is not None and counts_R[hot_rank] != cap:
                solve(hot_rank)
                counts_R = recount()
            over = [r for r in range(num_ranks) if r != hot_rank and counts_R[r] > cap]
            if not over:
                break
            solve(max(over, key=lambda r: counts_R[r]))
            counts_R = recount()
        return per_expert(delta_R)


def _copies_per_rank(eff_TE: torch.Tensor, top_k: int, per_rank: int, num_ranks: int) -> list[int]:
    idx_TK = torch.topk(eff_TE, top_k, dim=-1).indices
    return torch.bincount(idx_TK.reshape(-1) // per_rank, minlength=num_ranks).tolist()


def _main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--ep-size", type=int, default=4)
    parser.add_argument("--pattern", default="production", choices=PATTERNS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    schedule = SkewSchedule(SkewConfig(seed=args.seed, pattern=args.pattern), args.ep_size)
    spikes = [s for s in range(args.steps) if schedule.is_spike(s)]
    print(f"{len(spikes)} spikes in {args.steps} steps ({len(spikes) / args.steps:.2%})")
    for s in spikes[:20]:
        hot, ratio = schedule.target(s)
        print(f"step {s:6d} | hot rank {hot} | ratio {ratio:.2f}x")


if __name__ == "__main__":
    _main()

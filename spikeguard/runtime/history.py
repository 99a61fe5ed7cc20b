"""Step records: what `guard.history` holds, one dict per `guard.step()`.

Decisions are counted per micro-batch attempt and merged into the step only when the
attempt completes, so a micro-batch the safety net re-ran counts what really ran.
"""

from __future__ import annotations

import time
from collections import Counter

from spikeguard.model.dispatch import expert_imbalance

ACTIONS = ("save", "recompute", "offload")


class StepRecorder:
    """Counters of the step in progress; `finish` turns them into the history record."""

    def __init__(self, offloaded_bytes_before: int):
        self.start = time.perf_counter()
        self.micro_batches = 0
        self.decisions: Counter = Counter()
        self.attempt: Counter = Counter()
        self.imbalance: dict[int, float] = {}
        self.received: dict[int, int] = {}   # layer -> most routed copies of a micro-batch
        self.safety_net_reruns = 0
        self.full_layers = 0   # layers the adaptive guard recomputed whole, decided at entry
        self.hookless_layers = 0   # expert paths run with no saved-tensor hook (hookless.py)
        self.hookless_ends = 0   # embeddings and heads run with none (hookless_ends.py)
        self.calm_forwards = 0   # forwards run as the plain model's (calm_forward.py)
        self.calm_left = 0   # ... that left calm at a layer beyond their proof's walk
        self.evicted_bytes = 0
        self.prefetched_bytes = 0   # of the evicted: brought back to the device for backward
        self.plan_us: list[float] = []
        self.offloaded_bytes_before = offloaded_bytes_before
        self.peak_bytes = 0       # the device's true peak over the step's attempts that stood
        self.peak_where = 0
        self.attempts_peak_bytes = 0   # ... and over every attempt, the abandoned included
        self.reruns: list[dict] = []   # step-level re-runs: scope and reason
        self.rerun_lines: list[str] = []   # their warnings, said once the step went through

    def note_peak(self, peak_bytes: int, where: int) -> None:
        if peak_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_where = int(peak_bytes), where
        self.note_attempt_peak(peak_bytes, where)

    def note_attempt_peak(self, peak_bytes: int, where: int) -> None:
        """The figure of an attempt about to be abandoned (before the device's peak is
        reset for its re-run): the step's true peak includes it."""
        self.attempts_peak_bytes = max(self.attempts_peak_bytes, int(peak_bytes))

    def restart(self, scope: str, reason: str) -> None:
        """The step is abandoned and runs again from its start: what it counted goes, except
        the re-runs themselves and the time (the failed attempt's time was spent)."""
        self.micro_batches = 0
        self.decisions = Counter()
        self.imbalance = {}
        self.received = {}
        self.full_layers = 0
        self.hookless_layers = 0
        self.hookless_ends = 0
        self.calm_forwards = 0
        self.calm_left = 0
        self.evicted_bytes = 0
        self.prefetched_bytes = 0
        self.peak_bytes, self.peak_where = 0, 0
        self.safety_net_reruns += 1
        self.reruns.append({"scope": scope, "reason": reason})

    def note_reload(self, num_bytes: int, where: tuple) -> None:
        """The offload engine brought a host copy back (runtime/offload.py, at the copy):
        an evicted storage's bytes count as prefetched back, so a step that evicts shows what
        its backward had to bring back, measured rather than assumed equal."""
        if len(where) > 2 and where[2] == "evicted":
            self.prefetched_bytes += int(num_bytes)

    def begin_attempt(self) -> None:
        self.attempt = Counter()

    def uncount_attempt(self) -> None:
        """A finished attempt the group refused: its micro-batch and decisions un-counted."""
        self.micro_batches -= 1
        self.decisions.subtract(self.attempt)

    def end_attempt(self) -> None:
        self.micro_batches += 1
        self.decisions.update(self.attempt)

    def record_plan(self, layer: int, tokens_per_expert: list[int], actions) -> None:
        """One layer's plan, and the layer's expert load imbalance (max/mean)."""
        for action in actions:
            self.attempt[action.value] += 1
        imb = expert_imbalance(tokens_per_expert)
        self.imbalance[layer] = max(self.imbalance.get(layer, 0.0), imb)
        self.received[layer] = max(self.received.get(layer, 0), int(sum(tokens_per_expert)))

    def finish(self, *, step: int, policy: str, layers: list[int], peak_bytes: int,
               budget_bytes: int, static_bytes: int, offloaded_bytes_now: int,
               peak_phase: str = "", peak_layer: int = -1, reserved_bytes: int = 0) -> dict:
        imbalance = [self.imbalance.get(layer, 1.0) for layer in layers]
        return {
            "step": step, "policy": policy,
            "peak_bytes": max(int(peak_bytes), self.attempts_peak_bytes),
            "rerun_peak_bytes": int(peak_bytes), "budget_bytes": budget_bytes,
            "peak_phase": peak_phase, "peak_layer": peak_layer,
            "reserved_bytes": int(reserved_bytes), "safety_net": list(self.reruns),
            "static_bytes": static_bytes,
            "decisions": {a: self.decisions.get(a, 0) for a in ACTIONS},
            "layer_imbalance": imbalance, "max_imbalance": max(imbalance),
            "received_per_layer": [self.received.get(layer, 0) for layer in layers],
            "micro_batches": self.micro_batches, "safety_net_reruns": self.safety_net_reruns,
            "full_layers": self.full_layers, "hookless_layers": self.hookless_layers,
            "hookless_ends": self.hookless_ends, "calm_forwards": self.calm_forwards,
            "calm_left": self.calm_left,
            "evicted_bytes": self.evicted_bytes, "prefetched_bytes": self.prefetched_bytes,
            "offloaded_bytes": offloaded_bytes_now - self.offloaded_bytes_before,
            "plan_us": sum(self.plan_us) / len(self.plan_us) if self.plan_us else 0.0,
            "seconds": time.perf_counter() - self.start,
        }

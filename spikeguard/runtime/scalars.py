"""A step record's scalars by tag: what the metrics sinks write (spikeguard.train.metrics:
--tensorboard, --wandb) and what a Trainer's logs carry (spikeguard.integrations.hf_trainer),
one mapping for all of them. A record is the training loop's (spikeguard.train.loop) or
the guard's own (`guard.history`, spikeguard.runtime.history), which has the memory and
decision figures and not the loss.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

# scalar tag -> the step record's key it is read from (nested keys joined by '.').
SCALARS: dict[str, str] = {
    "train/loss": "loss",
    "train/tokens_per_s": "tokens_per_s",
    "train/val_loss": "val_loss",
    "train/imbalance": "imbalance",
    "memory/peak_bytes": "peak_bytes",
    "memory/max_peak_bytes": "max_peak_bytes",   # the cluster's worst rank (EP / PP runs)
    "memory/budget_bytes": "budget_bytes",
    "memory/reserved_bytes": "reserved_bytes",
    "memory/evicted_bytes": "evicted_bytes",
    "memory/prefetched_bytes": "prefetched_bytes",
    "guard/decisions_save": "decisions.save",
    "guard/decisions_recompute": "decisions.recompute",
    "guard/decisions_offload": "decisions.offload",
    "guard/safety_net_reruns": "safety_net_reruns",
    "guard/plan_us": "plan_us",
}


def _lookup(record: Mapping[str, Any], key: str) -> Any:
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def step_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's scalars by tag (SCALARS): those it has, as floats. Missing or None
    (no guard: no memory figures; no budget; no validation this step) is left out, not
    written as 0; a non-finite loss is kept (a diverging curve should show it)."""
    if record.get("skipped"):
        return {}
    out = {}
    for tag, key in SCALARS.items():
        value = _lookup(record, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[tag] = float(value)
    return out


def largest_scalars(records: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Each tag's largest value over `records` (their step_scalars): what a log written
    every few steps carries, so that a peak or a re-run between two logs is not hidden."""
    out: dict[str, float] = {}
    for record in records:
        for tag, value in step_scalars(record).items():
            out[tag] = max(out.get(tag, value), value)
    return out

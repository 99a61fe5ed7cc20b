"""What the metrics sinks' tests expect: the JSONL log's records as (step, value) per tag,
read by SCALARS' key names straight from the records (not through step_scalars, the code
under test). Shared by tests/train/test_train_metrics.py and test_train_wandb.py."""

from __future__ import annotations

from typing import Callable

from spikeguard.train.metrics import SCALARS


def expected_scalars(records: list[dict], as_value: Callable[[float], float] = float
                     ) -> dict[str, list[tuple[int, float]]]:
    """Tag -> (step, value) of every record that has the tag's key (`as_value`: what the
    sink keeps of a float, e.g. TensorBoard's 32 bits)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for tag, key in SCALARS.items():
            value = record
            for part in key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if value is not None:
                out.setdefault(tag, []).append((record["step"], as_value(float(value))))
    return out

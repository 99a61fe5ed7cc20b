"""The pipeline's routing monitor (parallel/summary.py) keeps one record per (layer,
micro-batch) of a step when a safety net runs the step's forwards again: the step-level
net runs the whole schedule again from the first micro-batch, with the same data. Before,
a re-run's forwards were numbered on from the last (micro-batch 2, 3 of a 2-micro-batch
step), which the simulator's validation read as loads past the step's micro-batches.

    .venv/bin/python -m pytest tests/parallel/test_parallel_routing_monitor.py -q
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from spikeguard.model import build_model, model_config
from spikeguard.parallel.pipeline_stages import stage_module
from spikeguard.parallel.summary import RoutingMonitor


def _stage_and_monitor(micro_batches: int):
    model = build_model(model_config("tiny"), seed=0)
    stage = stage_module(model, 0, 1)
    prank = SimpleNamespace(micro_batches=micro_batches,
                            modules=SimpleNamespace(stages=[stage]))
    return model, stage, RoutingMonitor(prank)


def _data(cfg, micro_batches: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=gen)
            for _ in range(micro_batches)]


def test_a_rerun_step_keeps_one_record_per_layer_and_micro_batch():
    model, stage, monitor = _stage_and_monitor(2)
    data = _data(model.cfg, 2)
    monitor.begin_step()
    for x in data:
        stage(x)
    first = {(r["layer"], r["micro_batch"]): r["received"] for r in monitor.routing}
    for x in data:   # the step-level net: the schedule again, the same micro-batches
        stage(x)
    again = [(r["layer"], r["micro_batch"]) for r in monitor.routing]
    num_layers = len(stage.moe_blocks())
    assert sorted(again) == sorted((layer, mb) for layer in range(num_layers) for mb in range(2))
    assert {(r["layer"], r["micro_batch"]): r["received"] for r in monitor.routing} == first
    monitor.close()


def test_forwards_without_grad_are_not_counted():
    """Evaluation forwards (no grad) are not micro-batches of the step."""
    model, stage, monitor = _stage_and_monitor(2)
    data = _data(model.cfg, 2)
    monitor.begin_step()
    with torch.no_grad():
        stage(data[0])
    assert monitor.routing == []
    stage(data[1])
    assert {r["micro_batch"] for r in monitor.routing} == {0}
    monitor.close()

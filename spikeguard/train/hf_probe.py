"""The budget of a Hugging Face run given none: a fraction of what an unguarded step needs.

A newcomer's first `spikeguard train --hf NAME` should show the guard working, so without
`--budget` the budget is 0.85 x the peak of an unguarded training step on the emulated
device (forwards, backwards and the AdamW step, with AdamW's state resident).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

UNLIMITED = 1 << 50


def measure_unguarded_peak(model: nn.Module, optimizer, batches: list[tuple]) -> int:
    """Peak device bytes of a training step with everything kept and no limit: every
    micro-batch's forward and backward, then the optimizer step (its foreach temporaries
    beside parameters, gradients and state). Two steps are run and the larger peak taken:
    the first has no optimizer state during its backward (its optimizer step creates it),
    every later step has. Parameters, optimizer state and random generators come back as
    they were, and no gradient is left."""
    import spikeguard

    peak = 0

    def micro_batches() -> None:
        for (w_BT,) in batches:
            (model(input_ids=w_BT, labels=w_BT).loss / len(batches)).backward()

    with torch.random.fork_rng(devices=[]):
        guard = spikeguard.attach(model, budget=UNLIMITED, policy="none", optimizer=optimizer)
        # Taken after attach: under FSDP2 attach reshards the modules that kept their
        # parameters gathered, and the parameters are then the sharded ones.
        params = [p for p in model.parameters()]
        with torch.no_grad():
            weights = [p.detach().clone() for p in params]
        state = copy.deepcopy(optimizer.state_dict())
        try:
            for _ in range(2):
                optimizer.zero_grad(set_to_none=True)
                guard.run_step(micro_batches)
                optimizer.step()
                # The device's peak since the step opened: the optimizer step's included.
                peak = max(peak, guard.history[-1]["peak_bytes"], guard.meter.peak())
        finally:
            guard.detach()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for p, w in zip(params, weights):
                    p.copy_(w)
            optimizer.load_state_dict(state)
    return peak

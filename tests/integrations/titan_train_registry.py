"""The test's torchtitan config registry: a user's run with spikeguard added to it.

    torchrun --nproc-per-node 1 -m torchtitan.train --module titan_train_registry \
        --config tiny_deepseek_guarded --hf_assets_path TOKENIZER_DIR \
        --dataloader.dataset_path CORPUS_DIR --spikeguard.budget 3MiB

`tiny_deepseek` is torchtitan's own `deepseek_v3_debugmodel` config at the test's sizes
(spikeguard's tiny deepseek_v3 config, byte vocabulary); `tiny_deepseek_guarded` is that
plus the one line a user adds (`with_spikeguard`). The CPU shims come first
(titan_cpu_shims.py). With SPIKEGUARD_TEST_REPORT set, each rank writes what an
independent meter saw: the device's own peak counter read after every optimizer step
(spikeguard's device API on the guard's device object, not the guard's history), and
the guard's re-runs per step.
"""

from __future__ import annotations

import atexit
import json
import os

import titan_cpu_shims  # noqa: F401  (torchtitan's, not spikeguard's)

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

from spikeguard.integrations.titan_models import BYTE_VOCAB, TitanSizes, titan_config
from spikeguard.integrations.titan_trainer import with_spikeguard

SIZES = TitanSizes()
SPIKE_EVERY = int(os.environ.get("SPIKEGUARD_TEST_SPIKE_EVERY", "0"))
OOM_AT_STEP = int(os.environ.get("SPIKEGUARD_TEST_BACKWARD_OOM_AT", "-1"))


def tiny_deepseek():
    """torchtitan's debug model's config, tiny and on CPU."""
    config = deepseek_v3_debugmodel()
    config.model_spec.model = titan_config("deepseek_v3", SIZES)
    config.loss = ChunkedLossWrapper.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=BYTE_VOCAB))
    config.training.local_batch_size = 2
    config.training.seq_len = 64
    config.training.steps = 4
    config.training.disable_cuda_graphs = True   # CUDA graphs: no CPU
    config.activation_checkpoint = None          # the guard decides recompute
    config.checkpoint.enable = False
    config.lr_scheduler.warmup_steps = 1
    config.comm.init_timeout_seconds = 120
    config.debug.seed = 0                        # the same weights in every job
    config.model_spec.post_optimizer_build_fn = _meter(config.model_spec.post_optimizer_build_fn)
    return config


def tiny_deepseek_guarded():
    return with_spikeguard(tiny_deepseek(), policy="adaptive")


def _meter(chain):
    """The model spec's own hook, then the test's meter (and forced spike) on each part."""
    def hook(optimizers, model_parts, parallel_dims):
        if chain is not None:
            chain(optimizers, model_parts, parallel_dims)
        if os.environ.get("SPIKEGUARD_TEST_REPORT"):
            _install_meter(optimizers, model_parts)
        if SPIKE_EVERY:
            _install_spike(model_parts)
        if OOM_AT_STEP >= 0:
            _install_backward_oom(model_parts)
    return hook


def _install_meter(optimizers, model_parts):
    peaks: list[int] = []

    def after_step(*_):
        guard = getattr(model_parts[0], "spikeguard", None)
        if guard is not None and not peaks[len(guard.history):]:
            peaks.append(guard.meter.peak())   # the allocator's counter, this step's
    for opt in optimizers.optimizers:
        opt.register_step_post_hook(after_step)

    def report():
        guard = getattr(model_parts[0], "spikeguard", None)
        history = guard.history if guard is not None else []
        out = {"peaks": peaks, "budget": guard.budget_bytes if guard else None,
               "reruns": [r["safety_net_reruns"] for r in history],
               "record_peaks": [r["peak_bytes"] for r in history],   # the guard's own
               "decisions": [r.get("decisions") for r in history],
               "calm": [r["calm_forwards"] for r in history]}
        path = f"{os.environ['SPIKEGUARD_TEST_REPORT']}.{os.environ.get('RANK', '0')}.json"
        with open(path, "w") as f:
            json.dump(out, f)
    atexit.register(report)


def _install_spike(model_parts):
    """Every SPIKE_EVERY-th step, all tokens to rank 0's experts, through torchtitan's own
    expert bias (it moves the choice, not the scores)."""
    import torch
    blocks = [m for m in model_parts[0].modules() if torch.is_tensor(getattr(m, "expert_bias_E", None))]

    def before(module, args):
        guard = getattr(model_parts[0], "spikeguard", None)
        step = len(guard.history) if guard is not None else 0   # a re-run: the same step
        on = step % SPIKE_EVERY == SPIKE_EVERY - 1
        for block in blocks:
            block.expert_bias_E.zero_()
            if on:
                block.expert_bias_E[: SIZES.num_experts // 2] = 10.0
    model_parts[0].register_forward_pre_hook(before)


def _install_backward_oom(model_parts):
    """At step OOM_AT_STEP (0-based), on its first attempt only, an allocation in backward
    that no plan foresees (the budget's size, held): the device refuses it, and only the
    guard's step-level net (a re-run with every layer recomputed) can save the step."""
    import torch
    part = model_parts[0]
    state = {"done": False}

    def allocate(grad):
        guard = part.spikeguard
        if len(guard.history) == OOM_AT_STEP and not state["done"]:
            state["done"] = True
            state["held"] = torch.empty(guard.budget_bytes, dtype=torch.uint8)
        return grad

    def after_forward(module, args, out):
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(allocate)
    part.register_forward_hook(after_forward)

"""One torchrun rank of the transformers-EP checks (tests/integrations/test_integrations_hf_ep.py).

T = tokens per sequence, E = experts (4), L = local experts per rank (2), K = top-k (2).

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 \
        tests/integrations/hf_ep_worker.py OUT_DIR [CHECK ...]

A tiny Qwen3-MoE with random weights under transformers' own expert parallelism
(`DistributedConfig(fsdp_size=2, ep_size=2)`: FSDP2 on the dense weights, two experts
whole on each rank). Each check writes its findings to OUT_DIR/<check>_rank<r>.json; the
test reads them. Checks run in the order given, all ranks together (collectives must
match): `policies`, `tight`, `mixed`, `fallback`, `spike`; `spike_none` last, since it
ends the job (every rank holds the same agreed line; rank 0, which ran out, prints it and
exits 3), as a real job would.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import spikeguard
from spikeguard.errors import DeviceOutOfMemory
from spikeguard.runtime.agreement import JobEnds, worst

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: the meter

HUGE = 1 << 40
POLICIES = ("none", "experts", "offload", "full", "adaptive")
SEQ, BATCH = 32, 4      # tokens per sequence, sequences per micro-batch and rank


def build():
    """The same seeded model on every rank, then transformers' layout applied to it (what
    from_pretrained(distributed_config=...) does after init, without a checkpoint)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig
    cfg = AutoConfig.for_model(
        "qwen3_moe", hidden_size=32, intermediate_size=32, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        vocab_size=256, num_experts=4, num_experts_per_tok=2, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    kind = type(model)
    dc, _, mesh = kind.prepare_distribute_model(DistributedConfig(fsdp_size=2, ep_size=2))
    return kind.maybe_distribute_model(model, dc, mesh)


def batches(step: int = 0) -> list[torch.Tensor]:
    """Two micro-batches of this rank's data for `step` (different on each rank)."""
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return [torch.randint(0, 256, (BATCH, SEQ + 1), generator=gen) for _ in range(2)]


def grads(model) -> dict:
    return {n: p.grad.to_local().clone() for n, p in model.named_parameters()}


def run(model, data, guard=None):
    for p in model.parameters():
        p.grad = None

    def body():
        for w in data:
            model(input_ids=w, labels=w).loss.backward()
    if guard is None:
        body()
    else:
        guard.run_step(body)
    return grads(model)


def differ(a: dict, b: dict) -> list[str]:
    return [n for n in a if not torch.equal(a[n], b[n])]


def world_max(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def record(guard) -> dict:
    r = guard.history[-1]
    return {"decisions": r["decisions"], "peak": r["peak_bytes"], "budget": r["budget_bytes"],
            "reruns": r.get("safety_net_reruns", 0), "full_layers": r.get("full_layers", 0),
            "calm": r["calm_forwards"]}


def guarded(policy: str, budget) -> tuple:
    model = build()
    return model, spikeguard.attach(model, budget=budget, policy=policy)


def metered(model):
    """The independent meter (tests/meter.py) while entered: the local shards of the
    sharded state as baseline; the guard's host memory (its host copy of the gradients,
    the offload pool's buffers) is host memory (tests/host_marks.py). DTensor-level ops
    are not seen (their outputs have no storage), their local ops are."""
    from host_marks import metered as host_marked_meter
    return host_marked_meter(model)


def metered_peak(model, guard) -> int:
    """The step's peak by the independent meter."""
    with metered(model) as meter:
        run(model, batches(), guard)
    return meter.peak_bytes


def check_policies(state: dict) -> dict:
    """Every policy, unlimited budget: gradients bitwise the unguarded layout's; the
    device's peak of the "none" step beside the independent meter's."""
    out = {}
    for policy in POLICIES:
        model, guard = guarded(policy, HUGE)
        g = run(model, batches(), guard)
        out[policy] = {"differ": differ(state["ref"], g), **record(guard)}
        if policy == "none":
            out[policy]["meter_peak"] = metered_peak(model, guard)
            out[policy]["device_peak"] = record(guard)["peak"]
        guard.detach()
    state["none_peak"] = world_max(out["none"]["peak"])
    return out


def check_bytes(state: dict) -> dict:
    """The derived byte model against what the ledger saw the experts call keep, per layer,
    on the rows this rank received (one micro-batch, everything kept, before backward).
    Every call hooked: a hookless call's bytes are the byte model's own (check_hookless)."""
    model, guard = guarded("none", HUGE)
    guard.hookless.enabled = False
    w = batches()[0]
    out = {}

    def body():
        loss = model(input_ids=w, labels=w).loss
        for layer in range(len(guard.moe_blocks)):
            rows = guard.recorder.received[layer]
            out[str(layer)] = {"rows": rows, "kept": guard.ledger.bytes_by(0, layer, "experts"),
                               "predicted": rows * guard.shape.save_per_token}
        loss.backward()
    guard.run_step(body)
    guard.detach()
    return out


HOOKLESS_OPS = ("attn", "router", "experts", "combine", "shared")


def _hookless_run(policy: str, budget: int, hookless: bool, ref: dict) -> dict:
    """Two steps of `policy` with hookless layers on or off; in the second the ledger's
    attribution per (micro-batch, layer, op) once both forwards ran, the independent
    meter's peak, the ledger after backward and the gradients."""
    model, guard = guarded(policy, budget)
    guard.hookless.enabled = hookless
    guard.calm.enabled = False   # the hooked path's attribution is studied: a calm
    run(model, batches(), guard)   # forward (none's, FSDP2 units and all) models nothing
    seen = {}

    def body():
        outs = [model(input_ids=w, labels=w) for w in batches()]
        for mb in range(len(outs)):
            for layer in range(len(guard.moe_blocks)):
                for op in HOOKLESS_OPS:
                    seen[f"{mb},{layer},{op}"] = guard.ledger.bytes_by(mb, layer, op)
        for out in outs:
            out.loss.backward()
    for p in model.parameters():
        p.grad = None
    with metered(model) as meter:
        guard.run_step(body)
    found = {"differ": differ(ref, grads(model)), "seen": seen, "meter_peak": meter.peak_bytes,
             "left": guard.ledger.activation_bytes,
             "hookless_layers": guard.history[-1]["hookless_layers"], **record(guard)}
    guard.detach()
    return found


def check_hookless(state: dict) -> dict:
    """Hookless layers under transformers' EP (runtime/hookless.py): none and adaptive,
    each with hookless layers on and off (unlimited budget: both forwards run before
    either backward)."""
    return {f"{policy},{hookless}": _hookless_run(policy, HUGE, hookless, state["ref"])
            for policy in ("none", "adaptive") for hookless in (True, False)}


def _walks(steps_seen: bool) -> list:
    """Four calm steps of adaptive (the same batches, unlimited budget): per step, for
    each later layer the hookless proof's walk (runtime/hookless.py `_layers_fit`) went
    to, the in-use it predicted at that layer's decision and the in-use there when that
    layer decided. `steps_seen` False: the walk's bound without what layers were seen to
    leave (runtime/routed_history.py `LayerSteps`)."""
    model, guard = guarded("adaptive", HUGE)
    guard.calm.enabled = False   # the hooked path's walks (a calm forward decides nothing)
    h = guard.hookless
    walks, decided = [], {}
    real_fit, real_proven = h.needs_no_eviction, h.proven
    if not steps_seen:
        h.steps.most = lambda num_tokens: None

    def needs_no_eviction(layer, in_use, walk):
        walks.append((guard.window.ctx.micro_batch, layer, in_use))
        return real_fit(layer, in_use, walk)

    def proven(layer, num_routed, decision):
        decided[(guard.window.ctx.micro_batch, layer)] = guard.ledger.in_use()
        return real_proven(layer, num_routed, decision)
    h.needs_no_eviction, h.proven = needs_no_eviction, proven
    out = []
    for _ in range(4):
        walks.clear()
        run(model, batches(), guard)
        out.append([[predicted, decided[(mb, layer)]] for mb, layer, predicted in walks])
    guard.detach()
    return out


def check_walk(state: dict) -> dict:
    return {"seen": _walks(True), "bound": _walks(False)}


def check_tight(state: dict) -> dict:
    """Adaptive at 0.85 and 0.7 of the everything-kept peak (worst rank)."""
    out = {}
    for frac in (0.85, 0.7):
        budget = int(state["none_peak"] * frac)
        model, guard = guarded("adaptive", budget)
        g = run(model, batches(), guard)
        out[str(frac)] = {"differ": differ(state["ref"], g), **record(guard)}
        guard.detach()
    return out


def check_mixed(state: dict) -> dict:
    """Ranks deciding differently: rank 0 recomputes or offloads what rank 1 keeps."""
    out = {}
    for mine in ("experts", "offload", "adaptive"):
        policy = mine if dist.get_rank() == 0 else "none"
        model, guard = guarded(policy, HUGE)
        g = run(model, batches(), guard)
        out[mine] = {"differ": differ(state["ref"], g), **record(guard)}
        guard.detach()
    try:   # "full" on one rank only would hang in backward: refused at attach, on all
        guarded("full" if dist.get_rank() == 0 else "adaptive", HUGE)
        out["full_one_rank"] = "attached"
    except spikeguard.UsageError as err:
        out["full_one_rank"] = str(err)
    return out


def count_votes(agreement, per_step: list) -> None:
    """Count the all-gathers made inside `agreement.vote` (the fallback votes) into
    `per_step[-1]`: the caller appends a 0 for each step. The real calls run unchanged."""
    voting, real_gather, real_vote = [False], agreement.gather, agreement.vote

    def gather(*args, **kwargs):
        per_step[-1] += voting[0]
        return real_gather(*args, **kwargs)

    def vote(*args):
        voting[0] = True
        try:
            return real_vote(*args)
        finally:
            voting[0] = False
    agreement.gather, agreement.vote = gather, vote


def check_votes(state: dict) -> dict:
    """Adaptive at 1.1x none's calm peak for three steps, with every rank's promise
    (runtime/window.py `promise`) and without it (every layer votes): the layer votes
    gathered in each step, each step's peak by the independent meter (baseline: the
    model's state after attach) and the last step's gradients against the unguarded
    layout's (the same batches every step, no optimizer step)."""
    budget = int(state["none_peak"] * 1.1)
    out = {}
    for name, promise in (("promised", None), ("every_layer", lambda layer: False)):
        model, guard = guarded("adaptive", budget)
        if promise is not None:
            guard.window.promise = promise
        per_step = []
        count_votes(guard.layers.agreement, per_step)
        meter_peaks, hookless, calm = [], [], []
        for _ in range(3):
            per_step.append(0)
            with metered(model) as meter:
                g = run(model, batches(), guard)
            meter_peaks.append(meter.peak_bytes)
            hookless.append(guard.history[-1]["hookless_layers"])
            calm.append(guard.history[-1]["calm_forwards"])
        out[name] = {"votes": per_step, "meter_peaks": meter_peaks, "hookless": hookless,
                     "calm_forwards": calm, "differ": differ(state["ref"], g), **record(guard)}
        guard.detach()
    return out


def check_fallback(state: dict) -> dict:
    """Adaptive's whole-layer fallback forced on rank 1 only, layer 1, on the third of
    three steps of the same batches: agreed by the group (both recompute it), no hang,
    gradients bitwise. Rank 0's forwards run calm by then (runtime/calm_forward.py): its
    calm layers cast their votes too, and it runs layer 1 whole, still calm."""
    model, guard = guarded("adaptive", HUGE)
    step = [0]
    if dist.get_rank() == 1:
        guard.window.layer_cannot_fit = lambda layer: step[0] == 2 and layer == 1
        # ... and, as its entry checks would, promises nothing before layer 1 (its vote
        # is then cast in every micro-batch: runtime/window.py `promise`)
        guard.window.promise = lambda layer: step[0] != 2 or layer > 1
    for step[0] in range(3):
        g = run(model, batches(), guard)
    out = {"differ": differ(state["ref"], g), **record(guard)}
    guard.detach()
    return out


def steer_to_rank0(model) -> list:
    """Every token's K experts become experts 0..K-1, rank 0's: rank 0 receives every
    rank's copies, twice its calm share at EP=2 (a 2x spike); rank 1 receives none."""
    handles = []
    for module in model.modules():
        experts = getattr(module, "experts", None)
        gate = getattr(module, "gate", None)
        if experts is None or gate is None:
            continue

        def hook(gate, args, output):
            *rest, index = output
            steered = torch.arange(index.shape[-1]).expand_as(index).contiguous()
            return (*rest, steered)
        handles.append(gate.register_forward_hook(hook))
    return handles


def check_spike(state: dict) -> dict:
    """Budget: 1.05 x the calm step's peak (worst rank, everything kept). The spiked step
    under adaptive stays under it on the true device."""
    model, guard = guarded("none", HUGE)
    run(model, batches(), guard)
    calm = world_max(record(guard)["peak"])
    guard.detach()
    state["spike_budget"] = budget = int(calm * 1.05)
    model, guard = guarded("adaptive", budget)
    run(model, batches(), guard)          # a calm step
    calm_record = record(guard)
    steer_to_rank0(model)
    run(model, batches(1), guard)         # the spike
    return {"calm": calm_record, "spike": record(guard), "budget": budget}


def check_spike_none(state: dict) -> dict:
    """The same spike under "none": rank 0 dies with the one-line message (exit 3). The
    budget is the `spike` check's (this job's, or the one whose findings are in OUT_DIR)."""
    budget = state.get("spike_budget") or json.loads(
        (state["out_dir"] / "spike_rank0.json").read_text())["budget"]
    model, guard = guarded("none", budget)
    steer_to_rank0(model)
    try:
        run(model, batches(1), guard)
    except DeviceOutOfMemory as err:
        # As the CLI does (spikeguard.cli): an agreed end is said by the rank that ran
        # out; the others hold the same line and exit a moment later.
        if isinstance(err, JobEnds) and worst(err.notes).rank != dist.get_rank():
            time.sleep(2.0)
        else:
            print(f"spikeguard: out of memory on rank {dist.get_rank()}: {err}",
                  file=sys.stderr, flush=True)
        os._exit(3)
    return {"survived": True}


CHECKS = {"policies": check_policies, "bytes": check_bytes, "hookless": check_hookless,
          "walk": check_walk,
          "tight": check_tight, "mixed": check_mixed, "votes": check_votes,
          "fallback": check_fallback, "spike": check_spike, "spike_none": check_spike_none}


def main() -> None:
    out_dir, names = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {"out_dir": out_dir}
    if set(names) - {"spike", "spike_none"}:   # the checks that compare gradients
        state["ref"] = run(build(), batches())
    for name in names:
        found = CHECKS[name](state)
        (out_dir / f"{name}_rank{rank}.json").write_text(json.dumps(found))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

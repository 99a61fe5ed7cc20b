"""The per-device byte and FLOP model of one layout: what each stage keeps and computes.

T = tokens of one micro-batch (micro_batch_size * seq_len), D = model width, F = expert
hidden width, F_s = shared expert width, H = heads, E = experts, K = top-k, V = vocabulary,
b = bytes per element, tp = tensor-parallel size.

Tensor parallelism with sequence parallelism: a device holds T/tp tokens of each
micro-batch for everything that keeps activations, and routes those tokens itself; the
experts are not tensor-parallel (ETP = 1, as Megatron-Core's MoE with sequence
parallelism) and are sharded over `ep` ranks drawn from the tp*dp devices of a stage.
So every per-token figure below is per token *on the device* (Td = T/tp).

Bytes on the device: spikeguard.sim.device_bytes, what the allocator holds layer by layer
(the runtime's figure since the device is emulated at the allocator): what each layer keeps
for backward (attention, router, the expert path's plan, the shared expert, the combine
under ep; whole-layer recompute keeps the input and the router's choice), the forward's
and backward's working set above it, the head's logits and their gradients. Static:
weights always; gradients and optimizer state either persistent (Megatron's buffers) or,
with `training.lazy_state`, as PyTorch allocates them (each step's first backward makes
the gradients, `zero_grad(set_to_none=True)` frees them, Adam's state exists from the
first optimizer step on), as the runtime's training loops run.

FLOPs per token (forward; backward is twice that, training 3x): attention 8*D^2 + 2*S*D
(causal), router 2*D*E, shared 6*D*F_s, each routed copy 6*D*F, head 2*D*V.
"""

from __future__ import annotations

from dataclasses import dataclass

from spikeguard.plan.catalogue import ExpertShape
from spikeguard.sim.config import SimConfig
from spikeguard.sim.device_bytes import LayerBytes
from spikeguard.sim.head_bytes import HeadBytes

FP32 = 4
INDEX = 8


@dataclass(frozen=True)
class StageShape:
    """One device of pipeline stage `stage`: its layers, static bytes and per-token rates."""

    stage: int
    chunks: tuple[tuple[int, ...], ...]   # global layer indices of each virtual chunk
    has_embed: bool
    has_head: bool
    num_params: int
    static_bytes: int                 # weights + gradients + optimizer state
    param_bytes: int = 0
    optimizer_bytes: int = 0
    chunk_grad_bytes: tuple[int, ...] = ()   # gradients of each chunk's parameters
    buffer_bytes: int = 0             # torch_buffers: the pipeline's receive buffers


@dataclass(frozen=True)
class DeviceModel:
    """Bytes and FLOPs of one device, for every stage of the layout."""

    tokens: int                     # Td = T/tp, tokens of one micro-batch on one device
    expert_shape: ExpertShape
    attn_bytes_per_token: float     # attention + router part of one layer (planner's layer_part)
    shared_bytes_per_token: float
    combine_bytes_per_token: float  # kept after the experts under ep (runtime's forecast figure)
    head_bytes_per_token: float
    embed_bytes_per_token: float
    input_bytes_per_token: float    # one layer under full recompute
    dense_flops_per_token: float    # attention + router + shared of one layer, per device
    expert_flops_per_copy: float    # one routed copy through one expert, per device
    head_flops_per_token: float
    a2a_bytes_per_copy: float       # one row of the dispatch / combine exchange
    model_flops_per_token: float    # training FLOPs of the whole model (MFU's numerator)
    num_params: int
    stages: tuple[StageShape, ...]
    layer: LayerBytes = None          # the device's bytes of one layer (device_bytes)
    head: HeadBytes = None
    embed_bytes: int = 0              # on the device per micro-batch (the position ids)
    lazy_state: bool = False          # training.lazy_state
    torch_buffers: bool = False       # training.torch_buffers
    layer_grad_bytes: int = 0         # one layer's parameters' gradients, on one device
    head_grad_bytes: int = 0

    def layer_part(self) -> int:
        return int(self.attn_bytes_per_token * self.tokens)


def param_counts(cfg: SimConfig) -> dict[str, int]:
    m = cfg.model
    D, F, E = m.d_model, m.d_expert, m.num_experts
    return {"attn": 4 * D * D + 2 * D, "router": D * E, "experts": E * 3 * D * F,
            "shared": 3 * D * F * m.num_shared_experts,
            "embed": m.vocab_size * D + m.seq_len * D, "head": m.vocab_size * D + D}


def num_params(cfg: SimConfig) -> int:
    p = param_counts(cfg)
    per_layer = p["attn"] + p["router"] + p["experts"] + p["shared"]
    return cfg.model.num_layers * per_layer + p["embed"] + p["head"]


def build(cfg: SimConfig) -> DeviceModel:
    m, lay = cfg.model, cfg.layout
    D, F, H, E, K, V, S, b, tp = (m.d_model, m.d_expert, m.num_heads, m.num_experts, m.top_k,
                                  m.vocab_size, m.seq_len, m.dtype_bytes, lay.tp)
    Fs = F * m.num_shared_experts
    g = cfg.training.grad_bytes
    tokens = lay.micro_batch_size * S // tp
    shape = ExpertShape(d_model=D, d_expert=F, elem_bytes=b, weight_bytes=b,
                        combine_after_exchange=lay.ep > 1)
    layer = LayerBytes(shape=shape, num_heads=H, num_experts=E, num_local_experts=E // lay.ep,
                       top_k=K, shared_width=Fs, grad_bytes=cfg.training.grad_bytes,
                       grouped=m.grouped_gemm, exchanged=lay.ep > 1)
    combine = K * (2 * D * b + b) if lay.ep > 1 else 0.0
    attn = 9 * D * b + 2 * FP32 + FP32 * H + D * b + FP32 * E + 28 * K + FP32
    flops_attn = 8 * D * D + 2 * S * D
    model_fwd = m.num_layers * (flops_attn + 2 * D * E + 6 * D * Fs + K * 6 * D * F) + 2 * D * V
    return DeviceModel(
        tokens=tokens, expert_shape=shape, attn_bytes_per_token=attn,
        shared_bytes_per_token=4 * Fs * b, combine_bytes_per_token=combine,
        head_bytes_per_token=3 * D * b + V * b + 12,
        embed_bytes_per_token=INDEX + INDEX / lay.micro_batch_size, input_bytes_per_token=D * b,
        dense_flops_per_token=flops_attn + 2 * D * E + 6 * D * Fs,
        expert_flops_per_copy=6 * D * F, head_flops_per_token=2 * D * V,
        a2a_bytes_per_copy=D * b, model_flops_per_token=3 * model_fwd,
        num_params=num_params(cfg), stages=tuple(_stages(cfg)), layer=layer,
        head=HeadBytes(d_model=D, vocab_size=V, elem_bytes=b, grad_bytes=g),
        embed_bytes=INDEX * S, lazy_state=cfg.training.lazy_state,
        torch_buffers=cfg.training.torch_buffers,
        layer_grad_bytes=int(g * (_dense_layer(cfg) + _expert_layer(cfg))),
        head_grad_bytes=int(g * param_counts(cfg)["head"] / tp))


def _dense_layer(cfg: SimConfig) -> float:
    p = param_counts(cfg)
    return (p["attn"] + p["shared"] + p["router"]) / cfg.layout.tp


def _expert_layer(cfg: SimConfig) -> float:
    return param_counts(cfg)["experts"] / cfg.layout.ep


def _stages(cfg: SimConfig) -> list[StageShape]:
    """Interleaved placement: model chunk c*pp + s runs on stage s (Megatron's order)."""
    m, lay, tr = cfg.model, cfg.layout, cfg.training
    p = param_counts(cfg)
    chunks_total = lay.pp * lay.virtual_stages
    per_chunk = m.num_layers // chunks_total
    dense_layer, expert_layer = _dense_layer(cfg), _expert_layer(cfg)
    dp, edp = lay.dp, lay.tp * lay.dp // lay.ep   # expert parameters' data-parallel copies
    shard = tr.distributed_optimizer
    out = []
    for s in range(lay.pp):
        chunks = tuple(tuple(range((c * lay.pp + s) * per_chunk, (c * lay.pp + s + 1) * per_chunk))
                       for c in range(lay.virtual_stages))
        n_layers = sum(len(c) for c in chunks)
        dense = n_layers * dense_layer + (p["embed"] / lay.tp if s == 0 else 0) \
            + (p["head"] / lay.tp if s == lay.pp - 1 else 0)
        experts = n_layers * expert_layer
        weights = (dense + experts) * (tr.param_bytes + tr.grad_bytes)
        optim = tr.optimizer_bytes * (dense / (dp if shard else 1) + experts / (edp if shard else 1))
        grads = []
        for c, chunk in enumerate(chunks):
            params = len(chunk) * (dense_layer + expert_layer)
            params += p["embed"] / lay.tp if s == 0 and c == 0 else 0
            params += p["head"] / lay.tp if s == lay.pp - 1 and c == len(chunks) - 1 else 0
            grads.append(int(params * tr.grad_bytes))
        # torch.distributed.pipelining: one receive buffer per micro-batch for the input of
        # every chunk but the model's first, and for the output's gradient of every chunk
        # but the model's last (one hidden state, T*D*b, each)
        flow = lay.micro_batch_size * m.seq_len // lay.tp * m.d_model * m.dtype_bytes
        ends = sum((c * lay.pp + s > 0) + (c * lay.pp + s < chunks_total - 1)
                   for c in range(lay.virtual_stages))
        buffers = ends * lay.micro_batches * flow if tr.torch_buffers and lay.pp > 1 else 0
        out.append(StageShape(stage=s, chunks=chunks, has_embed=s == 0,
                              has_head=s == lay.pp - 1, num_params=int(dense + experts),
                              static_bytes=int(weights + optim),
                              param_bytes=int((dense + experts) * tr.param_bytes),
                              optimizer_bytes=int(optim), chunk_grad_bytes=tuple(grads),
                              buffer_bytes=buffers))
    return out

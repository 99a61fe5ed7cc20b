"""What the device really holds while one micro-batch runs through one MoE layer.

The runtime's figure is the allocator's (spikeguard/memory/device.py): every live storage,
not only what autograd saves. This module is that figure for a layer of the built-in
model (spikeguard.model: pre-norm attention, top-k router, SwiGLU experts run stage by
stage by the runtime's executor, an optional shared SwiGLU expert), as arithmetic on the
shapes: every term was read off the emulated device op by op on `small`, and checked on
other widths, top-k and shared-expert counts (tests/sim/test_sim_device_bytes.py).

T = tokens of the micro-batch on this device, n = routed copies its experts received,
D = model width, F = expert width, Fs = shared expert width (all shared experts), V =
vocabulary, b = bytes per activation element, g = per gradient element, E = local experts.

Forward of a layer, from its entry (where the layer's input, T*D*b, is alive):

    decision     + attention and router parts - T*D*b (the input is in both) + n*(D*b + 8)
                   (the dispatched rows and their int64 index)
    experts      + n*b*max(4F, held at down + 2D) above the decision: the GEMM pieces
                   before their `cat`; the executor holds every stage's output until the
                   path ends (a recompute region returns its last one only)
    layer end    + kept + 2*T*D*b + 8*T above the entry (the shared expert's output and
                   the residual sum beside all the layer keeps; dispatch's rows stay alive
                   to the end even when offloaded)

Backward of a layer is a timeline over what is in use when it starts (`backward_over`):
the shared expert first (its gradients, 2*T*Fs*b at its peak), then combine, down, the
activation and gate_up, each bringing back what it needs (a saved tensor is there, an
offloaded or evicted one is copied back at its unpack, a recompute rematerialises its
region at its first unpack, the GEMM pieces again included), making its gradients and
freeing what it consumed. The experts' weight gradients are made per expert by
`select_backward` into a full-size tensor and summed into autograd's input buffer in place
(the engine steals a buffer no one else holds): at each sum the buffer, the new full-size
tensor and that expert's own slice are alive, two copies of the local experts' weights and
1/E of one (`grouped`: a grouped GEMM writing them in place, as production MoE kernels do,
keeps one). Under a Python dispatch mode (tests/meter.py's independent meter) every tensor
also has a Python reference and the engine adds out of place: three copies there,
measured; this module models the device without a mode. The first backward of a step
allocates every parameter's gradient as it goes (the shared expert's, the experts' ...).

The output head's bytes are sim/head_bytes.py's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from spikeguard.plan.catalogue import OPERATOR, OPERATORS, OPS, Action, ExpertShape, LayerPlan

INDEX = 8
_MEMO = 1 << 16   # remembered backward peaks per LayerBytes (a bound on the memory)
EVICTABLE_MIN_BYTES = 16 << 10   # runtime/hooks.py: smaller saved tensors are never evicted
REGION_BYTES = 5056              # a recompute region's own bookkeeping (checkpoint, SAC)


@dataclass(frozen=True)
class LayerBytes:
    """The device's bytes of one layer of the built-in model, for one micro-batch."""

    shape: ExpertShape
    num_heads: int
    num_experts: int             # all experts (the router's scores)
    num_local_experts: int
    top_k: int
    shared_width: int            # Fs: d_expert * num_shared_experts (0: none)
    grad_bytes: int
    grouped: bool = False        # weight gradients written in place (no select_backward)
    exchanged: bool = False      # expert parallelism: rows go out and back by all-to-all

    @property
    def d_model(self) -> int:
        return self.shape.d_model

    @property
    def b(self) -> int:
        return self.shape.elem_bytes

    # ---- what a layer keeps ------------------------------------------------------------
    def flow(self, tokens: int) -> int:
        """The hidden state passed from layer to layer (its gradient, back)."""
        return tokens * self.d_model * self.b

    def attn_part(self, tokens: int) -> int:
        D, b, H = self.d_model, self.b, self.num_heads
        return tokens * (9 * D * b + 8 + 4 * H)

    def router_part(self, tokens: int) -> int:
        D, b, E, K = self.d_model, self.b, self.num_experts, self.top_k
        return tokens * (D * b + 4 * E + 28 * K + 4)

    def layer_part(self, tokens: int) -> int:
        """Attention and router parts (the ledger's `layer_part`, the window's figure)."""
        return self.attn_part(tokens) + self.router_part(tokens)

    def shared_part(self, tokens: int) -> int:
        return 4 * tokens * self.shared_width * self.b

    def sent(self, tokens: int) -> int:
        """Routed copies this rank's tokens make (T*K): the rows it sends, and gets back."""
        return tokens * self.top_k

    def combine_rows(self, tokens: int) -> int:
        """Under ep: the rows back from the reverse exchange and their weighted copy, and
        the weights (the forecast's `combine_bytes_per_token`)."""
        if not self.exchanged:
            return 0
        return self.sent(tokens) * (2 * self.d_model * self.b + self.b)

    def expert_bytes(self, plan: LayerPlan, num_routed: int) -> int:
        """The expert path's bytes on the device under `plan` (the planner's figure)."""
        per = self.shape.bytes_per_token()
        saved = sum(per[op] for op, a in zip(OPS, plan.actions) if a is Action.SAVE)
        return num_routed * (saved + per["combine"])

    def kept(self, plan: LayerPlan, tokens: int, num_routed: int) -> int:
        region = REGION_BYTES if plan.region() else 0
        # under ep: the received rows' int64 order, kept by their regrouping
        order = INDEX * num_routed if self.exchanged else 0
        return (self.layer_part(tokens) + self.expert_bytes(plan, num_routed)
                + self.shared_part(tokens) + self.combine_rows(tokens) + order + region)

    def storages(self, plan: LayerPlan, tokens: int, num_routed: int) -> list[tuple[str, int]]:
        """The layer's saved storages the runtime can evict, in the order they were saved
        (runtime/hooks.py evicts them earliest layer first, in that order)."""
        T, n, D, b = tokens, num_routed, self.d_model, self.b
        F, Fs = self.shape.d_expert, self.shared_width
        TD = self.flow(T)
        out = [("attn", TD)] * 3 + [("attn", 3 * TD), ("attn", 4 * T * self.num_heads)] \
            + [("attn", TD)] * 3
        out += [("router", TD), ("router", 4 * T * self.num_experts),
                ("router", INDEX * T * self.top_k), ("router", INDEX * T * self.top_k),
                ("router", INDEX * T * self.top_k)]
        sizes = {op.name: n * op.elements(D, F) * b for op in OPERATORS}
        if self.exchanged:
            sizes["down"] = 0                   # its rows leave through the exchange
        out += [(op, sizes[op]) for op, a in zip(OPS, plan.actions) if a is Action.SAVE]
        if self.exchanged:
            N = self.sent(T)
            out += [("router", INDEX * n), ("combine", N * D * b), ("combine", N * D * b)]
        else:
            out += [("combine", n * D * b)]
        if Fs:
            out += [("shared", 2 * T * Fs * b), ("shared", T * Fs * b), ("shared", T * Fs * b)]
        return [(op, size) for op, size in out if size >= EVICTABLE_MIN_BYTES]

    # ---- forward -----------------------------------------------------------------------
    def at_decision(self, tokens: int, num_routed: int) -> int:
        """Above the layer's entry, once the router has run and before the experts: the
        dispatched rows, an int64 index of the sent rows (and, under ep, the received
        rows' two orders)."""
        order = 2 * INDEX * num_routed if self.exchanged else 0
        return (self.layer_part(tokens) - self.flow(tokens) + num_routed * self.d_model * self.b
                + INDEX * self.sent(tokens) + order)

    def expert_forward(self, plan: LayerPlan, num_routed: int) -> int:
        """The expert stages' peak above the decision."""
        D, F, b = self.d_model, self.shape.d_expert, self.b
        region = plan.region()
        if not region or region[-1] == "down":
            held = 4 * F                        # gate_up 2F, silu F, act F
        else:                                   # a region ending at act returns act only
            held = F
            if "silu" in region and plan.action("silu") is Action.SAVE:
                held += F                       # SAC's cache keeps it
            if "gate_up" not in region:
                held += 2 * F                   # computed before the region, still held
        extra = REGION_BYTES if region else 0
        return num_routed * b * max(4 * F, held + 2 * D) + extra

    def forward_over_decision(self, plan: LayerPlan, tokens: int, num_routed: int) -> int:
        """The layer's forward peak above the in-use at its decision."""
        # Dispatch's rows live to the end of the block (its `Dispatched`); down's output to
        # the end of combine, which is the layer's end when there is no shared expert.
        rows = num_routed * self.d_model * self.b
        end = self.kept(plan, tokens, num_routed) + INDEX * tokens
        end += (2 if self.shared_width else 1) * self.flow(tokens)
        if plan.action("dispatch") is not Action.SAVE:
            end += rows
        if plan.action("down") is not Action.SAVE and not self.shared_width:
            end += rows
        over = max(self.expert_forward(plan, num_routed), end - self.at_decision(tokens, num_routed))
        if self.exchanged:
            # The combine: down's rows, their regrouped copy and the rows back, weighted,
            # beside what the expert path keeps and the combined sum
            expert = self.expert_bytes(plan, num_routed) - INDEX * num_routed
            if plan.action("dispatch") is Action.SAVE:
                expert -= rows
            over = max(over, expert + 2 * rows + self.combine_rows(tokens)
                       + 2 * self.flow(tokens))
        return over

    # ---- backward ----------------------------------------------------------------------
    def backward_over(self, plan: LayerPlan, tokens: int, num_routed: int, first: bool = False,
                      on_host: Optional[dict[str, int]] = None) -> int:
        """The peak of the layer's backward above the in-use when it starts. `first`: the
        first backward of the step (the gradients are allocated as it goes); `on_host`:
        bytes per op of this layer's saved tensors evicted to host (come back at use).

        A pure function of its arguments, and the simulator's adaptive walk asks it again
        and again for the same ones (a layer's plan, its tokens and its routed rows repeat
        over devices and steps): it is remembered per LayerBytes (at most _MEMO entries)."""
        key = (plan, tokens, num_routed, first, tuple(sorted(on_host.items())) if on_host else ())
        memo = self._backward_memo
        over = memo.get(key)
        if over is None:
            if len(memo) >= _MEMO:
                memo.clear()
            over = memo[key] = _Backward(self, plan, tokens, num_routed, first,
                                         on_host or {}).run()
        return over

    @functools.cached_property
    def _backward_memo(self) -> dict:
        return {}   # cached_property writes the instance's __dict__: allowed when frozen

    def weight_grads(self) -> tuple[int, int, int, int]:
        """(shared down, shared gate_up, experts' down, experts' gate_up) gradient bytes."""
        D, F, Fs, g = self.d_model, self.shape.d_expert, self.shared_width, self.grad_bytes
        e = self.num_local_experts
        return Fs * D * g, 2 * Fs * D * g, e * F * D * g, 2 * e * F * D * g

    # ---- the whole layer recomputed ----------------------------------------------------
    def full_kept(self, tokens: int, num_routed: int) -> int:
        """The layer's input, and the router's choice (topk and sort are never recomputed);
        under ep also the exchanges' outputs (the rows received and the rows back) and the
        received rows' sorts, which a recompute must not repeat (runtime/executor.py)."""
        out = self.flow(tokens) + tokens * (28 * self.top_k + 4)
        if self.exchanged:
            D, b = self.d_model, self.b
            out += num_routed * (D * b + 4 * INDEX) + self.sent(tokens) * (D * b + 2 * INDEX)
        return out

    def full_forward_over(self, tokens: int, num_routed: int) -> int:
        """Above the layer's entry: the gate_up GEMM beside the dispatched rows."""
        D, F, b = self.d_model, self.shape.d_expert, self.b
        return num_routed * (D + 4 * F) * b + 2 * self.flow(tokens)

    def full_backward_over(self, tokens: int, num_routed: int, first: bool = False) -> int:
        """Everything the layer keeps when saved comes back at once, then its backward."""
        keep_all = LayerPlan(tuple(Action.SAVE for _ in OPS))
        back = self.kept(keep_all, tokens, num_routed) - self.full_kept(tokens, num_routed)
        return back + self.backward_over(keep_all, tokens, num_routed, first)


class _Backward:
    """One layer's backward as a timeline of allocations and frees (see the module doc);
    `r` is the in-use relative to the layer's start, `peak` its maximum."""

    def __init__(self, lb: LayerBytes, plan: LayerPlan, T: int, n: int, first: bool,
                 on_host: dict[str, int]):
        self.lb, self.plan, self.T, self.n, self.first = lb, plan, T, n, first
        D, F, b = lb.d_model, lb.shape.d_expert, lb.b
        self.nD, self.nF, self.TD = n * D * b, n * F * b, T * D * b
        self.ND = lb.sent(T) * D * b
        self.TFs = T * lb.shared_width * b
        # Where each expert-path tensor is when the backward starts.
        self.where = {}
        for op, a in zip(OPS, plan.actions):
            self.where[op] = {Action.SAVE: "dev", Action.OFFLOAD: "host",
                              Action.RECOMPUTE: "rec"}[a]
            if a is Action.SAVE and on_host.get(op, 0) > 0:
                self.where[op] = "host"
        self.present = {op: w == "dev" for op, w in self.where.items()}
        self.on_host = on_host
        self.r = 0
        self.peak = 0

    def alloc(self, num_bytes: int) -> None:
        self.r += num_bytes
        self.peak = max(self.peak, self.r)

    def free(self, num_bytes: int) -> None:
        self.r -= num_bytes

    def size(self, op: str) -> int:
        if op == "down" and self.lb.exchanged:
            return 0                            # its rows leave through the exchange
        return self.n * self.lb.b * OPERATOR[op].elements(self.lb.d_model, self.lb.shape.d_expert)

    def use(self, op: str) -> None:
        if not self.present[op]:
            if self.where[op] == "rec":
                self.recompute()
            else:                                   # on host: copied back at its unpack
                self.alloc(self.size(op))
                self.present[op] = True

    def release(self, op: str) -> None:
        if self.present[op]:
            self.free(self.size(op))
            self.present[op] = False
        self.where[op] = "gone"

    def recompute(self) -> None:
        """SAC re-runs the region up to the last tensor still needed (early stop)."""
        region = self.plan.region()
        if "gate_up" in region and self.where["gate_up"] == "rec":
            self.use("dispatch")
            self.alloc(4 * self.nF)                 # GEMM pieces and their cat
            self.free(2 * self.nF)
            self.present["gate_up"] = True
        for op in ("silu", "act"):
            if op in region and self.where[op] == "rec":
                self.alloc(self.size(op))
                self.present[op] = True

    def weight_grad(self, num_bytes: int) -> int:
        """Transient of one weight's per-expert gradients (see the module doc): the sum so
        far, the next expert's full-size copy and its own slice (E >= 2)."""
        e = self.lb.num_local_experts
        if self.lb.grouped or e < 2:
            return num_bytes
        return 2 * num_bytes + num_bytes // e

    def run(self) -> int:
        lb, n, T = self.lb, self.n, self.T
        nD, nF, TD, TFs = self.nD, self.nF, self.TD, self.TFs
        ws2, ws13, w2, w13 = lb.weight_grads()
        keep = 1 if self.first else 0       # a first backward keeps the gradients it makes
        if lb.shared_width:
            shared_host = self.on_host.get("shared", 0)
            self.alloc(min(shared_host, TFs))            # its activation comes back
            self.alloc(ws2 + TFs)
            self.free(TFs + ws2 * (1 - keep))
            self.alloc(max(0, shared_host - TFs))        # its input and silu come back
            self.alloc(2 * TFs)                          # gradients of silu and up: the peak
            self.free(2 * TFs)
            self.alloc(TFs)
            self.free(3 * TFs)
            self.alloc(2 * TFs)
            self.free(2 * TFs)
            self.alloc(ws13 + TD)
            self.free(2 * TFs + ws13 * (1 - keep))
        # combine: the gradient of the weighted rows, then of the rows and their weights
        if lb.exchanged:
            ND, N = self.ND, lb.sent(T)
            self.alloc(ND)
            self.free(ND)                                   # the weighted rows
            self.alloc(2 * ND + N * lb.b)
            self.free(3 * ND + N * lb.b)                    # and the rows back
            self.alloc(nD)                                  # the reverse exchange
            self.free(ND)
            self.alloc(2 * nD)                              # regrouped
            self.free(2 * nD + INDEX * n)
            self.grad_y = nD
        else:
            self.alloc(nD)
            self.free(nD)                                   # its weighted rows
            self.use("down")
            self.alloc(2 * nD + n * lb.b)
            self.free(2 * nD + n * lb.b)
            self.release("down")
            self.grad_y = nD
        # down: the activation's gradient per expert, the weights' gradients summed
        self.use("act")
        self.alloc(nF + self.weight_grad(w2))
        self.free(self.weight_grad(w2) - w2 * keep)
        self.release("act")
        self.free(self.grad_y)
        self.alloc(nF)
        self.free(nF)
        # act and silu: the product's gradients, silu's, then one chunk's backward joins
        # the halves into gate_up's gradient (silu and act share one chunk of gate_up)
        self.use("silu")
        self.use("gate_up")
        self.alloc(2 * nF)                          # of silu and of up
        self.free(nF)                               # the activation's gradient
        self.release("silu")
        self.alloc(nF)                              # of gate
        self.free(nF)
        self.release("gate_up")
        self.alloc(2 * nF)                          # cat of the halves
        self.free(2 * nF)
        # gate_up: the rows' gradient per expert, the weights' gradients summed
        self.use("dispatch")
        self.alloc(nD + self.weight_grad(w13))
        self.free(self.weight_grad(w13) - w13 * keep)
        self.release("dispatch")
        self.free(2 * nF)
        self.alloc(nD)
        self.free(nD)
        # dispatch and attention: what was evicted of them comes back
        back = self.on_host.get("attn", 0) + self.on_host.get("router", 0)
        self.alloc(TD + back + 3 * TD)
        return self.peak

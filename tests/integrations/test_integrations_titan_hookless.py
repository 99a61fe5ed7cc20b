"""Hookless experts calls on torchtitan models in one process (spikeguard/runtime/
hookless.py, integrations/titan_blocks.py `titan_window`): a call that keeps everything,
where nothing of the step can later want what it saves off the device, runs with no
saved-tensor hook, and the layers after it in the micro-batch run whole without
one; everything else is as with the hook on every layer (the same guard with
`hookless.enabled = False`).

Against that reference, for adaptive and none: the same gradients (torch.equal, and the
unguarded model's), the same true peak (tests/meter.py, an independent meter over every
op's outputs), the ledger empty after backward; and what the ledger models for a hookless
layer: "experts" the region byte model's keep-everything bytes, within 5% of what the hook
measures; torchtitan's combine (after the call) and the attention, router and shared
expert as the hook measured them on the first layer (up to 4% over on a later micro-batch:
that layer, of the first micro-batch, also saved what later ones share).

The dense first layer runs before the first guarded one, counted as the embedding
(runtime/hookless_ends.py): under adaptive it runs hookless where the proof holds for the
whole micro-batch before it starts (the same gradients, true peak and "embed" bytes as
hooked), and hooked where a decision will need room (a budget under the calm peak).

    .venv/bin/python -m pytest tests/integrations/test_integrations_titan_hookless.py -q
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")

import spikeguard  # noqa: E402
from spikeguard.integrations.titan_models import lm_loss  # noqa: E402

from meter import LiveMeter, model_state_tensors  # noqa: E402
from titan_helpers import HUGE, batches, bitwise, build, moe_blocks, step  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore:In CPU autocast")]

OPS = ("attn", "router", "experts", "combine", "shared")


def _guarded(policy: str, hookless: bool):
    model = build()
    guard = spikeguard.attach(model, budget=HUGE, policy=policy)
    if not hookless:
        guard.hookless.enabled = False
    return model, guard


def _two_steps(policy: str, hookless: bool, data):
    model, guard = _guarded(policy, hookless)
    step(model, data, guard)
    with LiveMeter(baseline_tensors=model_state_tensors(model, None)) as meter:
        grads = step(model, data, guard)
    return guard, grads, meter


@pytest.mark.parametrize("policy", ["adaptive", "none"])
def test_a_calm_step_runs_every_experts_call_hookless_and_changes_nothing_else(policy):
    data = batches(3)
    on, grads_on, meter_on = _two_steps(policy, True, data)
    off, grads_off, meter_off = _two_steps(policy, False, data)
    assert on.history[-1]["hookless_layers"] == len(moe_blocks(build())) * len(data)
    assert off.history[-1]["hookless_layers"] == 0
    assert bitwise(grads_off, grads_on)
    assert bitwise(step(build(), data), grads_on)
    assert meter_on.peak_bytes == meter_off.peak_bytes
    assert on.ledger.activation_bytes == off.ledger.activation_bytes == 0


def _attribution(hookless: bool):
    model, guard = _guarded("adaptive", hookless)
    data = batches(23)
    with guard.step():
        losses = [lm_loss(model, x, y) for x, y in data]
        seen = {(mb, layer, op): guard.ledger.bytes_by(mb, layer, op)
                for mb in range(len(data)) for layer in range(len(moe_blocks(model)))
                for op in OPS}
        for loss in losses:
            loss.backward()
    return seen, guard


def test_the_modelled_attribution_matches_what_the_hook_measures():
    # Both forwards before either backward: both micro-batches are in the ledger at once.
    modelled, guard = _attribution(True)
    measured, _ = _attribution(False)
    assert guard.history[-1]["hookless_layers"] == 2 * len(moe_blocks(build()))
    assert guard.ledger.activation_bytes == 0   # the backward released what was modelled
    for key, want in measured.items():
        got = modelled[key]
        assert want > 0, key   # every op of a MoE layer saves something here
        if key[2] == "experts":
            assert abs(got - want) <= 0.05 * want, (key, got, want)
        elif key[0] == 0:   # the first micro-batch: its first layer measured, same shapes
            assert got == want, (key, got, want)
        else:
            assert want <= got <= 1.04 * want, (key, got, want)


class _Packs:
    """A guard's tracker counting what it packs per layer (-1: before the first guarded
    layer, the embedding and here the dense first layer), and the ledger's "embed" bytes
    when each forward ends."""

    def __init__(self, guard):
        self.per_layer: dict[int, int] = {}
        self.embed_read: list[int] = []
        pack, observe = guard.tracker.pack, guard.window.observe_forward

        def counting_pack(t):
            self.per_layer[guard.ctx.layer] = self.per_layer.get(guard.ctx.layer, 0) + 1
            return pack(t)

        def reading_observe(mb, *args):
            self.embed_read.append(guard.ledger.bytes_by(mb, -1, "embed"))
            return observe(mb, *args)

        guard.tracker.pack = counting_pack
        guard.window.observe_forward = reading_observe

    def clear(self) -> None:
        self.per_layer.clear()
        self.embed_read.clear()


def _embed_case(budget, ends: bool, data, steps: int = 3):
    """`steps` steps of adaptive at `budget`, the ends' cover on or off: the last step's
    gradients, meter peak and packs."""
    model = build()
    guard = spikeguard.attach(model, budget=budget, policy="adaptive")
    guard.hookless.ends.enabled = ends
    guard.calm.enabled = False   # the hooked path's later forwards (else calm_forward.py's)
    packs = _Packs(guard)
    for _ in range(steps - 1):
        step(model, data, guard)
    packs.clear()
    with LiveMeter(baseline_tensors=model_state_tensors(model, None)) as meter:
        grads = step(model, data, guard)
    assert guard.ledger.activation_bytes == 0
    return guard, grads, meter.peak_bytes, packs


def test_under_adaptive_the_dense_first_layer_runs_hookless_where_the_micro_batch_is_proven():
    """torchtitan's deepseek_v3 runs a dense layer before its first MoE layer: counted as
    the embedding, over the evictor's 16 KiB, so adaptive could evict it. In one process
    the layers' proof holds for the whole micro-batch before it starts (calm, a loose
    budget): it runs hookless, modelled as measured, and nothing else changes."""
    from spikeguard.runtime.hooks import EVICTABLE_MIN_BYTES
    data = batches(3)
    on, grads_on, peak_on, packs_on = _embed_case(HUGE, True, data)
    off, grads_off, peak_off, packs_off = _embed_case(HUGE, False, data)
    assert min(packs_off.embed_read) >= EVICTABLE_MIN_BYTES   # not the small-bytes rule
    assert packs_off.per_layer.get(-1, 0) > 0
    assert packs_on.per_layer.get(-1, 0) == 0, packs_on.per_layer
    assert sum(packs_on.per_layer.values()) == 0   # every layer and the head too
    assert on.history[-1]["hookless_ends"] == 2 * len(data)
    assert packs_on.embed_read == packs_off.embed_read   # modelled exactly as measured
    assert bitwise(grads_off, grads_on)
    assert bitwise(step(build(), data), grads_on)
    assert peak_on == peak_off


def test_where_a_decision_will_need_room_the_dense_first_layer_stays_hooked():
    """At a budget the calm step does not fit with everything saved, the proof fails
    before the embedding: it runs hooked (its tensors evictable), gradients bitwise."""
    data = batches(3)
    probe, _, _, _ = _embed_case(HUGE, True, data, steps=1)
    budget = int(0.75 * probe.history[-1]["peak_bytes"])
    guard, grads, _, packs = _embed_case(budget, True, data)
    assert guard.history[-1]["hookless_layers"] < len(moe_blocks(build())) * len(data)
    assert packs.per_layer.get(-1, 0) > 0, packs.per_layer
    assert bitwise(step(build(), data), grads)

"""A rank refused by its device under torchtitan's own expert parallelism, after exchanges.

torchtitan's deepseek_v3 tiny model (titan_helpers.py) at EP=2, 2 spawned gloo ranks. Rank
1's device is asked, once, for an allocation no plan foresees (the whole budget) in the
second MoE layer's experts (after the first layer's all-to-alls and this layer's dispatch),
in forward, or in that layer's backward. torchtitan's token dispatcher is not journalled:
what rank 0 waits in cannot be made by rank 1, so the job ends on every rank, with the
same line, within seconds (spikeguard.parallel.agreement: the note in the job's store,
the groups aborted), never a hang or a mismatched collective.

    .venv/bin/python -m pytest tests/integrations/test_integrations_titan_ep_recovery.py -q
"""

from __future__ import annotations

import json
import os
import time
import warnings

import pytest
import torch

pytest.importorskip("torchtitan")

from spikeguard.parallel.launch_utils import init_gloo, run_spawned  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200), pytest.mark.filterwarnings("ignore:In CPU autocast")]

BUDGET = 64 << 20


def _arm(model, where: str) -> None:
    """On rank 1, the whole budget asked for once in the second MoE layer's experts."""
    from titan_helpers import moe_blocks
    state = {"done": torch.distributed.get_rank() != 1}

    def ask(*_):
        if not state["done"]:
            state["done"] = True
            torch.empty(BUDGET // 4 + 1, dtype=torch.float32)
    experts = moe_blocks(model)[1].routed_experts
    if where == "forward":
        experts.register_forward_pre_hook(lambda m, a: ask())
    else:
        experts.register_full_backward_pre_hook(lambda m, g: ask())


def _worker(rank, world, store, out_dir, where):
    warnings.filterwarnings("ignore", message="In CPU autocast")
    init_gloo(rank, world, store)
    import spikeguard
    from spikeguard.runtime.agreement import JobEnds
    from titan_helpers import batches, build, step
    model = build(ep=2)
    guard = spikeguard.attach(model, budget=BUDGET, policy="adaptive")
    _arm(model, where)
    start = time.perf_counter()
    try:
        step(model, batches(10 + rank), guard)
        result = {"ended": None}
    except JobEnds as err:
        result = {"ended": str(err)}
    result["seconds"] = time.perf_counter() - start
    (out_dir / f"{rank}.json").write_text(json.dumps(result))
    os._exit(0)   # the job's groups are aborted: nothing to tear down


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_refusal_after_exchanges_ends_every_rank_with_the_same_line(tmp_path, where):
    run_spawned(_worker, 2, (tmp_path, where), tmp_path / "store", timeout_s=150)
    r0, r1 = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert r0["ended"] is not None and r0["ended"] == r1["ended"], (r0, r1)
    assert r0["ended"].startswith(f"rank 1 ran out of memory in {where} of micro-batch 0"), r0
    assert "on a device of" in r0["ended"], r0
    assert r0["seconds"] < 30 and r1["seconds"] < 30, (r0, r1)

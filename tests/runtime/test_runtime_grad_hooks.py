"""One torch gradient hook per tensor for all of the guard's waits (runtime/grad_hooks.py)."""

from __future__ import annotations

import torch

from spikeguard.runtime.grad_hooks import on_grad


def test_waits_share_one_hook_run_in_order_and_leave_the_gradient_alone():
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)
    y = x @ w
    seen = []
    on_grad(y, lambda g: seen.append(("a", g.clone())))
    y.register_hook(lambda g: seen.append(("foreign", None)))
    on_grad(y, lambda g: seen.append(("b", g.clone())))
    assert len(y._backward_hooks) == 2   # ours (both waits) and the foreign one
    y.sum().backward()
    assert [s[0] for s in seen] == ["a", "b", "foreign"]
    assert torch.equal(seen[0][1], torch.ones(2, 3)) and torch.equal(seen[1][1], seen[0][1])
    expected = x.t() @ torch.ones(2, 3)
    assert torch.equal(w.grad, expected)


def test_each_tensor_its_own_waits():
    w = torch.randn(3, requires_grad=True)
    a, b = w * 2, w * 3
    got = []
    on_grad(a, lambda g: got.append("a"))
    on_grad(b, lambda g: got.append("b"))
    on_grad(a, lambda g: got.append("a2"))
    (a.sum() + b.sum()).backward()
    assert sorted(got) == ["a", "a2", "b"] and got.index("a") < got.index("a2")
    assert len(a._backward_hooks) == 1 and len(b._backward_hooks) == 1

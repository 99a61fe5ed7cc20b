"""The meter itself, on plain torch code (no spikeguard): figures computed by hand.

    .venv/bin/python -m pytest tests/test_meter.py -q -p no:cacheprovider

B = batch rows, D = input width, H = hidden width; float32, so 4 bytes an element.
"""

import threading

import pytest
import torch

from meter import LiveMeter, model_state_tensors

F32 = 4
B, D, H = 8, 16, 32


def test_linear_relu_forward_backward_peaks_by_hand():
    torch.manual_seed(0)
    linear = torch.nn.Linear(D, H)
    x_BD = torch.randn(B, D)
    base_bytes = (H * D + H + B * D) * F32  # weight, bias, input
    with LiveMeter(baseline_tensors=[*model_state_tensors(linear), x_BD]) as meter:
        assert meter.live_bytes == meter.peak_bytes == base_bytes
        meter.phase = "forward"
        loss = torch.relu(linear(x_BD)).sum()
        # at relu: the addmm output h_BH and relu's r_BH; then h_BH is freed, r_BH is
        # kept only by the graph (saved for relu's backward), plus the scalar loss
        assert meter.peak_bytes == base_bytes + 2 * B * H * F32
        assert meter.live_bytes == base_bytes + B * H * F32 + F32
        meter.phase = "backward"
        loss.backward()
        # r_BH is released once threshold_backward has run; the peak is at the bias grad:
        # loss, its ones grad, grad_h_BH, grad_w_HD and grad_b_H all alive
        assert meter.peak_bytes == base_bytes + (2 + B * H + H * D + H) * F32
        assert meter.peak_phase == "backward"
        assert meter.live_bytes == base_bytes + (H * D + H) * F32 + F32
        del loss
        assert meter.live_bytes == base_bytes + (H * D + H) * F32


def test_views_counted_once_and_freed_with_the_last_one():
    with LiveMeter() as meter:
        a = torch.empty(100)
        views = [a[10:], a.view(10, 10), a.view(10, 10).t(), a.unsqueeze(0), *a.split(25)]
        assert meter.live_bytes == 100 * F32
        del a
        assert meter.live_bytes == 100 * F32  # the views hold the storage
        del views
        assert meter.live_bytes == 0
        assert meter.peak_bytes == 100 * F32
        meter.reset_peak()
        assert meter.peak_bytes == 0


def test_inplace_does_not_count_and_resizes_are_followed():
    with LiveMeter() as meter:
        a = torch.zeros(10)
        a.add_(1).mul_(2)
        assert meter.live_bytes == 10 * F32
        a.resize_(50)
        assert meter.live_bytes == 50 * F32
        out = torch.empty(0)
        torch.add(a, 1, out=out)  # out= resizes its output
        assert meter.live_bytes == 100 * F32
        out.untyped_storage().resize_(0)  # not an aten op: seen at refresh()
        assert meter.live_bytes == 100 * F32
        meter.refresh()
        assert meter.live_bytes == 50 * F32
        assert meter.peak_bytes == 100 * F32


def test_fresh_tensors_from_data_are_counted():
    with LiveMeter() as meter:
        t = torch.tensor([1.0, 2.0, 3.0])
        assert meter.live_bytes == 3 * F32
        del t
        assert meter.live_bytes == 0


def test_baseline_counted_once_and_subtracted_when_freed():
    a = torch.empty(10)
    with LiveMeter(baseline_tensors=[a, a[2:], torch.empty(5)]) as meter:
        assert meter.live_bytes == 10 * F32  # the unnamed empty(5) died after entry
        b = a * 2  # an op on a baseline tensor: only the new output counts
        assert meter.live_bytes == 20 * F32
        del a
        assert meter.live_bytes == 10 * F32
        del b
    untracked = torch.empty(3)
    with LiveMeter() as meter:
        views = [untracked[1:], untracked.view(3, 1)]  # made outside, not in the baseline:
        untracked.add_(1)  # neither its views nor writes to it are allocations here
        untracked.resize_(30)
        del views
        assert meter.live_bytes == 0


def test_host_memory_excluded_by_predicate_and_by_scope():
    def is_uint8(t):
        return t.dtype == torch.uint8

    with LiveMeter(exclude=is_uint8) as meter:
        device_x = torch.randn(100)
        host_by_predicate = torch.empty(400, dtype=torch.uint8)
        with meter.host_scope():
            host_by_scope = torch.empty(100)
        assert meter.live_bytes == 100 * F32
        host_by_scope.copy_(device_x)  # writing into a host buffer later: still host
        host_by_scope.resize_(200)
        host_by_predicate.view(torch.float32).copy_(device_x)
        assert meter.live_bytes == meter.peak_bytes == 100 * F32
        del host_by_scope, host_by_predicate
        assert meter.live_bytes == 100 * F32


class _ScratchInBackward(torch.autograd.Function):
    """Identity whose backward allocates a 1000-float scratch: only backward makes it."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _ScratchInBackward.thread = threading.get_ident()
        scratch = torch.ones(1000)
        return grad * scratch[0]


def test_backward_ops_are_seen():
    torch.manual_seed(0)
    x = torch.randn(10, requires_grad=True)
    with LiveMeter() as meter:
        meter.phase = "forward"
        loss = _ScratchInBackward.apply(x).exp().sum()
        # clone's c and exp's e at exp; then c is freed, e is saved by exp's backward
        assert meter.peak_bytes == 20 * F32
        assert meter.live_bytes == (10 + 1) * F32
        meter.phase = "backward"
        loss.backward()
        # in the Function's backward: loss, its ones grad, exp's grad (e released by then),
        # the scratch and the returned grad
        assert meter.peak_bytes == (1 + 1 + 10 + 1000 + 10) * F32
        assert meter.peak_phase == "backward"
        assert meter.live_bytes == (1 + 10) * F32  # loss and x.grad
    assert _ScratchInBackward.thread == threading.get_ident()  # why one `with` sees it


def test_graph_saved_tensor_counted_until_backward_releases_it():
    x = torch.randn(H, requires_grad=True)
    with LiveMeter() as meter:
        loss = x.exp().sum()  # the exp result is referenced only by the graph
        assert meter.live_bytes == (H + 1) * F32
        loss.backward()  # frees the exp result, makes x.grad (H floats) and the ones grad
        del loss
        assert meter.live_bytes == H * F32


def test_optimizer_state_counted_then_in_the_baseline():
    torch.manual_seed(0)
    linear = torch.nn.Linear(D, H)
    opt = torch.optim.SGD(linear.parameters(), lr=0.1, momentum=0.9)
    param_bytes = (H * D + H) * F32
    x_BD = torch.randn(B, D)
    with LiveMeter(baseline_tensors=model_state_tensors(linear, opt)) as meter:
        linear(x_BD).sum().backward()
        opt.step()  # the momentum buffers are made here
        assert meter.live_bytes == 3 * param_bytes  # params, grads, momentum
    with LiveMeter(baseline_tensors=model_state_tensors(linear, opt)) as meter:
        assert meter.live_bytes == 3 * param_bytes
        opt.zero_grad(set_to_none=True)
        assert meter.live_bytes == 2 * param_bytes


def test_cap_raises_out_of_memory_one_op_late():
    with LiveMeter(cap_bytes=100 * F32) as meter:
        keep = torch.empty(60)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(60)
        assert meter.live_bytes == 60 * F32  # the op's output was freed as it unwound
        assert meter.peak_bytes == 120 * F32  # but it had been allocated: one op late
        del keep

    torch.manual_seed(0)
    x = torch.randn(10, requires_grad=True)
    with LiveMeter(cap_bytes=500 * F32) as meter:
        y = _ScratchInBackward.apply(x).sum()
        with pytest.raises(torch.OutOfMemoryError):  # raised inside the autograd engine
            y.backward()


def test_a_wrapper_subclass_counts_its_inner_tensor_once():
    """torch.distributed's functional collectives hand back an AsyncCollectiveTensor, a
    wrapper subclass around the collective's output, through an op of its own
    (_c10d_functional._wrap_tensor_autograd). Its storage is a placeholder of the full
    size with no data: only the inner tensor is memory."""
    from torch.distributed._functional_collectives import _wrap_tensor_autograd
    with LiveMeter() as meter:
        inner_BH = torch.randn(B, H)
        wrapped_BH = _wrap_tensor_autograd(inner_BH)
        assert type(wrapped_BH).__name__ == "AsyncCollectiveTensor"
        assert meter.live_bytes == meter.peak_bytes == B * H * F32
        del inner_BH, wrapped_BH
        assert meter.live_bytes == 0


def test_a_storage_freed_on_another_thread_is_named():
    """A storage whose last reference another thread drops (as a CPU backend's worker drops
    a collective's tensors) is listed with its bytes and the phase; one freed here is not."""
    with LiveMeter() as meter:
        meter.phase = "forward"
        here, there = torch.empty(10), torch.empty(25)
        del here
        held = [there]
        del there
        meter.phase = "backward"
        worker = threading.Thread(target=held.clear)
        worker.start()
        worker.join()
    assert meter.freed_elsewhere == [(25 * F32, "backward")]
    assert meter.live_bytes == 0

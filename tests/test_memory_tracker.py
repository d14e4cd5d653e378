"""The allocation tracker used by memory tests (tests/_memory.py): single process, CPU."""

import gc

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from tests._memory import track_allocations

MiB = 1 << 20
N = MiB // 4  # float32 elements in 1 MiB
SLACK = 4096  # room for the odd scalar (loss values, autograd's ones_like seed, ...)


def approx(value: int, expected: int) -> bool:
    return expected <= value <= expected + SLACK


def test_allocation_counted_then_freed() -> None:
    with track_allocations() as tracker:
        x = torch.empty(N)
        assert tracker.peak_bytes >= MiB
        assert approx(tracker.live_bytes(), MiB)
        del x
        assert tracker.live_bytes() == 0
    assert approx(tracker.peak_bytes, MiB)
    assert tracker.live_bytes() == 0


def test_live_bytes_after_exit_follows_frees() -> None:
    with track_allocations() as tracker:
        x = torch.zeros(N)
    assert approx(tracker.live_bytes(), MiB)
    del x
    assert tracker.live_bytes() == 0
    assert approx(tracker.peak_bytes, MiB)


def test_sequential_allocations_peak_is_max_not_sum() -> None:
    with track_allocations() as tracker:
        x = torch.ones(N)
        del x
        # same size: the allocator may hand back the same StorageImpl address / data pointer
        y = torch.ones(N)
        assert approx(tracker.live_bytes(), MiB)  # y is tracked despite any address reuse
        del y
    assert approx(tracker.peak_bytes, MiB)


def test_peak_includes_temporaries() -> None:
    with track_allocations() as tracker:
        x = torch.ones(N)
        y = (x * 2).sum()  # the 1 MiB product is freed right after sum
        del x
    assert approx(tracker.peak_bytes, 2 * MiB)
    assert approx(tracker.live_bytes(), 0)
    del y


def test_storage_resize_seen_on_sample() -> None:
    with track_allocations() as tracker:
        x = torch.empty(N)
        assert approx(tracker.live_bytes(), MiB)
        x.untyped_storage().resize_(0)
        assert tracker.sample() == 0
        assert tracker.live_bytes() == 0
        x.untyped_storage().resize_(2 * MiB)  # grows again: not dispatched, seen when sampled
        tracker.sample()
        assert approx(tracker.peak_bytes, 2 * MiB)
        x.untyped_storage().resize_(0)
    assert tracker.live_bytes() == 0
    assert approx(tracker.peak_bytes, 2 * MiB)


def test_zero_size_storage_tracked_until_grown() -> None:
    with track_allocations() as tracker:
        x = torch.empty(0)
        assert tracker.live_bytes() == 0
        x.untyped_storage().resize_(MiB)
        assert tracker.sample() == MiB
    del x


def test_preexisting_tensors_not_counted() -> None:
    a = torch.ones(N)
    b = torch.ones(N)
    with track_allocations() as tracker:
        a.add_(1)
        a.mul_(b)
        torch.add(a, b, out=a)
        a.copy_(b)
        a[::2].zero_()
        v = a.view(2, -1).t()
        a.resize_(N)
        assert tracker.live_bytes() == 0
        c = a + b  # out-of-place: a new allocation
        assert approx(tracker.live_bytes(), MiB)
        del c, v
    assert approx(tracker.peak_bytes, MiB)


def test_views_do_not_double_count() -> None:
    with track_allocations() as tracker:
        x = torch.empty(N)
        views = [x[1:], x.view(4, -1), x.view(4, -1).t(), x.unsqueeze(0), x.detach(), *x.chunk(4)]
        assert approx(tracker.live_bytes(), MiB)
        del x
        assert approx(tracker.live_bytes(), MiB)  # kept alive by its views
        del views
        assert tracker.live_bytes() == 0
    assert approx(tracker.peak_bytes, MiB)


def test_meta_tensors_count_zero() -> None:
    with track_allocations() as tracker:
        x = torch.empty(1 << 30, device="meta")
        model = nn.Sequential(*(nn.Linear(1024, 1024, device="meta") for _ in range(8)))
        y = model(torch.empty(16, 1024, device="meta"))
    assert tracker.peak_bytes == 0
    assert tracker.live_bytes() == 0
    del x, y


def test_meta_model_materialized() -> None:
    model = nn.Linear(512, 512, device="meta")
    with track_allocations() as tracker:
        model.to_empty(device="cpu")
    weight_and_bias = (512 * 512 + 512) * 4
    assert approx(tracker.live_bytes(), weight_and_bias)
    assert approx(tracker.peak_bytes, weight_and_bias)


def test_no_grad() -> None:
    w = torch.ones(N, requires_grad=True)
    with torch.no_grad(), track_allocations() as tracker:
        y = w * 2
        w.add_(1)
    assert approx(tracker.live_bytes(), MiB)
    del y


def test_autograd_backward_inside() -> None:
    w = torch.ones(N, requires_grad=True)
    with track_allocations() as tracker:
        loss = (w * w).sum()  # mul saves w (pre-existing): nothing new kept for backward
        assert approx(tracker.live_bytes(), 0)
        loss.backward()
        assert w.grad is not None
        assert approx(tracker.live_bytes(), MiB)  # the gradient
    assert tracker.peak_bytes >= 2 * MiB  # the product before sum, grad terms in backward
    w.grad = None
    assert approx(tracker.live_bytes(), 0)


def test_graph_built_outside_backward_inside() -> None:
    w = torch.ones(N, requires_grad=True)
    loss = (w.exp()).sum()  # exp saves its result (allocated outside the block)
    with track_allocations() as tracker:
        loss.backward()
    assert w.grad is not None
    assert approx(tracker.live_bytes(), MiB)
    assert tracker.peak_bytes >= MiB


def test_foreign_memory_is_not_counted() -> None:
    # Memory PyTorch's allocator did not allocate (a Python buffer here; numpy arrays and
    # DLPack capsules behave the same) is not counted; a copy of it is.
    buffer = bytearray(MiB)
    with track_allocations() as tracker:
        shared = torch.frombuffer(buffer, dtype=torch.float32)
        also_shared = shared.view(-1, 4)
        assert tracker.live_bytes() == 0  # the buffer's memory, allocated before
        copied = shared.clone()
        assert approx(tracker.live_bytes(), MiB)
        small = torch.tensor([1.0, 2.0, 3.0, 4.0])
        assert approx(tracker.live_bytes(), MiB + 16)
    del shared, also_shared, copied, small


def test_nested_trackers_report_their_own() -> None:
    with track_allocations() as outer:
        a = torch.empty(N)
        with track_allocations() as inner:
            b = torch.empty(2 * N)
            a.add_(1)
            assert approx(inner.live_bytes(), 2 * MiB)
            assert approx(outer.live_bytes(), 3 * MiB)
            del b
        c = torch.empty(N)  # after inner exited: outer only
        assert approx(outer.live_bytes(), 2 * MiB)
        assert inner.live_bytes() == 0
        del a, c
    assert approx(inner.peak_bytes, 2 * MiB)
    assert approx(outer.peak_bytes, 3 * MiB)
    assert outer.live_bytes() == 0


def test_watch_opts_in_preexisting_storage() -> None:
    x = torch.empty(N)
    x.untyped_storage().resize_(0)  # like a freed unsharded flat parameter
    with track_allocations() as tracker:
        x.untyped_storage().resize_(MiB)
        assert tracker.sample() == 0  # pre-existing: ignored ...
        tracker.watch(x)
        assert tracker.sample() == MiB  # ... unless opted in
        x.untyped_storage().resize_(0)
        tracker.reset_peak()
    assert tracker.peak_bytes == 0


def test_device_filter() -> None:
    with track_allocations(device="cuda") as tracker:
        x = torch.empty(N)
    assert tracker.peak_bytes == 0
    with track_allocations(device="cpu") as tracker:
        y = torch.empty(N)
    assert approx(tracker.peak_bytes, MiB)
    del x, y


def test_exception_propagates_and_mode_popped() -> None:
    assert _get_current_dispatch_mode() is None
    with pytest.raises(ValueError, match="boom"):
        with track_allocations() as tracker:
            x = torch.empty(N)
            raise ValueError("boom")
    assert _get_current_dispatch_mode() is None
    assert approx(tracker.peak_bytes, MiB)
    del x
    gc.collect()
    # nothing keeps tracking after exit
    y = torch.empty(N)
    assert tracker.live_bytes() == 0
    del y


def test_tracker_holds_no_strong_references() -> None:
    with track_allocations() as tracker:
        x = torch.empty(N)
        ref = x.untyped_storage()
        del ref
    storage_ref = __import__("weakref").ref(x.untyped_storage())
    del x
    assert storage_ref() is None
    assert tracker.live_bytes() == 0

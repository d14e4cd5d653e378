"""The two memory meters: the allocation tracker used by memory tests (tests/_memory.py;
single process, CPU) and the memory timeline of the planner's measure mode and the benchmarks
(flatshard/_base/_memory_timeline.py, [Note: measuring memory]), whose allocations and frees
count from every thread, gloo's worker threads included."""

import gc
import os
import threading
import time
import weakref
from typing import Any, Dict, List, Tuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from expecttest import TestCase
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from flatshard._base._memory_timeline import MemoryTimeline, PhaseMemory
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


# -- the memory timeline ----------------------------------------------------------------------


def _timeline() -> MemoryTimeline:
    gc.collect()  # (nothing freed during the timeline is an earlier allocation)
    return MemoryTimeline(torch.device("cpu"))


def _on_another_thread(fn: Any) -> None:
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


def test_timeline_counts_a_free_on_another_thread() -> None:
    held: List[torch.Tensor] = []
    with _timeline() as timeline:
        with timeline.phase("allocate"):
            held.append(torch.empty(N))
        with timeline.phase("free on another thread"):
            _on_another_thread(held.clear)
        with timeline.phase("allocate again"):
            again = torch.empty(N)
            del again
    assert timeline.phases == {
        "allocate": PhaseMemory(start=0, peak=MiB, end=MiB),
        "free on another thread": PhaseMemory(start=MiB, peak=MiB, end=0),
        "allocate again": PhaseMemory(start=0, peak=MiB, end=0),
    }, timeline.phases


def test_timeline_counts_a_free_on_another_thread_between_phases() -> None:
    held: List[torch.Tensor] = []
    with _timeline() as timeline:
        with timeline.phase("allocate"):
            held.append(torch.empty(N))
        _on_another_thread(held.clear)
        with timeline.phase("nothing"):
            pass
    assert timeline.phases["nothing"] == PhaseMemory(start=0, peak=0, end=0), timeline.phases


def test_timeline_counts_an_allocation_on_another_thread() -> None:
    held: List[torch.Tensor] = []
    with _timeline() as timeline:
        with timeline.phase("allocate on another thread"):
            _on_another_thread(lambda: held.append(torch.empty(2 * N)))
        with timeline.phase("free"):
            held.clear()
    assert timeline.phases == {
        "allocate on another thread": PhaseMemory(start=0, peak=2 * MiB, end=2 * MiB),
        "free": PhaseMemory(start=2 * MiB, peak=2 * MiB, end=0),
    }, timeline.phases


def test_timeline_counts_resizes_and_not_what_was_allocated_before() -> None:
    before = torch.empty(N)
    with _timeline() as timeline:
        with timeline.phase("resize"):
            grown = torch.empty(0)
            grown.untyped_storage().resize_(2 * MiB)
            grown.untyped_storage().resize_(0)
            del before  # allocated before the timeline: neither it nor its freeing counts
    assert timeline.phases["resize"] == PhaseMemory(start=0, peak=2 * MiB, end=0), timeline.phases


def test_timeline_leaves_the_allocators_flag_as_it_found_it() -> None:
    from flatshard._base._memory_timeline import _cpu_report_flag

    flag = _cpu_report_flag()
    assert not flag.value
    with pytest.raises(ValueError, match="boom"):
        with _timeline():
            assert flag.value  # (counting on every thread while the timeline runs)
            raise ValueError("boom")
    assert not flag.value
    flag.value = True  # (as something else turned it on)
    try:
        with _timeline() as timeline:
            with timeline.phase("allocate"):
                x = torch.empty(N)
                del x
        assert flag.value
        with pytest.raises(RuntimeError) as raised:
            with _timeline():
                flag.value = False
    finally:
        flag.value = False
    assert timeline.phases["allocate"] == PhaseMemory(start=0, peak=MiB, end=0), timeline.phases
    assert str(raised.value) == (
        "c10's flag FLAGS_caffe2_report_cpu_memory_usage was turned off by other code while this MemoryTimeline ran: "
        "frees on other threads may have gone uncounted"
    )


def _freed_by_gloo(rank: int, world_size: int) -> Tuple[Dict[str, PhaseMemory], bool]:
    """Rank 0 drops the tensor it all-reduces right after issuing it, while the collective
    waits for rank 1 (which joins late): its last reference is the work's, which gloo's
    worker thread drops when the collective completes. Returns the phases and whether the
    tensor was freed on a thread other than the main one."""
    main = threading.get_ident()
    freed_on: List[int] = []
    store = dist.distributed_c10d._get_default_store()  # (no tensors: the timeline counts none)
    with _timeline() as timeline:
        with timeline.phase("issue"):
            if rank == 1:
                store.wait(["rank 0 dropped its tensor"])  # (a sleep here raced a slow rank 0)
            sent = torch.ones(N)
            weakref.finalize(sent, lambda: freed_on.append(threading.get_ident()))
            dist.all_reduce(sent, async_op=True)  # (the work, dropped at once, holds `sent`)
            del sent
            if rank == 0:
                store.set("rank 0 dropped its tensor", "1")
        deadline = time.monotonic() + 60
        while not freed_on and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # (the finalizer runs as the tensor goes; its storage goes right after)
        with timeline.phase("after"):
            fresh = torch.empty(N)
            del fresh
    return timeline.phases, bool(freed_on) and freed_on[0] != main


def _gloo_training(rank: int, world_size: int, steps: int) -> Dict[str, Any]:
    """A model trained on plain gloo (no shared-memory exchange): what the timeline says a rank
    holds after each step, and each step's peaks, beside the rank's shards and optimizer state."""
    from flatshard import ShardedDataParallel
    from flatshard.wrap import ModuleWrapPolicy
    from tests._scale_run import Block, Decoder, _init, example_tokens, lm_loss

    with mock.patch.dict(os.environ, {"FLATSHARD_SHARED_MEMORY": "0"}):
        with torch.device("meta"):
            meta = Decoder()
        tokens = example_tokens()
        with _timeline() as timeline:
            model = ShardedDataParallel(meta, auto_wrap_policy=ModuleWrapPolicy({Block}), param_init_fn=_init)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for step in range(steps):
                with timeline.phase(f"forward {step}"):
                    loss = lm_loss(model(tokens))
                with timeline.phase(f"backward {step}"):
                    loss.backward()
                    del loss
                with timeline.phase(f"optimizer step {step}"):
                    optim.step()
                    optim.zero_grad(set_to_none=True)
    shards = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for s in optim.state.values() for t in s.values() if torch.is_tensor(t))
    return {"phases": timeline.phases, "shards_and_state": shards + state}


class TimelineOnGlooTest(TestCase):
    def test_a_tensor_freed_by_gloos_worker_thread_is_counted(self) -> None:
        results = self.pool.run(_freed_by_gloo, 2)
        phases, freed_elsewhere = results[0]
        self.assertTrue(freed_elsewhere, "rank 0's tensor was freed on its main thread: the test no longer exercises a free on gloo's thread")
        self.assertEqual(phases["issue"], PhaseMemory(start=0, peak=MiB, end=MiB))  # (still held by the collective)
        for rank, (phases, _) in enumerate(results):
            self.assertEqual(phases["after"], PhaseMemory(start=0, peak=MiB, end=0), f"rank {rank}")

    def test_training_on_plain_gloo_each_step_ends_holding_the_shards_and_optimizer_state(self) -> None:
        steps = 4
        for rank, result in enumerate(self.pool.run(_gloo_training, 2, steps)):
            phases = result["phases"]
            for step in range(steps):
                self.assertEqual(phases[f"optimizer step {step}"].end, result["shards_and_state"], f"rank {rank} step {step}")
            for phase in ("forward", "backward", "optimizer step"):
                peaks = [phases[f"{phase} {step}"].peak for step in range(1, steps)]
                self.assertEqual(len(set(peaks)), 1, f"rank {rank}: {phase} peaks of steps 1..{steps - 1} differ: {peaks}")


def test_timeline_without_the_allocators_flag_warns_and_counts_this_thread() -> None:
    """A torch that does not export c10's flag: the timeline says what it cannot count and
    counts what this thread allocates and frees, as it did before it set the flag."""
    from unittest import mock

    import flatshard._base._memory_timeline as memory_timeline

    with mock.patch.object(memory_timeline.ctypes.c_bool, "in_dll", mock.Mock(side_effect=ValueError("no such symbol"))):
        with pytest.warns(RuntimeWarning, match="does not export") as caught:
            with _timeline() as timeline:
                with timeline.phase("allocate"):
                    x = torch.empty(N)
                    del x
    assert len(caught) == 1
    assert timeline.phases["allocate"] == PhaseMemory(start=0, peak=MiB, end=0), timeline.phases

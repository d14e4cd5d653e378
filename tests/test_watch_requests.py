"""A waiting rank's store requests do not grow with the world size (issue 44, item 4).

[Note: one counter of changes] in ``flatshard/_comm/_peer_failures.py``: a rank waiting on a
slow peer makes one store request per slice at 16 ranks as at 4096 (it made one per peer), still
hears a peer that leaves at the next slice, and reads what was in a reused store before its
watch was made as before.
"""

from __future__ import annotations

import importlib.util
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, List, Tuple

import pytest
import torch.distributed as dist

from flatshard import PeerFailedError
from flatshard._comm._peer_failures import StepWatch


def _bench() -> Any:
    """``bench/host_checks.py``, whose ``CountingStore`` the tests count with too."""
    spec = importlib.util.spec_from_file_location("host_checks_bench", Path(__file__).resolve().parents[1] / "bench" / "host_checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _counting_store() -> Any:
    """A ``torch.distributed.HashStore`` that counts the requests made of it (what one
    TCPStore would serve)."""
    return _BENCH.CountingStore(dist.HashStore())


_BENCH = _bench()


def _watch(store: Any, rank: int, world: int, number: int = 1) -> StepWatch:
    watch = StepWatch(store, number, rank, [r for r in range(world) if r != rank], timedelta(seconds=60))
    watch.begin_step()
    watch.next_call()
    return watch


def _requests_per_slice(world: int, slices: int = 5) -> Tuple[int, List[int]]:
    """The store requests of rank 0's first look at its peers, then of each later slice, at
    ``world`` ranks while nothing fails."""
    store = _counting_store()
    watch = _watch(store, 0, world)
    store.requests = 0
    watch.look(time.monotonic(), "an all-gather")
    first = store.requests
    per_slice = []
    for _ in range(slices):
        store.requests = 0
        watch.look(time.monotonic(), "an all-gather")
        per_slice.append(store.requests)
    return first, per_slice


def test_a_waiting_rank_makes_one_store_request_per_slice_at_any_world_size() -> None:
    small_first, small = _requests_per_slice(16)
    large_first, large = _requests_per_slice(4096)
    assert small == large == [1] * 5, (small, large)
    # (each watch reads every record once: what was in the store before it was made)
    assert small_first >= 15 and large_first >= 4095, (small_first, large_first)


class _Slow:
    """A gloo ``Work`` of a peer that is slow: every slice runs out; at slice ``leave_at``,
    ``leave`` is called (a peer leaves the call while this rank waits)."""

    def __init__(self, leave_at: int, leave: Any, store: Any) -> None:
        self.slices = 0
        self.leave_at = leave_at
        self.leave = leave
        self.store = store
        self.requests: List[int] = []  # the store requests of each slice

    def wait(self, timeout: Any = None) -> None:
        self.requests.append(self.store.requests)
        self.store.requests = 0
        self.slices += 1
        if self.slices == self.leave_at:
            self.leave()
            self.store.requests = 0  # (the peer's writes are not the waiter's requests)
        raise RuntimeError("Timed out waiting 1000ms for recv operation to complete")

    def is_completed(self) -> bool:
        return False


def test_a_peer_that_leaves_is_heard_at_the_next_slice_at_4096_ranks() -> None:
    store = _counting_store()
    waiter, leaver = _watch(store, 0, 4096), _watch(store, 4095, 4096)
    work = _Slow(4, lambda: leaver.announce("rank 4095 raised ValueError('tripwire') in the forward of unit 'blocks.1' of step 1"), store)
    with pytest.raises(PeerFailedError) as caught:
        waiter.wait(work, "all_gather (unit 'blocks.2')")
    assert str(caught.value) == (
        "[rank 0] rank 4095 raised ValueError('tripwire') in the forward of unit 'blocks.1' of step 1, "
        "while rank 0 waited in all_gather (unit 'blocks.2')"
    )
    assert work.slices == 4, work.slices  # (heard at the slice right after it left)
    # slice 1 waits before any look; slice 2 makes the full read; slices 3 and 4: one request each
    assert work.requests[2:] == [1, 1], work.requests


def test_records_already_in_a_reused_store_are_read_as_before() -> None:
    # an earlier object's call that every rank left alike: their records say CLEARED, and the
    # counter of changes has moved; a later object's watch reads them, hears nothing, and then
    # makes one request per slice
    store = _counting_store()
    earlier = [_watch(store, rank, 3) for rank in range(3)]
    for watch in earlier:
        watch.announce(f"rank {watch.rank} raised ValueError('alike')")
    for watch in earlier:
        watch.leave_with(f"rank {watch.rank} raised ValueError('alike')")
    assert [w.stuck for w in earlier] == [None] * 3
    later = _watch(store, 0, 3, number=2)
    for _ in range(3):
        store.requests = 0
        later.look(time.monotonic(), "an all-gather")
    assert store.requests == 1


def test_a_stuck_peer_from_before_the_watch_is_heard_at_its_first_look() -> None:
    store = _counting_store()
    earlier = _watch(store, 1, 3)
    earlier._become_stuck("rank 1 could not go on: its collective failed")
    for _ in range(3):
        store.add("flatshard/watch/changes", 1)  # (other records moved the counter since)
    watch = _watch(store, 0, 3, number=2)
    with pytest.raises(PeerFailedError, match=r"^\[rank 0\] rank 1 could not go on: its collective failed, while rank 0 waited in x$"):
        watch.look(time.monotonic(), "x")


def test_an_unchanged_counter_keeps_a_verdict_that_depends_on_this_ranks_own_leaving() -> None:
    # rank 0 and rank 1 leave the same call: neither stops the other's wait; a later call that
    # rank 1 alone leaves does, although rank 0's verdict was cached at the same count
    store = _counting_store()
    a, b = _watch(store, 0, 2), _watch(store, 1, 2)
    a.announce("rank 0 raised ValueError('alike')")
    b.announce("rank 1 raised ValueError('alike')")
    a.look(time.monotonic(), "x")  # (left alike: nothing to hear)
    a.next_call()
    b.next_call()
    b.announce("rank 1 raised ValueError('alone')")
    with pytest.raises(PeerFailedError, match="rank 1 raised ValueError\\('alone'\\)"):
        a.look(time.monotonic(), "x")

"""Host checks that scale (issue 44, item 4).

- ``StepWatch``: a rank waiting on a slow peer makes one store request per slice at any world
  size ([Note: one counter of changes] in ``flatshard/_comm/_peer_failures.py``), and still
  hears a peer that leaves at the next slice, and what was in the store before it.
- The agreement checks take the maximum by recursive doubling over gloo ([Note: agreement by
  recursive doubling] in ``flatshard/_comm/_doubling.py``): every rank's schedule, run
  together at N = 4096, gives every rank the maximum after log2(N) rounds of messages (gloo's
  ring: 2 (N - 1)); ``Communicator.agree`` itself, over a stand-in group of 100 ranks in one
  process, sends as many messages one after another as the schedule says; over gloo at 3 and 4
  ranks it tells agreement from disagreement wherever the odd rank is, and a peer that leaves
  while the others wait in it is named within seconds.
"""

from __future__ import annotations

import math
import queue
import random
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from expecttest import TestCase

from flatshard import PeerFailedError
from flatshard._comm._collectives import Communicator
from flatshard._comm._doubling import SEND, SWAP, TAKE, rounds, schedule
from flatshard._comm._guard import make_guard

CPU = torch.device("cpu")


# -- the agreement's algorithm --------------------------------------------------------------------


def _run_schedules(world: int, values: List[int]) -> Tuple[List[int], int, List[int]]:
    """Every rank's ``schedule`` run together, the messages between each pair matched in
    order: every rank's result, the longest chain of messages one after another (a message
    leaves when its sender is ready and arrives one hop later), and the messages each rank sent."""
    steps = [schedule(rank, world) for rank in range(world)]
    held, clock, position, sent = list(values), [0] * world, [0] * world, [0] * world
    posted = [False] * world  # whether the send of the rank's current step is out
    mail: Dict[Tuple[int, int], List[Tuple[int, int]]] = {}  # (from, to) -> [(value, arrives at)]
    progress = True
    while progress:
        progress = False
        for rank in range(world):
            while position[rank] < len(steps[rank]):
                kind, peer = steps[rank][position[rank]]
                if kind in (SEND, SWAP) and not posted[rank]:
                    mail.setdefault((rank, peer), []).append((held[rank], clock[rank] + 1))
                    sent[rank], posted[rank] = sent[rank] + 1, True
                if kind != SEND:
                    box = mail.get((peer, rank), [])
                    if not box:
                        break  # (waits for the peer)
                    value, arrives = box.pop(0)
                    held[rank] = value if kind == TAKE else max(held[rank], value)
                    clock[rank] = max(clock[rank], arrives)
                position[rank], posted[rank], progress = position[rank] + 1, False, True
    if position != [len(s) for s in steps] or any(mail.values()):
        raise AssertionError(f"the schedules do not pair: the ranks stopped at steps {position}")
    return held, max(clock), sent


@pytest.mark.parametrize("world", [3, 4, 5, 7, 8, 100, 4096, 4097])
def test_every_rank_gets_the_maximum_in_log2_rounds(world: int) -> None:
    rng = random.Random(world)
    values = [rng.randrange(1 << 62) for _ in range(world)]
    held, depth, sent = _run_schedules(world, values)
    assert held == [max(values)] * world
    assert depth <= rounds(world) <= math.floor(math.log2(world)) + 2, (depth, rounds(world))
    assert rounds(world) == max(len(schedule(rank, world)) for rank in range(world))
    assert max(sent) <= math.floor(math.log2(world)) + 1, max(sent)
    if world == 4096:
        assert depth == 12 and 2 * (world - 1) == 8190  # (gloo's ring, for the record)


def test_a_schedule_refuses_a_rank_outside_the_world() -> None:
    with pytest.raises(ValueError, match=r"schedule: rank must be in \[0, 4\); got 4"):
        schedule(4, 4)


# -- Communicator.agree over a stand-in group of 100 ranks ------------------------------------------


class _StandIn:
    """One rank's view of a group that lives in this process (``rank()`` and ``size()``)."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


class _Arrival:
    """A receive: its ``wait`` takes the next message from the peer (and its hop count)."""

    def __init__(self, network: "_Network", tensor: torch.Tensor, src: int, dst: int) -> None:
        self.network, self.tensor, self.src, self.dst = network, tensor, src, dst

    def wait(self, timeout: Any = None) -> bool:
        value, hops = self.network.boxes[(self.src, self.dst)].get(timeout=30)
        self.tensor.copy_(value)
        self.network.clock[self.dst] = max(self.network.clock[self.dst], hops)
        return True


class _Network:
    """Point-to-point messages between the stand-in ranks, each stamped with the longest chain
    of messages before it (so the longest chain of all is the algorithm's depth)."""

    def __init__(self, world: int) -> None:
        self.boxes: Dict[Tuple[int, int], "queue.Queue[Any]"] = {(s, d): queue.Queue() for s in range(world) for d in range(world) if s != d}
        self.clock = [0] * world
        self.sent = [0] * world

    def isend(self, tensor: torch.Tensor, dst: int, group: _StandIn, tag: int = 0) -> _Done:
        src = group.rank()
        self.sent[src] += 1
        self.boxes[(src, dst)].put((tensor.clone(), self.clock[src] + 1))
        return _Done()

    def irecv(self, tensor: torch.Tensor, src: int, group: _StandIn, tag: int = 0) -> _Arrival:
        return _Arrival(self, tensor, src, group.rank())


class _NoWatch:
    watch = None

    def before_collective(self, what: str) -> None:
        pass


def _agree_over_stand_ins(world: int, values: List[int]) -> Tuple[List[bool], _Network, List[Any]]:
    network = _Network(world)
    groups = [_StandIn(rank, world) for rank in range(world)]  # (held here: communicators hold them weakly)
    comms = []
    for rank in range(world):
        comm = Communicator(groups[rank], guard=_NoWatch())  # type: ignore[arg-type]
        comm.gloo = True  # (its collectives take gloo's paths)
        comm.doubling_from = 3
        comms.append(comm)
    events: List[Any] = []
    comms[0].observe(events.append)
    results: List[Optional[bool]] = [None] * world
    with mock.patch.object(dist, "isend", network.isend), mock.patch.object(dist, "irecv", network.irecv), mock.patch.object(
        dist, "get_global_rank", lambda group, rank: rank
    ):
        def run(rank: int) -> None:
            results[rank] = comms[rank].agree(values[rank], CPU)

        threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    return [bool(r) for r in results], network, events


def test_agree_sends_log2_messages_one_after_another_at_100_ranks() -> None:
    assert Communicator(_StandIn(0, 100)).doubling_from <= 100  # type: ignore[arg-type]
    same, network, events = _agree_over_stand_ins(100, [7] * 100)
    assert same == [True] * 100
    assert max(network.clock) <= rounds(100) == 8, network.clock
    assert max(network.sent) <= 7, network.sent  # (log2(64) swaps and one send back)
    assert [(e.kind, e.op, e.nbytes, e.check) for e in events] == [("all_reduce", "send_recv", 16 * network.sent[0], True)]


def test_agree_tells_one_odd_rank_to_every_rank_at_100_ranks() -> None:
    for odd in (0, 1, 63, 64, 99):
        values = [7] * 100
        values[odd] = 8 if odd % 2 else 6
        differ, _, _ = _agree_over_stand_ins(100, values)
        assert differ == [False] * 100, odd


# -- over gloo ---------------------------------------------------------------------------------------


def _agreements(rank: int, world_size: int) -> List[bool]:
    """``agree`` with every rank alike, then with each rank in turn passing another value."""
    comm = Communicator(dist.group.WORLD)
    comm.doubling_from = 3  # (by recursive doubling at any size: DOUBLING_FROM is 64)
    guard = make_guard([comm], CPU)
    with guard.call("an agreement test"):
        found = [comm.agree(11, CPU)]
        for odd in range(world_size):
            found.append(comm.agree(11 + (rank == odd) * (1 if odd % 2 else -1), CPU))
    return found


def _leaves_while_the_others_agree(rank: int, world_size: int) -> Tuple[str, float]:
    """The last rank raises after the call's entry check; the others wait in an agreement."""
    group = dist.new_group(timeout=timedelta(seconds=6))  # (the stuck ranks' threads end with it)
    comm = Communicator(group)
    comm.doubling_from = 3
    guard = make_guard([comm], CPU)
    text, left_at = "", time.monotonic()
    try:
        with guard.call("an agreement test"):
            guard.check_entry()
            if rank == world_size - 1:
                time.sleep(0.5)
                left_at = time.monotonic()
                raise ValueError("tripwire")
            comm.agree(3, CPU)
    except (PeerFailedError, ValueError) as exc:
        text = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - left_at
    for thread in threading.enumerate():  # (the agreement's own thread ends at the group's timeout)
        if thread.name.startswith("flatshard agreement check"):
            thread.join(timeout=20)
    return text, took


class AgreementOverGlooTest(TestCase):
    def test_every_rank_tells_agreement_from_one_odd_rank(self) -> None:
        for world_size in (3, 4):
            outcomes = self.pool.run(_agreements, world_size, timeout=120)
            self.assertEqual(outcomes, [[True] + [False] * world_size] * world_size)

    def test_a_peer_that_leaves_is_named_by_the_ranks_waiting_in_an_agreement(self) -> None:
        outcomes = self.pool.run(_leaves_while_the_others_agree, 3, timeout=120)
        self.assertEqual(outcomes[2][0], "ValueError: tripwire")
        for rank in (0, 1):
            text, took = outcomes[rank]
            self.assertEqual(
                text,
                f"PeerFailedError: [rank {rank}] rank 2 raised ValueError('tripwire') in an agreement test (call #1), "
                f"while rank {rank} waited in an agreement check (the root)",
            )
            self.assertLess(took, 4.0)  # (a slice is 1 s; the group's timeout 6 s)

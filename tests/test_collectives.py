"""The collectives of ``flatshard._comm._collectives`` on gloo, checked value by value: the two-rank
chunk swap ([Note: pair exchange]) and the general paths from three ranks on give every rank
every shard in rank order and its own chunk of the sum or mean, synchronously and in flight,
for floats and for the bytes object collectives send."""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from expecttest import TestCase

from flatshard._comm._collectives import all_gather_object
from tests._models import guarded_comm


def _exchange(rank: int, world_size: int) -> Dict[str, Any]:
    comm = guarded_comm()
    functions: List[str] = []
    comm.observe(lambda event: functions.append(event.op))
    shard = torch.arange(5.0) + 10 * rank
    gathered = torch.full((5 * world_size,), -1.0)
    comm.all_gather(gathered, shard)
    in_flight = torch.full((5 * world_size,), -1.0)
    pending = comm.all_gather(in_flight, shard, async_op=True)
    pending.wait()
    # every rank's full tensor differs: element p of rank r's is 100 * r + p
    full = torch.arange(4.0 * world_size) + 100 * rank
    means = []
    for async_op in (False, True):
        out = torch.empty(4)
        comm.reduce_scatter_mean(out, full, async_op=async_op).wait()
        means.append(out.tolist())
    summed = torch.empty(4)
    comm.reduce_scatter_sum(summed, full)
    objects = all_gather_object({"rank": rank, "text": "x" * (rank + 3)}, comm)
    return {
        "gathered": gathered.tolist(), "in_flight": in_flight.tolist(), "means": means,
        "sum": summed.tolist(), "objects": objects, "functions": functions,
    }


def _yields(rank: int, world_size: int) -> List[int]:
    """How often the caller yields its core: after a blocking all-gather, after the first wait
    of a reduce-scatter in flight (not the second), never for a drained one."""
    import flatshard._comm._collectives as collectives

    comm = guarded_comm()  # (its call's entry check made: only the collectives below count)
    calls: List[int] = []
    real = collectives._sched_yield
    collectives._sched_yield = lambda: calls.append(1)
    try:
        counts = []
        comm.all_gather(torch.empty(2 * world_size), torch.ones(2))
        counts.append(len(calls))
        pending = comm.reduce_scatter_mean(torch.empty(2), torch.ones(2 * world_size), async_op=True)
        pending.wait()
        pending.wait()
        counts.append(len(calls))
        comm.all_gather(torch.empty(2 * world_size), torch.ones(2), async_op=True).drain()
        counts.append(len(calls))
    finally:
        collectives._sched_yield = real
    return counts


class GlooCollectivesTest(TestCase):
    def test_a_thread_that_waited_on_gloo_yields_its_core_once(self) -> None:
        # [Note: yield after a gloo wait]
        for world_size in (2, 3):
            self.assertEqual(self.pool.run(_yields, world_size), [[1, 2, 2]] * world_size)

    def test_every_rank_gets_the_gathered_and_reduced_values(self) -> None:
        for world_size in (2, 3):
            for rank, got in enumerate(self.pool.run(_exchange, world_size)):
                expected_gather = [float(10 * r + i) for r in range(world_size) for i in range(5)]
                self.assertEqual(got["gathered"], expected_gather, (world_size, rank))
                self.assertEqual(got["in_flight"], expected_gather, (world_size, rank))
                positions = range(4 * rank, 4 * rank + 4)
                total = [sum(100.0 * r + p for r in range(world_size)) for p in positions]
                self.assertEqual(got["sum"], total, (world_size, rank))
                self.assertEqual(got["means"], [[t / world_size for t in total]] * 2, (world_size, rank))
                self.assertEqual(got["objects"], [{"rank": r, "text": "x" * (r + 3)} for r in range(world_size)])
                # two ranks swap chunks with an all-to-all; three use gloo's list all-gather
                gather_function = "all_to_all_single" if world_size == 2 else "all_gather"
                self.assertEqual(got["functions"][:2], [gather_function] * 2, (world_size, rank))
                self.assertEqual(set(got["functions"][2:5]), {"all_to_all_single"}, (world_size, rank))

"""The root's pool of idle CPU memory (see [Note: buffer pool]): what it keeps and hands out,
that a training step in steady state allocates none of its gathers and reduction buffers, and
that training through the pooled gradient path stays identical to single-process training
(also when the backward builds a graph)."""

from __future__ import annotations

from typing import List, Tuple

import torch
from expecttest import TestCase
from flatshard._buffer_pool import BufferPool
from tests._models import batch, build, lm_loss, local, make_optim, run_parity, wrap

CPU = torch.device("cpu")


class BufferPoolTest(TestCase):
    def test_emptied_memory_fills_the_next_storage_of_that_size(self) -> None:
        pool = BufferPool(limit_bytes=64)
        a, b = torch.arange(4.0), torch.empty(0)
        memory = a.untyped_storage().data_ptr()
        pool.empty(a)
        self.assertEqual((a.untyped_storage().nbytes(), pool.held_bytes), (0, 16))
        pool.fill(b, 16)
        self.assertEqual((b.untyped_storage().data_ptr(), pool.held_bytes), (memory, 0))
        self.assertEqual((pool.reused, pool.allocated), (1, 0))
        pool.fill(a, 16)  # nothing idle: allocates
        self.assertEqual((a.untyped_storage().nbytes(), pool.allocated), (16, 1))

    def test_a_storage_keeps_its_identity_and_views(self) -> None:
        pool = BufferPool(limit_bytes=64)
        full = torch.zeros(4)
        view = full[1:3]
        pool.empty(full)
        donor = torch.full((4,), 7.0)
        pool.give(donor)
        del donor
        pool.fill(full, 16)
        self.assertEqual(view.tolist(), [7.0, 7.0])  # the saved view sees the new memory

    def test_the_limit_bounds_the_idle_memory(self) -> None:
        pool = BufferPool(limit_bytes=20)
        a, b, c = torch.zeros(4), torch.zeros(4), torch.empty(0)
        newest = b.untyped_storage().data_ptr()
        pool.empty(a)
        pool.empty(b)  # no room for both: the older block (a's) is freed
        self.assertEqual((pool.held_bytes, b.untyped_storage().nbytes()), (16, 0))
        pool.fill(c, 16)
        self.assertEqual(c.untyped_storage().data_ptr(), newest)
        pool.give(torch.zeros(6))  # larger than the limit: never kept
        self.assertEqual(pool.held_bytes, 0)
        pool.give(torch.zeros(4))
        pool.clear()
        self.assertEqual(pool.held_bytes, 0)

    def test_sizes_do_not_mix_and_parts_of_storages_are_not_kept(self) -> None:
        pool = BufferPool(limit_bytes=1 << 20)
        pool.give(torch.zeros(8)[2:6])  # a view: its storage is larger than it
        pool.give(torch.zeros(3))
        got = pool.new(4, torch.float32, CPU)
        self.assertEqual((pool.reused, got.shape), (0, torch.Size([4])))
        self.assertEqual(pool.new(3, torch.float32, CPU).numel(), 3)
        self.assertEqual(pool.reused, 1)

    def test_a_pool_without_room_never_keeps_anything(self) -> None:
        pool = BufferPool()
        a = torch.zeros(4)
        pool.empty(a)
        pool.give(torch.zeros(4))
        self.assertEqual((pool.held_bytes, a.untyped_storage().nbytes()), (0, 0))


# -- multi-rank ---------------------------------------------------------------------------


def _pool_counts(rank: int, world_size: int, steps: int) -> List[Tuple[int, ...]]:
    """Per step of sharded training: requests allocated in forward, allocated in backward,
    served from idle memory in backward, whether the idle memory stayed within the limit."""
    model = wrap(build(), "nested")
    optim = make_optim(model.parameters())
    counts = []
    for step in range(steps):
        tokens, targets = batch(step, world_size)
        optim.zero_grad(set_to_none=True)
        pool = model._unit.ctx.buffers if model._unit.ctx is not None else None
        before = (pool.allocated, pool.reused) if pool is not None else (0, 0)
        loss = lm_loss(model(local(tokens, rank)), local(targets, rank))
        pool = model._unit.ctx.buffers
        forward = (pool.allocated, pool.reused)
        loss.backward()
        optim.step()
        within = int(pool.held_bytes <= pool.limit_bytes)
        counts.append((forward[0] - before[0], pool.allocated - forward[0], pool.reused - forward[1], within))
    return counts


class PooledTrainingTest(TestCase):
    def test_later_forwards_gather_into_idle_memory_and_backward_reuses_it(self) -> None:
        for counts in self.pool.run(_pool_counts, 2, 4):
            forward_allocated, _, backward_reused, within = zip(*counts)
            # the first forward allocates; later ones gather into memory the step before gave up
            self.assertGreater(forward_allocated[0], 0)
            self.assertEqual(forward_allocated[1:], (0, 0, 0))
            # backward reuses too (freed gathers, reduced gradients, reduction buffers)
            self.assertTrue(all(n > 0 for n in backward_reused), backward_reused)
            self.assertEqual(within, (1, 1, 1, 1))

    # (run_parity raises on the ranks, failing the test, unless training matches)
    def test_training_equals_single_process_training(self) -> None:
        self.pool.run(run_parity, 2, "nested", steps=3)
        self.pool.run(run_parity, 3, "nested", steps=3)

    def test_a_backward_that_builds_a_graph_trains_like_single_process(self) -> None:
        self.pool.run(run_parity, 2, "nested", steps=3, create_graph=True)

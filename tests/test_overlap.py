"""Asynchronous collectives overlap computation, prefetch stays bounded, and ranks that run
different units get an error instead of a hang."""

import os
from unittest import mock

import torch
from expecttest import TestCase
from torch import nn

from flatshard import BackwardPrefetch, ShardedDataParallel
from flatshard._comm._shared_memory import available_here
from tests._models import Block, batch, build, lm_loss, local, make_optim, wrap
from tests._spy import recording


def _reduction_events(rank, world_size, overlap=True):
    """Events of one backward (second step), including when reductions are issued and completed."""
    with recording(reductions=True) as rec:
        model = wrap(build(n_blocks=4), "nested", backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
        model.set_communication_overlap(overlap)
        rec.attach(model)
        tokens, targets = (local(t, rank) for t in batch(0, world_size))
        optim = make_optim(model.parameters())
        for step in range(2):
            if step == 1:
                rec.clear()
            lm_loss(model(tokens), targets).backward()
            optim.step()
    events = rec.events
    return " | ".join(events[events.index("pre-backward root") :])


class Swapping(nn.Module):
    """Runs its blocks in the first-iteration order, then the even ones and then the odd ones:
    the forward prefetches of the later iterations (which follow the first iteration's order)
    gather the odd blocks long before their use."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(6))
        self.calls = 0

    def forward(self, x):
        order = list(self.blocks) if self.calls == 0 else list(self.blocks[::2]) + list(self.blocks[1::2])
        self.calls += 1
        for block in order:
            x = block(x)
        return x


def _peak_with_mistargeted_prefetch(rank, world_size, limit):
    with recording() as rec:
        module = Swapping()
        for i, block in enumerate(module.blocks):
            module.blocks[i] = ShardedDataParallel(block, forward_prefetch=True, limit_all_gathers=limit)
        model = ShardedDataParallel(module, forward_prefetch=True, limit_all_gathers=limit)
        rec.attach(model)
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(rank))
        for step in range(2):
            if step == 1:
                rec.clear()
            model(x).square().mean().backward()
    return rec.max_gathered


def _divergent(rank, world_size, iteration, shared_memory="1", detail=False):
    """Rank 1 runs blocks 1 and 2 swapped, from iteration ``iteration`` on: every rank must
    raise (the message is returned per rank). ``shared_memory``: FLATSHARD_SHARED_MEMORY;
    ``detail``: under torch's DETAIL debug level (every collective checked)."""
    import torch.distributed as dist

    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL if detail else dist.DebugLevel.OFF)
    try:
        with mock.patch.dict(os.environ, {"FLATSHARD_SHARED_MEMORY": shared_memory}):
            return _divergent_run(rank, world_size, iteration)
    finally:
        dist.set_debug_level(level)


def _detail_on_one_rank(rank, world_size):
    """Only the last rank checks every collective: refused at the first forward."""
    import torch.distributed as dist

    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL if rank == world_size - 1 else dist.DebugLevel.OFF)
    try:
        model = wrap(build(n_blocks=3), "nested")
        tokens, targets = (local(t, rank) for t in batch(0, world_size))
        model(tokens)
    except RuntimeError as exc:
        return str(exc)
    finally:
        dist.set_debug_level(level)
    return "no error"


def _check_collectives(rank, world_size, detail):
    """The small collectives of the ranks' agreement checks in each of three training steps."""
    import torch.distributed as dist

    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL if detail else dist.DebugLevel.OFF)
    try:
        model = wrap(build(n_blocks=3), "nested")
        tokens, targets = (local(t, rank) for t in batch(0, world_size))
        counts = []
        for _ in range(3):
            events = []
            model._unit.comm.observe(lambda e: events.append(e))
            for m in ShardedDataParallel.fsdp_modules(model):
                m._unit.comm.observe(lambda e: events.append(e))
            lm_loss(model(tokens), targets).backward()
            counts.append(sum(e.check for e in events))
        return counts
    finally:
        dist.set_debug_level(level)


def _divergent_run(rank, world_size, iteration):
    module = build(n_blocks=3)
    model = wrap(module, "nested")
    tokens, targets = (local(t, rank) for t in batch(0, world_size))
    try:
        for step in range(iteration + 1):
            if rank == 1 and step == iteration:
                inner = model.module.blocks
                inner[1], inner[2] = inner[2], inner[1]
            lm_loss(model(tokens), targets).backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


class OverlapTest(TestCase):
    def test_a_reduction_runs_until_the_next_unit_has_queued_its_gradient(self):
        events = self.pool.run(_reduction_events, 2)[0]
        # "reduce X" is issued in X's post-backward; "reduced X" completes it in the next
        # unit's post-backward, after that unit's gradient computation, before its own
        # reduction is issued ([Note: reductions in flight]); the root's at the end of backward
        self.assertExpectedInline(events, """pre-backward root | gather blocks.3 | pre-backward blocks.3 | gather blocks.2 | post-backward blocks.3 | reduce blocks.3 | free blocks.3 | pre-backward blocks.2 | gather blocks.1 | post-backward blocks.2 | reduced blocks.3 | reduce blocks.2 | free blocks.2 | pre-backward blocks.1 | gather blocks.0 | post-backward blocks.1 | reduced blocks.2 | reduce blocks.1 | free blocks.1 | pre-backward blocks.0 | post-backward blocks.0 | reduced blocks.1 | reduce blocks.0 | free blocks.0 | post-backward root | reduced blocks.0 | reduce root | free root | reduced root""")

    def test_without_overlap_a_reduction_completes_before_the_backward_allocates_again(self):
        events = self.pool.run(_reduction_events, 2, False)[0]
        # completed when the next unit's backward begins, before that unit gathers or
        # prefetches anything, or just before a unit assembles its own full gradient (blocks.0's
        # before the root's; [Note: reductions in flight]); the root's at the end of backward
        self.assertExpectedInline(events, """pre-backward root | gather blocks.3 | pre-backward blocks.3 | gather blocks.2 | post-backward blocks.3 | reduce blocks.3 | free blocks.3 | pre-backward blocks.2 | reduced blocks.3 | gather blocks.1 | post-backward blocks.2 | reduce blocks.2 | free blocks.2 | pre-backward blocks.1 | reduced blocks.2 | gather blocks.0 | post-backward blocks.1 | reduce blocks.1 | free blocks.1 | pre-backward blocks.0 | reduced blocks.1 | post-backward blocks.0 | reduce blocks.0 | free blocks.0 | reduced blocks.0 | post-backward root | reduce root | free root | reduced root""")


class LimitAllGathersTest(TestCase):
    def test_at_most_two_units_wait_gathered_ahead_of_their_use(self):
        limited = self.pool.run(_peak_with_mistargeted_prefetch, 2, True)[0]
        unlimited = self.pool.run(_peak_with_mistargeted_prefetch, 2, False)[0]
        self.assertLessEqual(limited, 1 + 1 + 2)  # the root, the computing block, two ahead
        self.assertGreater(unlimited, limited)


class OrderCheckTest(TestCase):
    def test_different_units_in_the_first_iteration(self):
        # on gloo, the check at the end of the forward
        first, second = self.pool.run(_divergent, 2, 0, "0", timeout=60)
        self.assertEqual(second, first.replace("[rank 0]", "[rank 1]"))  # both ranks raise
        self.assertExpectedInline(first, """[rank 0] the ranks ran different units (every rank must run the same units in the same order, e.g. no data-dependent skipping): unit #2 of this forward differs: rank 0 ran 'blocks.1'; rank 1 ran 'blocks.2'""")
        # under TORCH_DISTRIBUTED_DEBUG=DETAIL, already at the first all-gather that differs
        first, second = self.pool.run(_divergent, 2, 0, "0", True, timeout=60)
        self.assertEqual(second, first.replace("[rank 0]", "[rank 1]"))
        self.assertExpectedInline(first, """[rank 0] the ranks ran different units (every rank must run the same units in the same order, e.g. no data-dependent skipping): rank 0 is gathering the parameters of unit 'blocks.1'; rank 1 is gathering the parameters of unit 'blocks.2'""")
        first, second = self.pool.run(_divergent, 3, 0, "0", True, timeout=60)[:2]
        self.assertIn("rank 0 is gathering the parameters of unit 'blocks.1'; rank 1 is gathering the parameters of unit 'blocks.2'", first)
        if not available_here():
            return
        # two ranks through shared memory: at the first exchange that differs, naming the
        # peer's unit too though this rank has not exchanged it yet
        first, second = self.pool.run(_divergent, 2, 0, timeout=60)
        self.assertEqual(second, first.replace("[rank 0]", "[rank 1]"))
        self.assertExpectedInline(first, """[rank 0] the ranks disagree on collective #3 of this model (every rank must run the same units in the same order, e.g. no data-dependent skipping): rank 0 issued an all-gather of unit 'blocks.1' (592 bytes of torch.float32); rank 1 an all-gather of unit 'blocks.2' (592 bytes of torch.float32)""")

    def test_ranks_that_disagree_on_checking_every_collective_are_refused(self):
        # (they would pair a rank's per-collective check with another's gather)
        for rank, message in enumerate(self.pool.run(_detail_on_one_rank, 3)):
            self.assertEqual(message, f"[rank {rank}] the ranks' TORCH_DISTRIBUTED_DEBUG levels differ (rank 0: not DETAIL; rank 1: not DETAIL; rank 2: DETAIL): under DETAIL every collective is checked, which only works when every rank checks; set it alike on every rank")

    def test_each_iteration_checks_with_a_constant_number_of_small_collectives(self):
        # [Note: order check]: the forward's entry and end checks and the backward's, at any
        # world size (the first forward also checks once that the ranks built the same units);
        # under DETAIL one per collective of each unit in every iteration
        for world_size in (2, 3):
            for counts in self.pool.run(_check_collectives, world_size, False):
                self.assertEqual(counts, [4, 3, 3])
        for counts in self.pool.run(_check_collectives, 3, True):
            self.assertEqual(counts[0], counts[1] + 1)
            self.assertEqual(counts[1], counts[2])
            self.assertGreater(counts[1], 2 * 4)  # two gathers and a reduction of each of 4 units

    def test_different_order_in_a_later_iteration(self):
        # on gloo, the check at the end of every forward
        first, second = self.pool.run(_divergent, 2, 2, "0", timeout=60)
        self.assertEqual(second, first.replace("[rank 0]", "[rank 1]"))
        self.assertExpectedInline(first, """[rank 0] the ranks ran different units (every rank must run the same units in the same order, e.g. no data-dependent skipping): unit #2 of this forward differs: rank 0 ran 'blocks.1'; rank 1 ran 'blocks.2'""")
        if not available_here():
            return
        # through shared memory too: both ranks prefetched the same units by the recorded order, so
        # the check at the end of the forward names the first difference
        first, second = self.pool.run(_divergent, 2, 2, timeout=60)
        self.assertEqual(second, first.replace("[rank 0]", "[rank 1]"))
        self.assertExpectedInline(first, """[rank 0] the ranks ran different units (every rank must run the same units in the same order, e.g. no data-dependent skipping): unit #2 of this forward differs: rank 0 ran 'blocks.1'; rank 1 ran 'blocks.2'""")

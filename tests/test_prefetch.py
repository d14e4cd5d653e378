"""Which unit is gathered when: prefetch order, bounded memory, collectives and bytes per step."""

import contextlib

from expecttest import TestCase

from flatshard import BackwardPrefetch, ShardedDataParallel, ShardingStrategy
from flatshard._comm._shared_memory import available_here
from tests._models import batch, build, lm_loss, local, make_optim, wrap
from tests._spy import recording


def _step_events(
    rank,
    world_size,
    strategy_name="FULL_SHARD",
    backward_prefetch=None,
    forward_prefetch=False,
    no_sync=False,
    model_kwargs=None,
    mode="nested",
    overlap=True,
):
    """Events of the second training step (the first records the forward order)."""
    with recording() as rec:
        model = wrap(
            build(**(model_kwargs or {})),
            mode,
            sharding_strategy=ShardingStrategy[strategy_name],
            backward_prefetch=backward_prefetch,
            forward_prefetch=forward_prefetch,
        )
        model.set_communication_overlap(overlap)
        rec.attach(model)
        optim = make_optim(model.parameters())
        tokens, targets = (local(t, rank) for t in batch(0, world_size))
        for step in range(2):
            if step == 1:
                rec.clear()
            with model.no_sync() if no_sync and step == 1 else contextlib.nullcontext():
                lm_loss(model(tokens), targets).backward()
            if not (no_sync and step == 1):  # (a step would average what the no_sync backward held)
                optim.step()
        return rec.events, dict(rec.collectives), rec.max_gathered


def _events(pool, **options):
    """Rank 0's events, checked identical on both ranks, and collectives / peak gathered."""
    (events, collectives, peak), other = pool.run(_step_events, 2, **options)
    assert other[0] == events
    return " | ".join(events), collectives, peak


class PrefetchOrderTest(TestCase):
    # Units: the root (embedding, final norm, head) and blocks.0-2, FULL_SHARD unless stated.

    def test_without_prefetch_each_unit_gathers_in_its_own_pre_backward(self):
        events, collectives, peak = _events(self.pool, backward_prefetch=None, overlap=False)
        self.assertExpectedInline(
            events,
            """forward root | gather root | forward blocks.0 | gather blocks.0 | free blocks.0 | forward blocks.1 | gather blocks.1 | free blocks.1 | forward blocks.2 | gather blocks.2 | free blocks.2 | pre-backward root | pre-backward blocks.2 | gather blocks.2 | post-backward blocks.2 | free blocks.2 | pre-backward blocks.1 | gather blocks.1 | post-backward blocks.1 | free blocks.1 | pre-backward blocks.0 | gather blocks.0 | post-backward blocks.0 | free blocks.0 | post-backward root | free root""",
        )
        self.assertEqual(peak, 2)  # the root and the computing block

    def test_overlapping_gathers_the_next_unit_in_forward_without_forward_prefetch(self):
        # (each forward gather is issued before the unit in front of it computes: [Note: overlap])
        events, collectives, peak = _events(self.pool, backward_prefetch=None)
        self.assertExpectedInline(
            events,
            """forward root | gather root | gather blocks.0 | forward blocks.0 | gather blocks.1 | free blocks.0 | forward blocks.1 | gather blocks.2 | free blocks.1 | forward blocks.2 | free blocks.2 | pre-backward root | pre-backward blocks.2 | gather blocks.2 | post-backward blocks.2 | free blocks.2 | pre-backward blocks.1 | gather blocks.1 | post-backward blocks.1 | free blocks.1 | pre-backward blocks.0 | gather blocks.0 | post-backward blocks.0 | free blocks.0 | post-backward root | free root""",
        )
        self.assertEqual(collectives, {"all_gather": 7, "reduce_scatter": 4})
        self.assertEqual(peak, 3)  # the root, the computing block and the next one

    def test_backward_pre_gathers_the_next_unit_before_the_current_gradient(self):
        events, collectives, peak = _events(self.pool, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
        self.assertExpectedInline(
            events,
            """forward root | gather root | gather blocks.0 | forward blocks.0 | gather blocks.1 | free blocks.0 | forward blocks.1 | gather blocks.2 | free blocks.1 | forward blocks.2 | free blocks.2 | pre-backward root | gather blocks.2 | pre-backward blocks.2 | gather blocks.1 | post-backward blocks.2 | free blocks.2 | pre-backward blocks.1 | gather blocks.0 | post-backward blocks.1 | free blocks.1 | pre-backward blocks.0 | post-backward blocks.0 | free blocks.0 | post-backward root | free root""",
        )
        self.assertEqual(collectives, {"all_gather": 7, "reduce_scatter": 4})  # never gathered twice
        self.assertEqual(peak, 3)  # root, computing block, prefetched block: bounded

    def test_backward_post_gathers_the_next_unit_after_the_current_gradient(self):
        events, collectives, peak = _events(self.pool, backward_prefetch=BackwardPrefetch.BACKWARD_POST, overlap=False)
        self.assertExpectedInline(
            events,
            """forward root | gather root | forward blocks.0 | gather blocks.0 | free blocks.0 | forward blocks.1 | gather blocks.1 | free blocks.1 | forward blocks.2 | gather blocks.2 | free blocks.2 | pre-backward root | pre-backward blocks.2 | gather blocks.2 | post-backward blocks.2 | free blocks.2 | gather blocks.1 | pre-backward blocks.1 | post-backward blocks.1 | free blocks.1 | gather blocks.0 | pre-backward blocks.0 | post-backward blocks.0 | free blocks.0 | post-backward root | free root""",
        )
        self.assertEqual(peak, 2)

    def test_forward_prefetch_gathers_the_next_unit_before_the_current_forward(self):
        events, collectives, peak = _events(
            self.pool, backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True
        )
        forward = events[: events.index(" | pre-backward root")]
        self.assertExpectedInline(
            forward,
            """forward root | gather root | gather blocks.0 | forward blocks.0 | gather blocks.1 | free blocks.0 | forward blocks.1 | gather blocks.2 | free blocks.1 | forward blocks.2 | free blocks.2""",
        )
        self.assertEqual(collectives, {"all_gather": 7, "reduce_scatter": 4})
        self.assertEqual(peak, 3)


class CollectivesPerStepTest(TestCase):
    def test_theoretical_minimum_per_strategy(self):
        for strategy_name, expected in (
            ("FULL_SHARD", {"all_gather": 7, "reduce_scatter": 4}),  # blocks twice, root once
            ("SHARD_GRAD_OP", {"all_gather": 4, "reduce_scatter": 4}),  # every unit once
            ("NO_SHARD", {"all_reduce": 4}),
        ):
            for prefetch in (None, BackwardPrefetch.BACKWARD_PRE):
                _, collectives, _ = _events(self.pool, strategy_name=strategy_name, backward_prefetch=prefetch)
                self.assertEqual(collectives, expected, (strategy_name, prefetch))

    def test_no_sync_backward_communicates_no_gradient(self):
        for strategy_name in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            _, collectives, _ = _events(self.pool, strategy_name=strategy_name, no_sync=True)
            self.assertEqual(
                {k: v for k, v in collectives.items() if k != "all_gather"}, {}, strategy_name
            )


def _step_bytes(rank, world_size, strategy_name):
    """(bytes sent in the second step per function, the minimum for the strategy): every
    gather and every gradient reduce-scatter of a unit moves (world - 1) / world of it."""
    with recording() as rec:
        model = wrap(build(), "nested", sharding_strategy=ShardingStrategy[strategy_name])
        rec.attach(model)
        optim = make_optim(model.parameters())
        tokens, targets = (local(t, rank) for t in batch(0, world_size))
        for step in range(2):
            rec.clear()
            lm_loss(model(tokens), targets).backward()
            optim.step()
        sent = dict(rec.sent)
    minimum = 0
    for unit in ShardedDataParallel.fsdp_modules(model):
        unit_bytes = sum(h.padded_numel * h.flat_param.element_size() for h in unit.handles)
        # FULL_SHARD gathers a block for forward and again for backward; the root is kept
        gathers = 2 if strategy_name == "FULL_SHARD" and unit is not model else 1
        minimum += (gathers + 1) * unit_bytes // world_size * (world_size - 1)
    return sent, minimum


class BytesPerStepTest(TestCase):
    def test_a_sharded_step_on_gloo_sends_the_minimum(self):
        for strategy_name in ("FULL_SHARD", "SHARD_GRAD_OP"):
            for world_size in (2, 3):
                # two ranks on one host swap chunks through shared memory for both ([Note:
                # shared-memory exchange]); from three on, gloo's all-gather and all-to-all
                pair = "shared_memory" if available_here() else "all_to_all_single"  # ([Note: pair exchange])
                functions = [pair] if world_size == 2 else ["all_gather", "all_to_all_single"]
                for sent, minimum in self.pool.run(_step_bytes, world_size, strategy_name):
                    self.assertEqual(sorted(sent), functions, (strategy_name, world_size))
                    self.assertEqual(sum(sent.values()), minimum, (strategy_name, world_size))


def _sent_at_world_size_1(rank, world_size, strategy_name):
    """Every collective of two training steps (bytes sent per function, counts per kind, checks)."""
    with recording() as rec:
        model = wrap(build(), "nested", sharding_strategy=ShardingStrategy[strategy_name])
        rec.attach(model)
        optim = make_optim(model.parameters())
        tokens, targets = batch(0, world_size)
        for step in range(2):
            lm_loss(model(tokens), targets).backward()
            optim.step()
    return {**rec.sent, **rec.collectives, **({"checks": rec.checks} if rec.checks else {})}


class WorldSizeOneTest(TestCase):
    def test_nothing_is_communicated(self):
        for strategy_name in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            self.assertEqual(self.pool.run(_sent_at_world_size_1, 1, strategy_name), [{}], strategy_name)


class UnusualUnitsTest(TestCase):
    def test_a_frozen_unit_is_freed_when_its_backward_is_done(self):
        # blocks.1 has no trainable parameters: the gradients of its input end its backward
        events, collectives, peak = _events(self.pool, model_kwargs={"frozen_blocks": (1,)})
        backward = events[events.index("pre-backward root") :]
        self.assertExpectedInline(
            backward,
            """pre-backward root | pre-backward blocks.2 | gather blocks.2 | post-backward blocks.2 | free blocks.2 | pre-backward blocks.1 | gather blocks.1 | pre-backward blocks.0 | gather blocks.0 | post-backward blocks.1 | free blocks.1 | post-backward blocks.0 | free blocks.0 | post-backward root | free root""",
        )
        # (the gradient that ends blocks.1's backward is the one that starts blocks.0's, and
        # blocks.0's hook on that tensor was registered first)
        self.assertEqual(collectives, {"all_gather": 7, "reduce_scatter": 3})  # no gradient to reduce for blocks.1
        self.assertEqual(peak, 3)

    def test_a_unit_without_backward_is_never_gathered_for_backward(self):
        # the frozen embedding's input is token ids: nothing in backward involves it
        events, collectives, _ = _events(
            self.pool,
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            model_kwargs={"untied_head": True, "frozen_embed": True},
            mode="nested+embed",
        )
        self.assertNotIn("embed", events[events.index("pre-backward root") :])
        self.assertEqual(collectives, {"all_gather": 8, "reduce_scatter": 4})

    def test_a_hook_on_a_passed_through_input_gathers_nothing_again(self):
        # each block also returns its input; that tensor's gradient is complete only after
        # the block's own backward, when its hook must not gather the block again
        _, collectives, _ = _events(self.pool, model_kwargs={"output": "passthrough"})
        self.assertEqual(collectives, {"all_gather": 7, "reduce_scatter": 4})

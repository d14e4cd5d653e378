"""Training through ShardedDataParallel equals single-process training on the global batch."""

import itertools

import pytest

from flatshard import BackwardPrefetch
from tests._models import run_parity, strategy

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["nested", "single"])
@pytest.mark.parametrize("strategy_name", STRATEGIES)
def test_parity_with_single_process(rank_pool, strategy_name, mode, world_size):
    # 5 AdamW steps; the model has tied input/output embeddings and a buffer.
    rank_pool.run(run_parity, world_size, mode, sharding_strategy=strategy(strategy_name))


@pytest.mark.parametrize(
    "backward_prefetch,forward_prefetch",
    list(itertools.product([BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST, None], [False, True])),
)
def test_parity_for_each_prefetch_mode(rank_pool, backward_prefetch, forward_prefetch):
    rank_pool.run(
        run_parity, 3, "nested", backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch
    )


@pytest.mark.parametrize("strategy_name", STRATEGIES)
def test_no_sync_accumulation_matches_the_accumulated_batch(rank_pool, strategy_name):
    # 3 micro-batches per step, the first two under no_sync: the same as one step on the
    # three global micro-batches' summed gradient.
    rank_pool.run(run_parity, 2, "nested", steps=3, micro_batches=3, sharding_strategy=strategy(strategy_name))


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_backward_that_builds_a_graph_trains_like_single_process(rank_pool, world_size):
    # backward(create_graph=True): the full gradients are part of a graph (dropped before the step)
    rank_pool.run(run_parity, world_size, "nested", steps=3, create_graph=True)

"""The CUDA/NCCL path: the same code as on CPU, with device_id. Skipped without GPUs."""

import pytest
import torch

from tests._models import run_parity

GPUS = torch.cuda.device_count()


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
@pytest.mark.parametrize("strategy_name", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_parity_on_gpus_with_nccl(rank_pool, strategy_name):
    from flatshard import ShardingStrategy

    world_size = min(GPUS, 2)
    # the model is built on the CPU; device_id moves each unit to the rank's GPU, and the
    # root moves the CPU inputs there too
    rank_pool.run(
        _gpu_parity, world_size, ShardingStrategy[strategy_name], backend="nccl"
    )


def _gpu_parity(rank, world_size, strategy):
    run_parity(rank, world_size, "nested", sharding_strategy=strategy, device_id=rank)

"""FSDP1's import path ``torch.distributed.fsdp.fully_sharded_data_parallel``, under flatshard.

``from flatshard.fully_sharded_data_parallel import FullyShardedDataParallel, OptimStateKeyType``
gives flatshard's wrapper and enum. The configuration types that code commonly imports from that
torch module too (``StateDictType``, ``FullStateDictConfig``, ``ShardingStrategy``, ...) are
importable from here as well; they are the same objects as in ``flatshard.api``.
"""

from .api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from .sharded_data_parallel import ShardedDataParallel

# FSDP1's class name, so that only the module in an import line has to change.
FullyShardedDataParallel = ShardedDataParallel

# As torch's: the module's own public names; the configuration types above are re-exports.
__all__ = ["FullyShardedDataParallel", "OptimStateKeyType"]

"""flatshard: fully sharded data parallel training for PyTorch, in the style of FSDP1.

``from flatshard import ShardedDataParallel as FSDP`` replaces
``from torch.distributed.fsdp import FullyShardedDataParallel as FSDP``.
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
from .flat_param import FlatParameter, FlatParamHandle
from .sharded_data_parallel import ShardedDataParallel

# FSDP1's class name, so that only the module in an import line has to change.
FullyShardedDataParallel = ShardedDataParallel

__version__ = "0.1.0.dev0"

__all__ = [
    "ShardedDataParallel",
    "FullyShardedDataParallel",
    "FlatParameter",
    "FlatParamHandle",
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
]

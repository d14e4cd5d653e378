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
from . import comm_hooks
from .flat_param import FlatParameter, FlatParamHandle
from .plan import Plan, plan
from .sharded_data_parallel import ShardedDataParallel
from .wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

# FSDP1's class name, so that only the module in an import line has to change.
FullyShardedDataParallel = ShardedDataParallel

__version__ = "0.1.0.dev0"

__all__ = [
    "ShardedDataParallel",
    "comm_hooks",
    "FullyShardedDataParallel",
    "FlatParameter",
    "FlatParamHandle",
    "plan",
    "Plan",
    "always_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "lambda_auto_wrap_policy",
    "ModuleWrapPolicy",
    "CustomPolicy",
    "enable_wrap",
    "wrap",
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

"""flatshard: fully sharded data parallel training for PyTorch, in the style of FSDP1.

``from flatshard import ShardedDataParallel as FSDP`` replaces
``from torch.distributed.fsdp import FullyShardedDataParallel as FSDP``.
"""

import warnings

# [Note: torch's NumPy warning] torch warns when it is imported without NumPy ("Failed to
# initialize NumPy: No module named 'numpy'"). flatshard never uses NumPy, so on a machine without
# it that warning is noise (e.g. in every ``python -m flatshard.plan``). The filter is local to
# this import of torch, where the warning is raised, and to exactly that message: the caller's
# warning filters are left as they were.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy: No module named 'numpy'", category=UserWarning)
    import torch  # noqa: F401

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
from . import api, comm_hooks, fully_sharded_data_parallel, plan, sharded_grad_scaler, wrap
from .flat_param import FlatParameter, FlatParamHandle
from ._base._errors import DivergedRanksError
from ._comm._guard import CallFailedError
from ._comm._peer_failures import PeerFailedError
from .fully_sharded_data_parallel import FullyShardedDataParallel
from .plan import Plan
from .sharded_data_parallel import ShardedDataParallel
from .sharded_grad_scaler import ShardedGradScaler
from . import frameworks
from .frameworks import RewrapError, TorchFSDPPatch, patch_torch_fsdp
from . import pretrained, run_checkpoints, state_dict, teardown
from .pretrained import IncompatibleKeys, empty_init, load_pretrained
from .run_checkpoints import Resumed, RunCheckpoints, SkippedCheckpointWarning
from .teardown import destroy_process_group
from .state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

# ``wrap`` and ``plan`` are the submodules (FSDP1's ``wrap`` is a module), callable like their
# functions; importing the functions here would shadow them. See [Note: callable modules].
from .wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "ShardedDataParallel",
    "PeerFailedError",
    "CallFailedError",
    "DivergedRanksError",
    "destroy_process_group",
    "teardown",
    "comm_hooks",
    "FullyShardedDataParallel",
    "FlatParameter",
    "FlatParamHandle",
    "ShardedGradScaler",
    "frameworks",
    "patch_torch_fsdp",
    "TorchFSDPPatch",
    "RewrapError",
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
    "state_dict",
    "pretrained",
    "load_pretrained",
    "empty_init",
    "IncompatibleKeys",
    "run_checkpoints",
    "RunCheckpoints",
    "Resumed",
    "SkippedCheckpointWarning",
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]

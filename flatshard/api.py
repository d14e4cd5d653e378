"""Public enums and configuration classes.

Names, members, fields and defaults match ``torch.distributed.fsdp`` (FSDP1), so code written
against FSDP1 keeps working after changing its import line. Where a user hands us torch's own
enum member or config instead of ours, the constructor translates it by name, so mixing the two
import sources is not an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Optional, Sequence, Type

import torch
from torch import nn

__all__ = [
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "StateDictType",
    "StateDictConfig",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "LocalStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "StateDictSettings",
    "OptimStateKeyType",
]


class ShardingStrategy(Enum):
    """How parameters, gradients and optimizer state are split over the ranks.

    - ``FULL_SHARD``: parameters are gathered for a unit's forward and backward and freed after
      each; gradients and optimizer state are sharded (ZeRO-3).
    - ``SHARD_GRAD_OP``: like ``FULL_SHARD`` but parameters stay gathered from forward until
      the end of the unit's backward (ZeRO-2).
    - ``NO_SHARD``: every rank keeps everything; gradients are all-reduced (like DDP).
    - ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``: ``FULL_SHARD`` / ``SHARD_GRAD_OP`` within a
      shard group, replicated across groups.
    """

    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()


class BackwardPrefetch(Enum):
    """When the next unit's all-gather is issued during backward.

    - ``BACKWARD_PRE``: before the current unit's gradient computation.
    - ``BACKWARD_POST``: after the current unit's gradient computation.
    """

    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


@dataclass
class MixedPrecision:
    """Dtypes for computation, gradient reduction and buffers.

    Args:
        param_dtype: dtype parameters are gathered and computed in (``None``: their own dtype).
        reduce_dtype: dtype gradients are reduced in (``None``: ``param_dtype``).
        buffer_dtype: dtype of buffers (``None``: their own dtype).
        keep_low_precision_grads: keep gradients in the low precision after reduction.
        cast_forward_inputs: cast floating-point forward inputs of every unit to ``param_dtype``.
        cast_root_forward_inputs: cast floating-point forward inputs of the root unit.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[Type[nn.Module]] = (nn.modules.batchnorm._BatchNorm,)


@dataclass
class CPUOffload:
    """Whether sharded parameters (and their gradients) live on the CPU.

    Args:
        offload_params: keep parameter shards and gradient shards on the CPU.
    """

    offload_params: bool = False


class StateDictType(Enum):
    """Which form ``state_dict()`` and ``load_state_dict()`` use."""

    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


@dataclass
class StateDictConfig:
    """Base of the model state-dict configurations.

    Args:
        offload_to_cpu: move the tensors of the state dict to the CPU.
    """

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """Configuration of ``StateDictType.FULL_STATE_DICT``.

    Args:
        offload_to_cpu: move the full tensors to the CPU.
        rank0_only: only rank 0 materialises the state dict; other ranks get ``{}``.
    """

    rank0_only: bool = False


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """Configuration of ``StateDictType.SHARDED_STATE_DICT``.

    Args:
        offload_to_cpu: put the local shards of the ``DTensor`` values on the CPU.
        _use_dtensor: FSDP1's switch between ``ShardedTensor`` and ``DTensor`` values; flatshard
            always produces ``DTensor`` values (``ShardedTensor`` is deprecated in torch).
    """

    _use_dtensor: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    """Configuration of ``StateDictType.LOCAL_STATE_DICT``."""


@dataclass
class OptimStateDictConfig:
    """Base of the optimizer state-dict configurations.

    Args:
        offload_to_cpu: move the tensors of the optimizer state dict to the CPU.
    """

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    """Configuration of the full optimizer state dict.

    Args:
        offload_to_cpu: move the full tensors to the CPU.
        rank0_only: only rank 0 materialises the optimizer state dict.
    """

    rank0_only: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """Configuration of the sharded optimizer state dict."""

    _use_dtensor: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """Configuration of the local optimizer state dict."""

    offload_to_cpu: bool = False


@dataclass
class StateDictSettings:
    """The state-dict type and configurations in effect for a module."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


class OptimStateKeyType(Enum):
    """How an optimizer state dict is keyed: by parameter name or by parameter ID."""

    PARAM_NAME = auto()
    PARAM_ID = auto()

"""FSDP1's optimizer-state-dict functions, called with the model and the options directly.

[Note: direct checkpoint paths] ``ShardedDataParallel``'s static methods
(``optim_state_dict``, ``full_optim_state_dict``, ...) and ``flatshard.state_dict``'s
functions are two faces over the functions here and over ``_state_dict``'s ``model_state`` /
``load_model_state``: each face turns its own arguments into the model, the optimizer and one
``StateDictSettings`` and calls down once. Nothing below reads the units' state-dict settings
back or calls the public class, so a call enters each module it needs once: torch's API no
longer sets every unit's settings for the length of a call just so that a lower function can
read them back.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional

import torch
from torch import nn

from .._base._common import coerce_enum
from .._comm._collectives import ProcessGroup
from ..api import OptimStateKeyType, StateDictSettings, StateDictType
from ._checkpointing import model_root
from ._optim_state import LoadTarget, flatten_optim_state, gather_optim_state, optimizer_groups, optimizer_names, rekey, scatter_optim_state
from ._optim_templates import template_state

__all__ = [
    "check_group",
    "check_optim_args",
    "gather_full_optim_state",
    "gather_sharded_optim_state",
    "shard_full_optim_state",
    "scatter_full_optim_state",
    "flatten_sharded_optim_state",
    "rekey_plain_optim_state",
    "optim_state_for",
    "optim_state_to_load",
]


def check_group(model: nn.Module, group: Optional[ProcessGroup]) -> None:
    """``group`` must be ``None`` or the group ``model`` is sharded over."""
    root = model_root(model)
    if group is not None and group is not root.group:
        raise ValueError("group must be None or the process group the model is sharded over")


def check_optim_args(model: nn.Module, optim: Any, optim_input: Any, group: Optional[ProcessGroup]) -> None:
    """The checks every optimizer-state call of FSDP1's makes on its common arguments."""
    if not isinstance(optim, torch.optim.Optimizer):
        raise TypeError(f"optim must be a torch.optim.Optimizer; got {type(optim).__name__}")
    if optim_input is not None:
        raise NotImplementedError("optim_input (FSDP1's deprecated alternative to optim) is not supported here; pass optim")
    check_group(model, group)


def gather_full_optim_state(model: nn.Module, optim: torch.optim.Optimizer, rank0_only: bool) -> Dict[str, Any]:
    """Full, name-keyed optimizer state on the CPU (``{}`` off rank 0 with ``rank0_only``)."""
    return gather_optim_state(model, optim, None, rank0_only, offload=True, sharded=False)


def gather_sharded_optim_state(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    """Name-keyed optimizer state with ``DTensor`` parts, a template for every parameter."""
    with template_state(optim):
        return gather_optim_state(model, optim, None, rank0_only=False, offload=False, sharded=True)


def shard_full_optim_state(full: Dict[str, Any], model: nn.Module, optim_input: Any, optim: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
    """This rank's ID-keyed part of a full optimizer state dict every rank holds."""
    target = LoadTarget(model, optim, optim_input)
    return flatten_optim_state(model, full, target, "shard_full_optim_state_dict", collective=False)


def scatter_full_optim_state(full: Optional[Dict[str, Any]], model: nn.Module, optim_input: Any, optim: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
    """This rank's ID-keyed part of the full optimizer state dict only rank 0 holds."""
    target = LoadTarget(model, optim, optim_input)
    return scatter_optim_state(model, full, target, "scatter_full_optim_state_dict")


def flatten_sharded_optim_state(sharded: Dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    """The inverse of ``sharded_optim_state_dict``, keyed by parameter ID."""
    return flatten_optim_state(model, sharded, LoadTarget(model, optim), "flatten_sharded_optim_state_dict", collective=True)


def rekey_plain_optim_state(
    osd: Dict[str, Any], key_type: Any, model: nn.Module, optim_input: Any, optim: Optional[torch.optim.Optimizer]
) -> Dict[str, Any]:
    """An optimizer state dict re-keyed between parameter names and IDs, of a plain model or
    a wrapped one (see [Note: parameter IDs of a wrapped model])."""
    kind = coerce_enum(key_type, OptimStateKeyType, "optim_state_key_type")
    return rekey(osd, kind, optimizer_names(model, optimizer_groups(model, optim, optim_input)))  # type: ignore[arg-type]


def optim_state_for(
    model: nn.Module, optim: torch.optim.Optimizer, settings: StateDictSettings, source: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """Name-keyed optimizer state in the form ``settings`` select: full tensors
    (``FULL_STATE_DICT``) or ``DTensor`` parts with a template for every parameter
    (``SHARDED_STATE_DICT``). ``source``: ``optim.state_dict()`` to convert instead."""
    config = settings.optim_state_dict_config
    if settings.state_dict_type is StateDictType.FULL_STATE_DICT:
        rank0_only = getattr(config, "rank0_only", False)
        return gather_optim_state(model, optim, source, rank0_only, config.offload_to_cpu, sharded=False)
    if settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
        raise NotImplementedError("optim_state_dict under StateDictType.LOCAL_STATE_DICT is not supported; use FULL or SHARDED")
    with template_state(optim) if source is None else contextlib.nullcontext():
        return gather_optim_state(model, optim, source, False, config.offload_to_cpu, sharded=True)


def optim_state_to_load(
    model: nn.Module, optim: torch.optim.Optimizer, osd: Dict[str, Any], settings: StateDictSettings, load_directly: bool
) -> Dict[str, Any]:
    """The inverse of ``optim_state_dict``: this rank's ID-keyed state, loaded into ``optim``
    too with ``load_directly``. A full dict under ``rank0_only`` counts on rank 0 only."""
    target = LoadTarget(model, optim, base_rates=True)  # see [Note: initial_lr in param groups]
    if settings.state_dict_type is StateDictType.FULL_STATE_DICT and getattr(settings.optim_state_dict_config, "rank0_only", False):
        # FSDP1's rank0_only load: only rank 0's dict counts (the others pass {}).
        mine = osd if model_root(model).rank == 0 else None
        result = scatter_optim_state(model, mine, target, "optim_state_dict_to_load")
    else:
        result = flatten_optim_state(model, osd, target, "optim_state_dict_to_load", collective=True)
    if load_directly:
        optim.load_state_dict(result)
    return result

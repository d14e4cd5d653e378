"""The attributes other libraries read to tell an FSDP-managed module.

[Note: FSDP markers] Hugging Face transformers turns on ``synced_gpus`` in ``generate`` (every
rank keeps running forwards until all have finished, so ranks generating different lengths never
wait for each other forever) for modules whose ``_is_fsdp_managed_module`` attribute is true,
and other libraries test the same attribute. torch FSDP1 sets it (with
``_fsdp_use_orig_params``) on every module it manages. torch.compile reads it too, and then
treats the module as one of torch's FSDP's and traces its hooks as those of torch's FSDP --
wrong for flatshard, whose runtime must stay outside compiled graphs (see [Note:
torch.compile]). So flatshard's marker is an object that is true except while torch.compile
(or export) is compiling: libraries see an FSDP-managed module, the compiler sees a plain one.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import torch
from torch import nn

from ._common import clean_name

__all__ = ["ManagedFlag", "RewrapError", "check_not_rewrapped", "mark_fsdp_managed", "refuse_marker_write"]

# [Note: a second FSDP] A flatshard model handed to torch's own FSDP (a framework that builds
# ``torch.distributed.fsdp.FullyShardedDataParallel`` itself and does not recognise flatshard's
# wrapper) would be flattened and sharded a second time: torch's FSDP1 moves the parameters
# flatshard already owns into its own FlatParameter, and training goes wrong, in silence under
# ``use_orig_params=True``. Both of torch's implementations touch a wrapped model in a known
# way before they change anything, and flatshard refuses there:
# - FSDP1's constructor first marks every module it will manage with
#   ``_is_fsdp_managed_module = True`` (for dynamo). A flatshard wrapper refuses that write
#   (``refuse_marker_write``), and the root's first forward checks that no module under it
#   holds a marker other than flatshard's own (``check_not_rewrapped``): a module inside a unit
#   that FSDP1 wrapped on its own.
# - FSDP2 (``fully_shard``) and composable ``replicate`` go through torch's ``contract``, which
#   first takes the module's dict of composable states from ``module.__dict__``. Every module
#   flatshard manages holds a dict there that refuses those two APIs (other composable APIs,
#   e.g. activation checkpointing's ``checkpoint``, are let through).
# The errors say what fixes it: ``flatshard.patch_torch_fsdp()`` before the framework runs, so
# that the framework builds flatshard's wrapper and recognises one (and, for FSDP2, choosing
# FSDP version 1 in the framework: flatshard takes FSDP1's place only).
_SECOND_WRAP_FIX = (
    "Call flatshard.patch_torch_fsdp() before the framework runs (it makes torch's "
    "FullyShardedDataParallel flatshard's), or pass the framework the unwrapped model"
)
_REFUSED_COMPOSABLE = frozenset({"fully_shard", "replicate"})


class RewrapError(ValueError):
    """A flatshard model given to another FSDP implementation (see [Note: a second FSDP])."""


class ManagedFlag:
    """True outside compilation, false while ``torch.compiler.is_compiling()`` (see [Note: FSDP
    markers]). Holds no state."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return not torch.compiler.is_compiling()

    def __repr__(self) -> str:
        return "ManagedFlag()"


class _RefusingStates(dict):  # type: ignore[type-arg]
    """A module's dict of composable-API states (torch's ``contract``) that refuses FSDP2 and
    ``replicate``: see [Note: a second FSDP]."""

    __slots__ = ("_where",)

    def __init__(self, where: str = "a module", states: Any = ()) -> None:
        super().__init__(states)  # (the states of composable APIs applied before wrapping)
        self._where = where

    def setdefault(self, key: Any, default: Any = None) -> Any:
        name = getattr(key, "__name__", None)
        if name in _REFUSED_COMPOSABLE:
            raise RewrapError(
                f"torch's {name}() was applied to {self._where}, which flatshard already shards: a model "
                f"must not be sharded twice. flatshard takes FSDP1's place only: choose FSDP version 1 in the "
                f"framework (Trainer: fsdp_config={{'version': 1}}; accelerate: fsdp_version=1) and call "
                f"flatshard.patch_torch_fsdp() before it runs, or pass the framework the unwrapped model"
            )
        return super().setdefault(key, default)


def _composable_state_key() -> Optional[str]:
    """The ``module.__dict__`` key under which torch's ``contract`` keeps composable states
    (random per process), or ``None`` on a torch without it."""
    try:  # (the package exports a function of the same name as the module)
        contract = importlib.import_module("torch.distributed._composable.contract")
    except ImportError:  # (a torch built without distributed)
        return None
    key = getattr(contract, "STATE_KEY", None)
    return key if isinstance(key, str) else None


def mark_fsdp_managed(root: nn.Module, use_orig_params: bool) -> None:
    """Mark every module under ``root`` (itself included) as FSDP-managed, as torch FSDP1 does,
    and make it refuse FSDP2 (see [Note: a second FSDP])."""
    flag = ManagedFlag()
    state_key = _composable_state_key()
    for name, module in root.named_modules():
        module.__dict__["_is_fsdp_managed_module"] = flag
        module.__dict__["_fsdp_use_orig_params"] = use_orig_params
        states = module.__dict__.get(state_key) if state_key is not None else None
        if state_key is not None and not isinstance(states, _RefusingStates) and isinstance(states, (dict, type(None))):
            where = f"'{clean_name(name)}' ({type(module).__name__})" if name else f"the model ({type(module).__name__})"
            module.__dict__[state_key] = _RefusingStates(where, states or ())


def refuse_marker_write(wrapper: nn.Module, name: str, value: Any) -> None:
    """Called by a wrapper's ``__setattr__``: a write of ``_is_fsdp_managed_module`` from
    outside flatshard is torch FSDP1's constructor wrapping the model (see [Note: a second
    FSDP])."""
    if name == "_is_fsdp_managed_module" and not isinstance(value, ManagedFlag):
        raise RewrapError(
            f"torch's FullyShardedDataParallel is wrapping a model that holds a flatshard "
            f"{type(wrapper).__name__}: a model must not be sharded twice. {_SECOND_WRAP_FIX}"
        )


def check_not_rewrapped(root: nn.Module) -> None:
    """At the root's first forward: no module under ``root`` was marked by another FSDP
    since flatshard marked it (see [Note: a second FSDP])."""
    for name, module in root.named_modules():
        marker = module.__dict__.get("_is_fsdp_managed_module")
        if marker is not None and not isinstance(marker, ManagedFlag):
            raise RewrapError(
                f"'{clean_name(name)}' ({type(module).__name__}), inside a flatshard model, was wrapped by "
                f"another FSDP implementation (torch's FullyShardedDataParallel marked it): a model must not be "
                f"sharded twice. {_SECOND_WRAP_FIX}"
            )

"""``copy.deepcopy`` of a wrapped model: an independent model, as the copy of the unwrapped one.

[Note: deep copies] EMA and SWA (``torch.optim.swa_utils.AveragedModel``) deep-copy the model
and then train, evaluate and average the copy on its own. A copy of a wrapped model must behave
exactly as the copy of the single-process model would: its own shards (copies of the
original's, with every write the user made taken into them first, see [Note: writes to original
parameters]), its own full flat tensors, no gradients (a copied ``nn.Parameter`` has none), no
runtime until its first forward (which, like any root's first forward, checks the ranks agree
and makes its own exchange -- shared memory included), no hooks of the original's, and
original parameters that are views of *its* shards. It shares only what is not the model's:
the process groups, the device mesh and a communication hook with its state.

So the root wrapper's ``__deepcopy__`` settles the model (a backward that raised, writes taken,
gathers completed), copies it with ``copy.deepcopy``'s own machinery -- the units, handles,
communicators and placeholders define ``__deepcopy__`` to leave out what is the runtime's --
and, once everything is copied (a handle's modules may be half-built while it is copied),
lets each copied handle put its placeholders, parameters or views on its modules. Views of the
original's full flat tensors are never copied: the copy starts sharded. Every rank must copy
(the copy's first forward is collective, as the original's was). A unit nested in another
cannot be copied alone: its parameters are the root's to schedule.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Tuple

from torch import nn

from .._base._common import TrainingState
from ._runtime import settle
from ._stale_optimizer import watch_stale_optimizers
from ._unit import Unit, root_of, unit_of

__all__ = ["copy_model"]

# What the memo entry that marks a root being copied is keyed by (besides the root unit's id).
_COPYING = "flatshard: copying the units of root"
# What a view of an original full flat tensor is copied as (the copy starts sharded).
_NOT_COPIED = object()


def copy_model(wrapper: nn.Module, memo: Dict[Any, Any]) -> nn.Module:
    """``copy.deepcopy(wrapper, memo)`` for a ``ShardedDataParallel`` (see [Note: deep copies])."""
    unit = unit_of(wrapper)
    if unit is None:
        raise AssertionError(f"copy_model: {type(wrapper).__name__} is not a ShardedDataParallel")
    root = root_of(unit)
    key: Tuple[str, int] = (_COPYING, id(root))
    is_root_copy = key not in memo
    if is_root_copy:
        if unit is not root:
            raise ValueError(
                f"copy.deepcopy of the ShardedDataParallel unit at '{unit.name}' alone is not supported: it is "
                f"nested in another unit, which schedules its parameters; copy the outermost one (the root)"
            )
        _settle(root)
        memo[key] = True
        for member in root.members():
            for handle in member.handles:
                for view in handle.installed_views():
                    memo[id(view)] = _NOT_COPIED
    new = type(wrapper).__new__(type(wrapper))
    memo[id(wrapper)] = new
    new.__setstate__(copy.deepcopy(wrapper.__dict__, memo))
    if is_root_copy:
        new_root = unit_of(new)
        for member in new_root.members():  # type: ignore[union-attr]
            for handle in member.handles:
                handle.after_copy()
        new._stale_optimizer_check = watch_stale_optimizers(new, new_root)
    return new


def _settle(root: Unit) -> None:
    """Make the model's state copyable: idle, every write taken, no gather in flight."""
    settle(root.ctx)
    for member in root.members():
        if member.training_state is not TrainingState.IDLE:
            raise RuntimeError(
                f"{member.where()}: copy.deepcopy of a ShardedDataParallel model cannot run while a unit is in "
                f"{member.training_state.name} (during forward, backward or summon_full_params); copy it "
                f"between iterations"
            )
    for member in root.members():
        for handle in member.handles:
            handle.finish_gather()
            handle.take_user_writes()

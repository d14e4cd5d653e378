"""``clip_grad_norm_``: clip the gradients of a sharded model by their global norm.

[Note: gradient norm over shards] A sharded ``FlatParameter``'s ``.grad`` is this rank's
shard of the averaged gradient, so the shards of all ranks together hold every element once:
their ``sum |g|^p`` (or ``max |g|``) is reduced over the root's process group. Every other
gradient (``NO_SHARD`` and world-size-1 handles, parameters of ignored modules) is held whole by
every rank and must be counted once: rank 0 of the group adds it to the sum (every rank adds it
to the max). So every rank gets the same norm from one all-reduce, and scales by the same
coefficient even if the ranks' ignored gradients were never synchronised (torch FSDP1 adds them
on every rank after the reduction, so its ranks can disagree and clip one parameter's shards by
different factors).

Per-tensor norms are taken in the gradients' own dtype (as ``torch.nn.utils.clip_grad_norm_``
does) and combined in float64. The returned norm has the dtype torch's would have for the same
gradients, the promotion of their dtypes (float64 if any is; the default dtype if this rank has
none), and lives on the root's device.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from ._checkpointing import check_grads_averaged, check_idle, take_user_writes
from .._flat._layout import held_numel
from .._engine._unit import BackwardState, Unit
from .._flat._flat_param import FlatParamHandle

_WHAT = "clip_grad_norm_()"


def clip_grad_norm_(root_unit: Unit, module: nn.Module, max_norm: Any, norm_type: Any = 2.0) -> torch.Tensor:
    """Scale every gradient of ``module`` (the root wrapper of ``root_unit``) in place so that
    their global ``norm_type``-norm is at most ``max_norm``; return that norm (before clipping).

    Collective over the root's process group: every rank must call it (one all-reduce)."""
    max_norm, p = _check_args(max_norm, norm_type)
    units = _check_callable(root_unit)
    sharded, whole = _gradients(units, module)
    device = root_unit.device
    if math.isinf(p):
        local = torch.stack([_local_max(sharded, device), _local_max(whole, device)]).max()
        root_unit.comm.all_reduce(local, "max")
        total = local
    else:
        local = _local_power_sum(sharded, p, device)
        if root_unit.rank == 0:
            local = local + _local_power_sum(whole, p, device)
        root_unit.comm.all_reduce(local, "sum")
        total = local ** (1.0 / p)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [g for g, _ in sharded] + [g for g, _ in whole]
    on_device: Dict[torch.device, torch.Tensor] = {}
    for grad in grads:
        if grad.device not in on_device:
            on_device[grad.device] = coef.to(grad.device)
        grad.mul_(on_device[grad.device])
    dtypes = [g.dtype for g in grads]
    if not dtypes:
        # (FSDP1's words, which code written for it matches; usually a clip before backward)
        warnings.warn(
            f"{_WHAT} was called on rank {root_unit.rank} with no gradients -- returning the total norm in "
            f"the default dtype {torch.get_default_dtype()}",
            stacklevel=3,
        )
    dtype = functools.reduce(torch.promote_types, dtypes) if dtypes else torch.get_default_dtype()
    return total.to(dtype)


def _check_args(max_norm: Any, norm_type: Any) -> Tuple[float, float]:
    """``(max_norm, norm_type)`` as floats, after checking them."""
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"clip_grad_norm_: {name} must be a real number; got {value!r}")
    max_norm, p = float(max_norm), float(norm_type)
    if not max_norm >= 0.0:  # (also refuses nan)
        raise ValueError(f"clip_grad_norm_: max_norm must be non-negative; got {max_norm!r}")
    if not p > 0.0:
        raise ValueError(f"clip_grad_norm_: norm_type must be positive (e.g. 2.0) or inf; got {p!r}")
    return max_norm, p


def _check_callable(root_unit: Unit) -> List[Unit]:
    """The root's units, after checking that clipping may run now (on the root, every unit
    idle, no backward running)."""
    if not root_unit.is_root:
        raise RuntimeError(
            f"{root_unit.where()}: {_WHAT} should only be called on the root FSDP instance (the outermost "
            f"ShardedDataParallel), which holds every gradient of the model, not on a nested unit"
        )
    units = [root_unit] + [unit for _, unit in root_unit.descendants]
    check_idle(units, _WHAT)
    take_user_writes(units, _WHAT)
    ctx = root_unit.ctx
    if ctx is not None and ctx.backward_state is not BackwardState.IDLE:
        raise RuntimeError(f"{root_unit.where()}: {_WHAT} cannot be used during backward; call it after backward")
    return units


_Grads = List[Tuple[torch.Tensor, torch.Tensor]]  # (gradient to scale, the part of it to measure)


def _gradients(units: List[Unit], module: nn.Module) -> Tuple[_Grads, _Grads]:
    """(the gradients sharded over the ranks, the gradients every rank holds whole), each as
    (gradient, the part that counts: a shard's padding is left out)."""
    handles: Dict[int, FlatParamHandle] = {id(h.flat_param): h for unit in units for h in unit.handles}
    for handle in handles.values():
        handle.drop_grad_if_zeroed()  # (a no_sync gradient the user zeroed since does not count)
    check_grads_averaged(units, f"{units[0].where()}: {_WHAT}")
    group = units[0].group
    sharded: _Grads = []
    whole: _Grads = []
    # Originals kept as views of a shard (use_orig_params) count through their handle's shard gradient.
    viewed = {id(p) for h in handles.values() if h.orig is not None for p in h.orig.params}
    flat_grads = [(h, h.flat_grad()) for h in handles.values()]
    others = [(None, p.grad) for p in module.parameters() if id(p) not in handles and id(p) not in viewed]
    for handle, grad in flat_grads + others:
        if grad is None:
            continue
        grad = grad.detach()
        if handle is None or not handle.sharded:
            whole.append((grad, grad))
            continue
        if handle.comm.group is not group:
            raise NotImplementedError(f"{_WHAT} with units sharded over different process groups is not supported")
        sharded.append((grad, grad.reshape(-1)[: held_numel(handle.numel, handle.shard_numel, handle.rank)]))
    return sharded, whole


def _local_power_sum(grads: _Grads, p: float, device: torch.device) -> torch.Tensor:
    """``sum |g|^p`` over the measured parts, in float64 on ``device``."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for _, part in grads:
        norm = torch.linalg.vector_norm(part, p).to(device=device, dtype=torch.float64)
        total = total + norm**p
    return total


def _local_max(grads: _Grads, device: torch.device) -> torch.Tensor:
    """``max |g|`` over the measured parts (0 without any), in float64 on ``device``."""
    result = torch.zeros((), dtype=torch.float64, device=device)
    for _, part in grads:
        if part.numel():
            result = torch.maximum(result, torch.linalg.vector_norm(part, math.inf).to(device=device, dtype=torch.float64))
    return result

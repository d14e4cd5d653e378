"""``summon_full_params``: the full original parameters on the modules, outside forward and
backward.

[Note: summoned units] Inside the context each summoned unit is in the SUMMON_FULL_PARAMS
state, its handles are gathered, and its modules hold ``nn.Parameter``s under their plain
names (``install_params``, see [Note: plain view]) instead of views or placeholders. With
``writeback`` those parameters alias the gathered full flat tensor, so in-place changes
land there and the shard's range is copied back on exit; a parameter the user *replaced*
(``module.weight = nn.Parameter(...)``) is copied back by value. Without ``writeback`` the
changes must vanish: a full flat tensor that outlives the context (``NO_SHARD``, or a unit
gathered before the context) is therefore never handed out, only a copy of it. On exit the
summoned parameters are emptied, so a reference kept past the context cannot read freed memory.
A ``with`` block that raises still writes back, as in FSDP1 -- unless the error left a guarded
call inside the block on this rank only: the peers heard of it ([Note: peer failures]), the
write-back raises, and this rank raises the block's error. A forward
inside the context runs the wrapped modules as they are, without gathering or hooks, so
evaluation and generation work on the full model.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ._checkpointing import check_grads_averaged, check_idle, check_ranks_agree, guarded_call, raise_together, take_user_writes
from .._base._common import HandleState, TrainingState, display_name, join_name
from .._base._errors import UnsupportedCombinationError
from .._comm._peer_failures import PeerFailedError
from ._plain_view import install_params
from .._engine._unit import Unit
from .._flat._flat_param import FlatParamHandle

_SUMMON = TrainingState.SUMMON_FULL_PARAMS
_IDLE = TrainingState.IDLE


def check_summon_options(**flags: Any) -> None:
    """Check ``summon_full_params``' flags (given by keyword)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"summon_full_params: {name} must be a bool; got {value!r}")
    if flags["rank0_only"] and flags["writeback"]:
        raise UnsupportedCombinationError(
            "summon_full_params: rank0_only=True with writeback=True is not supported: only rank 0 "
            "holds the full parameters, so the other ranks' shards could not be written back "
            "(pass writeback=False)"
        )


@contextlib.contextmanager
def summon_full_params(
    modules: Sequence[nn.Module],
    units: Sequence[Unit],
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> Iterator[None]:
    """Gather ``units`` and install their full parameters on ``modules`` (every module of the
    tree summoned over) for the ``with`` block; see [Note: summoned units]. Entering and
    writing back are two guarded calls ([Note: one guarded path] in ``_comm/_guard``)."""
    handles = [h for unit in units for h in unit.handles]
    values: Dict[FlatParamHandle, List[nn.Parameter]] = {}
    aliased: Dict[FlatParamHandle, bool] = {}
    with contextlib.ExitStack() as leave:
        with guarded_call(units, "summon_full_params()"):
            check_summon_options(writeback=writeback, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu, with_grads=with_grads)
            flags = f"writeback={writeback}, rank0_only={rank0_only}, offload_to_cpu={offload_to_cpu}, with_grads={with_grads}"
            _check_may_summon(units, flags, with_grads)
            for unit in units:
                unit.move((_IDLE,), _SUMMON)
            gathered_before = {h: h.state is not HandleState.SHARDED for h in handles}
            leave.callback(_leave, units, handles, gathered_before, values)
            _gather_all(handles, values, aliased, writeback, rank0_only, offload_to_cpu, with_grads, gathered_before)
        installed = [h for h in handles if h in values]
        with install_params(modules, installed, values):
            try:
                yield
            except BaseException:
                if writeback:
                    _write_back_after_error(units, values, aliased)
                raise
            if writeback:
                with guarded_call(units, _WRITING_BACK):
                    _write_back_all(units, values, aliased)


_WRITING_BACK = "the end of summon_full_params() (writing back)"


def _write_back_after_error(units: Sequence[Unit], values: Dict[FlatParamHandle, List[nn.Parameter]], aliased: Dict[FlatParamHandle, bool]) -> None:
    """The ``with`` block raised: write back all the same (as FSDP1 does), unless this rank
    left a guarded call inside the block that the others did not (they heard of it: [Note: peer
    failures]); the block's own error is what this rank raises either way."""
    try:
        with guarded_call(units, _WRITING_BACK):
            _write_back_all(units, values, aliased)
    except PeerFailedError:
        pass


def _check_may_summon(units: Sequence[Unit], flags: str, with_grads: bool) -> None:
    """Everything ``summon_full_params`` checks before gathering (some of it collective)."""
    check_idle(units, "summon_full_params")
    take_user_writes(units, "summon_full_params")
    if with_grads:
        check_grads_averaged(units, "summon_full_params(with_grads=True)")
    if units:
        items = [flags] + [f"unit {display_name(u.name)}" for u in units]
        if with_grads:
            items += [f"{'a' if h.flat_grad() is not None else 'no'} gradient for unit {display_name(u.name)}" for u in units for h in u.handles]
        check_ranks_agree(units[0], items, "summon_full_params")


def _gather_all(
    handles: List[FlatParamHandle], values: Dict[FlatParamHandle, List[nn.Parameter]], aliased: Dict[FlatParamHandle, bool],
    writeback: bool, rank0_only: bool, offload: bool, with_grads: bool, gathered_before: Dict[FlatParamHandle, bool],
) -> None:
    """Gather every handle (and its gradient), filling ``values`` with the parameters to install."""
    keep = {h: not rank0_only or h.rank == 0 for h in handles}
    for handle in handles:
        params, aliased[handle] = _summoned_params(handle, writeback, offload, gathered_before[handle])
        grads = handle.gather_grad() if with_grads else None
        if not keep[handle]:
            if not gathered_before[handle] and handle.state is not HandleState.SHARDED:
                handle.reshard()  # only rank 0 keeps them
            continue
        if grads is not None:
            for param, grad in zip(params, handle.split_full(grads)):
                param.grad = grad.cpu() if offload else grad
        values[handle] = params


def _leave(units: Sequence[Unit], handles: List[FlatParamHandle], gathered_before: Dict[FlatParamHandle, bool], values: Dict[FlatParamHandle, List[nn.Parameter]]) -> None:
    """Free what the context gathered and put the units back to IDLE."""
    _empty_summoned(values)
    for handle in handles:  # (under mixed precision a separate copy was gathered instead)
        if not gathered_before[handle] and handle.state is not HandleState.SHARDED:
            handle.reshard()
    for unit in units:
        unit.move((_SUMMON,), _IDLE)


def _empty_summoned(values: Dict[FlatParamHandle, List[nn.Parameter]]) -> None:
    """Summoned parameters kept past the context would read the full flat tensor after its
    memory is freed; emptied (as the originals are at wrapping), any such use fails loudly."""
    with torch.no_grad():
        for params in values.values():
            for param in params:
                param.grad = None
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def _summoned_params(handle: FlatParamHandle, writeback: bool, offload: bool, gathered_before: bool) -> Tuple[List[nn.Parameter], bool]:
    """The parameters to install, and whether they alias the full flat tensor."""
    views, in_full_tensor = handle.exact_views()  # (mixed precision: a full-precision copy)
    tensors = views
    if offload and handle.device.type != "cpu":
        tensors = [view.cpu() for view in views]
    elif in_full_tensor and not writeback and (not handle.sharded or gathered_before):
        tensors = [view.clone() for view in views]  # the full tensor outlives the context
    params = [nn.Parameter(t, requires_grad=handle.requires_grad) for t in tensors]
    return params, in_full_tensor and tensors is views


def _write_back_all(units: Sequence[Unit], values: Dict[FlatParamHandle, List[nn.Parameter]], aliased: Dict[FlatParamHandle, bool]) -> None:
    """Check every replaced parameter on every rank first, then write all back: either every
    shard is updated or, with an error on every rank, none."""
    replaced: Dict[FlatParamHandle, Dict[int, torch.Tensor]] = {}
    error: Optional[ValueError] = None
    try:
        for unit in units:
            for handle in unit.handles:
                replaced[handle] = _replacements(unit, handle, values[handle], aliased[handle])
    except ValueError as exc:
        error = exc
    raise_together(units, error, "summon_full_params: nothing was written back, because rank {rank} could not write back a replaced parameter (see its error)")
    for handle, changed in replaced.items():
        if aliased[handle]:
            handle.shard_from_full()
        else:
            for index, param in enumerate(values[handle]):
                handle.load_param(index, param)
        for index, value in changed.items():
            handle.load_param(index, value)


def _replacements(unit: Unit, handle: FlatParamHandle, params: List[nn.Parameter], aliased: bool) -> Dict[int, torch.Tensor]:
    """The parameters of ``handle`` the user replaced (``module.weight = ...`` or
    ``weight.data = ...``), by index; an error for one that cannot be written back."""
    replaced: Dict[int, torch.Tensor] = {}
    for module, attr, index in handle.slots():
        now = module._parameters.get(attr)
        if now is params[index]:
            if aliased and not handle.aliases(now):
                replaced.setdefault(index, now)  # its .data was replaced
            continue
        name = join_name(unit.name, handle.param_infos[index].name)
        expected = tuple(params[index].shape)
        if not isinstance(now, torch.Tensor) or tuple(now.shape) != expected:
            got = f"shape {tuple(now.shape)}" if isinstance(now, torch.Tensor) else repr(now)
            raise ValueError(
                f"summon_full_params(writeback=True): parameter '{name}' was replaced by {got}; "
                f"only a tensor of its shape {expected} can be written back to the shards"
            )
        replaced[index] = now
    return replaced


def forward_while_summoned(unit: Unit, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """A forward inside ``summon_full_params``: run the module on the summoned parameters."""
    parent = unit.parent
    if parent is not None and parent.training_state not in (_SUMMON, _IDLE):
        raise RuntimeError(
            f"{unit.where()}: its full parameters are summoned (summon_full_params), so it cannot run "
            f"inside the forward or backward of unit {display_name(parent.name)}, which is not; summon "
            f"the whole model (recurse=True) or leave the context first"
        )
    for name, member in unit.descendants:
        if member.training_state is not _SUMMON:
            raise RuntimeError(
                f"{unit.where()}: forward inside summon_full_params needs every unit under it summoned, "
                f"but unit {display_name(member.name)} is not (use recurse=True)"
            )
    return module(*args, **kwargs)

"""What every collective operation on a whole model between iterations needs: state dicts
(``_state_dict``), optimizer state (``optim_state``), ``summon_full_params`` (``_summon``) and
``clip_grad_norm_`` (``_clip``) all find the model's units, guard that they may run now (every
unit idle, gradients averaged), make the ranks agree on how they were called before the first
collective that could otherwise hang, and move full tensors in and out of ``DTensor`` parts.
This module is that shared layer; it sits above the runtime (whose ``settle`` and
``reduce_held`` the guards call) and below every such operation.

[Note: finding units] A wrapper keeps its ``Unit`` as the attribute ``_unit``; ``unit_of``
reads it, checking the type, so code below the wrapper class finds units without importing
that class or being handed a predicate for it.

[Note: load agreement] Loading is collective (``DTensor`` values are gathered), so before any
gathering the ranks compare, with one small all-gather, a digest of what they were given and
whether torch's own checks failed; a disagreement becomes an error on every rank, never a hang.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from .._comm._collectives import Communicator, all_gather_object, differences, fingerprint, first_difference, raise_on_every_rank
from .._base._common import TrainingState, clean_name
from .._base._errors import WrongStateError
from .._comm._peer_failures import together
from ._local_shards import assemble, described_shape, is_sharded_tensor
from .._engine._runtime import reduce_held, settle
from .._engine._unit import Unit, root_guard, root_of, unit_of

_SUMMON = TrainingState.SUMMON_FULL_PARAMS
_IDLE = TrainingState.IDLE


# -- finding units ------------------------------------------------------------------------


def named_units(module: nn.Module) -> List[Tuple[str, Unit]]:
    """Every unit in ``module``'s tree with its path relative to ``module`` (wrapper names
    removed), in module order."""
    found = ((path, unit_of(m)) for path, m in module.named_modules())
    return [(clean_name(path), unit) for path, unit in found if unit is not None]


def model_root(module: nn.Module) -> Unit:
    """The outermost unit in ``module``'s tree (the first in module order), whose rank and
    group a whole-model operation uses; a ``ValueError`` if ``module`` holds no unit."""
    units = [unit for _, unit in named_units(module)]
    if not units:
        raise ValueError(f"{type(module).__name__} contains no ShardedDataParallel module")
    roots = [unit for unit in units if unit.parent is None]
    return (roots or units)[0]


# -- guarded calls --------------------------------------------------------------------------


@contextlib.contextmanager
def guarded_call(model: Any, name: str, clears: bool = False, collective: bool = True) -> Iterator[None]:
    """Run the ``with`` block as the call ``name`` of the guard of every root in ``model`` (a
    module's tree, a unit, or a list of units), in order: [Note: one guarded path] in
    ``_comm/_guard``. A backward that raised is settled first, so its record precedes the call.
    ``clears``: the call restores the model's state (a load), so a failed optimizer step it
    carries does not stop it and is forgotten once it succeeds ([Note: a failed optimizer
    step] in ``_engine/_runtime``). ``collective=False``: the operation may make no collective
    (a local state dict), so an error before one is this rank's alone (``Guard.call``)."""
    if isinstance(model, Unit):
        units = [model]
    elif isinstance(model, nn.Module):
        units = [unit for _, unit in named_units(model)]
    else:
        units = list(model)
    roots = list({id(root_of(u)): root_of(u) for u in units}.values())
    with contextlib.ExitStack() as stack:
        for root in roots:
            settle(root.ctx)
            stack.enter_context(root_guard(root).call(name, clears=clears, collective=collective))
        yield


# -- guards -------------------------------------------------------------------------------


def check_idle(units: Sequence[Unit], what: str) -> None:
    """Raise unless every unit is idle: ``what`` cannot run during forward, backward or
    another ``summon_full_params``. A backward that raised is cleaned up first."""
    for ctx in {id(u.ctx): u.ctx for u in units}.values():
        settle(ctx)
    for unit in units:
        if unit.training_state is _SUMMON:
            raise WrongStateError(
                f"{unit.where()}: {what} cannot be used inside summon_full_params (the unit's "
                f"full parameters are already summoned)"
            )
        if unit.training_state is not _IDLE:
            raise WrongStateError(
                f"{unit.where()}: {what} cannot be used while the unit is in {unit.training_state.name} "
                f"(during forward or backward); call it between iterations"
            )


def take_user_writes(units: Sequence[Unit], what: str) -> None:
    """Before ``what`` reads or overwrites the shards: take into them what the user wrote to the
    parameters where they do not see it (``FlatParamHandle.take_user_writes``). A rank that
    cannot (a value of the wrong shape, a split tie) raises its error and the others raise
    naming it, before any collective of ``what`` (see [Note: raising together] in ``_collectives``)."""
    error: Optional[Exception] = None
    try:
        for handle in (h for unit in units for h in unit.handles):
            handle.take_user_writes()
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        error = exc
    raise_together(units, error, f"{what}: nothing was done, because rank {{rank}} could not take a write to its parameters into its shards (see its error)")


def raise_together(units: Sequence[Unit], error: Optional[Exception], others: str) -> None:
    """Raise on every rank of ``units``' root groups if any rank has an ``error`` (see
    [Note: raising together] in ``_collectives``): a rank its own, the others a
    ``RuntimeError`` saying ``others`` (``{rank}``: the first rank that failed)."""
    comms = communicators(units[0]) if units else []
    raise_on_every_rank(comms, error, others, units[0].device if units else torch.device("cpu"))


def communicators(root: Unit) -> List[Communicator]:
    """The root unit's group, then (hybrid sharding) the group of the ranks holding the same
    shards (see [Note: raising together] in ``_collectives``)."""
    return [root.comm] + ([root.replicate] if root.replicate is not None else [])


def check_grads_averaged(units: Sequence[Unit], what: str) -> None:
    """Before reading gradients: outside ``no_sync()``, average what ``no_sync`` backwards left
    that no synchronised backward averaged (collective, as ``optimizer.step()`` does; see
    [Note: no_sync gradients at the step] in ``_stale_optimizer``). Inside it they cannot be:
    raise."""
    for ctx in {id(u.ctx): u.ctx for u in units if u.ctx is not None}.values():
        if all(u.sync_gradients for u in ctx.units):
            reduce_held(ctx)
    for handle in (h for unit in units for h in unit.handles):
        if handle.holds_no_sync_grad():
            raise RuntimeError(
                f"{what} inside no_sync() after a backward under it: the gradients are not averaged over "
                f"the ranks yet; call it outside no_sync(), which averages them first"
            )


def check_ranks_agree(unit: Unit, items: Sequence[str], what: str) -> None:
    """Raise on every rank unless every rank passed the same ``items`` (a collective that
    only some ranks enter would hang), naming the first difference."""
    difference = first_difference(list(items), unit.comm, unit.device)
    if difference is not None:
        raise together(RuntimeError(
            f"[rank {unit.rank}] {what} is collective, but the ranks called it differently: rank 0 has "
            f"{difference.reference}, rank {difference.rank} has {difference.theirs}"
        ))


# -- load agreement -----------------------------------------------------------------------


def agree_on_load(unit: Unit, state_dict: Mapping[str, Any], error: Optional[BaseException], what: str) -> None:
    """See [Note: load agreement]. Raises ``error`` (or the first failing rank's) on every rank."""
    entries = _describe_entries(state_dict)
    if unit.world_size > 1:
        digest = fingerprint("\n".join(entries) + ("\nfailed" if error is not None else ""))
        if not unit.comm.agree(digest, unit.device):
            reports = all_gather_object((None if error is None else str(error), entries), unit.comm)
            raise together(_disagreement(unit.rank, reports, error, what))
    if error is not None:
        raise together(error)


def _describe_entries(state_dict: Mapping[str, Any]) -> List[str]:
    out = []
    for key, value in state_dict.items():
        shape = f" {described_shape(value)}" if isinstance(value, torch.Tensor) else ""
        out.append(f"{key}: {type(value).__name__}{shape}")
    return out


def _disagreement(rank: int, reports: List[Tuple[Optional[str], List[str]]], error: Optional[BaseException], what: str) -> BaseException:
    """What every rank raises where the ranks' loads differ: a rank's own error, or the first
    failing rank's, or the first difference between the state dicts."""
    if error is not None:
        return error
    failed = [r for r, (message, _) in enumerate(reports) if message is not None]
    if failed:
        return RuntimeError(f"[rank {rank}] {what} failed on rank {failed[0]}:\n{reports[failed[0]][0]}")
    difference = differences([entries for _, entries in reports], "nothing more")[0]
    return ValueError(
        f"[rank {rank}] {what}: the ranks passed different state dicts (every rank must pass the same "
        f"keys, types and shapes): entry #{difference.index} is '{difference.reference}' on rank 0 but "
        f"'{difference.theirs}' on rank {difference.rank}"
    )


# -- DTensor values -----------------------------------------------------------------------


def is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def as_dtensor(full: torch.Tensor, unit: Unit, offload: bool) -> Any:
    """This rank's part of ``full`` as a ``DTensor`` on the unit's mesh: ``Shard(0)`` in
    ``torch.chunk`` parts (``Replicate`` for 0-dim), optionally on the CPU."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if full.dim() == 0:
        local, placements = full.clone(), [Replicate()]
    else:
        local, placements = _chunk(full, unit.world_size, unit.rank).clone(), [Shard(0)]
    if offload:
        local = local.cpu()
    return DTensor.from_local(local, unit.mesh(), placements, run_check=False, shape=full.shape, stride=full.stride())


def _chunk(full: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """``rank``'s part of ``full`` along dim 0 as ``Shard(0)`` places it: ``torch.chunk``'s
    split, with empty parts for the ranks it runs out before."""
    chunks = full.chunk(world_size, dim=0)
    if rank < len(chunks):
        return chunks[rank]
    return full.new_empty((0,) + tuple(full.shape[1:]))


def full_value(value: Any, comm: Communicator) -> Any:
    """The full tensor of a state-dict value: a plain tensor as it is; a ``DTensor`` split
    ``Shard(0)`` over ``comm``'s ranks (as flatshard and FSDP1 make them) assembled with one
    all-gather on ``comm``; any other ``DTensor`` by ``full_tensor()``; a ``ShardedTensor``
    (FSDP1's and ``load_sharded_optimizer_state_dict``'s) with one all-gather over its group."""
    if is_sharded_tensor(value):
        theirs = comm.sibling(value._process_group) if getattr(value, "_process_group", None) is not None else comm
        return assemble(value, lambda out, mine: theirs.all_gather(out, mine), theirs.world_size)
    if not is_dtensor(value):
        return value
    from torch.distributed.tensor import Replicate, Shard

    mesh, shape = value.device_mesh, tuple(value.shape)
    if mesh.ndim != 1 or mesh.mesh.tolist() != comm.global_ranks():
        return value.full_tensor()
    local = value.to_local()
    if value.placements == (Replicate(),):
        return local
    if value.placements != (Shard(0),) or not shape:
        return value.full_tensor()
    rows = -(-shape[0] // comm.world_size)  # torch.chunk's part size
    padded = local.new_zeros((rows,) + shape[1:])
    padded[: local.shape[0]].copy_(local)
    out = local.new_empty((comm.world_size * rows,) + shape[1:])
    comm.all_gather(out.view(-1), padded.reshape(-1))
    return out[: shape[0]]

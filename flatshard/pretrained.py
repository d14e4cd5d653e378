"""Loading a pretrained checkpoint into a wrapped model with no rank holding more than its
shards: ``load_pretrained`` reads, on each rank, only the elements its shards hold, from a
``torch.distributed.checkpoint`` directory or Hugging Face safetensors files, straight into
the shards; ``empty_init`` lets a model built on the meta device be wrapped without
initialising what the load overwrites.

[Note: reading only this rank's shard] ``sync_module_states`` needs one rank holding the
whole model (for 70B in fp32, 280 GB of CPU memory on that rank), and a sharded state dict
loaded with ``dcp.load`` copies the shards before reading into them. Here every rank knows,
from the layout alone (``_layout``), which contiguous range of each parameter's elements its
shard holds, and asks its reader for exactly those ranges (see [Note: pieces of stored
tensors]), written into views of the shard. A rank's memory during the load is its shards
plus what its reader needs for one request: nothing for safetensors of the shard's dtype, a
bounded staging buffer otherwise, about two saved chunks for DCP (which deserialises every
saved chunk that overlaps the range, once per box: [Note: a flat range as boxes]). Buffers
(and parameters no unit flattened) are read whole on every rank, as every rank holds them.
The names are the model's state-dict keys, exactly as ``FULL_STATE_DICT`` gives them (through
the plain view); a tied parameter is read once, from the last of its names in state-dict order
that the checkpoint has: ``load_state_dict`` copies every name into the one tensor in that
order, so the last one is what it leaves (two names holding different values load as torch
loads them, whatever the file's order). The values go straight into the shards: modules' load
hooks and ``_load_from_state_dict`` overrides do not run. Units left gathered by a forward
without backward are gathered again at the end, so every view shows the loaded values at once.

Reading is local -- no collective moves data -- so its cost does not grow with the world
size. Constant-size collectives keep the ranks together ([Note: raising together] in
``_collectives``): after taking the user's writes, after planning (any rank's error, say a
file missing on one node, or a malformed file: see [Note: checking files], raises on every
rank before anything is written), on a digest of what each rank is about to read -- keys,
shapes, dtypes and the files' identities (sizes, whole headers, first and last 64 KiB), with
``verify=True`` also a digest of every byte read from -- so ranks given different checkpoints
(another step of the same run, say, or a copy that differs in its middle) are named, and
after reading (a read that failed on one rank raises everywhere).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ._checkpoint._checkpointing import check_idle, communicators, guarded_call, named_units, raise_together, take_user_writes
from ._comm._collectives import first_difference
from ._readers._dcp_reader import DcpReader, is_dcp_checkpoint
from ._checkpoint._plain_view import plain_view
from ._readers._safetensors import INDEX_NAME, SafetensorsReader
from ._readers._stored import CheckpointReader, Piece
from ._base._common import HandleState
from ._engine._unit import Unit
from ._flat._flat_param import FlatParamHandle

__all__ = ["IncompatibleKeys", "empty_init", "load_pretrained"]

_WHAT = "load_pretrained()"


class IncompatibleKeys(NamedTuple):
    """What ``load_pretrained`` did not match, as ``nn.Module.load_state_dict`` reports it."""

    missing_keys: List[str]  # the model's keys the checkpoint did not give a value
    unexpected_keys: List[str]  # the checkpoint's keys (after ``rename``) the model lacks


def load_pretrained(
    model: nn.Module,
    checkpoint: Union[str, "os.PathLike[str]"],
    *,
    rename: Optional[Callable[[str], Optional[str]]] = None,
    strict: bool = True,
    verify: bool = False,
) -> IncompatibleKeys:
    """Load the parameters and persistent buffers of ``model`` from ``checkpoint``, each rank
    reading only what its shards hold (see [Note: reading only this rank's shard]).

    Collective over the ranks of ``model``'s units; call it between iterations, on every
    rank, e.g. right after wrapping a model built on the meta device with
    ``param_init_fn=flatshard.empty_init(device)``.

    Args:
        model: a ``ShardedDataParallel`` model, or a module holding some.
        checkpoint: a ``torch.distributed.checkpoint`` directory (it holds ``.metadata``), a
            ``.safetensors`` file, a ``model.safetensors.index.json``, or a directory holding
            either of the latter two.
        rename: maps a checkpoint key to the model's key (its ``FULL_STATE_DICT`` key), or to
            ``None`` to skip the entry; by default keys are used as they are.
        strict: raise if a model key gets no value or a (renamed) checkpoint key matches no
            model key. A tied parameter needs a value under one of its names; given several,
            it takes the last in state-dict order, as ``load_state_dict`` does. With
            ``strict=False`` the missing keys keep what they held (after ``empty_init``:
            uninitialised memory).
        verify: also make sure every rank reads the same bytes: every rank reads every byte
            of every tensor the load takes (the whole checkpoint, for a whole model) and
            hashes it (SHA-256), and the ranks compare the digests, naming the first key
            whose bytes differ. Costs a full read of those tensors on every rank before the
            load. By default only the files' sizes, headers and first and last 64 KiB are
            compared.

    Returns:
        ``IncompatibleKeys(missing_keys, unexpected_keys)``.
    """
    target = model if isinstance(model, nn.Module) else []
    with guarded_call(target, _WHAT, clears=True):  # ([Note: one guarded path] in _comm/_guard)
        return _load_pretrained(model, checkpoint, rename, strict, verify)


def _load_pretrained(model: nn.Module, checkpoint: Any, rename: Optional[Callable[[str], Optional[str]]], strict: bool, verify: bool) -> IncompatibleKeys:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{_WHAT}: model must be an nn.Module; got {type(model).__name__}")
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"{_WHAT}: checkpoint must be a path (str or os.PathLike); got {type(checkpoint).__name__}")
    if rename is not None and not callable(rename):
        raise TypeError(f"{_WHAT}: rename must be a function from a checkpoint key to a model key (or None); got {type(rename).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"{_WHAT}: strict must be a bool; got {type(strict).__name__}")
    if not isinstance(verify, bool):
        raise TypeError(f"{_WHAT}: verify must be a bool; got {type(verify).__name__}")
    units = [unit for _, unit in named_units(model)]
    if not units:
        raise ValueError(f"{_WHAT}: {type(model).__name__} holds no ShardedDataParallel module; use load_state_dict() for a plain model")
    check_idle(units, _WHAT)
    take_user_writes(units, _WHAT)
    handles = [h for unit in units for h in unit.handles]
    path = os.fspath(checkpoint)
    error: Optional[Exception] = None
    plan = _Plan()
    try:
        reader = open_checkpoint(path)
        plan = _make_plan(model, handles, reader, rename or (lambda key: key), strict, verify)
    except Exception as exc:  # noqa: BLE001 - raised below, on every rank
        error = exc
    raise_together(units, error, f"{_WHAT}: nothing was loaded, because rank {{rank}} failed to plan its reads from {path!r} (see its error)")
    raise_together(units, _different_reads(units[0], plan.described), f"{_WHAT}: nothing was loaded, because the ranks read different checkpoints (see rank {{rank}}'s error)")
    try:
        with torch.no_grad():
            reader.read(plan.pieces)
            for target, scratch in plan.copy_back:
                target.copy_(scratch.view(target.shape))
    except Exception as exc:  # noqa: BLE001 - raised below, on every rank
        error = exc
    raise_together(units, error, f"{_WHAT}: rank {{rank}} failed while reading {path!r} (see its error); the model is partly loaded -- load it again")
    # (a unit left gathered by a forward without backward shows the new values at once, not
    # only from the next forward on: every rank has the same units gathered)
    for handle in handles:
        if handle.separate_full and handle.state is not HandleState.SHARDED:
            handle.refresh()
    return IncompatibleKeys(plan.missing, plan.unexpected)


def open_checkpoint(path: Union[str, "os.PathLike[str]"]) -> CheckpointReader:
    """A reader for the checkpoint at ``path`` (what ``load_pretrained`` accepts), from what
    is there: DCP's ``.metadata``, or safetensors files."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{_WHAT}: no such file or directory: {path!r}")
    if os.path.isdir(path):
        if is_dcp_checkpoint(path):
            return DcpReader(path)
        if os.path.isfile(os.path.join(path, INDEX_NAME)) or any(n.endswith(".safetensors") for n in os.listdir(path)):
            return SafetensorsReader(path)
    elif path.endswith((".safetensors", ".json")):
        return SafetensorsReader(path)
    raise ValueError(
        f"{_WHAT}: {path!r} is neither a torch.distributed.checkpoint directory (holding .metadata) nor safetensors "
        f"(a .safetensors file, a {INDEX_NAME}, or a directory holding them)"
    )


def empty_init(device: Union[torch.device, str]) -> Callable[[nn.Module], None]:
    """A ``param_init_fn`` for a model built on the meta device whose values a load will
    overwrite (``load_pretrained``): each module's own parameters and persistent buffers that
    are on the meta device get uninitialised storage on ``device``, one unit at a time, and
    nothing is computed. Tensors already on a real device are left as they are (unlike
    ``Module.to_empty``, which would empty them too).

    A non-persistent buffer on the meta device is an error: no checkpoint holds it, so it would
    stay uninitialised. Build such buffers on a real device (parameters alone on the meta
    device), or initialise their modules with ``reset_parameters()`` (the default, without
    ``param_init_fn``).

    Args:
        device: where the parameters and buffers go (the unit's compute device).
    """
    target = torch.device(device)

    def init(module: nn.Module) -> None:
        transient = getattr(module, "_non_persistent_buffers_set", set())
        left = [n for n, b in module._buffers.items() if b is not None and b.is_meta and n in transient]
        if left:
            raise ValueError(
                f"empty_init: {type(module).__name__} holds the non-persistent buffer(s) {', '.join(repr(n) for n in left)} "
                f"on the meta device; no checkpoint holds them, so they would stay uninitialised: build the buffers on a "
                f"real device, or wrap without param_init_fn so that the module's reset_parameters() initialises them"
            )
        with torch.no_grad():
            for name, param in module._parameters.items():
                if param is not None and param.is_meta:
                    module._parameters[name] = nn.Parameter(torch.empty_like(param, device=target), requires_grad=param.requires_grad)
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_meta:
                    module._buffers[name] = torch.empty_like(buffer, device=target)

    return init


# -- planning ------------------------------------------------------------------------------


@dataclass
class _Plan:
    """What this rank reads, and what it reports."""

    pieces: List[Piece] = field(default_factory=list)
    # (tensor, scratch): a non-contiguous buffer is read into scratch and copied back
    copy_back: List[Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)
    described: List[str] = field(default_factory=list)  # compared across the ranks


# A parameter a unit flattened (its handle and index), or a tensor the model holds as it is.
_Where = Union[Tuple[FlatParamHandle, int], torch.Tensor]


def _make_plan(
    model: nn.Module,
    handles: Sequence[FlatParamHandle],
    reader: CheckpointReader,
    rename: Callable[[str], Optional[str]],
    strict: bool,
    verify: bool,
) -> _Plan:
    sources = _sources(reader, rename)
    plan = _Plan()
    mismatches: List[str] = []
    held = {h: {s.index: s for s in h.shard_param_infos} for h in handles}
    model_keys = set()
    read: List[str] = []  # the checkpoint keys the load reads from (on some rank)
    for names, where in _targets(model, handles):
        model_keys.update(names)
        # (a tie: the last of its names, what load_state_dict's copies in this order leave)
        chosen = next((n for n in reversed(names) if n in sources), None)
        if chosen is None:
            plan.missing += names
            continue
        key = sources[chosen]
        if key in reader.unreadable:
            raise NotImplementedError(f"{_WHAT}: '{chosen}' cannot be read: {reader.unreadable[key]}")
        stored, shape = reader.tensors[key], _shape(where)
        if stored.shape != shape:
            mismatches.append(
                f"size mismatch for {chosen}: copying a param with shape {torch.Size(stored.shape)} from checkpoint "
                f"(key '{key}'), the shape in current model is {torch.Size(shape)}."
            )
            continue
        plan.described.append(f"{chosen} <- {key} {stored.dtype}")
        read.append(key)
        plan.pieces += _pieces(key, where, held, plan.copy_back)
    plan.unexpected = [model_key for model_key in sources if model_key not in model_keys]
    problems = mismatches
    if strict and plan.unexpected:
        problems = [f"Unexpected key(s) in checkpoint: {', '.join(repr(k) for k in plan.unexpected)}."] + problems
    if strict and plan.missing:
        problems = [f"Missing key(s) in checkpoint: {', '.join(repr(k) for k in plan.missing)}."] + problems
    if problems:
        raise RuntimeError(f"Error(s) in {_WHAT} for {type(model).__name__} from {reader.path!r}:\n\t" + "\n\t".join(problems))
    plan.described += [f"missing {k}" for k in plan.missing] + [f"unexpected {k}" for k in plan.unexpected]
    plan.described.append(f"files {reader.identity()}")
    if verify:
        plan.described += reader.digests(read)
    return plan


def _sources(reader: CheckpointReader, rename: Callable[[str], Optional[str]]) -> Dict[str, str]:
    """model key -> checkpoint key, for every checkpoint tensor ``rename`` keeps."""
    out: Dict[str, str] = {}
    for key in list(reader.tensors) + list(reader.unreadable):
        name = rename(key)
        if name is None:
            continue
        if not isinstance(name, str):
            raise TypeError(f"{_WHAT}: rename must return a model key (str) or None; for '{key}' it returned {type(name).__name__}")
        if name in out:
            raise ValueError(f"{_WHAT}: rename maps two checkpoint keys, '{out[name]}' and '{key}', to the model key '{name}'")
        out[name] = key
    return out


def _targets(model: nn.Module, handles: Sequence[FlatParamHandle]) -> List[Tuple[List[str], _Where]]:
    """The model's state-dict entries, grouped by tensor (a tied parameter's names together),
    in state-dict order, each with where its value goes."""
    standins = {h: [torch.empty(info.shape, dtype=h.dtype, device="meta") for info in h.param_infos] for h in handles}
    flattened = {id(t): (h, i) for h, ts in standins.items() for i, t in enumerate(ts)}
    with plain_view(model, handles, standins) as inner:
        state = inner.state_dict(keep_vars=True)
    groups: Dict[int, Tuple[List[str], _Where]] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise NotImplementedError(f"{_WHAT}: '{key}' is a module's extra state ({type(value).__name__}), which is not read from checkpoints")
        where: _Where = flattened.get(id(value), value)
        if where is value and value.is_meta:
            raise ValueError(
                f"{_WHAT}: '{key}' is on the meta device (never materialised, or a state-dict hook replaced it); "
                f"load_pretrained reads into the model's own tensors"
            )
        groups.setdefault(id(value), ([], where))[0].append(key)
    return list(groups.values())


def _shape(where: _Where) -> Tuple[int, ...]:
    if isinstance(where, torch.Tensor):
        return tuple(where.shape)
    handle, index = where
    return tuple(handle.param_infos[index].shape)


def _pieces(key: str, where: _Where, held: Dict[FlatParamHandle, Dict[int, Any]], copy_back: List[Tuple[torch.Tensor, torch.Tensor]]) -> List[Piece]:
    if isinstance(where, torch.Tensor):
        tensor = where.detach()
        if tensor.is_contiguous():
            return [Piece(key, 0, tensor.view(-1))]
        scratch = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        copy_back.append((tensor, scratch))
        return [Piece(key, 0, scratch)]
    handle, index = where
    part = held[handle].get(index)
    if part is None:  # (this rank's shard holds none of it)
        return []
    shard = handle.flat_param.detach()
    return [Piece(key, part.param_offset, shard[part.shard_offset : part.shard_offset + part.numel])]


# -- keeping the ranks together ------------------------------------------------------------


def _different_reads(root: Unit, described: List[str]) -> Optional[Exception]:
    """An error naming the first difference if the ranks are about to read different keys,
    shapes, dtypes or files, else ``None``. Compared in each of the root's groups, every rank
    taking part in every comparison (a rank that stopped early would leave the others waiting)."""
    found: Optional[Exception] = None
    for comm in communicators(root):
        difference = first_difference(described, comm, root.device)
        if difference is not None and found is None:
            ranks = comm.global_ranks()
            found = RuntimeError(
                f"[rank {ranks[comm.rank]}] {_WHAT}: the ranks read different checkpoints: rank {ranks[0]} reads "
                f"{difference.reference}, rank {ranks[difference.rank]} reads {difference.theirs}"
            )
    return found

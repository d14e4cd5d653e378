"""The layout of a unit's flat tensor: which original parameters it holds, where each one
sits, what each rank's shard holds of them, and the padded and shard sizes. Pure functions
of the parameters' shapes (no process group), so they are tested without ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

__all__ = ["OrigParam", "ParamInfo", "SharedParamInfo", "ShardParamInfo", "shard_sizes", "held_numel", "shard_param_infos", "layout", "flatten"]


@dataclass(frozen=True)
class OrigParam:
    """One registration of an original parameter in the tree of the module being wrapped."""

    name: str  # e.g. "blocks.0.fc.weight", relative to the wrapped module
    module_name: str
    module: nn.Module
    attr_name: str
    param: nn.Parameter


@dataclass(frozen=True)
class ParamInfo:
    """Layout of one original parameter inside the (unpadded) flat tensor."""

    name: str
    module_name: str
    attr_name: str
    shape: torch.Size
    numel: int
    offset: int


@dataclass(frozen=True)
class SharedParamInfo:
    """A further registration of an already flattened parameter (a tied weight)."""

    name: str
    module_name: str
    attr_name: str
    primary: int  # index into ``param_infos``


@dataclass(frozen=True)
class ShardParamInfo:
    """The part of one original parameter that a rank's shard holds."""

    index: int  # into ``param_infos``
    param_offset: int  # first element held, counted in the flattened parameter
    shard_offset: int  # where that element sits in the shard
    numel: int


def shard_sizes(numel: int, world_size: int, sharded: bool) -> Tuple[int, int]:
    """(padded numel, shard numel) of a flat tensor of ``numel`` elements: padded to a multiple
    of ``world_size`` and split evenly when sharded (over more than one rank), else whole."""
    if not sharded or world_size == 1:
        return numel, numel
    padded = math.ceil(numel / world_size) * world_size
    return padded, padded // world_size


def held_numel(numel: int, shard_numel: int, rank: int) -> int:
    """How many elements of a flat tensor of ``numel`` elements ``rank``'s shard of
    ``shard_numel`` holds (the rest of the shard is padding)."""
    return max(0, min(shard_numel, numel - rank * shard_numel))


def shard_param_infos(infos: Sequence[ParamInfo], shard_numel: int, rank: int) -> Tuple[ShardParamInfo, ...]:
    """Which original parameters (and which of their elements) ``rank``'s shard holds."""
    start, end = rank * shard_numel, (rank + 1) * shard_numel
    held = []
    for index, info in enumerate(infos):
        lo, hi = max(start, info.offset), min(end, info.offset + info.numel)
        if lo < hi:
            held.append(ShardParamInfo(index, lo - info.offset, lo - start, hi - lo))
    return tuple(held)


_Layout = Tuple[List[OrigParam], Tuple[ParamInfo, ...], Tuple[SharedParamInfo, ...], List[Tuple[nn.Module, str, int]]]


def layout(params: Sequence[OrigParam]) -> _Layout:
    """Split registrations into primaries (first registration of each parameter object) and
    shared ones, lay the primaries out one after another, and list every registration's
    (module, attribute, primary index)."""
    primaries: List[OrigParam] = []
    index_of: Dict[int, int] = {}
    infos: List[ParamInfo] = []
    shared: List[SharedParamInfo] = []
    slots: List[Tuple[nn.Module, str, int]] = []
    offset = 0
    for p in params:
        index = index_of.get(id(p.param))
        if index is not None:
            shared.append(SharedParamInfo(p.name, p.module_name, p.attr_name, index))
        else:
            index = index_of[id(p.param)] = len(primaries)
            primaries.append(p)
            infos.append(ParamInfo(p.name, p.module_name, p.attr_name, p.param.shape, p.param.numel(), offset))
            offset += p.param.numel()
        slots.append((p.module, p.attr_name, index))
    return primaries, tuple(infos), tuple(shared), slots




def flatten(params: Sequence[nn.Parameter], padded_numel: int, device: torch.device) -> torch.Tensor:
    """A new 1-D tensor on ``device``: the parameters' values one after another, zero padded."""
    dtype = params[0].dtype
    flat = torch.zeros(padded_numel, dtype=dtype, device=device)
    offset = 0
    with torch.no_grad():
        for p in params:
            flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
            offset += p.numel()
    return flat

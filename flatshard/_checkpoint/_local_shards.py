"""FSDP1's ``ShardedTensor`` values: a ``LOCAL_STATE_DICT``'s flat shards, and the full tensor
of any ``ShardedTensor`` a loader is given (``load_sharded_optimizer_state_dict`` makes them).

[Note: local shards as ShardedTensors] FSDP1 saves a unit's flat parameter under
``<unit path>._flat_param`` as a one-dimensional ``ShardedTensor`` of the unpadded full size,
whose local shard is this rank's part without padding (none on a rank that holds only
padding); code written for it calls ``.local_shards()`` on the values. The global metadata is
built here from the layout every rank already knows, so saving needs no collective (FSDP1's
``init_from_local_shards`` gathers it). Loading takes such a value, or a plain tensor holding
the padded shard, and checks what the value says about where it came from -- the full size,
the number of ranks, this rank's offset -- before anything is copied.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

from .._flat._layout import held_numel

__all__ = ["as_sharded_tensor", "assemble", "described_shape", "is_sharded_tensor", "local_shard_problem", "local_tensor"]


def as_sharded_tensor(shard: torch.Tensor, numel: int, rank: int, world_size: int, group: Any) -> Any:
    """``shard`` (this rank's padded flat shard) as FSDP1's ``ShardedTensor`` of ``numel``
    elements over ``group``'s ``world_size`` ranks."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    shard_numel = shard.numel()
    device = shard.device
    shards: List[ShardMetadata] = [
        ShardMetadata(shard_offsets=[r * shard_numel], shard_sizes=[held_numel(numel, shard_numel, r)], placement=f"rank:{r}/{device}")
        for r in range(world_size)
        if held_numel(numel, shard_numel, r) > 0
    ]
    properties = TensorProperties(
        dtype=shard.dtype, layout=shard.layout, requires_grad=shard.requires_grad, memory_format=torch.contiguous_format, pin_memory=False
    )
    metadata = ShardedTensorMetadata(shards_metadata=shards, size=torch.Size([numel]), tensor_properties=properties)
    mine = held_numel(numel, shard_numel, rank)
    local = [Shard.from_tensor_and_offsets(shard[:mine], [rank * shard_numel], rank)] if mine else []
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata, process_group=group)


def is_sharded_tensor(value: Any) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


def local_shard_problem(value: Any, key: str, numel: int, shard_numel: int, rank: int, world_size: int) -> Optional[str]:
    """Why ``value`` cannot be loaded as the flat shard ``key`` of this rank (``numel``
    elements in shards of ``shard_numel`` over ``world_size`` ranks), or ``None`` if it can."""
    if not is_sharded_tensor(value):
        if isinstance(value, torch.Tensor) and tuple(value.shape) == (shard_numel,):
            return None
        got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        return f"flat shard '{key}' has {got}; this rank's shard has shape ({shard_numel},)"
    saved = value.metadata()
    if tuple(saved.size) != (numel,):
        return f"flat shard '{key}' is part of a flat parameter of {'x'.join(map(str, saved.size))} elements; this one has {numel}"
    placed = sorted(m.placement.rank() for m in saved.shards_metadata)
    expected = [r for r in range(world_size) if held_numel(numel, shard_numel, r) > 0]
    if placed != expected:
        return f"flat shard '{key}' was saved by ranks {placed}; at this world size ({world_size}) its parts are on ranks {expected}"
    shards = value.local_shards()
    mine = held_numel(numel, shard_numel, rank)
    offsets = [s.metadata.shard_offsets[0] for s in shards]
    if offsets != ([rank * shard_numel] if mine else []):
        return f"flat shard '{key}' holds the part at offsets {offsets}; this rank's part is at [{rank * shard_numel}]"
    return None


def local_tensor(value: Any, shard_numel: int) -> torch.Tensor:
    """The padded flat shard held by ``value`` (checked by ``local_shard_problem``)."""
    if not is_sharded_tensor(value):
        return value
    # (through the metadata and the local shards: touching the ShardedTensor itself warns
    # that torch deprecates the type, once per operation)
    shards = value.local_shards()
    out = torch.zeros(shard_numel, dtype=value.metadata().tensor_properties.dtype)
    if shards:
        part = shards[0].tensor
        out = out.to(part.device)
        out[: part.numel()].copy_(part.reshape(-1))
    return out


def described_shape(value: Any) -> Tuple[int, ...]:
    """A state-dict tensor's (global) shape, without warnings for a ``ShardedTensor``."""
    return tuple(value.metadata().size) if is_sharded_tensor(value) else tuple(value.shape)


def assemble(value: Any, all_gather: Callable[[torch.Tensor, torch.Tensor], None], world_size: int) -> torch.Tensor:
    """The full tensor of the ``ShardedTensor`` ``value``, from every rank's local shards with
    one ``all_gather(output, mine)`` over its process group of ``world_size`` ranks (each rank
    packs its shards, in offset order, into a buffer as long as the largest rank's)."""
    metadata = value.metadata()
    dtype = metadata.tensor_properties.dtype
    by_rank: List[List[Any]] = [[] for _ in range(world_size)]
    for shard in metadata.shards_metadata:
        by_rank[shard.placement.rank()].append(shard)
    for shards in by_rank:
        shards.sort(key=lambda m: list(m.shard_offsets))
    sizes = [sum(_numel(m.shard_sizes) for m in shards) for shards in by_rank]
    longest = max(sizes) if sizes else 0
    local = sorted(value.local_shards(), key=lambda s: list(s.metadata.shard_offsets))
    device = local[0].tensor.device if local else torch.device("cpu")
    mine = torch.zeros(longest, dtype=dtype, device=device)
    if local:
        packed = torch.cat([s.tensor.reshape(-1) for s in local])
        mine[: packed.numel()].copy_(packed)
    gathered = torch.empty(world_size * longest, dtype=dtype, device=device)
    all_gather(gathered, mine)
    full = torch.empty(tuple(metadata.size), dtype=dtype, device=device)
    for rank, shards in enumerate(by_rank):
        start = rank * longest
        for shard in shards:
            count = _numel(shard.shard_sizes)
            region = tuple(slice(o, o + n) for o, n in zip(shard.shard_offsets, shard.shard_sizes))
            full[region].copy_(gathered[start : start + count].view(list(shard.shard_sizes)))
            start += count
    return full


def _numel(sizes: Any) -> int:
    out = 1
    for n in sizes:
        out *= int(n)
    return out

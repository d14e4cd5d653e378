"""The only module that calls ``torch.distributed`` collectives.

Differences between torch versions (e.g. ``all_gather_single`` replacing
``all_gather_into_tensor`` in newer releases) are settled here, once, at import.
"""

from __future__ import annotations

import hashlib
from typing import Any, List, Optional

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def require_initialized() -> None:
    """Raise a clear error when no default process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ShardedDataParallel needs torch.distributed to be initialised: call "
            "torch.distributed.init_process_group(backend=...) on every rank before wrapping "
            "(or launch with torchrun and call init_process_group())"
        )


def default_group() -> ProcessGroup:
    return dist.group.WORLD  # type: ignore[return-value]


def rank_of(group: ProcessGroup) -> int:
    return dist.get_rank(group)


def size_of(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


def backend_of(group: ProcessGroup) -> str:
    return str(dist.get_backend(group))


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup) -> None:
    """Fill ``output`` (``world_size * shard.numel()`` elements) with every rank's shard, in rank order."""
    _all_gather_flat(output, shard, group=group)


def reduce_scatter_mean(output: torch.Tensor, full: torch.Tensor, group: ProcessGroup) -> None:
    """Set ``output`` to this rank's chunk of the mean of ``full`` over the ranks.

    Summed then divided: gloo has no averaging reduction, and one code path keeps CPU and GPU
    numerics alike.
    """
    _reduce_scatter_flat(output, full, op=dist.ReduceOp.SUM, group=group)
    output.div_(size_of(group))


def all_reduce_mean(tensor: torch.Tensor, group: ProcessGroup) -> None:
    """Replace ``tensor`` by its mean over the ranks, in place."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    tensor.div_(size_of(group))


def broadcast_from_first(tensor: torch.Tensor, group: ProcessGroup) -> None:
    """Overwrite ``tensor`` on every rank with the group's first rank's ``tensor``."""
    if size_of(group) > 1:
        dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)


def fingerprint(text: str) -> int:
    """A 63-bit digest of ``text`` that is the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def all_ranks_agree(text: str, group: ProcessGroup, device: torch.device) -> bool:
    """Whether every rank passed the same ``text``: one all-gather of one integer per rank."""
    world = size_of(group)
    mine = torch.tensor([fingerprint(text)], dtype=torch.int64, device=device)
    if world == 1:
        return True
    everyone = torch.empty(world, dtype=torch.int64, device=device)
    _all_gather_flat(everyone, mine, group=group)
    return bool((everyone == mine).all().item())


def all_gather_object(obj: Any, group: ProcessGroup) -> List[Any]:
    """Every rank's ``obj``, in rank order (slow; for error reports and metadata only)."""
    out: List[Optional[Any]] = [None] * size_of(group)
    dist.all_gather_object(out, obj, group=group)
    return out

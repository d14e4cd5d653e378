"""Hybrid sharding's default groups: shard within each node, replicate across the nodes.

[Note: groups per node] ``HYBRID_SHARD`` (and ``_HYBRID_SHARD_ZERO2``) without
``process_group`` or ``device_mesh`` shards each unit over the ranks of one node and averages
the gradient shards over the ranks that hold the same shard on the other nodes, as FSDP1 does by
default. flatshard learns the ranks per node from the launcher's ``LOCAL_WORLD_SIZE`` (torchrun
sets it; so can a SLURM script), and relies on torchrun's numbering: the ranks of node ``n`` are
``n * L ... n * L + L - 1``. Where ``GROUP_RANK`` (torchrun's node index) says otherwise, or
``L`` does not divide the world, or nothing says ``L``, construction raises instead of guessing.

The groups are made once per constructor call: an auto-wrap plan's units share them, so every
unit's collectives run over the same groups. Each group gets the default group's timeout (the
one the user gave ``init_process_group``), not torch's default -- FSDP1's HYBRID_SHARD groups
got torch's default. Every rank makes every group, in the same order (``new_group`` needs it).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Tuple

import torch.distributed as dist

from ._collectives import (
    Communicator,
    ProcessGroup,
    default_group,
    global_rank,
    object_device,
    raise_on_every_rank,
    require_initialized,
    size_of,
    timeout_of,
)
from ._common import coerce_enum
from ._options import ConstructionOptions
from .api import ShardingStrategy

__all__ = ["NodeGroups", "node_groups"]

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def node_groups(strategy: ShardingStrategy) -> Tuple[ProcessGroup, ProcessGroup]:
    """(this rank's node's group, the group of the ranks at its place on every node), made
    over the default group (see [Note: groups per node]). Collective: every rank calls it; a
    rank whose launcher settings do not fit raises, and so does every other (no rank is left
    waiting in ``new_group``)."""
    require_initialized()
    world, rank = size_of(default_group()), global_rank()
    per_node: Optional[int] = None
    error: Optional[ValueError] = None
    try:
        per_node = _ranks_per_node(strategy, world, rank)
    except ValueError as exc:
        error = exc
    raise_on_every_rank(
        [Communicator(default_group())], error,
        f"sharding_strategy=ShardingStrategy.{strategy.name}: no node groups were made, because rank {{rank}}'s "
        f"launcher settings do not fit (see its error)",
        object_device(default_group()),
    )
    if per_node is None:
        raise AssertionError(f"[rank {rank}] node groups: no ranks per node and no error")
    timeout = timeout_of(default_group())
    node = rank // per_node
    shard: Optional[ProcessGroup] = None
    replicate: Optional[ProcessGroup] = None
    for n in range(world // per_node):
        group = dist.new_group(list(range(n * per_node, (n + 1) * per_node)), timeout=timeout)
        shard = group if n == node else shard
    for place in range(per_node):
        group = dist.new_group(list(range(place, world, per_node)), timeout=timeout)
        replicate = group if place == rank % per_node else replicate
    if shard is None or replicate is None:
        raise AssertionError(f"[rank {rank}] no node group made for rank {rank} of {world} (per node: {per_node})")
    return shard, replicate


def _ranks_per_node(strategy: ShardingStrategy, world: int, rank: int) -> int:
    """``LOCAL_WORLD_SIZE``, checked against the world and the launcher's node index."""
    what = f"[rank {rank}] sharding_strategy=ShardingStrategy.{strategy.name} without process_group or device_mesh"
    hint = "launch with torchrun, or pass process_group=(shard_group, replicate_group) or a 2-D device_mesh (replicate, shard)"
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None:
        raise ValueError(
            f"{what} shards within each node, and the ranks per node come from the launcher's LOCAL_WORLD_SIZE, "
            f"which is not set: {hint}"
        )
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"{what}: LOCAL_WORLD_SIZE must be a positive integer (ranks per node); got {raw!r}")
    per_node = int(raw)
    if world % per_node:
        raise ValueError(
            f"{what}: LOCAL_WORLD_SIZE={per_node} ranks per node does not divide the world of {world} ranks; "
            f"every node needs as many ranks ({hint})"
        )
    launcher_node = os.environ.get("GROUP_RANK", "").strip()
    if launcher_node.isdigit() and int(launcher_node) != rank // per_node:
        raise ValueError(
            f"{what}: the launcher puts this rank on node {launcher_node} (GROUP_RANK), but with "
            f"LOCAL_WORLD_SIZE={per_node} rank {rank} would be on node {rank // per_node}: the ranks are not "
            f"numbered node by node ({hint})"
        )
    return per_node


class NodeGroups:
    """The default hybrid groups of one constructor call, made when a unit first needs them
    (see [Note: groups per node])."""

    def __init__(self) -> None:
        self.groups: Optional[Tuple[ProcessGroup, ProcessGroup]] = None

    def fill(self, options: ConstructionOptions) -> ConstructionOptions:
        """``options`` with the default groups where hybrid sharding has none."""
        strategy = coerce_enum(options.sharding_strategy, ShardingStrategy, "sharding_strategy", allow_none=True)
        if strategy not in _HYBRID or options.process_group is not None or options.device_mesh is not None:
            return options
        if self.groups is None:
            self.groups = node_groups(strategy)
        return dataclasses.replace(options, process_group=self.groups)

"""Hybrid sharding's default groups: shard within each node, replicate across the nodes.

[Note: groups per node] ``HYBRID_SHARD`` (and ``_HYBRID_SHARD_ZERO2``) without
``process_group`` or ``device_mesh`` shards each unit over the ranks of one node and averages
the gradient shards over the ranks that hold the same shard on the other nodes, as FSDP1 does by
default. FSDP1 takes the node size from the number of GPUs the machine has; flatshard takes it
from the launcher's ``LOCAL_WORLD_SIZE`` where one sets it (torchrun; a SLURM script may), and
relies on torchrun's numbering: the ranks of node ``n`` are ``n * L ... n * L + L - 1``. Where
no launcher says (ranks started by ``torch.multiprocessing.spawn``), the ranks compare host
names and each host is a node, whatever its ranks' numbers (see [Note: ranks by host] in
``_host_layout``). The ranks always compare hosts (one all-gather of one integer per rank), and
``LOCAL_WORLD_SIZE`` must agree with them: no node across two hosts.

Where ``GROUP_RANK`` (torchrun's node index) disagrees with the numbering, ``L`` does not divide
the world, a node spans hosts or the hosts have different numbers of ranks, construction
raises instead of guessing; ranks that disagree on ``L`` raise too (one constant-size
comparison), all before any group is made, so no rank is left waiting in ``new_group``.

Every unit with default groups uses the same two groups, also units built by separate
constructor calls (blocks wrapped by hand, then the root): the groups carry a description
naming ``L`` and the timeout, and a later call finds them in torch's registry instead of making
more (one communicator per group under NCCL, and ``clip_grad_norm_`` needs one set). Every
rank has the same construction history, so every rank finds them, or every rank makes them,
each rank making every group in the same order (``new_group`` needs it). Each group gets the
default group's timeout (the one the user gave ``init_process_group``), not torch's default,
which FSDP1's HYBRID_SHARD groups had.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from .._comm._peer_failures import together
from .._comm._collectives import (
    Communicator,
    ProcessGroup,
    default_group,
    fingerprint,
    global_rank,
    object_device,
    raise_on_every_rank,
    registered_groups,
    require_initialized,
    size_of,
    timeout_of,
)
from .._base._common import coerce_enum
from .._comm._host_checks import takes_cpu_tensors
from .._base._options import ConstructionOptions
from ._host_layout import HostLayout, host_digest, host_name, layout_by_host, layout_by_launcher
from ..api import ShardingStrategy

__all__ = ["NodeGroups", "launcher_ranks_per_node", "node_groups", "ranks_per_node"]

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def node_groups(strategy: ShardingStrategy, device: torch.device, guard: Optional[Any] = None) -> Tuple[ProcessGroup, ProcessGroup]:
    """(this rank's node's group, the group of the ranks at its place on every node), over the
    default group (see [Note: groups per node]). Collective: every rank calls it. ``device``:
    where the ranks' comparisons run under a backend without CPU tensors (NCCL); ``guard``: the
    constructor's (its collectives are part of the constructor's call)."""
    require_initialized()
    world, rank = size_of(default_group()), global_rank()
    comm = Communicator(default_group(), guard)
    where = torch.device("cpu") if takes_cpu_tensors(default_group()) else device
    hosts = comm.gather_ints(host_digest(), where)  # (before anything can fail: every rank takes part)
    layout: Optional[HostLayout] = None
    error: Optional[ValueError] = None
    try:
        layout = _layout(strategy, world, rank, hosts)
    except ValueError as exc:
        error = exc
    raise_on_every_rank(
        [comm], error,
        f"sharding_strategy=ShardingStrategy.{strategy.name}: no node groups were made, because rank {{rank}}'s "
        f"launcher settings do not fit (see its error)",
        where,
    )
    if layout is None:
        raise AssertionError(f"[rank {rank}] node groups: no layout and no error")
    timeout = timeout_of(default_group())
    description = f"flatshard node groups, {layout.per_node} ranks per node, timeout {timeout.total_seconds():g} s"
    found = _registered(description, layout.groups_of(rank))
    if not comm.agree(fingerprint(f"{layout.describe()} {found is not None}"), where):
        launcher = os.environ.get("LOCAL_WORLD_SIZE")
        raise together(ValueError(
            f"[rank {rank}] sharding_strategy=ShardingStrategy.{strategy.name} without process_group: the ranks "
            f"disagree on LOCAL_WORLD_SIZE (this rank: {'not set' if launcher is None else layout.per_node}) or on "
            f"which node groups they made before; every rank must see the same LOCAL_WORLD_SIZE"
        ))
    return found if found is not None else _make(description, layout, rank, timeout)


def _layout(strategy: ShardingStrategy, world: int, rank: int, hosts: List[int]) -> HostLayout:
    """The launcher's nodes checked against the hosts, or the hosts' where no launcher says."""
    what = f"[rank {rank}] sharding_strategy=ShardingStrategy.{strategy.name} without process_group or device_mesh"
    where = f"this rank is on {host_name()!r}"
    per_node = launcher_ranks_per_node(strategy, world, rank)
    if per_node is None:
        return layout_by_host(hosts, what, where, _GROUPS_HINT)
    return layout_by_launcher(per_node, hosts, what, where, _GROUPS_HINT)


def _registered(description: str, wanted: Tuple[List[int], List[int]]) -> Optional[Tuple[ProcessGroup, ProcessGroup]]:
    """This rank's node groups if an earlier call made them (and they are still alive); each
    group plays one part (with one rank, both groups hold the same ranks)."""
    mine: List[Optional[ProcessGroup]] = [None, None]
    for group in registered_groups():
        if getattr(group, "group_desc", None) != description:
            continue
        ranks = dist.get_process_group_ranks(group)
        part = next((i for i, expected in enumerate(wanted) if ranks == expected and mine[i] is None), None)
        if part is not None:
            mine[part] = group
    shard, replicate = mine
    return (shard, replicate) if shard is not None and replicate is not None else None


def _make(description: str, layout: HostLayout, rank: int, timeout: Any) -> Tuple[ProcessGroup, ProcessGroup]:
    shard: Optional[ProcessGroup] = None
    replicate: Optional[ProcessGroup] = None
    for node in layout.nodes:
        group = _new_group(list(node), timeout, description)
        shard = group if rank in node else shard
    for place in layout.places:
        group = _new_group(list(place), timeout, description)
        replicate = group if rank in place else replicate
    if shard is None or replicate is None:
        raise AssertionError(f"[rank {rank}] no node group made for rank {rank} in nodes {layout.describe()}")
    return shard, replicate


def _new_group(ranks: List[int], timeout: Any, description: str) -> ProcessGroup:
    try:
        return dist.new_group(ranks, timeout=timeout, group_desc=description)
    except TypeError:  # (a torch without group descriptions: later calls make their own groups)
        return dist.new_group(ranks, timeout=timeout)


_GROUPS_HINT = "pass process_group=(shard_group, replicate_group) or a 2-D device_mesh (replicate, shard)"


def launcher_ranks_per_node(strategy: ShardingStrategy, world: int, rank: Optional[int] = None) -> Optional[int]:
    """``LOCAL_WORLD_SIZE`` (``None`` where it is not set), checked against the world and
    (given ``rank``) the launcher's node index ``GROUP_RANK``; raises ``ValueError`` naming what
    does not fit."""
    what = f"sharding_strategy=ShardingStrategy.{strategy.name} without process_group or device_mesh"
    hint = f"launch with torchrun, or {_GROUPS_HINT}"
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None:
        return None
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"{what}: LOCAL_WORLD_SIZE must be a positive integer (ranks per node); got {raw!r}")
    per_node = int(raw)
    if world % per_node:
        raise ValueError(
            f"{what}: LOCAL_WORLD_SIZE={per_node} ranks per node does not divide the world of {world} ranks; "
            f"every node needs as many ranks ({hint})"
        )
    launcher_node = os.environ.get("GROUP_RANK", "").strip()
    if rank is not None and launcher_node.isdigit() and int(launcher_node) != rank // per_node:
        raise ValueError(
            f"[rank {rank}] {what}: the launcher puts this rank on node {launcher_node} (GROUP_RANK), but with "
            f"LOCAL_WORLD_SIZE={per_node} rank {rank} would be on node {rank // per_node}: the ranks are not "
            f"numbered node by node ({hint})"
        )
    return per_node


def ranks_per_node(strategy: ShardingStrategy, world: int) -> int:
    """The planner's shard-group size for hybrid sharding without groups: ``LOCAL_WORLD_SIZE``,
    checked as ``launcher_ranks_per_node`` does. The planner runs without a process group, so it
    cannot compare the ranks' hosts: without ``LOCAL_WORLD_SIZE`` it raises ``ValueError``."""
    per_node = launcher_ranks_per_node(strategy, world)
    if per_node is None:
        raise ValueError(
            f"flatshard.plan: sharding_strategy=ShardingStrategy.{strategy.name} without process_group or device_mesh "
            f"shards within each node, and the plan, made without a process group, cannot compare the ranks' host "
            f"names: set LOCAL_WORLD_SIZE to the ranks per node (torchrun sets it), or pass a policy that gives the "
            f"units process_group=(shard_group, replicate_group)"
        )
    return per_node


class NodeGroups:
    """The default hybrid groups of one constructor call, found or made when a unit first needs
    them (see [Note: groups per node])."""

    def __init__(self, guard: Optional[Any] = None) -> None:
        self.groups: Optional[Tuple[ProcessGroup, ProcessGroup]] = None
        self.guard = guard  # the constructor's ([Note: one guarded path] in ``_comm/_guard``)

    def fill(self, options: ConstructionOptions) -> ConstructionOptions:
        """``options`` with the default groups where hybrid sharding has none."""
        strategy = coerce_enum(options.sharding_strategy, ShardingStrategy, "sharding_strategy", allow_none=True)
        if strategy not in _HYBRID or options.process_group is not None or options.device_mesh is not None:
            return options
        if self.groups is None:
            self.groups = node_groups(strategy, _device(options.device_id), self.guard)
        return dataclasses.replace(options, process_group=self.groups)


def _device(device_id: Any) -> torch.device:
    """Where a comparison over the default group runs under NCCL: the unit's device when the
    user names it (the current CUDA device may be every rank's cuda:0), else the current one."""
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    if isinstance(device_id, torch.device) and device_id.type == "cuda":
        return device_id
    return object_device(default_group())

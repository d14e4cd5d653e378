"""Which ranks share a host, and the node groups of hybrid sharding that follow from it.

[Note: ranks by host] Without a launcher that says how many ranks each node runs (ranks
started by ``torch.multiprocessing.spawn`` or ``multiprocessing.Process``, no
``LOCAL_WORLD_SIZE``), the ranks compare where they run: each contributes a 63-bit digest of
its host name and the kernel's boot id (``/proc/sys/kernel/random/boot_id``, where readable),
and the ranks with the same digest are one node. The boot id tells apart machines that carry
the same host name (containers started with one ``--hostname``); it is the same for every
process of one machine. Grouping by host needs no particular numbering: a node is the sorted
ranks of one host, in the order of their first rank, and its ``i``-th rank holds shard ``i``
(a group's ranks are numbered in ascending global rank), so the replicate group of place
``i`` is the ``i``-th rank of every node. The ranks with one host name all hold one shard
each only if every host has as many ranks; otherwise there is no layout to choose.

With a launcher's ``LOCAL_WORLD_SIZE = L``, node ``n`` is ranks ``n * L ... n * L + L - 1`` as
before, and the host names check it: a launcher's node runs on one host, so a node whose
ranks are on different hosts means ``L`` is wrong. A host may hold several nodes (two
launchers started on one machine, as the multi-node trials do).

Everything here is pure: the digests are gathered by the caller, so every rank decides on the
same list and the same errors.
"""

from __future__ import annotations

import dataclasses
import socket
from typing import Dict, List, Sequence, Tuple

from .._comm._collectives import fingerprint

__all__ = ["HostLayout", "host_digest", "host_name", "layout_by_host", "layout_by_launcher"]

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def host_name() -> str:
    return socket.gethostname()


def host_digest() -> int:
    """This process's host, as a 63-bit integer the ranks compare (see [Note: ranks by host])."""
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return fingerprint(f"{host_name()}\n{boot}")


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """The node groups of one world: ``nodes[n]`` the ranks of node ``n`` (ascending),
    ``places[i]`` the ``i``-th rank of every node (ascending)."""

    nodes: Tuple[Tuple[int, ...], ...]
    places: Tuple[Tuple[int, ...], ...]

    @property
    def per_node(self) -> int:
        return len(self.places)

    def groups_of(self, rank: int) -> Tuple[List[int], List[int]]:
        """(``rank``'s node, the ranks at its place on every node)."""
        for node in self.nodes:
            if rank in node:
                return list(node), list(self.places[node.index(rank)])
        raise AssertionError(f"[rank {rank}] node groups: rank {rank} is on no node of {self.describe()}")

    def describe(self) -> str:
        return ", ".join(str(list(node)) for node in self.nodes)


def _layout(nodes: Sequence[Tuple[int, ...]]) -> HostLayout:
    # (ascending, as torch numbers a group's ranks: a later call finds the group by its ranks)
    places = tuple(tuple(sorted(node[i] for node in nodes)) for i in range(len(nodes[0])))
    return HostLayout(tuple(nodes), places)


def _by_digest(hosts: Sequence[int]) -> List[Tuple[int, ...]]:
    members: Dict[int, List[int]] = {}
    for rank, digest in enumerate(hosts):
        members.setdefault(digest, []).append(rank)
    return [tuple(ranks) for ranks in members.values()]  # (in the order of their first rank)


def layout_by_host(hosts: Sequence[int], what: str, where: str, hint: str) -> HostLayout:
    """One node per host (``hosts``: every rank's ``host_digest``, in rank order); raises
    ``ValueError`` if the hosts have different numbers of ranks. ``what``: the setting, ``where``:
    this rank and its host name, ``hint``: what to do instead, for the message."""
    nodes = _by_digest(hosts)
    if len({len(node) for node in nodes}) > 1:
        grouped = HostLayout(tuple(nodes), ()).describe()
        raise ValueError(
            f"{what} shards within each host, but the hosts have different numbers of ranks: the host names "
            f"group the ranks as {grouped} ({where}); every host needs as many ranks ({hint})"
        )
    return _layout(nodes)


def layout_by_launcher(per_node: int, hosts: Sequence[int], what: str, where: str, hint: str) -> HostLayout:
    """Nodes of ``per_node`` consecutive ranks (the launcher's numbering; ``per_node`` divides the
    world), each on one host; raises ``ValueError`` naming the first node that is not."""
    nodes = [tuple(range(first, first + per_node)) for first in range(0, len(hosts), per_node)]
    for node in nodes:
        if len({hosts[r] for r in node}) > 1:
            grouped = HostLayout(tuple(_by_digest(hosts)), ()).describe()
            raise ValueError(
                f"{what}: LOCAL_WORLD_SIZE={per_node} puts ranks {list(node)} on one node, but they are on different "
                f"hosts: the host names group the ranks as {grouped} ({where}); a launcher's node is one host: check "
                f"LOCAL_WORLD_SIZE (unset, the host names decide), or {hint}"
            )
    return _layout(nodes)

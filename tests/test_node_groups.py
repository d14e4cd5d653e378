"""Hybrid sharding's default groups ([Note: groups per node] in ``flatshard/_build/_node_groups.py``):
with ``HYBRID_SHARD`` or ``_HYBRID_SHARD_ZERO2`` and no groups, each unit shards over its node's
ranks and replicates across the nodes; training equals single-process training; an auto-wrap
plan's units share one set of groups; the groups have the user's timeout; layouts that do not
fit raise on every rank.

The nodes come from the launcher's ``LOCAL_WORLD_SIZE`` where it is set (four pool ranks play two
nodes of two, ``LOCAL_WORLD_SIZE=2``, as torchrun sets it), else from the ranks' host names (the
pool's ranks are one host; other hosts are played by patching ``socket.gethostname`` per rank)."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Iterator, Optional
from unittest import mock

import torch.distributed as dist
from expecttest import TestCase

from flatshard import ModuleWrapPolicy, ShardedDataParallel, ShardingStrategy
from flatshard._build._host_layout import host_digest, layout_by_host, layout_by_launcher
from flatshard._comm._collectives import timeout_of
from tests._models import Block, build, error_text, run_parity


HYBRID_HINT = "pass process_group=(shard_group, replicate_group) or a 2-D device_mesh (replicate, shard)"


@contextlib.contextmanager
def _placed(rank: int, hosts: Optional[str], env: Dict[str, str]) -> Iterator[None]:
    """This rank with the launcher variables ``env`` alone (a value with commas: one per rank,
    empty for unset), on the host named ``hosts.split(",")[rank]`` (the real host, the pool's
    one, for ``None``)."""
    mine = {k: v.split(",")[rank] if "," in v else v for k, v in env.items()}
    mine = {k: v for k, v in mine.items() if v}
    with mock.patch.dict(os.environ, mine):
        for name in ("LOCAL_WORLD_SIZE", "GROUP_RANK"):
            if name not in mine:
                os.environ.pop(name, None)  # (patch.dict puts it back)
        if hosts is None:
            yield
            return
        with mock.patch("socket.gethostname", return_value=hosts.split(",")[rank]):
            yield


def _parity(rank: int, world_size: int, mode: str, strategy: str, hosts: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> None:
    with _placed(rank, hosts, {"LOCAL_WORLD_SIZE": "2"} if env is None else env):
        run_parity(rank, world_size, mode, steps=3, sharding_strategy=ShardingStrategy[strategy])


def _groups(rank: int, world_size: int, hosts: Optional[str], env: Dict[str, str]) -> Dict[str, Any]:
    with _placed(rank, hosts, env):
        model = ShardedDataParallel(build(), auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    units = [m._unit for m in model.modules() if isinstance(m, ShardedDataParallel)]
    root = model._unit
    return {
        "shard": dist.get_process_group_ranks(root.group),
        "replicate": dist.get_process_group_ranks(root.replicate_group),
        "shared": all(u.group is root.group and u.replicate_group is root.replicate_group for u in units),
        "units": len(units),
        "timeouts": [timeout_of(root.group).total_seconds(), timeout_of(root.replicate_group).total_seconds()],
        "default timeout": timeout_of(dist.group.WORLD).total_seconds(),
    }


def _by_hand_with_clipping(rank: int, world_size: int, hosts: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Blocks wrapped one by one, then the root (separate constructor calls): one set of groups
    for all of them, so clip_grad_norm_ (which needs one) works and equals the plain model's."""
    import torch

    from tests._models import batch, local

    with _placed(rank, hosts, {"LOCAL_WORLD_SIZE": "2"} if env is None else env):
        net = build()
        for i, block in enumerate(net.blocks):
            net.blocks[i] = ShardedDataParallel(block, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        model = ShardedDataParallel(net, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        again = ShardedDataParallel(build(), sharding_strategy=ShardingStrategy.HYBRID_SHARD)  # (another model)
    units = [m._unit for m in model.modules() if isinstance(m, ShardedDataParallel)] + [again._unit]
    tokens = batch(0, world_size)[0]
    model(local(tokens, rank)).sum().backward()
    norm = model.clip_grad_norm_(1.0)
    plain = build()
    plain(tokens).sum().backward()  # (the ranks' mean loss is the global batch's up to the factor)
    for p in plain.parameters():
        if p.grad is not None:
            p.grad.div_(world_size)
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
    return {
        "shared": all(u.group is units[0].group and u.replicate_group is units[0].replicate_group for u in units),
        "norm": float(norm),
        "expected": float(expected),
    }


def _disagreeing(rank: int, world_size: int, env: Dict[str, str]) -> str:
    with _placed(rank, None, env):
        try:
            ShardedDataParallel(build(), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        except ValueError as exc:
            return str(exc)
    return "built"


def _misconfigured(rank: int, world_size: int, env: Dict[str, str], hosts: Optional[str] = None) -> str:
    with _placed(rank, hosts, env):
        try:
            ShardedDataParallel(build(), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        except (ValueError, RuntimeError) as exc:
            return f"{type(exc).__name__}: {exc}"
    return "built"


class NodeGroupsTest(TestCase):
    def test_training_equals_a_single_process(self) -> None:
        for mode in ("nested", "single"):
            for strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
                with self.subTest(mode=mode, strategy=strategy):
                    self.pool.run(_parity, 4, mode, strategy)

    def test_groups_per_node_shared_by_the_plan_with_the_users_timeout(self) -> None:
        # (two launcher nodes on the pool's one host: a host may hold several nodes)
        results = self.pool.run(_groups, 4, None, {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0,0,1,1"})
        for rank, result in enumerate(results):
            self.assertEqual(result["shard"], [0, 1] if rank < 2 else [2, 3])
            self.assertEqual(result["replicate"], [rank % 2, rank % 2 + 2])
            self.assertTrue(result["shared"])
            self.assertEqual(result["units"], 4)
            self.assertEqual(result["timeouts"], [result["default timeout"]] * 2)

    def test_units_wrapped_by_hand_share_one_set_of_groups_and_clip(self) -> None:
        # (by host name too, and on one rank, where both groups hold rank 0 alone)
        # ("a,b,b,a": the second place is ranks 3 and 2 of the hosts, group ranks [2, 3])
        for world_size, hosts, env in ((4, None, None), (4, "a,a,b,b", {}), (4, "a,b,b,a", {}), (1, None, {})):
            with self.subTest(world_size=world_size, hosts=hosts):
                for result in self.pool.run(_by_hand_with_clipping, world_size, hosts, env):
                    self.assertTrue(result["shared"])
                    self.assertAlmostEqual(result["norm"], result["expected"], delta=1e-5 * result["expected"])

    def test_ranks_that_disagree_on_the_node_size_raise_on_every_rank(self) -> None:
        for env, seen in (
            ({"LOCAL_WORLD_SIZE": "2,2,4,4"}, ["2", "2", "4", "4"]),
            ({"LOCAL_WORLD_SIZE": "2,2,,"}, ["2", "2", "not set", "not set"]),  # (the others: by host name)
        ):
            for rank, outcome in enumerate(self.pool.run(_disagreeing, 4, env)):
                self.assertEqual(
                    outcome,
                    f"[rank {rank}] sharding_strategy=ShardingStrategy.HYBRID_SHARD without process_group: the ranks disagree "
                    f"on LOCAL_WORLD_SIZE (this rank: {seen[rank]}) or on which node groups they made before; every "
                    f"rank must see the same LOCAL_WORLD_SIZE",
                )

    def test_launcher_settings_that_do_not_fit_raise_on_every_rank(self) -> None:
        indivisible = self.pool.run(_misconfigured, 4, {"LOCAL_WORLD_SIZE": "3"})
        for outcome in indivisible:
            self.assertEqual(
                outcome,
                "ValueError: sharding_strategy=ShardingStrategy.HYBRID_SHARD without process_group or "
                "device_mesh: LOCAL_WORLD_SIZE=3 ranks per node does not divide the world of 4 ranks; every node needs "
                "as many ranks (launch with torchrun, or pass process_group=(shard_group, replicate_group) or a 2-D "
                "device_mesh (replicate, shard))",
            )
        # rank 2 says it is on node 0: only it finds out, and the others must not wait for it
        shuffled = self.pool.run(_misconfigured, 4, {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0,0,0,1"}, timeout=60)
        self.assertEqual(
            shuffled[2],
            "ValueError: [rank 2] sharding_strategy=ShardingStrategy.HYBRID_SHARD without process_group or device_mesh: "
            "the launcher puts this rank on node 0 (GROUP_RANK), but with LOCAL_WORLD_SIZE=2 rank 2 would be on node 1: "
            "the ranks are not numbered node by node (launch with torchrun, or pass process_group=(shard_group, "
            "replicate_group) or a 2-D device_mesh (replicate, shard))",
        )
        for rank in (0, 1, 3):
            self.assertEqual(
                shuffled[rank],
                f"RuntimeError: [rank {rank}] sharding_strategy=ShardingStrategy.HYBRID_SHARD: no node groups were made, "
                f"because rank 2's launcher settings do not fit (see its error)",
            )


class HostNamesTest(TestCase):
    """Without a launcher (ranks started by ``torch.multiprocessing.spawn``), the ranks that
    share a host name are a node."""

    def test_one_host_is_one_shard_group(self) -> None:
        for rank, result in enumerate(self.pool.run(_groups, 4, None, {})):
            self.assertEqual(result["shard"], [0, 1, 2, 3])
            self.assertEqual(result["replicate"], [rank])
            self.assertTrue(result["shared"])
            self.assertEqual(result["timeouts"], [result["default timeout"]] * 2)

    def test_each_host_is_a_shard_group_in_any_rank_order(self) -> None:
        for rank, result in enumerate(self.pool.run(_groups, 4, "a,a,b,b", {})):
            self.assertEqual(result["shard"], [0, 1] if rank < 2 else [2, 3])
            self.assertEqual(result["replicate"], [rank % 2, rank % 2 + 2])
            self.assertTrue(result["shared"])
        # (ranks dealt to the hosts in turn, as a launcher with a cyclic distribution does)
        for rank, result in enumerate(self.pool.run(_groups, 4, "a,b,a,b", {})):
            self.assertEqual(result["shard"], [0, 2] if rank % 2 == 0 else [1, 3])
            self.assertEqual(result["replicate"], [0, 1] if rank < 2 else [2, 3])
            self.assertTrue(result["shared"])

    def test_training_equals_a_single_process(self) -> None:
        for hosts in (None, "a,a,b,b", "a,b,a,b"):
            for mode, strategy in (("nested", "HYBRID_SHARD"), ("single", "_HYBRID_SHARD_ZERO2")):
                with self.subTest(hosts=hosts, mode=mode, strategy=strategy):
                    self.pool.run(_parity, 4, mode, strategy, hosts, {})

    def test_hosts_with_different_numbers_of_ranks_raise_on_every_rank(self) -> None:
        for rank, outcome in enumerate(self.pool.run(_misconfigured, 4, {}, "a,a,a,b", timeout=60)):
            self.assertEqual(
                outcome,
                f"ValueError: [rank {rank}] sharding_strategy=ShardingStrategy.HYBRID_SHARD without process_group or "
                f"device_mesh shards within each host, but the hosts have different numbers of ranks: the host names "
                f"group the ranks as [0, 1, 2], [3] (this rank is on {'ab'[rank == 3]!r}); every host needs as many "
                f"ranks ({HYBRID_HINT})",
            )

    def test_a_launcher_node_across_hosts_raises_on_every_rank(self) -> None:
        for env, hosts, node, groups in (
            ({"LOCAL_WORLD_SIZE": "2"}, "a,b,a,b", "[0, 1]", "[0, 2], [1, 3]"),
            ({"LOCAL_WORLD_SIZE": "4"}, "a,a,b,b", "[0, 1, 2, 3]", "[0, 1], [2, 3]"),
        ):
            for rank, outcome in enumerate(self.pool.run(_misconfigured, 4, env, hosts, timeout=60)):
                self.assertEqual(
                    outcome,
                    f"ValueError: [rank {rank}] sharding_strategy=ShardingStrategy.HYBRID_SHARD without process_group or "
                    f"device_mesh: LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']} puts ranks {node} on one node, but they are "
                    f"on different hosts: the host names group the ranks as {groups} (this rank is on "
                    f"{hosts.split(',')[rank]!r}); a launcher's node is one host: check LOCAL_WORLD_SIZE (unset, the "
                    f"host names decide), or {HYBRID_HINT}",
                )


class _NcclOnly:
    """A process group as a plain NCCL one is: a CUDA backend only (its timeout there)."""

    class _Backend:
        class options:
            _timeout = __import__("datetime").timedelta(seconds=42)

    def _get_backend(self, device: Any) -> Any:
        if device.type != "cuda":
            raise RuntimeError("No backend type associated with device type cpu")
        return self._Backend()


def test_a_groups_timeout_is_read_from_its_cuda_backend_when_it_has_no_cpu_one() -> None:
    # (the user's timeout for the groups flatshard makes under NCCL; reading the CPU backend
    # alone fell back to torch's default)
    assert timeout_of(_NcclOnly()).total_seconds() == 42


def test_host_layouts_of_larger_worlds() -> None:
    # (pure: the digests a gather would give, three hosts of two, dealt in turn)
    what, where = "HYBRID_SHARD", "this rank is on 'a'"
    layout = layout_by_host([7, 8, 9, 7, 8, 9], what, where, HYBRID_HINT)
    assert layout.nodes == ((0, 3), (1, 4), (2, 5))
    assert layout.places == ((0, 1, 2), (3, 4, 5))
    assert layout.groups_of(4) == ([1, 4], [3, 4, 5])
    assert layout_by_host([7, 8, 8, 7], what, where, HYBRID_HINT).places == ((0, 1), (2, 3))  # (ascending, as in a group)
    launched = layout_by_launcher(3, [7, 7, 7, 7, 7, 7], what, where, HYBRID_HINT)  # (two launchers, one host)
    assert launched.nodes == ((0, 1, 2), (3, 4, 5)) and launched.places == ((0, 3), (1, 4), (2, 5))
    assert error_text(lambda: layout_by_launcher(3, [7, 7, 8, 8, 9, 9], what, where, HYBRID_HINT), ValueError) == (
        "HYBRID_SHARD: LOCAL_WORLD_SIZE=3 puts ranks [0, 1, 2] on one node, but they are on different hosts: the host "
        "names group the ranks as [0, 1], [2, 3], [4, 5] (this rank is on 'a'); a launcher's node is one host: check "
        f"LOCAL_WORLD_SIZE (unset, the host names decide), or {HYBRID_HINT}"
    )


def test_a_host_is_its_name_and_its_boot() -> None:
    here = host_digest()
    assert host_digest() == here
    with mock.patch("socket.gethostname", return_value="elsewhere"):
        assert host_digest() != here

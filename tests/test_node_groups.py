"""Hybrid sharding's default groups ([Note: groups per node] in ``flatshard/_build/_node_groups.py``):
with ``HYBRID_SHARD`` or ``_HYBRID_SHARD_ZERO2`` and no groups, each unit shards over its node's
ranks and replicates across the nodes, the node size read from the launcher's
``LOCAL_WORLD_SIZE``; training equals single-process training; an auto-wrap plan's units share
one set of groups; the groups have the user's timeout; launcher settings that do not fit raise
on every rank.

Four pool ranks play two nodes of two (``LOCAL_WORLD_SIZE=2``, as torchrun sets it)."""

from __future__ import annotations

import os
from typing import Any, Dict
from unittest import mock

import torch.distributed as dist
from expecttest import TestCase

from flatshard import ModuleWrapPolicy, ShardedDataParallel, ShardingStrategy
from flatshard._comm._collectives import timeout_of
from tests._models import Block, build, run_parity


def _parity(rank: int, world_size: int, mode: str, strategy: str) -> None:
    with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": "2"}):
        run_parity(rank, world_size, mode, steps=3, sharding_strategy=ShardingStrategy[strategy])


def _groups(rank: int, world_size: int) -> Dict[str, Any]:
    with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(rank // 2)}):
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


def _by_hand_with_clipping(rank: int, world_size: int) -> Dict[str, Any]:
    """Blocks wrapped one by one, then the root (separate constructor calls): one set of groups
    for all of them, so clip_grad_norm_ (which needs one) works and equals the plain model's."""
    import torch

    from tests._models import batch, local

    with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": "2"}):
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


def _disagreeing(rank: int, world_size: int) -> str:
    with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": "2" if rank < 2 else "4"}):
        try:
            ShardedDataParallel(build(), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        except ValueError as exc:
            return str(exc)
    return "built"


def _misconfigured(rank: int, world_size: int, env: Dict[str, str]) -> str:
    mine = {k: v.split(",")[rank] if "," in v else v for k, v in env.items()}
    with mock.patch.dict(os.environ, mine):
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
        results = self.pool.run(_groups, 4)
        for rank, result in enumerate(results):
            self.assertEqual(result["shard"], [0, 1] if rank < 2 else [2, 3])
            self.assertEqual(result["replicate"], [rank % 2, rank % 2 + 2])
            self.assertTrue(result["shared"])
            self.assertEqual(result["units"], 4)
            self.assertEqual(result["timeouts"], [result["default timeout"]] * 2)

    def test_units_wrapped_by_hand_share_one_set_of_groups_and_clip(self) -> None:
        for result in self.pool.run(_by_hand_with_clipping, 4):
            self.assertTrue(result["shared"])
            self.assertAlmostEqual(result["norm"], result["expected"], places=5)

    def test_ranks_that_disagree_on_the_node_size_raise_on_every_rank(self) -> None:
        for rank, outcome in enumerate(self.pool.run(_disagreeing, 4)):
            self.assertEqual(
                outcome,
                f"[rank {rank}] sharding_strategy=ShardingStrategy.HYBRID_SHARD without process_group: the ranks disagree "
                f"on LOCAL_WORLD_SIZE (this rank: {2 if rank < 2 else 4}) or on which node groups they made before; every "
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

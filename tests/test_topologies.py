"""Sharded checkpoints across hybrid-sharding topologies (FSDP1 and FSDP2 users report
mismatches when hybrid sharding meets ``torch.distributed.checkpoint``): a run checkpointed
(``RunCheckpoints``: model, optimizer, step) at one topology resumes at another, and after
training on it equals single-process training of all the steps.

Topologies, replicas × shard group: ``2x2`` (4 ranks, 2 per "node"), ``1x2`` (2 ranks, one
node), ``4x1`` (4 ranks, one per node: every rank holds everything, the replicas average);
the node size is ``LOCAL_WORLD_SIZE``, as torchrun sets it, and ``HYBRID_SHARD`` makes the
groups ([Note: groups per node])."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Dict
from unittest import mock

import torch
from expecttest import TestCase

from flatshard import ModuleWrapPolicy, RunCheckpoints, ShardedDataParallel, ShardingStrategy
from tests._models import Block, build, full_params, step_on_global_batch

ROWS = 12  # global batch rows: every topology's ranks split it evenly
K = 2
TOPOLOGIES = {"2x2": (4, 2), "1x2": (2, 2), "4x1": (4, 1)}  # name: (ranks, ranks per node)


def _leg(rank: int, world_size: int, per_node: int, directory: str, first: int, last: int) -> Dict[str, torch.Tensor]:
    """Steps ``first..last`` at this topology, resuming from ``directory`` unless ``first`` is
    1, then a checkpoint: the full parameters afterwards."""
    with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": str(per_node)}):
        model = ShardedDataParallel(build(0), auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = RunCheckpoints(directory, model, optim)
    if first > 1:
        resumed = run.resume()
        if resumed is None or resumed.step != first - 1:
            raise AssertionError(f"resumed {resumed and resumed.step}, expected step {first - 1}")
    for step in range(first, last + 1):
        step_on_global_batch(model, optim, step, rank, world_size, rows=ROWS)
    run.save(last)
    return full_params(model)


def _reference(steps: int) -> Dict[str, torch.Tensor]:
    model = build(0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, steps + 1):
        step_on_global_batch(model, optim, step, rows=ROWS)
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


class TopologiesTest(TestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="flatshard-topologies-")
        self.addCleanup(shutil.rmtree, self.root, True)

    def test_a_checkpoint_moves_between_hybrid_topologies(self) -> None:
        expected = _reference(2 * K)
        for saved_at, resumed_at in (("2x2", "1x2"), ("2x2", "4x1"), ("1x2", "2x2"), ("4x1", "2x2")):
            with self.subTest(saved_at=saved_at, resumed_at=resumed_at):
                directory = os.path.join(self.root, f"{saved_at}-to-{resumed_at}")
                self.pool.run(_leg, TOPOLOGIES[saved_at][0], TOPOLOGIES[saved_at][1], directory, 1, K)
                for params in self.pool.run(_leg, TOPOLOGIES[resumed_at][0], TOPOLOGIES[resumed_at][1], directory, K + 1, 2 * K):
                    self.assertEqual(sorted(params), sorted(expected))
                    for name, value in expected.items():
                        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{saved_at} -> {resumed_at}: {name}: {m}")

"""The per-step agreement checks gather CPU tensors (see [Note: agreement checks on the host] in
``flatshard/_comm/_host_checks.py``): through the model's group where its backend takes them, else
through a gloo group of the same ranks, so that a NCCL job's host never waits for its GPU to
check. NCCL is simulated here by treating the world group as a group that takes no CPU
tensors: the checks then run over a gloo group of their own, train exactly as before, and still
turn divergent ranks into errors on every rank.
"""

from __future__ import annotations

import os

import warnings
from typing import Any, List
from unittest import mock

import torch
import torch.distributed as dist
from expecttest import TestCase

from flatshard import ShardedDataParallel
from flatshard._comm._collectives import Communicator
from flatshard._comm._host_checks import check_device, host_check_comm, takes_cpu_tensors
from torch import nn

from tests._models import DIM, Block, batch, build, local, run_parity, wrap
from tests.test_adversarial import _aux_skipped_on_one_rank


def _world_takes_no_cpu_tensors() -> Any:
    """The world group behaves like a NCCL group (other groups as they are)."""
    return mock.patch("flatshard._comm._host_checks.takes_cpu_tensors", lambda group: group is not dist.group.WORLD)


def _check_groups(rank: int, world_size: int) -> List[Any]:
    with _world_takes_no_cpu_tensors():
        model = wrap(build(), "nested")
        model(local(batch(0, world_size)[0], rank)).sum().backward()
        (comm,) = model._unit.ctx.check_comms
        return [comm.group is dist.group.WORLD, dist.get_process_group_ranks(comm.group), check_device(comm, torch.device("meta")).type]


def _side_group_timeout(rank: int, world_size: int) -> float:
    """The side group of a user's group with its own timeout: the same timeout (torch's
    default is 30 minutes, and FSDP1's HYBRID_SHARD groups ignored the user's)."""
    from datetime import timedelta

    from flatshard._comm._collectives import timeout_of

    group = dist.new_group(timeout=timedelta(seconds=17))
    with mock.patch("flatshard._comm._host_checks.takes_cpu_tensors", lambda g: g is not group):
        model = ShardedDataParallel(build(), process_group=group)
        model(local(batch(0, world_size)[0], rank)).sum().backward()
        (comm,) = model._unit.ctx.check_comms
        return comm.group is not group and timeout_of(comm.group).total_seconds()


def _parity_with_side_group(rank: int, world_size: int) -> None:
    with _world_takes_no_cpu_tensors():
        run_parity(rank, world_size, "nested")


class Skippy(nn.Module):
    """Two blocks; ``skip`` leaves the first out (data-dependent skipping)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Block(DIM), Block(DIM)

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        return self.second(x if skip else self.first(x))


def _divergent_with_side_group(rank: int, world_size: int) -> None:
    # every collective checked (TORCH_DISTRIBUTED_DEBUG=DETAIL), on gloo alone: the check
    # before the first gather that differs runs through the side group
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    with _world_takes_no_cpu_tensors(), mock.patch.dict(os.environ, {"FLATSHARD_SHARED_MEMORY": "0"}):
        torch.manual_seed(0)
        net = Skippy()
        net.first, net.second = ShardedDataParallel(net.first), ShardedDataParallel(net.second)
        model = ShardedDataParallel(net)
        try:
            model(torch.randn(2, DIM), skip=rank == 1)
        finally:
            dist.set_debug_level(level)


def _aux_skipped_with_side_group(rank: int, world_size: int) -> str:
    with _world_takes_no_cpu_tensors():
        return _aux_skipped_on_one_rank(rank, world_size)


def _fallback(rank: int, world_size: int) -> List[Any]:
    comm = Communicator(dist.group.WORLD)

    def refuse(**kwargs: Any) -> Any:
        raise RuntimeError("Gloo connectFullMesh failed")

    with _world_takes_no_cpu_tensors(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same = host_check_comm(comm, make_group=refuse) is comm
    return [same, [str(w.message) for w in caught]]


class HostChecksTest(TestCase):
    def test_gloo_groups_check_through_themselves(self) -> None:
        self.assertTrue(self.pool.run(_gloo_checks_itself, 2)[0])

    def test_a_group_without_cpu_tensors_checks_over_a_gloo_group_of_its_ranks(self) -> None:
        for is_world, ranks, device in self.pool.run(_check_groups, 2):
            self.assertFalse(is_world)
            self.assertEqual(ranks, [0, 1])
            self.assertEqual(device, "cpu")

    def test_the_side_group_has_the_users_timeout(self) -> None:
        self.assertEqual(self.pool.run(_side_group_timeout, 2), [17.0, 17.0])

    def test_training_through_the_side_group_matches_single_process(self) -> None:
        self.pool.run(_parity_with_side_group, 2)

    def test_divergent_forwards_raise_on_every_rank_through_the_side_group(self) -> None:
        with self.assertRaisesRegex(RuntimeError, r"the ranks ran different units .*: rank 0 is gathering the parameters of unit 'first'; rank 1 is gathering the parameters of unit 'second'") as caught:
            self.pool.run(_divergent_with_side_group, 2, timeout=120)
        self.assertNotIn("did not finish", str(getattr(caught.exception, "__notes__", "")))

    def test_divergent_backwards_raise_on_every_rank_through_the_side_group(self) -> None:
        with self.assertRaisesRegex(RuntimeError, r"the ranks' backward passes differ.*rank 0: none; rank 1: 'aux_head'") as caught:
            self.pool.run(_aux_skipped_with_side_group, 2, timeout=120)
        self.assertNotIn("did not finish", str(getattr(caught.exception, "__notes__", "")))

    def test_no_gloo_group_falls_back_to_the_device_with_a_warning(self) -> None:
        same, messages = self.pool.run(_fallback, 2)[0]
        self.assertTrue(same)
        self.assertEqual(len(messages), 1)
        self.assertExpectedInline(
            messages[0],
            """flatshard could not make a gloo group of ranks [0, 1] for its per-step agreement checks (RuntimeError: Gloo connectFullMesh failed); the checks run on the device instead, which makes the host wait for the GPU twice per step""",
        )


def _gloo_checks_itself(rank: int, world_size: int) -> bool:
    comm = Communicator(dist.group.WORLD)
    return takes_cpu_tensors(dist.group.WORLD) and host_check_comm(comm) is comm

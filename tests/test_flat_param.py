"""Flattening, padding, shard metadata, unshard/reshard and views of FlatParamHandle."""

import math

import torch
from expecttest import TestCase
from torch import nn

from flatshard import FlatParameter, ShardedDataParallel, ShardingStrategy
from flatshard._base._common import HandleState
from tests._models import build, handles, inside_call, wrap


class Tied(nn.Module):
    """13 distinct elements: a vector of 5 used under two names, a Linear(3, 2) (6 + 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.vec = nn.Parameter(torch.arange(5.0))
        self.other = nn.Module()
        self.other.alias = self.vec


def _layout(rank, world_size):
    torch.manual_seed(0)
    module = Tied()
    originals = {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}
    model = ShardedDataParallel(module)
    handle = model.handle
    flat = handle.flat_param
    result = {
        "is_flat_param": isinstance(flat, FlatParameter),
        "registered": [n for n, _ in model.named_parameters()],
        "params": [(i.name, tuple(i.shape), i.numel, i.offset) for i in handle.param_infos],
        "shared": [(s.name, s.primary) for s in handle.shared_param_infos],
        "shard_numel": flat.numel(),
        "padded": handle.padded_numel,
        "shard": [(s.index, s.param_offset, s.shard_offset, s.numel) for s in handle.shard_param_infos],
        "freed": handle.full_storage_bytes(),
        "placeholder": (module.lin.weight.device.type, tuple(module.lin.weight.shape)),
    }
    call = inside_call(model)
    call.__enter__()  # (the handle is driven directly: its collectives run in a guarded call)
    handle.unshard()
    views = dict(handle.named_full_views())
    result["gathered_equal"] = sorted(views) == sorted(originals) and all(
        torch.equal(views[n], originals[n]) for n in originals
    )
    full = handle.grad_leaf
    base, end = full.data_ptr(), full.data_ptr() + full.numel() * full.element_size()
    handle.use_views(track_grad=False)
    result["views_alias_full"] = all(base <= t.data_ptr() < end for t in (module.lin.weight, module.vec))
    result["tied_is_same_view"] = module.other.alias is module.vec
    handle.reshard()
    call.__exit__(None, None, None)
    result["after_reshard"] = (handle.state.name, handle.full_storage_bytes(), module.vec.device.type)
    return result


class FlatParamTest(TestCase):
    def test_layout_and_shards_at_world_size_3(self):
        results = self.pool.run(_layout, 3)
        for rank, r in enumerate(results):
            self.assertTrue(r["is_flat_param"])
            self.assertEqual(r["registered"], ["_fsdp_wrapped_module._flat_param"])
            # named_parameters() order: a module's own parameters, then its children's
            self.assertEqual(r["params"], [("vec", (5,), 5, 0), ("lin.weight", (2, 3), 6, 5), ("lin.bias", (2,), 2, 11)])
            self.assertEqual(r["shared"], [("other.alias", 0)])
            self.assertEqual((r["shard_numel"], r["padded"]), (5, 15))  # ceil(13 / 3) = 5
            self.assertEqual(r["freed"], 0)
            self.assertEqual(r["placeholder"], ("meta", (2, 3)))
            self.assertTrue(r["gathered_equal"])
            self.assertTrue(r["views_alias_full"])
            self.assertTrue(r["tied_is_same_view"])
            self.assertEqual(r["after_reshard"], ("SHARDED", 0, "meta"))
        # rank 0: vec; rank 1: weight[0:5]; rank 2: weight[5], bias, then 2 elements of padding
        self.assertEqual(
            [r["shard"] for r in results],
            [
                [(0, 0, 0, 5)],
                [(1, 0, 0, 5)],
                [(1, 5, 0, 1), (2, 0, 1, 2)],
            ],
        )

    def test_per_rank_parameter_memory_is_ceil_total_over_world(self):
        for world_size in (2, 3, 4):
            for rank, per_unit in enumerate(self.pool.run(_shard_sizes, world_size)):
                for total, shard_numel, held in per_unit:
                    self.assertEqual(shard_numel, math.ceil(total / world_size), (world_size, rank))
                    self.assertLessEqual(held, shard_numel)
            totals = self.pool.run(_shard_sizes, world_size)
            # the real (unpadded) elements of all ranks add up to each unit's total
            for unit in range(len(totals[0])):
                self.assertEqual(sum(r[unit][2] for r in totals), totals[0][unit][0])

    def test_a_sharded_parameter_reports_the_flat_parameters_requires_grad(self):
        # Staged freezing through model.parameters(): outside forward, modules hold
        # placeholders, whose requires_grad follows the FlatParameter from the next forward on.
        for r in self.pool.run(_placeholder_requires_grad, 2):
            self.assertEqual(r, [True, False, False, True, True])

    def test_no_shard_keeps_everything_unpadded(self):
        (r,) = self.pool.run(_no_shard_layout, 1)
        self.assertEqual(r, (13, 13, "UNSHARDED", 13 * 4, "cpu"))
        r0, r1 = self.pool.run(_no_shard_layout, 2)
        self.assertEqual(r0, r1)
        self.assertEqual(r0, (13, 13, "UNSHARDED", 13 * 4, "cpu"))


def _shard_sizes(rank, world_size):
    model = wrap(build(), "nested")
    return [(h.numel, h.flat_param.numel(), sum(s.numel for s in h.shard_param_infos)) for h in handles(model)]


def _placeholder_requires_grad(rank, world_size):
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    model = ShardedDataParallel(nn.Sequential(lin))
    flags = [lin.weight.requires_grad]
    for flag in (False, True):
        model.handle.flat_param.requires_grad_(flag)
        with torch.no_grad():
            model(torch.ones(1, 3))  # (a no_grad forward frees the unit after it)
        flags.extend([lin.weight.requires_grad, lin.bias.requires_grad])
    return flags


def _no_shard_layout(rank, world_size):
    torch.manual_seed(0)
    module = Tied()
    model = ShardedDataParallel(module, sharding_strategy=ShardingStrategy.NO_SHARD)
    h = model.handle
    assert h.state is HandleState.UNSHARDED
    return (h.numel, h.flat_param.numel(), h.state.name, h.full_storage_bytes(), module.vec.device.type)


def _a_gather_that_cannot_start(rank, world_size):
    """Every rank's gather fails to start (the collective call raises ``KeyboardInterrupt``):
    the handle returns to where it was, and resharding and gathering again work."""
    from unittest import mock

    torch.manual_seed(0)
    module = Tied()
    model = ShardedDataParallel(module)
    handle = model.handle
    seen = []
    call = inside_call(model)
    call.__enter__()
    for start in (handle.unshard, handle.refresh):  # (from SHARDED, then from UNSHARDED)
        try:
            with mock.patch.object(handle, "_gather_padded_into", side_effect=KeyboardInterrupt("injected")):
                start()
        except KeyboardInterrupt:
            seen.append((handle.state.name, handle.full_storage_bytes() > 0))
        if handle.state is HandleState.SHARDED:
            handle.unshard()
    handle.reshard()
    handle.unshard()
    seen.append((handle.state.name, torch.equal(dict(handle.named_full_views())["vec"], torch.arange(5.0))))
    handle.reshard()
    call.__exit__(None, None, None)
    return seen


class AGatherThatCannotStartTest(TestCase):
    def test_the_handle_returns_to_its_state(self):
        for seen in self.pool.run(_a_gather_that_cannot_start, 2):
            self.assertEqual(seen, [("SHARDED", False), ("UNSHARDED", True), ("UNSHARDED", True)])

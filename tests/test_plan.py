"""flatshard.plan reports exactly the units the wrapper builds, needs no process group, and
runs from the command line."""

import functools
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import torch
from expecttest import TestCase
from torch import nn

import flatshard
from flatshard import MixedPrecision, ShardedDataParallel, ShardingStrategy
from tests._models import Block, Layer, build, error_text, sample_transformer
from tests.test_auto_wrap import POLICIES

ROOT = Path(__file__).resolve().parents[1]


def _layout_of_plan(plan):
    return [
        (u.name, u.sharding_strategy.name, [(str(g.dtype), g.requires_grad, g.params, g.numel, g.shard_numel) for g in u.groups])
        for u in plan.units
    ]


def _layout_of_model(model):
    return [
        (
            m._unit.name,
            m.sharding_strategy.name,
            [(str(h.dtype), h.requires_grad, len(h.param_infos), h.numel, h.shard_numel) for h in m.handles],
        )
        for m in ShardedDataParallel.fsdp_modules(model)
    ]


def _agree(rank, world_size, policy_name, model_options):
    """The plan of an unwrapped copy (no process group needed) == what the wrapper builds."""
    planned = flatshard.plan(
        sample_transformer(**model_options), POLICIES[policy_name](), world_size=world_size, print_table=False
    )
    model = ShardedDataParallel(sample_transformer(**model_options), auto_wrap_policy=POLICIES[policy_name]())
    return _layout_of_plan(planned), _layout_of_model(model)


def _agree_with_hand_wrapped_units(rank, world_size):
    module = build()
    module.blocks[0] = ShardedDataParallel(module.blocks[0])  # already a unit: reported as is
    planned = flatshard.plan(module, flatshard.ModuleWrapPolicy({Block}), world_size=world_size, print_table=False)
    model = ShardedDataParallel(module, auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}))
    return _layout_of_plan(planned), _layout_of_model(model)


def _precision_of_plan(plan):
    return [(u.name, [(str(g.compute_dtype), str(g.reduce_dtype), str(g.grad_dtype)) for g in u.groups]) for u in plan.units]


def _precision_of_model(model):
    return [(m._unit.name, [(str(h.compute_dtype), str(h.reduce_dtype), str(h.grad_dtype)) for h in m.handles]) for m in ShardedDataParallel.fsdp_modules(model)]


def _normed_net():
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))


def _agree_under_mixed_precision(rank, world_size, keep_low_precision_grads):
    """With mixed precision at the root: the same units (a BatchNorm one of its own, in full
    precision) and every FlatParameter's compute, reduce and gradient dtypes."""
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, keep_low_precision_grads=keep_low_precision_grads)
    policy = flatshard.ModuleWrapPolicy({nn.Linear})
    planned = flatshard.plan(_normed_net(), policy, world_size=world_size, mixed_precision=mp, print_table=False)
    model = ShardedDataParallel(_normed_net(), auto_wrap_policy=policy, mixed_precision=mp)
    return (_layout_of_plan(planned), _precision_of_plan(planned)), (_layout_of_model(model), _precision_of_model(model))


class PlanAgreesWithWrapperTest(TestCase):
    def test_mixed_precision_at_the_root(self):
        for keep in (False, True):
            planned, built = self.pool.run(_agree_under_mixed_precision, 2, keep)[0]
            self.assertEqual(planned, built, keep)
        self.assertEqual([name for name, _ in planned[1]], ["", "0", "1", "2"])
        self.assertEqual(
            [groups for _, groups in planned[1]][1:],
            [[("torch.bfloat16", "torch.float32", "torch.bfloat16")], [("torch.float32", "torch.float32", "torch.float32")], [("torch.bfloat16", "torch.float32", "torch.bfloat16")]],
        )

    def test_every_policy_and_frozen_mixed_groups(self):
        cases = [(name, {}) for name in POLICIES] + [("transformer", {"frozen_attention": True, "float64_gain": True})]
        for name, options in cases:
            for world_size in (2, 3):
                planned, built = self.pool.run(_agree, world_size, name, options)[0]
                self.assertEqual(planned, built, (name, options, world_size))

    def test_hand_wrapped_units_are_reported(self):
        planned, built = self.pool.run(_agree_with_hand_wrapped_units, 2)[0]
        self.assertEqual(planned, built)


class PlanTableTest(TestCase):
    def test_table_of_a_frozen_fine_tuning_model_on_the_meta_device(self):
        with torch.device("meta"):
            model = sample_transformer(frozen_attention=True)
        plan = flatshard.plan(
            model,
            functools.partial(flatshard.transformer_auto_wrap_policy, transformer_layer_cls={Layer}),
            world_size=2,
            print_table=False,
        )
        self.assertExpectedInline(str(plan), """\
flatshard plan: 3 units, world size 2
unit      module             strategy    params  elements     full  per rank  flat parameters
<root>    SampleTransformer  FULL_SHARD       3       120    480 B     240 B  float32 3p/120
layers.0  Layer              FULL_SHARD      15       592  2.3 KiB   1.2 KiB  float32 8p/312, float32 frozen 7p/280
layers.1  Layer              FULL_SHARD      15       592  2.3 KiB   1.2 KiB  float32 8p/312, float32 frozen 7p/280
tied parameters:
  embed.weight = head.weight  ->  <root>
estimated peak per rank (parameters + gradients): 11.5 KiB = parameter shards 2.5 KiB + gradient shards 1.5 KiB + gathered parameters 5.1 KiB + unsharded gradient 2.4 KiB""")
        self.assertEqual(plan.peak_bytes, sum(v for _, v in plan.memory()))

    def test_no_policy_and_no_shard(self):
        plan = flatshard.plan(build(), world_size=4, sharding_strategy=ShardingStrategy.NO_SHARD, print_table=False)
        self.assertExpectedInline(str(plan), """\
flatshard plan: 1 unit, world size 4
unit    module  strategy  params  elements     full  per rank  flat parameters
<root>  TinyLM  NO_SHARD      21     1,008  3.9 KiB   3.9 KiB  float32 21p/1,008
tied parameters:
  embed.weight = head.weight  ->  <root>
estimated peak per rank (parameters + gradients): 7.9 KiB = parameter shards 3.9 KiB + gradient shards 3.9 KiB + gathered parameters 0 B + unsharded gradient 0 B""")

    def test_bad_world_size(self):
        with self.assertRaisesRegex(ValueError, "world_size must be a positive int; got 0"):
            flatshard.plan(build(), world_size=0)


class PlanCommandLineTest(TestCase):
    def test_python_m_flatshard_plan(self):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        done = subprocess.run(
            [sys.executable, "-m", "flatshard.plan", "tests._models:sample_transformer", "--world-size", "3",
             "--transformer-layer", "tests._models:Layer"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(done.stderr, "")
        self.assertExpectedInline(done.stdout, """\
flatshard plan: 3 units, world size 3
unit      module             strategy    params  elements     full  per rank  flat parameters
<root>    SampleTransformer  FULL_SHARD       3       120    480 B     160 B  float32 3p/120
layers.0  Layer              FULL_SHARD      15       592  2.3 KiB     792 B  float32 15p/592
layers.1  Layer              FULL_SHARD      15       592  2.3 KiB     792 B  float32 15p/592
tied parameters:
  embed.weight = head.weight  ->  <root>
estimated peak per rank (parameters + gradients): 13.2 KiB = parameter shards 1.7 KiB + gradient shards 1.7 KiB + gathered parameters 5.1 KiB + unsharded gradient 4.6 KiB
""")


def _hand_split_tie():
    module = build()
    module.embed = ShardedDataParallel(module.embed)  # splits the embed/head tie
    return module


def _wrapper_error(rank, world_size):
    try:
        ShardedDataParallel(_hand_split_tie(), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}))
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)


def _plan_error(rank, world_size):
    try:
        flatshard.plan(_hand_split_tie(), flatshard.ModuleWrapPolicy({Block}), world_size=2)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)


def _hybrid_plan_and_wrapper(rank, world_size):
    """The wrapper without a launcher, on two hosts of two ranks (host names patched), against
    the plan told the node size."""
    with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": "2"}):
        planned = flatshard.plan(build(), flatshard.ModuleWrapPolicy({Block}), world_size=world_size, sharding_strategy=ShardingStrategy.HYBRID_SHARD, print_table=False)
    with mock.patch.dict(os.environ), mock.patch("socket.gethostname", return_value="ab"[rank // 2]):
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        model = ShardedDataParallel(build(), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    return _layout_of_plan(planned), _layout_of_model(model), [u.world_size for u in planned.units]


class PlanRefusesWhatTheWrapperRefusesTest(TestCase):
    def test_same_errors(self):
        wrapper = self.pool.run(_wrapper_error, 1)[0]
        planned = self.pool.run(_plan_error, 1)[0]
        self.assertIsNotNone(wrapper)
        self.assertEqual(planned, wrapper)

    def test_hybrid_sharding_without_groups_needs_the_node_size_in_the_plan_only(self):
        # (the wrapper compares the ranks' host names; the plan has no ranks to compare)
        planned, wrapped, sizes = self.pool.run(_hybrid_plan_and_wrapper, 4)[0]
        self.assertEqual(planned, wrapped)
        self.assertEqual(sizes, [2] * len(sizes))
        with mock.patch.dict(os.environ):
            os.environ.pop("LOCAL_WORLD_SIZE", None)
            self.assertExpectedInline(
                error_text(lambda: flatshard.plan(build(), flatshard.ModuleWrapPolicy({Block}), world_size=2, sharding_strategy=ShardingStrategy.HYBRID_SHARD), ValueError),
                """flatshard.plan: sharding_strategy=ShardingStrategy.HYBRID_SHARD without process_group or device_mesh shards within each node, and the plan, made without a process group, cannot compare the ranks' host names: set LOCAL_WORLD_SIZE to the ranks per node (torchrun sets it), or pass a policy that gives the units process_group=(shard_group, replicate_group)""",
            )

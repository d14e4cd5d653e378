"""Hybrid sharding, CPU offload and communication hooks: training equals single-process
training on the global batch."""

import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from expecttest import TestCase
from torch.distributed.device_mesh import init_device_mesh

from flatshard import CPUOffload, ShardedDataParallel, ShardingStrategy, StateDictType, comm_hooks
from tests._models import batch, build, full_params, lm_loss, local, run_parity, train_reference, wrap


def _pair(rank):
    """(shard group, replicate group) of a 2 x 2 layout: ranks {0, 1} and {2, 3} shard,
    {0, 2} and {1, 3} replicate (every rank creates every group, in the same order)."""
    shard = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return shard[rank // 2], replicate[rank % 2]


def _hybrid(rank, world_size, directory):
    """Both hybrid strategies, with a group pair and with a 2-D mesh; plus the FULL state dict."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    pair = _pair(rank)
    for strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        run_parity(rank, world_size, "nested", steps=3, sharding_strategy=strategy, process_group=pair)
        run_parity(rank, world_size, "nested", steps=3, sharding_strategy=strategy, device_mesh=mesh)
    model = wrap(build(), "nested", sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=pair)
    if model.world_size != 2 or model.handles[0].shard_numel * 2 != model.handles[0].padded_numel:
        raise AssertionError("each unit must be sharded over the 2 ranks of its shard group")
    plain = build().state_dict()
    state = model.state_dict()
    for key, value in plain.items():
        if not torch.equal(state[key], value):
            raise AssertionError(f"{key} differs")
    with ShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save(model.state_dict(), checkpoint_id=directory)
    for fresh in (
        wrap(build(seed=3), "nested", sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=pair),
        wrap(build(seed=3), "nested"),  # the same checkpoint without hybrid sharding
    ):
        with ShardedDataParallel.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
            loaded = fresh.state_dict()
            dcp.load(loaded, checkpoint_id=directory)
            fresh.load_state_dict(loaded)
        for key, value in fresh.state_dict().items():
            if not torch.equal(value, plain[key]):
                raise AssertionError(f"{key} differs after loading the hybrid checkpoint")
    return True


def _offload(rank, world_size):
    """On CPU devices, offloading is a no-op: the same training, shards on the CPU."""
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        run_parity(rank, world_size, "nested", steps=3, sharding_strategy=strategy, cpu_offload=CPUOffload(offload_params=True))
    model = wrap(build(), "nested", cpu_offload=CPUOffload(offload_params=True))
    return {h.flat_param.device.type for h in model.handles}


def _counting(calls, hook):
    def counted(state, grad, output=None):
        calls.append("sharded" if output is not None else "unsharded")
        return hook(state, grad) if output is None else hook(state, grad, output)

    return counted


def _train_with_hook(rank, world_size, strategy, hook, state_cls, steps=3):
    calls = []
    model = wrap(build(), "nested", sharding_strategy=strategy)
    model.register_comm_hook(state_cls(model.process_group), _counting(calls, hook))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(steps):
        tokens, targets = batch(step, world_size)
        loss = lm_loss(model(local(tokens, rank)), local(targets, rank))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return calls, full_params(model)


def _hooks(rank, world_size):
    """The default hooks give the default training; the compressing hooks train the same
    within low-precision rounding; every unit's reduction goes through the hook."""
    reference = train_reference(world_size, steps=3)[1]
    counts = {}
    cases = [
        ("default", ShardingStrategy.FULL_SHARD, comm_hooks.reduce_scatter_hook, comm_hooks.DefaultState, 1e-5),
        ("default", ShardingStrategy.NO_SHARD, comm_hooks.allreduce_hook, comm_hooks.DefaultState, 1e-5),
        ("bf16", ShardingStrategy.FULL_SHARD, comm_hooks.bf16_compress_hook, comm_hooks.LowPrecisionState, 3e-2),
        ("fp16", ShardingStrategy.NO_SHARD, comm_hooks.fp16_compress_hook, comm_hooks.LowPrecisionState, 3e-3),
    ]
    for name, strategy, hook, state_cls, tol in cases:
        calls, params = _train_with_hook(rank, world_size, strategy, hook, state_cls)
        for key, expected in reference.items():
            torch.testing.assert_close(params[key], expected, rtol=tol, atol=tol, msg=lambda m: f"{name}/{strategy.name}: {key}: {m}")
        counts[f"{name}/{strategy.name}"] = (len(calls), sorted(set(calls)))
    return counts


def _hook_errors(rank, world_size):
    messages = []
    model = wrap(build(), "nested")
    state = comm_hooks.DefaultState(model.process_group)
    pair = _pair(rank)
    hybrid = wrap(build(), "nested", sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=pair)
    for call in (
        lambda: model.blocks[0].register_comm_hook(state, comm_hooks.reduce_scatter_hook),
        lambda: model.register_comm_hook(state, "hook"),
        lambda: hybrid.register_comm_hook(state, comm_hooks.reduce_scatter_hook),
        lambda: model.register_comm_hook(state, comm_hooks.reduce_scatter_hook),
        lambda: model.register_comm_hook(state, comm_hooks.reduce_scatter_hook),
        lambda: (model(local(batch(0, world_size)[0], rank)), model.register_comm_hook(state, comm_hooks.reduce_scatter_hook)),
    ):
        try:
            call()
            messages.append("no error")
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    return messages


class HybridTest(TestCase):
    def test_hybrid_strategies_match_single_process_training_on_2x2(self):
        directory = tempfile.mkdtemp(prefix="flatshard-hybrid-")
        self.addCleanup(shutil.rmtree, directory, True)
        self.assertEqual(self.pool.run(_hybrid, 4, directory), [True] * 4)


class OffloadTest(TestCase):
    def test_cpu_offload_on_cpu_is_a_correct_no_op(self):
        self.assertEqual(self.pool.run(_offload, 2), [{"cpu"}] * 2)


class CommHookTest(TestCase):
    def test_hooks_reduce_every_unit_and_train_like_the_default(self):
        counts = self.pool.run(_hooks, 2)[0]
        # 4 units x 3 steps, each reduction through the hook
        self.assertEqual(
            counts,
            {
                "default/FULL_SHARD": (12, ["sharded"]),
                "default/NO_SHARD": (12, ["unsharded"]),
                "bf16/FULL_SHARD": (12, ["sharded"]),
                "fp16/NO_SHARD": (12, ["unsharded"]),
            },
        )

    def test_registration_errors(self):
        messages = self.pool.run(_hook_errors, 4)[0]
        self.assertExpectedInline("\n".join(messages), """\
RuntimeError: register_comm_hook must be called on the root ShardedDataParallel, not on the nested unit 'blocks.0'
TypeError: register_comm_hook: hook must be callable; got 'hook'
NotImplementedError: register_comm_hook with hybrid sharding (HYBRID_SHARD, _HYBRID_SHARD_ZERO2) is not supported
no error
RuntimeError: a communication hook is registered already; register_comm_hook can be called once
RuntimeError: register_comm_hook must be called before training starts (before the first forward)""")

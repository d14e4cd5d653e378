"""The CUDA paths: NCCL, mixed precision in bf16, pinned CPU offload, activation checkpointing,
``no_sync``, state dicts, original parameters and ``torch.compile``. Skipped without a GPU.

With one GPU, NCCL runs at world size 1 (every code path but the data movement between ranks;
NCCL cannot put two ranks on one GPU); two ranks share the GPU over gloo where gloo supports the
collectives on CUDA tensors (the test says so when it does not). The truth is single-process
training on the same GPU; bf16 mixed precision is compared with torch FSDP1 under the same policy.
``bench/gpu_check.sh`` runs this module first.
"""

from __future__ import annotations

import tempfile
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flatshard import (
    BackwardPrefetch,
    CPUOffload,
    FullStateDictConfig,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardedDataParallel,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from tests._models import Block, _train, build, full_params, wrap

GPUS = torch.cuda.device_count()
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
STEPS = 4
# Single-process and sharded training on the same GPU run the same kernels on the same shapes;
# only the order of the gradient reductions (and, compiled, inductor's fusions) differ.
TOL = dict(rtol=1e-5, atol=1e-6)
COMPILED_TOL = dict(rtol=1e-4, atol=1e-5)

# name -> (wrapping options, micro-batches per step, activation checkpointing, compiled)
CASES: Dict[str, Tuple[Dict[str, Any], int, bool, bool]] = {
    "FULL_SHARD": ({}, 1, False, False),
    "SHARD_GRAD_OP": ({"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}, 1, False, False),
    "NO_SHARD": ({"sharding_strategy": ShardingStrategy.NO_SHARD}, 1, False, False),
    "use_orig_params": ({"use_orig_params": True}, 1, False, False),
    "cpu_offload": ({"cpu_offload": CPUOffload(offload_params=True)}, 1, False, False),
    "cpu_offload+no_sync": ({"cpu_offload": CPUOffload(offload_params=True)}, 2, False, False),
    "no_sync": ({}, 3, False, False),
    "no_sync+use_orig_params": ({"use_orig_params": True}, 2, False, False),
    "prefetch_post+forward": ({"backward_prefetch": BackwardPrefetch.BACKWARD_POST, "forward_prefetch": True}, 1, False, False),
    "limit_all_gathers=False": ({"limit_all_gathers": False}, 1, False, False),
    "activation_checkpointing": ({}, 1, True, False),
    "torch.compile": ({}, 1, False, True),
    "torch.compile+use_orig_params": ({"use_orig_params": True}, 1, False, True),
}


def train(model: nn.Module, rank: Optional[int], world_size: int, device: torch.device, micro_batches: int = 1, steps: int = STEPS) -> List[float]:
    """AdamW training on ``device``: ``rank is None``, the plain model on global batches; else
    the wrapped model on this rank's slices, all micro-batches but the last under ``no_sync``."""
    return _train(model, world_size, steps, micro_batches, rank, device=device)


def reference(world_size: int, device: torch.device, micro_batches: int = 1, compiled: bool = False) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    model = build().to(device)
    run = torch.compile(model) if compiled else model
    losses = train(run, None, world_size, device, micro_batches)
    return losses, {n: p.detach().cpu() for n, p in model.named_parameters(remove_duplicate=False)}


def checkpointed(model: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing, checkpoint_wrapper

    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: isinstance(m, Block))
    return model


def assert_close_training(expected: Tuple[List[float], Dict[str, torch.Tensor]], actual: Tuple[List[float], Dict[str, torch.Tensor]], tol: Dict[str, float]) -> None:
    torch.testing.assert_close(torch.tensor(actual[0], dtype=torch.float64), torch.tensor(expected[0], dtype=torch.float64), **tol)
    actual = (actual[0], {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in actual[1].items()})
    if sorted(actual[1]) != sorted(expected[1]):
        raise AssertionError(f"parameter names differ: {sorted(actual[1])} vs {sorted(expected[1])}")
    for name, want in expected[1].items():
        torch.testing.assert_close(actual[1][name].cpu(), want, **tol, msg=lambda m: f"{name}: {m}")


def parity(rank: int, world_size: int, case: str, device_index: Optional[int] = None) -> None:
    """Rank function: ``case`` of ``CASES`` against single-process training on the same device."""
    options, micro_batches, ckpt, compiled = CASES[case]
    device = torch.device("cuda", rank if device_index is None else device_index) if GPUS else torch.device("cpu")
    expected = reference(world_size, device, micro_batches, compiled)
    net = build()
    model = wrap(checkpointed(net) if ckpt else net, "nested", device_id=device if device.type == "cuda" else None, **options)
    offload = options.get("cpu_offload") is not None and device.type == "cuda"
    for handle in model.handles if not offload else []:
        if handle.flat_param.device != device:
            raise AssertionError(f"{handle.flat_param.device} is not {device}")
    run = torch.compile(model) if compiled else model
    losses = train(run, rank, world_size, device, micro_batches)
    if offload:
        unpinned = [n for n, p in model.named_parameters() if p.device.type != "cpu" or not p.is_pinned()]
        if unpinned:
            raise AssertionError(f"offloaded shards not in pinned CPU memory: {unpinned}")
    assert_close_training(expected, (losses, full_params(model)), COMPILED_TOL if compiled else TOL)


@needs_gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_on_nccl(rank_pool, case):
    rank_pool.run(parity, 1, case, backend="nccl")


# -- bf16 mixed precision against torch FSDP1 -------------------------------------------------------

BF16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)


def _bf16_training(rank: int, world_size: int, which: str, device: torch.device) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    policy = ModuleWrapPolicy({Block})
    if which == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision as TorchMixedPrecision

        model = FSDP(build(), auto_wrap_policy=policy, device_id=device, mixed_precision=TorchMixedPrecision(**BF16))
        losses = train(model, rank, world_size, device)
        with FSDP.summon_full_params(model):
            return losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    model = ShardedDataParallel(build(), auto_wrap_policy=policy, device_id=device if device.type == "cuda" else None, mixed_precision=MixedPrecision(**BF16))
    losses = train(model, rank, world_size, device)
    with ShardedDataParallel.summon_full_params(model):
        return losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def bf16_against_fsdp1(rank: int, world_size: int) -> None:
    device = torch.device("cuda", rank) if GPUS else torch.device("cpu")
    ours = _bf16_training(rank, world_size, "flatshard", device)
    theirs = _bf16_training(rank, world_size, "torch", device)
    # the same bf16 kernels on the same inputs; the fp32 reduction and AdamW step agree
    assert_close_training(theirs, ours, dict(rtol=1e-3, atol=1e-4))


@needs_gpu
def test_bf16_mixed_precision_matches_fsdp1(rank_pool):
    rank_pool.run(bf16_against_fsdp1, 1, backend="nccl")


# -- state dicts ------------------------------------------------------------------------------------


def _trained(device: torch.device, rank: int, world_size: int) -> Tuple[ShardedDataParallel, Dict[str, torch.Tensor]]:
    model = wrap(build(), "nested", device_id=device if device.type == "cuda" else None)
    train(model, rank, world_size, device, steps=2)
    return model, full_params(model)


def full_state_dict_rank0_offload(rank: int, world_size: int) -> None:
    device = torch.device("cuda", rank) if GPUS else torch.device("cpu")
    model, params = _trained(device, rank, world_size)
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with ShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        state = model.state_dict()
    if rank != 0 and state:
        raise AssertionError(f"rank {rank}: rank0_only gave {sorted(state)}")
    if rank == 0:
        on_gpu = sorted(k for k, v in state.items() if v.device.type != "cpu")
        if on_gpu:
            raise AssertionError(f"offload_to_cpu left {on_gpu} on the GPU")
        for name, want in params.items():
            torch.testing.assert_close(state[name], want.cpu(), rtol=0, atol=0)
    with ShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        state = model.state_dict()  # (every rank loads one)
    fresh = wrap(build(seed=7), "nested", device_id=device if device.type == "cuda" else None)
    with ShardedDataParallel.state_dict_type(fresh, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        fresh.load_state_dict(state)
    loaded = full_params(fresh)
    for name, want in params.items():
        torch.testing.assert_close(loaded[name].cpu(), want.cpu(), rtol=0, atol=0)


def sharded_state_dict_dcp(rank: int, world_size: int) -> None:
    import torch.distributed.checkpoint as dcp

    device = torch.device("cuda", rank) if GPUS else torch.device("cpu")
    model, params = _trained(device, rank, world_size)
    with tempfile.TemporaryDirectory() as scratch:
        path = [scratch]
        dist.broadcast_object_list(path)  # (one directory for all ranks)
        with ShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()):
            dcp.save(model.state_dict(), checkpoint_id=path[0])
        fresh = wrap(build(seed=7), "nested", device_id=device if device.type == "cuda" else None)
        with ShardedDataParallel.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()):
            state = fresh.state_dict()
            dcp.load(state, checkpoint_id=path[0])
            fresh.load_state_dict(state)
        dist.barrier()
    loaded = full_params(fresh)
    for name, want in params.items():
        torch.testing.assert_close(loaded[name].cpu(), want.cpu(), rtol=0, atol=0)
    # and it trains on from there exactly as the original does
    torch.testing.assert_close(torch.tensor(train(fresh, rank, world_size, device, steps=1)), torch.tensor(train(model, rank, world_size, device, steps=1)), rtol=0, atol=0)


@needs_gpu
@pytest.mark.parametrize("check", [full_state_dict_rank0_offload, sharded_state_dict_dcp], ids=lambda f: f.__name__)
def test_state_dicts_on_nccl(rank_pool, check):
    rank_pool.run(check, 1, backend="nccl")


# -- two ranks on one GPU over gloo ----------------------------------------------------------------


def gloo_cuda_support(rank: int, world_size: int) -> Dict[str, str]:
    """Which collectives flatshard uses gloo runs on CUDA tensors: name -> "ok" or the error."""
    device = torch.device("cuda", 0)
    x = torch.full((4,), float(rank + 1), device=device)
    probes: Dict[str, Callable[[], Any]] = {
        "all_gather": lambda: dist.all_gather([torch.empty_like(x) for _ in range(world_size)], x),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(4 * world_size, device=device), x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(4 // world_size, device=device), x),
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "broadcast": lambda: dist.broadcast(x.clone(), src=0),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(x), x.clone()),
    }
    found = {}
    for name, probe in probes.items():
        try:
            probe()
            torch.cuda.synchronize()
            found[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - the answer is the error
            found[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return found


@needs_gpu
@pytest.mark.parametrize("case", ["FULL_SHARD", "SHARD_GRAD_OP", "use_orig_params", "no_sync", "cpu_offload"])
def test_two_ranks_on_one_gpu_over_gloo(rank_pool, case):
    support = rank_pool.run(gloo_cuda_support, 2)[0]
    missing = {k: v for k, v in support.items() if v != "ok"}
    if missing:
        pytest.skip(f"gloo in torch {torch.__version__} does not run these collectives on CUDA tensors: {missing}")
    rank_pool.run(parity, 2, case, 0)

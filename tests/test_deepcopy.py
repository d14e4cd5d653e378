"""``copy.deepcopy`` of a wrapped model (EMA, ``torch.optim.swa_utils.AveragedModel``): an
independent model that trains, evaluates and averages exactly as the deep copy of the
single-process model does, in both ``use_orig_params`` modes, over gloo and over shared
memory. Compared with the same steps on the unwrapped model and its deep copy."""

from __future__ import annotations

import copy
import os
from typing import Any, Dict, List, Optional, Tuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from expecttest import TestCase
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from flatshard import MixedPrecision, ShardingStrategy
from tests._models import ATOL, RTOL, batch, build, error_text, full_params, global_mean, lm_loss, local, wrap


def _plain_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _assert_same(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], what: str) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: {sorted(actual)} vs {sorted(expected)}"
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {name}: {m}")


def _loss(model: nn.Module, step: int, rank: Optional[int], world_size: int) -> torch.Tensor:
    tokens, targets = batch(step, world_size)
    if rank is not None:
        tokens, targets = local(tokens, rank), local(targets, rank)
    return lm_loss(model(tokens), targets)


def _value(loss: torch.Tensor, rank: Optional[int]) -> float:
    return loss.item() if rank is None else global_mean(loss)


def _ema_run(rank: Optional[int], world_size: int, **options: Any) -> Tuple[List[float], Dict[str, torch.Tensor], Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """Training with an EMA copy made after the first step (the model then holds gradients,
    and a metrics forward with autograd on left units gathered): the EMA is updated after each
    step and evaluated; returns (EMA losses, EMA parameters, model parameters, the EMA's
    state_dict())."""
    model: nn.Module = build() if rank is None else wrap(build(), "nested", **options)
    optim = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    _loss(model, 0, rank, world_size).backward()
    optim.step()
    _loss(model, 1, rank, world_size)  # metrics with autograd on: no backward
    for p in model.parameters():
        p.data = p.data * 0.95  # a write the copy must see
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    losses = []
    for step in range(2, 5):
        optim.zero_grad()
        _loss(model, step, rank, world_size).backward()
        optim.step()
        ema.update_parameters(model)
        with torch.no_grad():
            losses.append(_value(_loss(ema, step + 10, rank, world_size), rank))
    if rank is None:
        return losses, _plain_params(ema.module), _plain_params(model), dict(ema.module.state_dict())
    # The copy's state dicts are its own, also through its wrapped module (routed to the
    # copied wrapper, never the original's).
    routed = ema.module.module.state_dict()
    states = ema.module.state_dict()
    if sorted(routed) != sorted(states) or any(not torch.equal(routed[k], states[k]) for k in states):
        raise AssertionError("the copy's wrapped module's state_dict() differs from the copy's")
    return losses, full_params(ema.module), full_params(model), dict(states)


def _ema_parity(rank: int, world_size: int, shared_memory: str, **options: Any) -> bool:
    with mock.patch.dict(os.environ, {"FLATSHARD_SHARED_MEMORY": shared_memory}):
        expected = _ema_run(None, world_size)
        actual = _ema_run(rank, world_size, **options)
    torch.testing.assert_close(torch.tensor(actual[0]), torch.tensor(expected[0]), rtol=RTOL, atol=ATOL)
    _assert_same(actual[1], expected[1], "EMA")
    _assert_same(actual[2], expected[2], "model")
    _assert_same(actual[3], expected[3], "EMA state_dict()")
    return True


@pytest.mark.parametrize("shared_memory", ["1", "0"], ids=["shared-memory", "gloo"])
@pytest.mark.parametrize("orig", [True, False], ids=["orig", "flat"])
def test_an_ema_copy_averages_and_evaluates_like_single_process(rank_pool, orig, shared_memory):
    assert rank_pool.run(_ema_parity, 2, shared_memory, use_orig_params=orig) == [True, True]


def _ema_hybrid(rank: int, world_size: int) -> bool:
    shard = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = (shard[rank // 2], replicate[rank % 2])
    return _ema_parity(rank, world_size, "1", use_orig_params=True, sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=groups)


def test_ema_copies_of_other_strategies_and_at_world_sizes_3_and_4(rank_pool):
    for strategy in ("SHARD_GRAD_OP", "NO_SHARD"):
        rank_pool.run(_ema_parity, 2, "1", use_orig_params=True, sharding_strategy=ShardingStrategy[strategy])
    rank_pool.run(_ema_parity, 3, "1", use_orig_params=True)
    assert rank_pool.run(_ema_hybrid, 4) == [True] * 4


def _mixed_precision_copy(rank: int, world_size: int, orig: bool) -> float:
    """Under mixed precision the copy computes exactly as the original does (a copy of it)."""
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = wrap(build(), "nested", mixed_precision=mp, use_orig_params=orig)
    optim = torch.optim.SGD(model.parameters(), lr=0.2)
    _loss(model, 0, rank, world_size).backward()
    optim.step()
    clone = copy.deepcopy(model)
    with torch.no_grad():
        return max(abs(_loss(clone, step, rank, world_size).item() - _loss(model, step, rank, world_size).item()) for step in range(3))


def test_a_copy_under_mixed_precision_computes_as_the_original(rank_pool):
    for orig in (True, False):
        assert rank_pool.run(_mixed_precision_copy, 2, orig) == [0.0, 0.0]


def _copies_train_apart(rank: Optional[int], world_size: int, **options: Any) -> Tuple[List[float], Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """A copy trained on other data with its own optimizer, alternating with the original;
    writing to the copy's parameters changes only the copy."""
    model: nn.Module = build() if rank is None else wrap(build(), "nested", **options)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(1.1)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, clone)]
    losses = []
    for step in range(3):
        for index, (owner, optim) in enumerate(zip((model, clone), optims)):
            loss = _loss(owner, 2 * step + index, rank, world_size)
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(_value(loss, rank))
    read = _plain_params if rank is None else full_params
    return losses, read(model), read(clone)


def _copy_parity(rank: int, world_size: int, **options: Any) -> bool:
    expected = _copies_train_apart(None, world_size)
    actual = _copies_train_apart(rank, world_size, **options)
    torch.testing.assert_close(torch.tensor(actual[0]), torch.tensor(expected[0]), rtol=RTOL, atol=ATOL)
    _assert_same(actual[1], expected[1], "original")
    _assert_same(actual[2], expected[2], "copy")
    return True


@pytest.mark.parametrize("orig", [True, False], ids=["orig", "flat"])
def test_a_copy_trains_apart_from_the_original(rank_pool, orig):
    assert rank_pool.run(_copy_parity, 2, use_orig_params=orig) == [True, True]


def _copy_errors(rank: int, world_size: int) -> List[str]:
    model = wrap(build(), "nested", use_orig_params=True)

    def inside_forward() -> None:
        def hook(module: nn.Module, args: Any) -> None:
            copy.deepcopy(model)

        model.module.norm.register_forward_pre_hook(hook)
        model(batch(0, world_size)[0])

    return [
        error_text(lambda: copy.deepcopy(model.blocks[0]), ValueError),
        error_text(inside_forward, RuntimeError),
    ]


class CopyErrorsTest(TestCase):
    def test_what_cannot_be_copied_says_why(self) -> None:
        self.assertExpectedInline(
            "\n".join(self.pool.run(_copy_errors, 2)[0]),
            """\
copy.deepcopy of the ShardedDataParallel unit at 'blocks.0' alone is not supported: it is nested in another unit, which schedules its parameters; copy the outermost one (the root)
[rank 0] unit the root module: copy.deepcopy of a ShardedDataParallel model cannot run while a unit is in FORWARD (during forward, backward or summon_full_params); copy it between iterations""",
        )

"""EMA models written by hand (timm's ``ModelEmaV2`` and the like): the update that works on a
wrapped model and the one that does not.

The values of a wrapped model's ``state_dict()`` are copies, as in FSDP1 (in the plain model
they alias the parameters), so an EMA that writes into ``ema.state_dict().values()`` leaves the
EMA model as it was, silently. An EMA over ``parameters()`` and ``buffers()`` -- the wrapped
EMA model a deep copy of the wrapped model, so both hold the same shards -- averages exactly as
the same EMA of the plain model does, in both ``use_orig_params`` modes, and so does one over
the full parameters inside ``summon_full_params``. docs/migrating.md shows both
(section "An EMA through state_dict() values")."""

from __future__ import annotations

import copy
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn

from flatshard import ModuleWrapPolicy, ShardedDataParallel
from tests._models import ATOL, RTOL, Block, batch, build, full_params, global_mean, lm_loss, local

DECAY = 0.8
STEPS = 4


@torch.no_grad()
def update_ema(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """The EMA update of docs/migrating.md: ``ema = decay * ema + (1 - decay) * model``, over
    the parameters and buffers (``ema`` a ``copy.deepcopy`` of ``model``)."""
    for e, m in zip(ema.parameters(), model.parameters()):
        e.lerp_(m, 1.0 - decay)  # decay * e + (1 - decay) * m
    for e, m in zip(ema.buffers(), model.buffers()):
        e.lerp_(m, 1.0 - decay) if e.is_floating_point() else e.copy_(m)


@torch.no_grad()
def update_through_state_dicts(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """``ModelEmaV2``'s update: it writes into the values of ``ema.state_dict()``."""
    for e, m in zip(ema.state_dict().values(), model.state_dict().values()):
        e.copy_(e * decay + (1.0 - decay) * m)


def _summoned_update(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """``update_ema`` over the full original parameters (docs/migrating.md's second form)."""
    with ShardedDataParallel.summon_full_params(ema, writeback=True), ShardedDataParallel.summon_full_params(model, writeback=False):
        update_ema(ema, model, decay)


UPDATES = {"parameters": update_ema, "summon_full_params": _summoned_update, "state_dict": update_through_state_dicts}


def _loss(model: nn.Module, step: int, rank: Optional[int], world_size: int) -> torch.Tensor:
    tokens, targets = batch(step, world_size)
    if rank is not None:
        tokens, targets = local(tokens, rank), local(targets, rank)
    return lm_loss(model(tokens), targets)


def _params(model: nn.Module, wrapped: bool) -> Dict[str, torch.Tensor]:
    if wrapped:
        return full_params(model)
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _train_with_ema(model: nn.Module, update: str, rank: Optional[int], world_size: int) -> Tuple[List[float], Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """AdamW training with an EMA copy updated after each step and evaluated: (EMA losses, the
    EMA's parameters when made, the EMA's parameters at the end)."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = copy.deepcopy(model)
    start = _params(ema, rank is not None)
    losses = []
    for step in range(STEPS):
        _loss(model, step, rank, world_size).backward()
        optim.step()
        optim.zero_grad()
        UPDATES[update](ema, model, DECAY)
        with torch.no_grad():
            loss = _loss(ema, 100 + step, rank, world_size)
        losses.append(loss.item() if rank is None else global_mean(loss))
    return losses, start, _params(ema, rank is not None)


def _assert_same(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], what: str) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: {sorted(actual)} vs {sorted(expected)}"
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {name}: {m}")


def _wrapped(orig: bool) -> ShardedDataParallel:
    return ShardedDataParallel(build(0), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=orig)


def _ema_parity(rank: int, world_size: int, orig: bool, update: str) -> bool:
    """``update`` on the wrapped model equals ``update_ema`` on the plain one."""
    expected_losses, expected_start, expected = _train_with_ema(build(0), "parameters", None, world_size)
    losses, start, actual = _train_with_ema(_wrapped(orig), update, rank, world_size)
    _assert_same(start, expected_start, "EMA when made")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=RTOL, atol=ATOL)
    _assert_same(actual, expected, f"EMA ({update})")
    return True


@pytest.mark.parametrize("update", ["parameters", "summon_full_params"])
@pytest.mark.parametrize("orig", [True, False], ids=["orig", "flat"])
def test_an_ema_over_parameters_equals_the_single_process_ema(rank_pool, orig, update):
    assert rank_pool.run(_ema_parity, 2, orig, update) == [True, True]


def _fsdp1(orig: bool) -> nn.Module:
    return torch_fsdp.FullyShardedDataParallel(
        build(0), auto_wrap_policy=torch_fsdp.wrap.ModuleWrapPolicy({Block}), device_id=torch.device("cpu"), use_orig_params=orig
    )


def _largest_change(model: nn.Module, ema: nn.Module, read: Callable[[nn.Module], Dict[str, torch.Tensor]], rank: Optional[int], world_size: int) -> float:
    """How far ``update_through_state_dicts`` moves ``ema`` (read by ``read``) in training."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = read(ema)
    for step in range(STEPS):
        _loss(model, step, rank, world_size).backward()
        optim.step()
        optim.zero_grad()
        update_through_state_dicts(ema, model, DECAY)
    end = read(ema)
    return max((end[name] - start[name]).abs().max().item() for name in start)


def _fsdp1_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    with torch_fsdp.FullyShardedDataParallel.summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _state_dict_ema(rank: int, world_size: int) -> Dict[str, float]:
    """The largest change of the EMA: of the plain model, flatshard's (a deep copy, as
    ``ModelEmaV2`` makes) and FSDP1's (built alike), in both modes."""
    warnings.filterwarnings("ignore")  # (FSDP1's deprecation and CPU-device warnings)
    plain = build(0)
    out = {"plain": _largest_change(plain, copy.deepcopy(plain), lambda m: _params(m, False), None, world_size)}
    for orig in (False, True):
        model = _wrapped(orig)
        out[f"flatshard, use_orig_params={orig}"] = _largest_change(model, copy.deepcopy(model), full_params, rank, world_size)
        out[f"FSDP1, use_orig_params={orig}"] = _largest_change(_fsdp1(orig), _fsdp1(orig), _fsdp1_params, rank, world_size)
    return out


def test_an_ema_through_state_dict_values_leaves_the_ema_unchanged_as_in_fsdp1(rank_pool):
    for changes in rank_pool.run(_state_dict_ema, 2):
        assert changes["plain"] > 1e-3, changes  # the plain model's state_dict() values alias its parameters
        assert {k: v for k, v in changes.items() if k != "plain"} == {
            "flatshard, use_orig_params=False": 0.0,
            "flatshard, use_orig_params=True": 0.0,
            "FSDP1, use_orig_params=False": 0.0,
            "FSDP1, use_orig_params=True": 0.0,
        }

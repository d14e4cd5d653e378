"""A real client's training and resume flow (IBM's fms-fsdp, written for FSDP1), in our own
words: a model built on the meta device and initialised by a ``param_init_fn`` that initialises
container modules, wrapped by block, activation checkpointing applied after wrapping, optionally
``torch.compile``, AdamW with a ``LambdaLR`` built after loading (with the resumed step as its
offset), a sharded ``torch.distributed.checkpoint`` save, and a resume in a fresh process group
-- loading the optimizer either into a template or through torch's
``load_sharded_optimizer_state_dict``. The resumed run must end bit-identical to the
uninterrupted one."""

from __future__ import annotations

import functools
import shutil
import tempfile
from typing import Any, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._models import full_params

DIM = 8


class _Block(nn.Module):
    """Initialised as a whole by its own ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.ln = nn.LayerNorm(DIM)

    def reset_parameters(self) -> None:
        for linear in (self.fc, self.mlp[0], self.mlp[2]):
            nn.init.trunc_normal_(linear.weight, std=0.2)
            nn.init.zeros_(linear.bias)
        self.ln.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln(self.fc(x)))


def _init(module: nn.Module) -> None:
    """fms-style: containers initialise their subtrees (a block all of itself, the model its
    head); leaf modules are left to them. It relies on being called on every module of a
    unit, containers included, as FSDP1 calls it."""
    if isinstance(module, _Block):
        module.to_empty(device="cpu")  # (no unit inside a block: it may recurse)
        module.reset_parameters()
    elif type(module) is nn.Sequential and isinstance(module[-1], nn.Linear) and module[-1].weight.is_meta:
        head = module[-1].to_empty(device="cpu")
        nn.init.trunc_normal_(head.weight, std=0.2)
        nn.init.zeros_(head.bias)


def _build(use_orig_params: bool, compiled: bool, group: Any) -> Tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper

    from flatshard import ShardedDataParallel
    from flatshard.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    with torch.device("meta"):
        plain = nn.Sequential(_Block(), _Block(), nn.Linear(DIM, 3))
    model = ShardedDataParallel(
        plain, process_group=group, auto_wrap_policy=ModuleWrapPolicy({_Block}), param_init_fn=_init, use_orig_params=use_orig_params
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, _Block),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, (torch.compile(model, backend="eager") if compiled else model), optim


def _schedule(optim: torch.optim.Optimizer, start: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0 / (1.0 + step + start))


def _steps(model: nn.Module, optim: torch.optim.Optimizer, scheduler: Any, rank: int, world_size: int, first: int, last: int) -> None:
    for step in range(first, last):
        inputs = torch.randn(2 * world_size, DIM, generator=torch.Generator().manual_seed(step))[2 * rank : 2 * rank + 2]
        optim.zero_grad()
        model(inputs).pow(2).mean().backward()
        optim.step()
        scheduler.step()


def _resume_flow(rank: int, world_size: int, use_orig_params: bool, compiled: bool, loader: str, path: str) -> List[float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

    from flatshard import ShardedDataParallel, StateDictType

    sharded = StateDictType.SHARDED_STATE_DICT
    raw, model, optim = _build(use_orig_params, compiled, None)
    scheduler = _schedule(optim, 0)
    _steps(model, optim, scheduler, rank, world_size, 0, 2)
    with ShardedDataParallel.state_dict_type(raw, sharded):
        dcp.save({"model_state": model.state_dict(), "optimizer_state": ShardedDataParallel.optim_state_dict(model, optim)}, checkpoint_id=path)
    _steps(model, optim, scheduler, rank, world_size, 2, 4)
    expected = full_params(raw)

    group = dist.new_group(list(range(world_size)))  # the resume runs in a fresh process group
    raw, model, optim = _build(use_orig_params, compiled, group)
    with ShardedDataParallel.state_dict_type(raw, sharded):
        state = {"model_state": model.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model_state"])
        if loader == "helper":
            osd = load_sharded_optimizer_state_dict(
                model_state_dict=model.state_dict(), optimizer_key="optimizer_state", storage_reader=dcp.FileSystemReader(path)
            )["optimizer_state"]
        else:
            template = {"optimizer_state": ShardedDataParallel.optim_state_dict(model, optim)}
            dcp.load(template, checkpoint_id=path)
            osd = template["optimizer_state"]
        optim.load_state_dict(ShardedDataParallel.optim_state_dict_to_load(model, optim, osd))
    scheduler = _schedule(optim, 2)  # built after loading, offset by the resumed step (as fms does)
    _steps(model, optim, scheduler, rank, world_size, 2, 4)
    got = full_params(raw)
    for name, value in expected.items():
        if not torch.equal(got[name], value):
            raise AssertionError(f"{name} differs from the uninterrupted run by {(got[name] - value).abs().max().item()}")
    return [group["lr"] for group in optim.param_groups]


@pytest.mark.parametrize(
    "use_orig_params,compiled,loader",
    [(False, False, "template"), (True, False, "helper"), (True, True, "template"), (False, True, "helper")],
    ids=["flat-template", "orig-helper", "orig-compiled-template", "flat-compiled-helper"],
)
def test_the_resumed_run_is_bit_identical_to_the_uninterrupted_one(rank_pool: Any, use_orig_params: bool, compiled: bool, loader: str) -> None:
    path = tempfile.mkdtemp(prefix="flatshard-client-")
    try:
        lrs = rank_pool.run(_resume_flow, 2, use_orig_params, compiled, loader, path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    # LambdaLR after 4 steps, from the saved initial_lr (not the decayed lr the save had)
    assert lrs == [[1e-2 / (1.0 + 2 + 2)]] * 2


def _initial_lrs(rank: int, world_size: int) -> List[Any]:
    """Optimizer state dicts hold ``initial_lr`` only where a scheduler set it (as torch's
    and FSDP1's do: a template with more keys than a checkpoint would not load);
    ``optim_state_dict_to_load`` fills a missing one with the live optimizer's base rate (its
    scheduler's, else its ``lr``) where the loaded ``lr`` differs from it, and otherwise gives
    back exactly what was saved."""
    from flatshard import ShardedDataParallel

    raw, model, optim = _build(False, False, None)
    fresh = "initial_lr" in ShardedDataParallel.optim_state_dict(model, optim)["param_groups"][0]
    scheduler = _schedule(optim, 0)
    _steps(model, optim, scheduler, rank, world_size, 0, 2)
    saved = ShardedDataParallel.optim_state_dict(model, optim)
    scheduled = (saved["param_groups"][0]["initial_lr"], saved["param_groups"][0]["lr"])
    for group in saved["param_groups"]:
        del group["initial_lr"]  # (as a checkpoint loaded through a template of a fresh optimizer)
    into_scheduled = ShardedDataParallel.optim_state_dict_to_load(model, optim, saved)["param_groups"][0]
    _, other, other_optim = _build(False, False, None)
    into_fresh = ShardedDataParallel.optim_state_dict_to_load(other, other_optim, saved)["param_groups"][0]
    unscheduled = ShardedDataParallel.optim_state_dict(other, other_optim)  # (lr as built: nothing to fill)
    as_saved = ShardedDataParallel.optim_state_dict_to_load(other, other_optim, unscheduled)["param_groups"][0]
    return [fresh, scheduled, into_scheduled["initial_lr"], (into_fresh["initial_lr"], into_fresh["lr"]), "initial_lr" in as_saved]


def test_a_missing_initial_lr_is_the_live_optimizers_base_rate(rank_pool: Any) -> None:
    third = 1e-2 * (1.0 / 3.0)  # (LambdaLR: base rate times the factor)
    assert rank_pool.run(_initial_lrs, 2) == [[False, (1e-2, third), 1e-2, (1e-2, third), False]] * 2

"""use_orig_params=True: the model's own parameters stay registered under their names, as views
of the shards; optimizers are built from them by name. Everything is compared with
single-process training of the unwrapped model on the global batch."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from expecttest import TestCase
from torch import nn

from flatshard import (
    BackwardPrefetch,
    CPUOffload,
    CustomPolicy,
    MixedPrecision,
    ShardedDataParallel,
    ShardingStrategy,
    StateDictType,
)
from tests._models import (
    ATOL,
    RTOL,
    Block,
    batch,
    build,
    error_text,
    full_params,
    global_mean,
    lm_loss,
    local,
    run_parity,
    wrap,
)

ORIG = dict(use_orig_params=True)
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


# -- optimizers built by parameter name -------------------------------------------------------


def _name_groups(named: List[Tuple[str, nn.Parameter]]) -> List[Dict[str, Any]]:
    """What LLM training scripts do: no weight decay for biases and norms, and the blocks with
    their own learning rate; chosen by name only."""
    decay, no_decay, blocks = [], [], []
    for name, param in named:
        if not param.requires_grad:
            continue
        if name.startswith("blocks.") and name.endswith("fc1.weight"):
            blocks.append(param)
        elif name.endswith("bias") or "norm" in name:
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0},
        {"params": blocks, "weight_decay": 0.1, "lr": 3e-3},
    ]


OPTIMIZERS: Dict[str, Callable[[List[Tuple[str, nn.Parameter]]], torch.optim.Optimizer]] = {
    "AdamW": lambda named: torch.optim.AdamW(_name_groups(named), lr=1e-2),
    "SGD": lambda named: torch.optim.SGD(_name_groups(named), lr=0.05, momentum=0.9),
}


def _train(model: nn.Module, optim: torch.optim.Optimizer, world_size: int, rank: Any, steps: int = 4, hook: Any = None) -> List[float]:
    losses = []
    for step in range(steps):
        if hook is not None:
            hook(model, step)
        tokens, targets = batch(step, world_size)
        if rank is not None:
            tokens, targets = local(tokens, rank), local(targets, rank)
        loss = lm_loss(model(tokens), targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item() if rank is None else global_mean(loss))
    return losses


def _named_training(rank: int, world_size: int, optimizer: str, model_kwargs: Dict[str, Any], hook: Any = None, **options: Any) -> Tuple[List[str], List[str]]:
    """Train the plain and the wrapped model with an optimizer built from named_parameters();
    compare losses and parameters. Returns (wrapped names, plain names)."""
    plain = build(**model_kwargs)
    plain_losses = _train(plain, OPTIMIZERS[optimizer](list(plain.named_parameters())), world_size, None, hook=hook)
    model = wrap(build(**model_kwargs), "nested", **ORIG, **options)
    names = [n for n, _ in model.named_parameters()]
    losses = _train(model, OPTIMIZERS[optimizer](list(model.named_parameters())), world_size, rank, hook=hook)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=RTOL, atol=ATOL)
    actual = full_params(model)
    for name, expected in plain.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(actual[name], expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    return names, [n for n, _ in plain.named_parameters()]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy_name", STRATEGIES)
@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
def test_name_based_param_groups_train_like_single_process(rank_pool, optimizer, strategy_name, world_size):
    names, plain_names = rank_pool.run(
        _named_training, world_size, optimizer, {}, sharding_strategy=ShardingStrategy[strategy_name]
    )[0]
    assert names == plain_names  # the user's names, no wrapper prefixes


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy_name", STRATEGIES)
def test_parity_with_single_process(rank_pool, strategy_name, world_size):
    rank_pool.run(run_parity, world_size, "nested", sharding_strategy=ShardingStrategy[strategy_name], **ORIG)


@pytest.mark.parametrize(
    "options",
    [
        dict(backward_prefetch=BackwardPrefetch.BACKWARD_POST, forward_prefetch=True),
        dict(backward_prefetch=None, limit_all_gathers=False),
        dict(cpu_offload=CPUOffload(offload_params=True)),
    ],
    ids=["post+forward-prefetch", "no-prefetch", "offload"],
)
def test_parity_with_other_options(rank_pool, options):
    rank_pool.run(run_parity, 3, "nested", **ORIG, **options)


def test_no_sync_accumulation_and_activation_checkpointing(rank_pool):
    for strategy_name in STRATEGIES:
        rank_pool.run(run_parity, 2, "nested", steps=3, micro_batches=3, sharding_strategy=ShardingStrategy[strategy_name], **ORIG)
    rank_pool.run(run_parity, 2, "nested", steps=3, model_kwargs=dict(checkpoint="inner"), **ORIG)


def _hybrid(rank: int, world_size: int) -> bool:
    shard = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pair = (shard[rank // 2], replicate[rank % 2])
    for strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        _named_training(rank, world_size, "AdamW", {}, sharding_strategy=strategy, process_group=pair)
    return True


def test_hybrid_sharding(rank_pool):
    assert rank_pool.run(_hybrid, 4) == [True] * 4


def _mixed_precision(rank: int, world_size: int) -> float:
    """bf16 compute: the same as the default mode (which test_mixed_precision compares with
    single-process bf16 training), bit for bit."""
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    results = []
    for orig in (False, True):
        model = wrap(build(), "nested", mixed_precision=mp, use_orig_params=orig)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _train(model, optim, world_size, rank, steps=3)
        results.append(full_params(model))
    return max((results[0][n] - results[1][n]).abs().max().item() for n in results[0])


def test_mixed_precision_equals_the_default_mode(rank_pool):
    assert rank_pool.run(_mixed_precision, 2) == [0.0, 0.0]


# -- frozen and trainable parameters --------------------------------------------------------


def _freeze_fc1_at_step_2(model: nn.Module, step: int) -> None:
    if step == 2:
        for name, param in model.named_parameters():
            if name.endswith("fc1.weight"):
                param.requires_grad_(False)


def test_frozen_blocks_and_parameters_frozen_one_by_one_during_training(rank_pool):
    rank_pool.run(_named_training, 2, "AdamW", dict(frozen_blocks=(1,)))
    # staged freezing: single parameters inside a unit stop training at step 2
    rank_pool.run(_named_training, 3, "AdamW", {}, hook=_freeze_fc1_at_step_2)


def _frozen_memory(rank: int, world_size: int) -> Dict[str, Any]:
    """A LoRA-like unit: a frozen weight and a small trainable one. The frozen parameters get
    no gradient and no reduction."""
    model = wrap(build(frozen_blocks=(0, 1)), "nested", **ORIG)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trainable, lr=1e-2)
    tokens, targets = batch(0, world_size)
    lm_loss(model(local(tokens, rank)), local(targets, rank)).backward()
    frozen = {n: p.grad for n, p in model.named_parameters() if not p.requires_grad}
    frozen_handles = [h for m in ShardedDataParallel.fsdp_modules(model) for h in m.handles if not h.requires_grad]
    optim.step()
    return {
        "frozen with a gradient": sorted(n for n, g in frozen.items() if g is not None),
        "frozen FlatParameters with a gradient": sum(h.flat_param.grad is not None for h in frozen_handles),
        "frozen FlatParameters": len(frozen_handles),
    }


def test_frozen_parameters_get_no_gradient_memory(rank_pool):
    result = rank_pool.run(_frozen_memory, 2)[0]
    assert result == {"frozen with a gradient": [], "frozen FlatParameters with a gradient": 0, "frozen FlatParameters": 2}


# -- the parameters as the user sees them ------------------------------------------------------


def _views(rank: int, world_size: int) -> Dict[str, Any]:
    model = wrap(build(), "nested", **ORIG)
    plain = build()
    pieces = {n: p.numel() for n, p in model.named_parameters()}
    total = [torch.tensor(sum(pieces.values()))]
    dist.all_reduce(total[0])
    # an in-place edit of the sharded view outside forward reaches the shard
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "blocks.1.fc2.bias":
                param.fill_(0.5)
    with ShardedDataParallel.summon_full_params(model):
        summoned = {n: p.detach().clone() for n, p in model.named_parameters()}
        shapes_inside = {n: tuple(p.shape) for n, p in model.named_parameters()}
    seen: Dict[str, Any] = {}
    model.blocks[0].module.fc1.register_forward_pre_hook(lambda m, a: seen.update(shape=tuple(m.weight.shape)))
    tokens, targets = batch(0, world_size)
    loss = lm_loss(model(local(tokens, rank)), local(targets, rank))
    loss.backward()
    # (a parameter with no part in this rank's shard gets no gradient, as in FSDP1)
    grads = {n: ((p.grad is not None) == (p.numel() > 0), p.grad is None or p.grad.shape == p.shape) for n, p in model.named_parameters()}
    # zero_grad(set_to_none=True) drops the views; the next forward releases the shard gradients
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad(set_to_none=True)
    with torch.no_grad():
        model(local(tokens, rank))
    kept = [h for m in ShardedDataParallel.fsdp_modules(model) for h in m.handles if h.flat_param.grad is not None]
    return {
        "shard gradients kept after zero_grad": len(kept),
        "elements": total[0].item() == sum(p.numel() for p in plain.parameters()),
        "shapes inside summon": shapes_inside == {n: tuple(p.shape) for n, p in plain.named_parameters()},
        "edited": bool((summoned["blocks.1.fc2.bias"] == 0.5).all()),
        "shape in forward": seen["shape"],
        "grads": all(has and same for has, same in grads.values()),
        "attribute is the parameter": model.blocks[0].module.fc1.weight is dict(model.named_parameters())["blocks.0.fc1.weight"],
    }


def test_parameters_are_views_of_the_shards(rank_pool):
    for result in rank_pool.run(_views, 3):
        assert result == {
            "shard gradients kept after zero_grad": 0,
            "elements": True,
            "shapes inside summon": True,
            "edited": True,
            "shape in forward": (16, 8),
            "grads": True,
            "attribute is the parameter": True,
        }, result


def _clip_and_accumulate(rank: int, world_size: int) -> bool:
    """clip_grad_norm_ and gradient accumulation over two backwards without no_sync, with
    zero_grad(set_to_none=False), like torch.nn.utils.clip_grad_norm_ on the plain model."""
    plain = build()
    model = wrap(build(), "nested", **ORIG)
    plain_optim = OPTIMIZERS["AdamW"](list(plain.named_parameters()))
    optim = OPTIMIZERS["AdamW"](list(model.named_parameters()))
    for step in range(3):
        for micro in range(2):
            tokens, targets = batch(2 * step + micro, world_size)
            lm_loss(plain(tokens), targets).backward()
            lm_loss(model(local(tokens, rank)), local(targets, rank)).backward()
        expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        actual = model.clip_grad_norm_(0.5)
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)
        plain_optim.step()
        optim.step()
        plain_optim.zero_grad(set_to_none=False)
        optim.zero_grad(set_to_none=False)
    actual_params = full_params(model)
    for name, expected_param in plain.named_parameters():
        torch.testing.assert_close(actual_params[name], expected_param, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    return True


def test_clip_grad_norm_and_accumulation_without_no_sync(rank_pool):
    assert rank_pool.run(_clip_and_accumulate, 2) == [True, True]


def _optimizer_built_before_wrapping(rank: int, world_size: int) -> bool:
    """The parameters are the model's own objects, so an optimizer built before wrapping (e.g.
    with groups chosen by p.dim(), which is 1 for every parameter after wrapping) steps the
    wrapped model, as long as it has not stepped yet."""
    plain = build()
    groups = lambda m: [  # noqa: E731
        {"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    plain_optim = torch.optim.AdamW(groups(plain), lr=1e-2)
    _train(plain, plain_optim, world_size, None)
    unwrapped = build()
    optim = torch.optim.AdamW(groups(unwrapped), lr=1e-2)
    model = wrap(unwrapped, "nested", **ORIG)
    _train(model, optim, world_size, rank)
    actual = full_params(model)
    for name, expected in plain.named_parameters():
        torch.testing.assert_close(actual[name], expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    return True


def test_an_optimizer_built_before_wrapping_steps_the_model(rank_pool):
    assert rank_pool.run(_optimizer_built_before_wrapping, 2) == [True, True]


def _local_state_dict_and_summoned_grads(rank: int, world_size: int) -> bool:
    """A LOCAL_STATE_DICT round trip; summon_full_params(with_grads=True) gives the plain
    model's gradients under the plain names."""
    plain = build()
    tokens, targets = batch(0, world_size)
    lm_loss(plain(tokens), targets).backward()
    model = wrap(build(), "nested", **ORIG)
    lm_loss(model(local(tokens, rank)), local(targets, rank)).backward()
    with ShardedDataParallel.summon_full_params(model, with_grads=True):
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, param in plain.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    with ShardedDataParallel.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        state = model.state_dict()
    other = wrap(build(seed=3), "nested", **ORIG)
    with ShardedDataParallel.state_dict_type(other, StateDictType.LOCAL_STATE_DICT):
        other.load_state_dict(state)
    expected = full_params(model)
    for name, value in full_params(other).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    return True


def test_local_state_dict_and_summoned_gradients(rank_pool):
    assert rank_pool.run(_local_state_dict_and_summoned_grads, 3) == [True] * 3


# -- errors -------------------------------------------------------------------------------------


def _errors(rank: int, world_size: int) -> List[str]:
    override = CustomPolicy(lambda m: {"use_orig_params": False} if isinstance(m, Block) else False)
    model = build()
    model.blocks[0] = ShardedDataParallel(model.blocks[0])
    return [
        error_text(lambda: ShardedDataParallel(build(), auto_wrap_policy=override, use_orig_params=True), ValueError),
        error_text(lambda: ShardedDataParallel(model, use_orig_params=True), ValueError),
    ]


class OrigParamsErrorTest(TestCase):
    def test_errors(self):
        messages = self.pool.run(_errors, 2)[0]
        self.assertExpectedInline(
            "\n".join(messages),
            """\
the auto-wrap policy cannot override 'use_orig_params' for one unit (module 'blocks.0' (Block))
use_orig_params must be the same for every unit of a model: the unit at 'blocks.0' was built with use_orig_params=False, the unit wrapping it with use_orig_params=True""",
        )


def _frozen_sharded_checkpoint(rank: int, world_size: int, directory: str) -> bool:
    """With parameters frozen at wrapping, a trained model's sharded optimizer state dict has
    the same entries as a fresh model's (templates for the frozen ones), so it loads into one
    through torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp

    def make() -> Tuple[nn.Module, torch.optim.Optimizer]:
        model = wrap(build(frozen_blocks=(0,)), "nested", **ORIG)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def state(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, Any]:
        with ShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            return {"model": model.state_dict(), "optim": ShardedDataParallel.optim_state_dict(model, optim)}

    model, optim = make()
    _train(model, optim, world_size, rank, steps=1)
    saved = state(model, optim)
    dcp.save(saved, checkpoint_id=directory)
    fresh, fresh_optim = make()
    template = state(fresh, fresh_optim)
    assert sorted(template["optim"]["state"]) == sorted(saved["optim"]["state"])
    dcp.load(template, checkpoint_id=directory)
    return True


def test_a_sharded_checkpoint_with_frozen_parameters_loads_into_a_fresh_model(rank_pool, tmp_path):
    assert rank_pool.run(_frozen_sharded_checkpoint, 2, str(tmp_path / "ckpt")) == [True, True]

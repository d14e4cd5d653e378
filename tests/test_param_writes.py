"""No write to a parameter is ever lost: values written to the parameters (in place, by
rebinding ``.data``, by ``vector_to_parameters``, by registering a new ``nn.Parameter``)
outside forward, inside forward, or through the views of a unit left gathered reach the shards,
and what cannot be honoured (a change between forward and backward of a gathered unit) raises.
Everything is compared with single-process training on the global batch; the FSDP1 ports are
PyTorch's own ``use_orig_params`` writeback tests."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple
from unittest import mock

import pytest
import torch
from expecttest import TestCase
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from flatshard import MixedPrecision, ModuleWrapPolicy, ShardedDataParallel, ShardingStrategy
from tests._models import ATOL, RTOL, Block, batch, build, error_text, full_params, global_mean, lm_loss, local, wrap

ORIG = dict(use_orig_params=True)
Edit = Callable[[nn.Module], None]


def _plain_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _assert_same(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], what: str) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: {sorted(actual)} vs {sorted(expected)}"
    for name, value in expected.items():
        torch.testing.assert_close(actual[name].to(value.dtype), value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {name}: {m}")


# -- edits a training loop makes between steps ---------------------------------------------------


def _rebind_data(model: nn.Module) -> None:
    for p in model.parameters():
        p.data = p.data * 0.9


def _vector_to_parameters(model: nn.Module) -> None:
    params = list(model.parameters())
    vector_to_parameters(parameters_to_vector(params) * 0.9 + 0.01, params)


def _in_place(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)


def _rebind_some(model: nn.Module) -> None:
    """By name: only the first layers of the blocks (``use_orig_params`` names)."""
    for name, p in model.named_parameters():
        if "fc1" in name:
            p.data = p.data - 0.05


def _replace_biases(model: nn.Module) -> None:
    """Register new ``nn.Parameter``s (an optimizer built before keeps stepping the old ones,
    as in single-process training)."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias = nn.Parameter(module.bias.detach() * 0.5)


def _scale_grads(model: nn.Module) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad = p.grad * 0.5


def _rebind_grad_data(model: nn.Module) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.data = p.grad.data * 0.5 + 0.01


def _grads_in_place(model: nn.Module) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(0.5)


def _metrics_then_replace(model: nn.Module) -> None:
    """A forward with autograd on and no backward (units stay gathered, their attributes show
    the whole parameters), then new biases of the shape each attribute shows."""
    model(torch.zeros(1, 5, dtype=torch.long))
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias = nn.Parameter(torch.full_like(module.bias, 0.3))


EDITS: Dict[str, Tuple[Optional[Edit], Optional[Edit]]] = {  # (after the step, before the step)
    ".data rebound": (_rebind_data, None),
    ".data rebound before the step": (None, _rebind_data),
    "vector_to_parameters": (_vector_to_parameters, None),
    "in place": (_in_place, None),
    ".grad rebound": (None, _scale_grads),
    ".grad.data rebound": (None, _rebind_grad_data),
    ".grad in place": (None, _grads_in_place),
}
ORIG_ONLY_EDITS: Dict[str, Tuple[Optional[Edit], Optional[Edit]]] = {
    ".data of some rebound by name": (_rebind_some, None),
    "new nn.Parameters registered": (_replace_biases, None),
    "new nn.Parameters of the gathered shape": (_metrics_then_replace, None),
}


def _train(model: nn.Module, rank: Optional[int], world_size: int, after: Optional[Edit], before: Optional[Edit], steps: int = 3) -> List[float]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        tokens, targets = batch(step, world_size)
        if rank is not None:
            tokens, targets = local(tokens, rank), local(targets, rank)
        loss = lm_loss(model(tokens), targets)
        loss.backward()
        if before is not None:
            before(model)
        optim.step()
        optim.zero_grad()
        if after is not None:
            after(model)
        losses.append(loss.item() if rank is None else global_mean(loss))
    return losses


def _edits_reach_the_shards(rank: int, world_size: int, orig: bool, strategy: str, shared_memory: str) -> List[str]:
    """Each edit, in a fresh training run, compared with single-process training."""
    edits = {**EDITS, **(ORIG_ONLY_EDITS if orig else {})}
    done = []
    with mock.patch.dict(os.environ, {"FLATSHARD_SHARED_MEMORY": shared_memory}):
        for name, (after, before) in edits.items():
            plain = build()
            expected = _train(plain, None, world_size, after, before)
            model = wrap(build(), "nested", use_orig_params=orig, sharding_strategy=ShardingStrategy[strategy])
            losses = _train(model, rank, world_size, after, before)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
            _assert_same(full_params(model), _plain_params(plain), name)
            _assert_same(_summoned(model), _plain_params(plain), f"{name} (summoned)")
            done.append(name)
    return done


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("orig", [True, False], ids=["orig", "flat"])
def test_edits_between_steps_train_like_single_process(rank_pool, orig, strategy):
    done = rank_pool.run(_edits_reach_the_shards, 2, orig, strategy, "1")[0]
    assert len(done) == len(EDITS) + (len(ORIG_ONLY_EDITS) if orig else 0)


def test_edits_between_steps_over_gloo_and_at_world_size_3(rank_pool):
    rank_pool.run(_edits_reach_the_shards, 2, True, "FULL_SHARD", "0")
    rank_pool.run(_edits_reach_the_shards, 3, True, "FULL_SHARD", "1")


# -- the flows of PyTorch's FSDP1 writeback tests (test_fsdp_use_orig_params.py) ------------------


class TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.lin1 = nn.Linear(5, 5)
        self.lin2 = nn.Linear(5, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x)))


def _fsdp1_param_writeback(rank: int, world_size: int) -> List[str]:
    """Change the first or second weight, by ``.data`` or by a new ``nn.Parameter``; the
    summoned full parameters, the next forward and the state dict show the change."""
    checked = []
    for first in (True, False):
        for change_data in (True, False):
            plain, model = TwoLinear(), ShardedDataParallel(TwoLinear(), **ORIG)
            for owner in (plain, model.module):
                lin = owner.lin1 if first else owner.lin2
                new = nn.Parameter(torch.ones_like(lin.weight) * 2)
                if change_data:
                    lin.weight.data = new
                else:
                    lin.weight = new
            with ShardedDataParallel.summon_full_params(model):
                summoned = {n: p.detach().clone() for n, p in model.named_parameters()}
            _assert_same(summoned, _plain_params(plain), f"summoned first={first} data={change_data}")
            x = torch.randn(2, 5, generator=torch.Generator().manual_seed(rank))
            torch.testing.assert_close(model(x), plain(x), rtol=RTOL, atol=ATOL)
            _assert_same(dict(model.state_dict()), dict(plain.state_dict()), "state dict")
            checked.append(f"first={first} data={change_data}")
    return checked


def _fsdp1_grad_writeback(rank: int, world_size: int) -> int:
    """Change a weight's gradient (by ``.data``, by rebinding, to ``None``) before Adam steps;
    then accumulate another backward without zeroing."""
    cases = 0
    for first in (False, True):
        for change_data in (False, True):
            for set_to_none in (False, True):
                if change_data and set_to_none:
                    continue
                plain, model = TwoLinear(), ShardedDataParallel(TwoLinear(), **ORIG)
                optims = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (plain, model)]
                x = torch.randn(2 * world_size, 5, generator=torch.Generator().manual_seed(0))
                for owner, inputs in ((plain, x), (model, x[2 * rank : 2 * rank + 2])):
                    # (the sum over the global batch: the local sums, averaged, times the world size)
                    owner(inputs).sum().mul(1.0 if owner is plain else world_size).backward()
                for owner in (plain, model.module):
                    lin = owner.lin1 if first else owner.lin2
                    if change_data:
                        if lin.weight.grad is not None:
                            lin.weight.grad.data = torch.ones_like(lin.weight) * 2
                    else:
                        lin.weight.grad = None if set_to_none else torch.ones_like(lin.weight) * 2
                for optim in optims:
                    optim.step()
                _assert_same(full_params(model), _plain_params(plain), "after the first step")
                for owner, inputs in ((plain, x), (model, x[2 * rank : 2 * rank + 2])):
                    owner(inputs).sum().mul(1.0 if owner is plain else world_size).backward()
                for optim in optims:
                    optim.step()
                _assert_same(full_params(model), _plain_params(plain), f"first={first} data={change_data} none={set_to_none}")
                cases += 1
    return cases


def _fsdp1_shape_mismatch(rank: int, world_size: int) -> str:
    model = ShardedDataParallel(TwoLinear(), **ORIG)
    lin = model.module.lin1 if rank == 0 else model.module.lin2
    shape = [d + 1 for d in lin.weight.shape]
    lin.weight = nn.Parameter(torch.randn(shape))

    def summon() -> None:
        with ShardedDataParallel.summon_full_params(model):
            pass

    return error_text(summon, RuntimeError)


def _named_parameters_in_forward(rank: int, world_size: int) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(5, 5)
            self.block = Block(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            named = dict(self.named_parameters())
            seen["names"] = list(named)
            seen["shapes"] = {n: tuple(p.shape) for n, p in named.items() if n.startswith("lin.")}
            seen["same as attributes"] = named["lin.weight"] is self.lin.weight and named["lin.bias"] is self.lin.bias
            return self.lin(x)

    model = ShardedDataParallel(Model(), auto_wrap_policy=ModuleWrapPolicy({Block}), **ORIG)
    model(torch.randn(2, 5)).sum().backward()
    originals = {n: p for n, p in model.named_parameters()}
    seen["after forward, the optimizer's parameters"] = all(isinstance(p, nn.Parameter) for p in originals.values())
    return seen


class Fsdp1WritebackTest(TestCase):
    def test_param_writeback(self) -> None:
        for checked in self.pool.run(_fsdp1_param_writeback, 2):
            self.assertEqual(len(checked), 4)

    def test_grad_writeback(self) -> None:
        self.assertEqual(self.pool.run(_fsdp1_grad_writeback, 2), [6, 6])

    def test_writeback_shape_mismatch(self) -> None:
        messages = self.pool.run(_fsdp1_shape_mismatch, 2)
        self.assertExpectedInline(
            "\n".join(messages),
            """\
[rank 0] Cannot writeback parameter 'lin1.weight': it was set to a tensor of shape (26,) and dtype torch.float32, but it has shape (5, 5) and its part of this rank's shard shape (25,), dtype torch.float32 (with use_orig_params=True a parameter is, outside forward, its part of this rank's shard: give it a value of either shape and that dtype)
[rank 1] Cannot writeback parameter 'lin2.weight': it was set to a tensor of shape (30,) and dtype torch.float32, but it has shape (7, 5) and its part of this rank's shard shape (29,), dtype torch.float32 (with use_orig_params=True a parameter is, outside forward, its part of this rank's shard: give it a value of either shape and that dtype)""",
        )

    def test_named_parameters_in_forward_are_the_full_parameters(self) -> None:
        for seen in self.pool.run(_named_parameters_in_forward, 2):
            self.assertEqual(seen["names"][:2], ["lin.weight", "lin.bias"])
            self.assertEqual(seen["shapes"], {"lin.weight": (5, 5), "lin.bias": (5,)})
            self.assertTrue(seen["same as attributes"])
            self.assertTrue(seen["after forward, the optimizer's parameters"])


# -- writes made inside forward, and through the views of a unit left gathered ------------------


class ClampedLinear(nn.Linear):
    """Clamps its own weight in place inside forward, in eval mode (a constraint applied when
    the model is evaluated; ``always``: in every forward)."""

    always = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.always or not self.training:
            with torch.no_grad():
                self.weight.clamp_(-0.2, 0.2)
        return super().forward(x)


class ClampedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(13, 8)
        self.blocks = nn.ModuleList(nn.Sequential(ClampedLinear(8, 8), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(8, 13)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _in_forward_writes(rank: Optional[int], world_size: int, metrics: bool, **options: Any) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """Each step evaluates under ``no_grad`` (the forward clamps weights in place), then trains.
    ``metrics``: a forward with autograd on and no backward comes first (units stay gathered),
    after which the loop scales every parameter in place."""
    model: nn.Module = ClampedModel()
    if rank is not None:
        model = ShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), **options)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(3):
        tokens, targets = batch(step, world_size)
        if rank is not None:
            tokens, targets = local(tokens, rank), local(targets, rank)
        model.eval()
        with torch.no_grad():
            model(tokens)
        model.train()
        if metrics:
            model(tokens).sum()  # autograd on, no backward: the root (or every unit) stays gathered
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.99)
        loss = lm_loss(model(tokens), targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item() if rank is None else global_mean(loss))
    return losses, (_plain_params(model) if rank is None else full_params(model))


def _in_forward_parity(rank: int, world_size: int, metrics: bool, **options: Any) -> bool:
    expected_losses, expected = _in_forward_writes(None, world_size, metrics)
    losses, actual = _in_forward_writes(rank, world_size, metrics, **options)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=RTOL, atol=ATOL)
    _assert_same(actual, expected, f"metrics={metrics} {options}")
    return True


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("orig", [True, False], ids=["orig", "flat"])
def test_writes_inside_a_no_grad_forward_and_to_gathered_units_reach_the_shards(rank_pool, orig, strategy):
    for metrics in (False, True):
        rank_pool.run(_in_forward_parity, 2, metrics, use_orig_params=orig, sharding_strategy=ShardingStrategy[strategy])


def _in_place_with_autograd_on(rank: int, world_size: int, orig: bool) -> str:
    """With autograd on, the modules compute with views of one gathered tensor, which autograd
    does not let a forward change in place: a loud error (torch's), as in FSDP1."""
    model = ShardedDataParallel(ClampedModel(), auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), use_orig_params=orig)
    for block in model.module.blocks:
        block.module[0].always = True
    return error_text(lambda: model(batch(0, world_size)[0]), RuntimeError)


def test_an_in_place_write_inside_a_forward_with_autograd_on_raises(rank_pool):
    for orig in (True, False):
        for message in rank_pool.run(_in_place_with_autograd_on, 2, orig):
            assert "is a view and its base or another view of its base has been modified inplace" in message, message


def _summoned(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The full parameters in their own dtype (under mixed precision too)."""
    with ShardedDataParallel.summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _in_forward_writes_mixed_precision(rank: int, world_size: int) -> float:
    """Under mixed precision an in-place write in the compute dtype reaches exactly the
    elements it changed; the others keep their full precision."""
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    model = ShardedDataParallel(ClampedModel(), auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), mixed_precision=mp, **ORIG)
    before = _summoned(model)
    tokens, _ = batch(0, world_size)
    model.eval()
    with torch.no_grad():
        model(local(tokens, rank))
    after = _summoned(model)
    worst = 0.0
    for name, value in before.items():
        clamped = value.clamp(-0.2, 0.2) if name.startswith("blocks.") and name.endswith("0.weight") else value
        changed = clamped != value
        # changed elements: the clamp bound in bf16; the others: untouched, bit for bit
        assert torch.equal(after[name][~changed], value[~changed]), name
        worst = max(worst, (after[name][changed] - clamped[changed]).abs().max().item() if changed.any() else 0.0)
    return worst


def test_in_forward_writes_under_mixed_precision_change_only_the_written_elements(rank_pool):
    for worst in rank_pool.run(_in_forward_writes_mixed_precision, 2):
        assert worst < 1e-3


# -- a change between forward and backward of a unit that stays gathered ---------------------------


def _changed_between_forward_and_backward(rank: int, world_size: int, strategy: str, how: str, orig: bool) -> str:
    model = wrap(build(), "nested", use_orig_params=orig, sharding_strategy=ShardingStrategy[strategy])
    tokens, targets = batch(0, world_size)
    loss = lm_loss(model(local(tokens, rank)), local(targets, rank))
    # SHARD_GRAD_OP keeps every unit gathered; under FULL_SHARD only the root (the final norm)
    module = model.blocks[0].module.fc1 if strategy == "SHARD_GRAD_OP" else model.module.norm
    if how == ".data":
        module.weight.data = module.weight.detach().clone()
    elif how == "param":
        module.weight = nn.Parameter(module.weight.detach().clone())
    else:  # what the optimizer steps, e.g. vector_to_parameters(vec, model.parameters())
        params = list(model.parameters())
        vector_to_parameters(parameters_to_vector(params) * 0.5, params)
    return error_text(loss.backward, AssertionError)


class BetweenForwardAndBackwardTest(TestCase):
    def test_a_gathered_unit_changed_between_forward_and_backward_raises(self) -> None:
        messages = []
        cases = [("SHARD_GRAD_OP", ".data", True), ("SHARD_GRAD_OP", "param", True), ("FULL_SHARD", ".data", False), ("FULL_SHARD", "param", True)]
        cases += [("FULL_SHARD", "parameters", True), ("FULL_SHARD", "parameters", False)]
        for strategy, how, orig in cases:
            per_rank = self.pool.run(_changed_between_forward_and_backward, 2, strategy, how, orig)
            self.assertEqual(per_rank[1], per_rank[0].replace("[rank 0]", "[rank 1]"))
            messages.append(per_rank[0])
        self.assertExpectedInline(
            "\n".join(messages),
            """\
[rank 0] unit 'blocks.0': the .data of parameter 'blocks.0.fc1.weight' was rebound between the forward and the backward, while the unit kept its parameters gathered for the backward (SHARD_GRAD_OP): FSDP does not support changing the parameters between forward and backward for ShardingStrategy.SHARD_GRAD_OP; change them before the forward or after the backward
[rank 0] unit 'blocks.0': parameter 'blocks.0.fc1.weight' was replaced between the forward and the backward, while the unit kept its parameters gathered for the backward (SHARD_GRAD_OP): FSDP does not support changing the parameters between forward and backward for ShardingStrategy.SHARD_GRAD_OP; change them before the forward or after the backward
[rank 0] unit the root module: the .data of parameter 'norm.weight' was rebound between the forward and the backward, while the unit kept its parameters gathered for the backward (the root): FSDP does not support changing the parameters between forward and backward for ShardingStrategy.FULL_SHARD; change them before the forward or after the backward
[rank 0] unit the root module: parameter 'norm.weight' was replaced between the forward and the backward, while the unit kept its parameters gathered for the backward (the root): FSDP does not support changing the parameters between forward and backward for ShardingStrategy.FULL_SHARD; change them before the forward or after the backward
[rank 0] unit the root module: the .data of parameter 'embed.weight' was rebound between the forward and the backward, while the unit kept its parameters gathered for the backward (the root): FSDP does not support changing the parameters between forward and backward for ShardingStrategy.FULL_SHARD; change them before the forward or after the backward
[rank 0] unit the root module: the .data of the FlatParameter of 'embed.weight', 'norm.weight', ... was rebound between the forward and the backward, while the unit kept its parameters gathered for the backward (the root): FSDP does not support changing the parameters between forward and backward for ShardingStrategy.FULL_SHARD; change them before the forward or after the backward""",
        )


# -- what cannot be written back -----------------------------------------------------------------


def _write_errors(rank: int, world_size: int) -> List[str]:
    def shard_sized_only() -> None:
        model = wrap(build(), "nested", **ORIG)
        model.module.norm.weight.data = torch.ones(8, dtype=torch.float64)
        model(batch(0, world_size)[0])

    def tie_split() -> None:
        model = wrap(build(), "nested", **ORIG)
        model.module.head.weight = nn.Parameter(model.module.head.weight.detach().clone())
        model(batch(0, world_size)[0])

    def removed() -> None:
        model = wrap(build(), "nested", **ORIG)
        model.module.norm.bias = None
        model(batch(0, world_size)[0])

    def flat_replaced() -> None:
        model = wrap(build(), "nested")
        model.module.norm.weight = nn.Parameter(torch.ones(8))
        model(batch(0, world_size)[0])

    return [
        error_text(shard_sized_only, RuntimeError),
        error_text(tie_split, NotImplementedError),
        error_text(removed, ValueError),
        error_text(flat_replaced, ValueError),
    ]


def _one_rank_writes_wrong(rank: int, world_size: int) -> str:
    """Only rank 0 gives a parameter a value that cannot be written back: both ranks raise at
    summon_full_params (none waits for the other in its collectives)."""
    model = wrap(build(), "nested", **ORIG)
    if rank == 0:
        model.module.norm.bias.data = torch.zeros(3)

    def summon() -> None:
        with ShardedDataParallel.summon_full_params(model):
            pass

    return error_text(summon, RuntimeError)


class WriteErrorsTest(TestCase):
    def test_a_write_only_one_rank_cannot_take_fails_every_rank(self) -> None:
        self.assertExpectedInline(
            "\n".join(self.pool.run(_one_rank_writes_wrong, 2)),
            """\
[rank 0] Cannot writeback parameter 'norm.bias': it was set to a tensor of shape (3,) and dtype torch.float32, but it has shape (8,) and its part of this rank's shard shape (0,), dtype torch.float32 (with use_orig_params=True a parameter is, outside forward, its part of this rank's shard: give it a value of either shape and that dtype)
[rank 1] summon_full_params: nothing was done, because rank 0 could not take a write to its parameters into its shards (see its error)""",
        )

    def test_writes_that_cannot_be_honoured_name_the_parameter(self) -> None:
        self.assertExpectedInline(
            "\n".join(self.pool.run(_write_errors, 2)[0]),
            """\
[rank 0] Cannot writeback parameter 'norm.weight': it was set to a tensor of shape (8,) and dtype torch.float64, but it has shape (8,) and its part of this rank's shard shape (0,), dtype torch.float32 (with use_orig_params=True a parameter is, outside forward, its part of this rank's shard: give it a value of either shape and that dtype)
[rank 0] parameter 'embed.weight' is shared by 2 modules and was replaced in only some of them; ShardedDataParallel cannot split a shared parameter (replace it in every module that holds it, or change its values in place or through .data)
[rank 0] parameter 'norm.bias' was removed from its module (it is None now); ShardedDataParallel keeps every parameter of a wrapped module: change its values (in place, through .data, or with a new nn.Parameter of the same shape) instead
[rank 0] parameter 'norm.weight' was replaced by a new nn.Parameter (LayerNorm.weight = ...), but with use_orig_params=False its values live in its unit's FlatParameter, and the new object would be ignored: change the values inside summon_full_params(writeback=True) or with load_state_dict, or wrap the model with use_orig_params=True (where replacing a parameter is supported)""",
        )

"""``use_orig_params=True`` gradients as the user sees them: inside ``no_sync()`` the local,
unsharded gradient accumulated so far (in the compute dtype, as FSDP1 shows it), and what the
user does to it counts; outside, views of this rank's averaged shard, and ``None`` for a
parameter with no part in this rank's shard (as in FSDP1). Compared with single-process
backwards on the same data."""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional

import pytest
import torch
from expecttest import TestCase
from torch import nn

from flatshard import MixedPrecision, ShardedDataParallel, ShardingStrategy
from flatshard._base._common import join_name
from tests._models import ATOL, RTOL, batch, build, lm_loss, local, wrap

ORIG = dict(use_orig_params=True)
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


def _grads(model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_grads(actual: Dict[str, Optional[torch.Tensor]], expected: Dict[str, Optional[torch.Tensor]], what: str) -> None:
    assert sorted(actual) == sorted(expected), what
    for name, value in expected.items():
        got = actual[name]
        if value is None or got is None:
            assert got is None and value is None, f"{what} {name}: {got} vs {value}"
            continue
        torch.testing.assert_close(got.float(), value.float(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {name}: {m}")


def _no_sync_grads(rank: int, world_size: int, strategy: str, edit: Optional[str]) -> bool:
    """Two micro-batches under ``no_sync()``, then a synchronised one: inside, each parameter's
    ``.grad`` is the local gradient accumulated so far (a plain model on this rank's data);
    after, the average over the ranks (a plain model on the global batch). ``edit``: between
    the two ``no_sync()`` micro-batches the loop scales the local gradients (``scale``) or drops
    them (``zero_grad``), and the plain models do the same."""
    model = wrap(build(), "nested", sharding_strategy=ShardingStrategy[strategy], **ORIG)
    mine, everyone = build(), build()  # this rank's data; the global batch
    for micro in range(3):
        tokens, targets = batch(micro, world_size)
        lm_loss(mine(local(tokens, rank)), local(targets, rank)).backward()
        lm_loss(everyone(tokens), targets).backward()
        if micro < 2:
            with model.no_sync():
                lm_loss(model(local(tokens, rank)), local(targets, rank)).backward()
            _assert_grads(_grads(model), _grads(mine), f"{strategy} inside no_sync, micro-batch {micro}")
        else:
            lm_loss(model(local(tokens, rank)), local(targets, rank)).backward()
        if micro == 0 and edit == "scale":
            for owner in (model, mine, everyone):
                for p in owner.parameters():
                    if p.grad is not None:
                        p.grad.mul_(0.5)
        elif micro == 0 and edit == "zero_grad":
            for owner in (model, mine, everyone):
                torch.optim.SGD(owner.parameters(), lr=0.1).zero_grad()
    with ShardedDataParallel.summon_full_params(model, with_grads=True):
        averaged = _grads(model)
    _assert_grads(averaged, {n: g for n, g in _grads(everyone).items()}, f"{strategy} after the synchronised backward")
    return True


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_sync_shows_the_local_gradient_and_edits_to_it_count(rank_pool, strategy):
    for edit in (None, "scale", "zero_grad"):
        assert rank_pool.run(_no_sync_grads, 2, strategy, edit) == [True, True]


def test_no_sync_at_world_size_3(rank_pool):
    assert rank_pool.run(_no_sync_grads, 3, "FULL_SHARD", "scale") == [True] * 3


def _no_sync_dtypes(rank: int, world_size: int, strategy: str) -> List[List[torch.dtype]]:
    """PyTorch's FSDP1 test: the compute dtype inside ``no_sync()``, the parameters' outside."""
    mp = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    model = ShardedDataParallel(nn.Linear(3, 3), sharding_strategy=ShardingStrategy[strategy], mixed_precision=mp, **ORIG)
    x = torch.randn(2, 3)
    seen = []
    with model.no_sync():
        for _ in range(2):
            model(x).sum().backward()
            seen.append([p.grad.dtype for p in model.parameters() if p.grad is not None])
    model(x).sum().backward()
    seen.append([p.grad.dtype for p in model.parameters() if p.grad is not None])
    return seen


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_sync_gradients_are_in_the_compute_dtype(rank_pool, strategy):
    for seen in rank_pool.run(_no_sync_dtypes, 2, strategy):
        assert seen[0] and seen[2], seen
        assert seen[0] == seen[1] == [torch.float16] * len(seen[0]), seen
        assert seen[2] == [torch.float32] * len(seen[2]), seen


def _grads_of_parameters_not_held(rank: int, world_size: int) -> Dict[str, Any]:
    """PyTorch's FSDP1 check: a parameter with no part in this rank's shard has no gradient;
    and Adam, which counts steps of parameters with a gradient, trains like single-process
    Adam when some gradients are set to ``None``."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 5, bias=False), nn.Linear(5, 7))
    torch.manual_seed(0)
    model = ShardedDataParallel(nn.Sequential(nn.Linear(5, 5, bias=False), nn.Linear(5, 7)), **ORIG)
    optims = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (plain, model)]
    x = torch.randn(2 * world_size, 5, generator=torch.Generator().manual_seed(0))
    empty_with_grad = []
    for step in range(3):
        plain(x).sum().backward()
        model(x[2 * rank : 2 * rank + 2]).sum().mul(world_size).backward()
        empty_with_grad += [n for n, p in model.named_parameters() if p.numel() == 0 and p.grad is not None]
        if step == 1:  # only the first layer's weight keeps its gradient
            for owner in (plain, model):
                for name, p in owner.named_parameters():
                    if not name.startswith("0."):
                        p.grad = None
        for optim in optims:
            optim.step()
            optim.zero_grad()
    with ShardedDataParallel.summon_full_params(model):
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    return {"empty parameters with a gradient": empty_with_grad}


class NotHeldTest(TestCase):
    def test_a_parameter_with_no_part_in_the_shard_has_no_gradient(self) -> None:
        self.assertEqual(self.pool.run(_grads_of_parameters_not_held, 2), [{"empty parameters with a gradient": []}] * 2)


# -- no_sync() in the default mode, gradients kept from an earlier step, a step inside it ----------


def _flat_no_sync_grads(rank: int, world_size: int, strategy: str) -> bool:
    """The default mode shows the local gradient too, as FSDP1 does: inside ``no_sync()`` a
    ``FlatParameter``'s ``.grad`` is its unsharded local gradient (PyTorch's
    ``test_no_sync_correctness`` compares exactly this across the two modes)."""
    model = wrap(build(), "nested", sharding_strategy=ShardingStrategy[strategy])
    mine = build()
    tokens, targets = batch(0, world_size)
    lm_loss(mine(local(tokens, rank)), local(targets, rank)).backward()
    with model.no_sync():
        lm_loss(model(local(tokens, rank)), local(targets, rank)).backward()
    expected = dict(mine.named_parameters())
    for module in ShardedDataParallel.fsdp_modules(model):
        for handle in module.handles:
            grad = handle.flat_param.grad
            assert grad.numel() == handle.padded_numel, (grad.shape, handle.padded_numel)
            for info, piece in zip(handle.param_infos, handle.split_full(grad)):
                name = join_name(module._unit.name, info.name)
                torch.testing.assert_close(piece, expected[name].grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    return True


def test_the_default_mode_shows_the_unsharded_local_gradient_inside_no_sync(rank_pool):
    for strategy in STRATEGIES:
        assert rank_pool.run(_flat_no_sync_grads, 2, strategy) == [True, True]


def _kept_and_edited(rank: int, world_size: int, orig: bool, edit: str) -> Any:
    """A step without zero_grad (its gradient stays), then a no_sync() micro-batch, an edit of
    the gradients (or none), and a synchronised one: no edit and zeroing (either way) train like
    single-process training; scaling in place cannot reach the kept part and raises on every
    rank."""
    plain = build()
    model = wrap(build(), "nested", use_orig_params=orig)
    for owner, rank_ in ((plain, None), (model, rank)):
        optim = torch.optim.SGD(owner.parameters(), lr=0.1)
        for micro in range(3):
            tokens, targets = batch(micro, world_size)
            if rank_ is not None:
                tokens, targets = local(tokens, rank_), local(targets, rank_)
            no_sync = rank_ is not None and micro == 1
            with owner.no_sync() if no_sync else contextlib.nullcontext():
                try:
                    lm_loss(owner(tokens), targets).backward()
                except RuntimeError as exc:
                    return str(exc)
            if micro == 0:
                optim.step()
            elif micro == 1:
                if edit == "scale":
                    for p in owner.parameters():
                        if p.grad is not None:
                            p.grad.mul_(0.5)
                elif edit != "none":
                    optim.zero_grad(set_to_none=edit == "zero_grad(set_to_none=True)")
        optim.step()
    actual = _summoned(model)
    for name, value in plain.named_parameters():
        torch.testing.assert_close(actual[name], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    return True


class KeptGradientTest(TestCase):
    def test_a_kept_gradient_is_added_back_and_zeroing_inside_no_sync_zeroes_it(self) -> None:
        for orig in (True, False):
            for edit in ("none", "zero_grad(set_to_none=False)", "zero_grad(set_to_none=True)"):
                self.assertEqual(self.pool.run(_kept_and_edited, 2, orig, edit), [True, True], (orig, edit))

    def test_scaling_a_kept_gradient_inside_no_sync_raises_on_every_rank(self) -> None:
        messages = self.pool.run(_kept_and_edited, 2, True, "scale") + self.pool.run(_kept_and_edited, 2, False, "scale")
        self.assertExpectedInline(
            "\n".join(messages),
            """\
[rank 0] the gradients of 'embed.weight', 'norm.weight', ... were changed in place inside no_sync() while they also hold the gradient of an earlier step (no zero_grad() since it): that part cannot be changed the same way here; zero the gradients before accumulating again (optimizer.zero_grad()), or change them after the synchronised backward
[rank 1] the gradients of 'embed.weight', 'norm.weight', ... were changed in place inside no_sync() while they also hold the gradient of an earlier step (no zero_grad() since it): that part cannot be changed the same way here; zero the gradients before accumulating again (optimizer.zero_grad()), or change them after the synchronised backward
[rank 0] the gradients of 'embed.weight', 'norm.weight', ... were changed in place inside no_sync() while they also hold the gradient of an earlier step (no zero_grad() since it): that part cannot be changed the same way here; zero the gradients before accumulating again (optimizer.zero_grad()), or change them after the synchronised backward
[rank 1] the gradients of 'embed.weight', 'norm.weight', ... were changed in place inside no_sync() while they also hold the gradient of an earlier step (no zero_grad() since it): that part cannot be changed the same way here; zero the gradients before accumulating again (optimizer.zero_grad()), or change them after the synchronised backward""",
        )


def _step_inside_no_sync(rank: int, world_size: int, orig: bool) -> str:
    model = wrap(build(), "nested", use_orig_params=orig)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens, targets = batch(0, world_size)
    with model.no_sync():
        lm_loss(model(local(tokens, rank)), local(targets, rank)).backward()
        try:
            optim.step()
        except RuntimeError as exc:
            return str(exc)
    return "no error"


def test_a_step_inside_no_sync_after_a_backward_there_raises(rank_pool):
    for orig in (True, False):
        for message in rank_pool.run(_step_inside_no_sync, 2, orig):
            assert "optimizer.step() inside no_sync() after a backward under it" in message, message


def _replaced_inside_no_sync(rank: int, world_size: int) -> bool:
    """A parameter replaced by a new ``nn.Parameter`` between two ``no_sync()`` micro-batches
    (and in the optimizer): the old object keeps its gradient, the new one starts without, as
    in single-process training (every rank has the same data here)."""
    xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    finals = []
    for sharded in (False, True):
        torch.manual_seed(0)
        lin = nn.Linear(4, 4)
        model = ShardedDataParallel(lin, **ORIG) if sharded else lin
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.no_sync() if sharded else contextlib.nullcontext():
            model(xs[0]).sum().backward()
        old = lin.weight
        lin.weight = nn.Parameter(old.detach() * 0.9)
        optim.param_groups[0]["params"] = [lin.weight if p is old else p for p in optim.param_groups[0]["params"]]
        model(xs[1]).sum().backward()
        optim.step()
        finals.append(_summoned(model) if sharded else {n: p.detach().clone() for n, p in model.named_parameters()})
    return _same_finals(finals)


def test_a_parameter_replaced_inside_no_sync_starts_without_gradient(rank_pool):
    assert rank_pool.run(_replaced_inside_no_sync, 2) == [True, True]


def _summoned(model: nn.Module) -> Dict[str, torch.Tensor]:
    with ShardedDataParallel.summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _frozen_with_rebound_grad(rank: int, world_size: int) -> bool:
    """A parameter frozen after it got a gradient keeps it; rebinding that ``.grad`` before the
    step is honoured, as in single-process training."""
    xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    finals = []
    for sharded in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        model = ShardedDataParallel(net, **ORIG) if sharded else net
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        model(xs[0]).sum().backward()
        optim.step()
        dict(model.named_parameters())["0.bias"].requires_grad_(False)
        model(xs[1]).sum().backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad = p.grad * -1.0
        model(xs[1]).sum()  # a forward with autograd on before the step: the rebound gradients stay
        optim.step()
        finals.append(_summoned(model) if sharded else {n: p.detach().clone() for n, p in model.named_parameters()})
    return _same_finals(finals)


def test_a_frozen_parameter_steps_with_its_rebound_gradient(rank_pool):
    assert rank_pool.run(_frozen_with_rebound_grad, 2) == [True, True]


def _rebound_grads_then_inference(rank: int, world_size: int) -> bool:
    """Gradients rebound before a step and kept (no zero_grad), then an evaluation under
    ``torch.inference_mode()``: the gradient taken into the shard there is an ordinary tensor,
    so the next backward accumulates into it (as single-process training does)."""
    xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    finals = []
    for sharded in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        model = ShardedDataParallel(net, **ORIG) if sharded else net
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        model(xs[0]).sum().backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad = p.grad * -1.0
        optim.step()
        with torch.inference_mode():
            model(xs[1])
        model(xs[2]).sum().backward()
        optim.step()
        finals.append(_summoned(model) if sharded else {n: p.detach().clone() for n, p in model.named_parameters()})
    return _same_finals(finals)


def test_rebound_gradients_survive_an_inference_mode_forward(rank_pool):
    assert rank_pool.run(_rebound_grads_then_inference, 2) == [True, True]


def _zeroed_kept_then_edited(rank: int, world_size: int, orig: bool) -> bool:
    """``zero_grad(set_to_none=False)`` before accumulating (the gradients stay, as zeros), a
    parameter frozen after it got its gradient (it keeps a zero one, so momentum still moves
    it), then ``no_sync()`` micro-batches whose local gradients are scaled in place: as in
    single-process training."""
    finals = []
    for sharded in (False, True):
        model = wrap(build(), "nested", use_orig_params=orig) if sharded else build()
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(2):
            optim.zero_grad(set_to_none=False)
            for micro in range(3):
                tokens, targets = batch(3 * step + micro, world_size)
                if sharded:
                    tokens, targets = local(tokens, rank), local(targets, rank)
                with model.no_sync() if sharded and micro < 2 else contextlib.nullcontext():
                    lm_loss(model(tokens), targets).backward()
                if micro == 0:
                    for p in model.parameters():
                        if p.grad is not None:
                            p.grad.mul_(0.5)
            optim.step()
            if step == 0 and orig:
                dict(model.named_parameters())["blocks.0.fc1.bias"].requires_grad_(False)
        finals.append(_summoned(model) if sharded else {n: p.detach().clone() for n, p in model.named_parameters()})
    return _same_finals(finals)


def test_zeroed_gradients_kept_as_zeros_then_scaled_inside_no_sync(rank_pool):
    for orig in (True, False):
        assert rank_pool.run(_zeroed_kept_then_edited, 2, orig) == [True, True]


def _same_finals(finals: List[Dict[str, torch.Tensor]]) -> bool:
    """The parameters of the plain run (first) and of the sharded one (second) are the same."""
    for name, value in finals[0].items():
        torch.testing.assert_close(finals[1][name], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    return True

"""summon_full_params: full parameters under their plain names, write-back or discard,
gradients, rank0_only, offload, recurse, errors, and training afterwards.

Truth is the single-process model (``build()``) given the same changes and batches."""

import torch
from expecttest import TestCase
from torch import nn

from flatshard import ShardedDataParallel, ShardingStrategy
from flatshard._base._common import HandleState, TrainingState
from flatshard._flat._placeholder import ParamPlaceholder
from flatshard.flat_param import FlatParameter
from tests._models import (
    error_text as _message,
    ATOL,
    RTOL,
    Outer,
    _train,
    assert_same_training,
    batch,
    build,
    full_params,
    global_mean,
    handles,
    lm_loss,
    local,
    make_optim,
    wrap,
)

summon = ShardedDataParallel.summon_full_params


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _model(strategy_name="FULL_SHARD", mode="nested"):
    return wrap(build(), mode, sharding_strategy=ShardingStrategy[strategy_name])


def _enter(model, **flags):
    with summon(model, **flags):
        pass


def _assert_matches(model, reference, what, grads=False):
    """Inside the context: the plain model's names, order, tied objects and values (or grads)."""
    names = [n for n, _ in model.named_parameters()]
    if names != [n for n, _ in reference.named_parameters()]:
        raise AssertionError(f"{what}: names {names}")
    expected = dict(reference.named_parameters(remove_duplicate=False))
    got = dict(model.named_parameters(remove_duplicate=False))
    if sorted(got) != sorted(expected):
        raise AssertionError(f"{what}: names {sorted(got)}")
    for name, param in got.items():
        if type(param) is not nn.Parameter:
            raise AssertionError(f"{what}: {name} is a {type(param).__name__}")
        if grads:
            _close(param.grad, expected[name].grad, f"{what}: {name}.grad")
        else:
            _close(param.detach(), expected[name].detach(), f"{what}: {name}")


def _assert_idle(model, what, gathered_before=()):
    """After the context: units idle, sharded handles freed (but those gathered before),
    FlatParameters registered again."""
    for unit in ShardedDataParallel.fsdp_modules(model):
        if unit.training_state is not TrainingState.IDLE:
            raise AssertionError(f"{what}: a unit is {unit.training_state.name}")
    for h in handles(model):
        if h.sharded and h not in gathered_before and (h.state is not HandleState.SHARDED or h.full_storage_bytes()):
            raise AssertionError(f"{what}: a handle is still gathered")
    if not all(isinstance(p, FlatParameter) for p in model.parameters()):
        raise AssertionError(f"{what}: parameters {[n for n, _ in model.named_parameters()]}")


def _assert_unchanged(model, reference, what):
    with summon(model, writeback=False):
        _assert_matches(model, reference, what)


# -- values, names, forward ----------------------------------------------------------------------


def _values(rank, world_size, cases):
    tokens = batch(0, world_size)[0]
    for strategy_name, mode in cases:
        what = f"{strategy_name}/{mode}"
        model = _model(strategy_name, mode)
        reference = Outer(build()) if mode == "empty_root" else build()
        if mode == "empty_root":
            with torch.no_grad():
                model(local(tokens, rank))  # also after a forward (lazy init done)
        with summon(model):
            _assert_matches(model, reference, what)
            root, ref_root = (model.inner, reference.inner) if mode == "empty_root" else (model, reference)
            if root.embed.weight is not root.head.weight:
                raise AssertionError(f"{what}: tied weights are two objects")
            if mode != "single":
                block = root.blocks[0]
                inner_names = [n for n, _ in block.named_parameters()]
                if inner_names != [n for n, _ in ref_root.blocks[0].named_parameters()]:
                    raise AssertionError(f"{what}: block names {inner_names}")
                _close(block.fc1.weight.detach(), ref_root.blocks[0].fc1.weight.detach(), f"{what}: attribute access")
            model.eval()
            reference.eval()
            with torch.no_grad():
                _close(model(tokens), reference(tokens), f"{what}: forward inside")
            model.train()
        with summon(model, offload_to_cpu=True):
            _assert_matches(model, reference, f"{what} offload_to_cpu")
            if next(model.parameters()).device.type != "cpu":
                raise AssertionError(f"{what}: offloaded parameters not on the CPU")
        _assert_idle(model, what)
        if mode == "nested" and strategy_name != "NO_SHARD" and world_size > 1:
            if not isinstance(model.blocks[0].fc1.weight, ParamPlaceholder):
                raise AssertionError(f"{what}: no placeholder after exit")
        _close(model(local(tokens, rank)), reference.train()(local(tokens, rank)), f"{what}: forward after")


def _buffer_names(rank, world_size):
    model = _model()
    with summon(model):
        return [n for n, _ in model.named_buffers()], [n for n, _ in model.named_parameters()][:2]


class ValuesTest(TestCase):
    def test_full_parameters_names_ties_and_forward(self):
        self.pool.run(_values, 2, [("FULL_SHARD", "nested"), ("SHARD_GRAD_OP", "nested"), ("NO_SHARD", "nested"), ("FULL_SHARD", "single")])

    def test_world_sizes_1_3_4_and_a_root_without_parameters(self):
        self.pool.run(_values, 1, [("FULL_SHARD", "nested")])
        self.pool.run(_values, 3, [("FULL_SHARD", "nested"), ("SHARD_GRAD_OP", "empty_root")])  # padded shards
        self.pool.run(_values, 4, [("FULL_SHARD", "nested")])

    def test_named_buffers_inside_use_plain_names(self):
        # BUG (FSDP1 divergence): FSDP1 overrides named_buffers() to strip the wrapper prefix
        # inside summon_full_params, as it does for named_parameters(); flatshard only does the
        # latter, so this yields ['_fsdp_wrapped_module.pos'].
        buffers, params = self.pool.run(_buffer_names, 1)[0]
        self.assertEqual(params, ["embed.weight", "blocks.0.norm.weight"])
        self.assertEqual(buffers, [n for n, _ in build().named_buffers()])


# -- writeback ---------------------------------------------------------------------------------


def _change(module, offset):
    """The same changes on a wrapped model (inside the context) and on the plain model."""
    with torch.no_grad():
        module.blocks[0].fc1.weight.mul_(2)
        module.embed.weight.add_(offset)  # tied: the head changes too
        module.norm.weight.mul_(1 + offset)  # (the embedding shift alone leaves gradients unchanged)
        module.norm.bias.copy_(torch.linspace(-1, 1, module.norm.bias.numel()))
    module.blocks[1].fc1.bias = nn.Parameter(torch.arange(16.0) / 10)
    module.blocks[2].fc2.bias.data = torch.full((module.blocks[2].fc2.bias.numel(),), offset)


def _writeback(rank, world_size, strategies):
    for strategy_name in strategies:
        model, reference = _model(strategy_name), build()
        if strategy_name == "SHARD_GRAD_OP":
            _train(model, world_size, 1, 1, rank)  # also after a training step
            _train(reference, world_size, 1, 1, None)
        with summon(model):
            _change(model, 1.0)
        _change(reference, 1.0)
        _assert_idle(model, strategy_name)
        _assert_unchanged(model, reference, f"{strategy_name}: after writeback")
        with summon(model, offload_to_cpu=True):
            _change(model, 0.5)
        _change(reference, 0.5)
        _assert_unchanged(model, reference, f"{strategy_name}: after offloaded writeback")
        expected = _train(reference, world_size, 2, 1, None), dict(reference.named_parameters(remove_duplicate=False))
        assert_same_training(expected, (_train(model, world_size, 2, 1, rank), full_params(model)))


def _replace_bias(model, value):
    with summon(model):
        model.blocks[1].fc1.bias = value


def _bad_replacement(rank, world_size):
    model, reference = _model(), build()
    messages = []
    for value in (nn.Parameter(torch.zeros(3)), None):
        messages.append(_message(lambda: _replace_bias(model, value), ValueError))
        _assert_idle(model, "after the ValueError")
        if not isinstance(model.blocks[1].fc1.bias, ParamPlaceholder):
            raise AssertionError("the replaced parameter stayed on the module")
    _assert_unchanged(model, reference, "after the ValueError")
    try:  # an exception in the body: the changes are still written back, the units idle again
        with summon(model):
            _change(model, 1.0)
            raise KeyError("in the body")
    except KeyError:
        pass
    _change(reference, 1.0)
    _assert_idle(model, "after an exception in the body")
    _assert_unchanged(model, reference, "after an exception in the body")
    tokens = local(batch(0, world_size)[0], rank)
    _close(model(tokens), reference(tokens), "forward after the ValueError")
    return messages


class WritebackTest(TestCase):
    def test_in_place_and_replaced_parameters_persist_and_train_on(self):
        self.pool.run(_writeback, 2, ["FULL_SHARD", "NO_SHARD"])
        self.pool.run(_writeback, 3, ["SHARD_GRAD_OP", "FULL_SHARD"])

    def test_replacement_of_another_shape_raises(self):
        wrong_shape, removed = self.pool.run(_bad_replacement, 2)[1]
        self.assertExpectedInline(
            wrong_shape,
            """summon_full_params(writeback=True): parameter 'blocks.1.fc1.bias' was replaced by shape (3,); only a tensor of its shape (16,) can be written back to the shards""",
        )
        self.assertExpectedInline(
            removed,
            """summon_full_params(writeback=True): parameter 'blocks.1.fc1.bias' was replaced by None; only a tensor of its shape (16,) can be written back to the shards""",
        )


# -- writeback=False ---------------------------------------------------------------------------


def _discard(rank, world_size, strategies):
    tokens, targets = (local(t, rank) for t in batch(0, world_size))
    for strategy_name in strategies:
        model = _model(strategy_name)
        with summon(model, writeback=False):
            _change(model, 1.0)
        _assert_idle(model, strategy_name)
        _assert_unchanged(model, build(), f"{strategy_name}: writeback=False")
        # A unit gathered before the context (the root, between forward and backward).
        untouched = _model(strategy_name)
        loss, expected = lm_loss(model(tokens), targets), lm_loss(untouched(tokens), targets)
        states = [h.state for h in handles(model)]  # SHARD_GRAD_OP: the blocks too
        if states[0] is not HandleState.UNSHARDED:
            raise AssertionError(f"{strategy_name}: the root is not gathered after forward")
        with summon(model, writeback=False):
            _change(model, 1.0)
        if [h.state for h in handles(model)] != states:
            raise AssertionError(f"{strategy_name}: the context freed a unit gathered before it")
        _assert_idle(model, strategy_name, gathered_before=[h for h, st in zip(handles(model), states) if st is HandleState.UNSHARDED])
        loss.backward()
        expected.backward()
        for h, ref in zip(handles(model), handles(untouched)):
            _close(h.flat_param.grad, ref.flat_param.grad, f"{strategy_name}: gradient after the summon")
        _assert_idle(model, strategy_name)
        _assert_unchanged(model, build(), f"{strategy_name}: after backward")


class DiscardTest(TestCase):
    def test_writeback_false_discards_changes(self):
        self.pool.run(_discard, 2, ["FULL_SHARD", "NO_SHARD", "SHARD_GRAD_OP"])


# -- gradients ---------------------------------------------------------------------------------


def _grads(rank, world_size, strategies):
    tokens, targets = batch(0, world_size)
    reference = build()
    lm_loss(reference(tokens), targets).backward()
    for strategy_name in strategies:
        model = _model(strategy_name)
        with summon(model, with_grads=True):  # before any backward: no gradients
            if any(p.grad is not None for p in model.parameters()):
                raise AssertionError(f"{strategy_name}: a gradient before backward")
        lm_loss(model(local(tokens, rank)), local(targets, rank)).backward()
        before = [h.flat_param.grad.clone() for h in handles(model)]
        with summon(model, with_grads=True):
            _assert_matches(model, reference, f"{strategy_name} with_grads", grads=True)
            _assert_matches(model, build(), f"{strategy_name} with_grads values")
        with summon(model, with_grads=True, rank0_only=True, writeback=False, offload_to_cpu=True):
            if rank == 0:
                _assert_matches(model, reference, f"{strategy_name} rank0_only with_grads", grads=True)
        for h, grad in zip(handles(model), before):
            if not torch.equal(h.flat_param.grad, grad):
                raise AssertionError(f"{strategy_name}: the context changed a gradient")
        _assert_idle(model, strategy_name)


def _grads_disagree(rank, world_size):
    model = _model()
    tokens, targets = (local(t, rank) for t in batch(0, world_size))
    lm_loss(model(tokens), targets).backward()
    messages = []
    if rank == 1:
        model.blocks[1].zero_grad(set_to_none=True)
    messages.append(_message(lambda: _enter(model, with_grads=True), RuntimeError))
    if rank == 0:
        model.zero_grad(set_to_none=True)
    messages.append(_message(lambda: _enter(model, with_grads=True), RuntimeError))
    _assert_idle(model, "after the RuntimeError")
    if rank == 1:
        model.zero_grad(set_to_none=True)
    with summon(model, with_grads=True):  # agreeing again: no gradients anywhere
        if any(p.grad is not None for p in model.parameters()):
            raise AssertionError("a gradient after zero_grad")
    return messages


class GradsTest(TestCase):
    def test_with_grads_gives_the_global_batch_gradient(self):
        self.pool.run(_grads, 2, ["FULL_SHARD", "NO_SHARD"])
        self.pool.run(_grads, 4, ["SHARD_GRAD_OP", "FULL_SHARD"])

    def test_ranks_disagreeing_on_gradients_raise(self):
        for rank, (one_unit, root) in enumerate(self.pool.run(_grads_disagree, 2)):
            self.assertEqual(
                one_unit,
                f"[rank {rank}] summon_full_params is collective, but the ranks called it differently: rank 0 has "
                "a gradient for unit 'blocks.1', rank 1 has no gradient for unit 'blocks.1'",
            )
            self.assertEqual(
                root,
                f"[rank {rank}] summon_full_params is collective, but the ranks called it differently: rank 0 has "
                "no gradient for unit the root module, rank 1 has a gradient for unit the root module",
            )


# -- rank0_only ----------------------------------------------------------------------------------


def _rank0_only(rank, world_size, strategy_name):
    model, reference = _model(strategy_name), build()
    tokens = batch(0, world_size)[0]
    placeholder_error = None
    with summon(model, rank0_only=True, writeback=False):
        if rank == 0:
            _assert_matches(model, reference, "rank 0")
            with torch.no_grad():
                _close(model(tokens), reference(tokens), "rank 0 forward")
                model.blocks[2].fc2.weight.zero_()
        elif strategy_name != "NO_SHARD":
            weights = (model.embed.weight, model.blocks[0].fc1.weight)
            if not all(isinstance(w, ParamPlaceholder) for w in weights):
                raise AssertionError(f"rank {rank}: {weights}")
            placeholder_error = _message(lambda: model.blocks[0].fc1.weight.sum(), RuntimeError)
    _assert_idle(model, "rank0_only")
    _assert_unchanged(model, reference, "after rank0_only")
    return placeholder_error


class Rank0OnlyTest(TestCase):
    def test_only_rank_0_gets_full_parameters(self):
        results = self.pool.run(_rank0_only, 3, "FULL_SHARD")
        self.assertIsNone(results[0])
        for error in results[1:]:
            self.assertRegex(error, r"^parameter 'blocks\.0\.fc1\.weight' is sharded by ShardedDataParallel: .* so 'sum' cannot be used")

    def test_rank0_only_other_strategies(self):
        for strategy_name in ("SHARD_GRAD_OP", "NO_SHARD"):
            self.assertIsNone(self.pool.run(_rank0_only, 2, strategy_name)[0])


# -- recurse=False ---------------------------------------------------------------------------------


def _not_recursive(rank, world_size):
    model, reference = _model(), build()
    tokens, targets = batch(0, world_size)
    report = {}
    with summon(model, recurse=False):
        _close(model.embed.weight.detach(), reference.embed.weight.detach(), "root parameter")
        if not isinstance(model.blocks[0].fc1.weight, ParamPlaceholder):
            raise AssertionError("recurse=False summoned a block")
        states = [m.training_state for m in ShardedDataParallel.fsdp_modules(model)]
        if states != [TrainingState.SUMMON_FULL_PARAMS] + [TrainingState.IDLE] * 3:
            raise AssertionError(f"states {states}")
        with torch.no_grad():
            report["forward"] = _message(lambda: model(tokens), RuntimeError)
            with summon(model.blocks):  # the rest summoned too: now a forward works
                _close(model(tokens), reference(tokens), "forward with every unit summoned")
    _assert_idle(model, "recurse=False")
    with summon(model.blocks, recurse=False):  # no root inside: every block is outermost
        _close(model.blocks[2].fc2.bias.detach(), reference.blocks[2].fc2.bias.detach(), "block parameter")
        if not isinstance(model.embed.weight, ParamPlaceholder):
            raise AssertionError("the root was summoned")
        report["inside_forward"] = _message(lambda: model(local(tokens, rank)), RuntimeError)
    _assert_idle(model, "after a forward that failed", gathered_before=[model.handle])  # the abandoned root forward
    expected = _train(reference, world_size, 2, 1, None), dict(reference.named_parameters(remove_duplicate=False))
    assert_same_training(expected, (_train(model, world_size, 2, 1, rank), full_params(model)))
    return report


class RecurseTest(TestCase):
    def test_recurse_false_summons_only_outermost_units(self):
        report = self.pool.run(_not_recursive, 2)[0]
        self.assertExpectedInline(
            report["forward"],
            """[rank 0] unit the root module: forward inside summon_full_params needs every unit under it summoned, but unit 'blocks.0' is not (use recurse=True)""",
        )
        self.assertExpectedInline(
            report["inside_forward"],
            """[rank 0] unit 'blocks.0': its full parameters are summoned (summon_full_params), so it cannot run inside the forward or backward of unit the root module, which is not; summon the whole model (recurse=True) or leave the context first""",
        )


# -- training afterwards ------------------------------------------------------------------------------


def _parity_after_summon(rank, world_size, strategies, steps=4):
    """Summons without changes (between steps, and between backward and optimizer step)
    leave training exactly as the single-process model's."""
    for strategy_name in strategies:
        model, reference = _model(strategy_name), build()
        optim, ref_optim = make_optim(model.parameters()), make_optim(reference.parameters())
        losses, ref_losses = [], []
        for step in range(steps):
            tokens, targets = batch(step, world_size)
            if step == 2:
                with summon(model):
                    model.eval()
                    with torch.no_grad():
                        _close(model(tokens), reference.eval()(tokens), f"{strategy_name}: eval forward")
                reference.train()
                model.train()
            ref_optim.zero_grad()
            ref_loss = lm_loss(reference(tokens), targets)
            ref_loss.backward()
            ref_optim.step()
            ref_losses.append(ref_loss.item())
            optim.zero_grad()
            loss = lm_loss(model(local(tokens, rank)), local(targets, rank))
            loss.backward()
            if step == 1:
                with summon(model, with_grads=True):
                    pass
            optim.step()
            losses.append(global_mean(loss))
        expected = (ref_losses, dict(reference.named_parameters(remove_duplicate=False)))
        assert_same_training(expected, (losses, full_params(model)))
        _assert_idle(model, strategy_name)


class TrainingAfterTest(TestCase):
    def test_training_after_summons_matches_single_process(self):
        self.pool.run(_parity_after_summon, 2, ["FULL_SHARD", "NO_SHARD"])
        self.pool.run(_parity_after_summon, 3, ["SHARD_GRAD_OP"])


# -- errors ---------------------------------------------------------------------------------------


def _errors(rank, world_size):
    """Every rank makes the same mistakes, each raised before any collective of its call: the
    ranks raise together and still agree afterwards (a mistake on one rank only is
    tests/test_guarded_calls.py's)."""
    model, reference = _model(), build()
    messages = {}
    messages["rank0_only_writeback"] = _message(lambda: _enter(model, rank0_only=True), ValueError)
    _enter(nn.Linear(2, 2))  # (no units under it: a no-op, as in FSDP1)
    for flag, value in (("recurse", 1), ("writeback", None), ("rank0_only", "yes"), ("offload_to_cpu", 0), ("with_grads", 1.0)):
        messages[flag] = _message(lambda: _enter(model, **{flag: value}), TypeError)
    _assert_idle(model, "after the errors")
    with summon(model):
        messages["nested"] = _message(lambda: _enter(model, writeback=False), RuntimeError)
        messages["nested_inner"] = _message(lambda: _enter(model.blocks[1]), RuntimeError)
    hook = model.blocks[1].module.fc2.register_forward_pre_hook(lambda *_: _enter(model))
    with torch.no_grad():
        during_forward = _message(lambda: model(local(batch(0, world_size)[0], rank)), RuntimeError)
    if rank == 1:
        messages["during_forward"] = during_forward
    hook.remove()
    _assert_unchanged(model, reference, "after the errors")
    return messages


class ErrorsTest(TestCase):
    def test_errors(self):
        messages = self.pool.run(_errors, 2)[1]
        self.assertExpectedInline(
            "\n".join(f"{key}: {text}" for key, text in messages.items()),
            """\
rank0_only_writeback: summon_full_params: rank0_only=True with writeback=True is not supported: only rank 0 holds the full parameters, so the other ranks' shards could not be written back (pass writeback=False)
recurse: summon_full_params: recurse must be a bool; got 1
writeback: summon_full_params: writeback must be a bool; got None
rank0_only: summon_full_params: rank0_only must be a bool; got 'yes'
offload_to_cpu: summon_full_params: offload_to_cpu must be a bool; got 0
with_grads: summon_full_params: with_grads must be a bool; got 1.0
nested: [rank 1] unit the root module: summon_full_params cannot be used inside summon_full_params (the unit's full parameters are already summoned)
nested_inner: [rank 1] unit 'blocks.1': summon_full_params cannot be used inside summon_full_params (the unit's full parameters are already summoned)
during_forward: [rank 1] unit the root module: summon_full_params cannot be used while the unit is in FORWARD (during forward or backward); call it between iterations""",
        )


# -- review regressions --------------------------------------------------------------------------


def _lifetimes(rank, world_size):
    """A parameter kept past the context is emptied (not a view of freed memory); NO_SHARD
    gradients handed out are copies; with_grads after no_sync is refused; a write-back that
    fails on one rank writes nothing on any rank."""
    out = {}
    model = _model()
    with summon(model):
        kept = model.module.blocks[0].fc1.weight
    out["kept"] = tuple(kept.shape)
    model = _model("NO_SHARD")
    tokens, targets = (local(t, rank) for t in batch(0, world_size))
    lm_loss(model(tokens), targets).backward()
    before = model.blocks[0].module._flat_param.grad.clone()
    with summon(model, with_grads=True):
        model.module.blocks[0].fc1.weight.grad.fill_(100.0)
    out["grad_untouched"] = torch.equal(model.blocks[0].module._flat_param.grad, before)
    with model.no_sync():
        lm_loss(model(tokens), targets).backward()
        out["no_sync"] = _message(lambda: _enter(model, with_grads=True), RuntimeError)
    model, reference = _model(), build()

    def change():
        with summon(model):
            with torch.no_grad():
                model.module.blocks[0].fc1.weight.fill_(2.0)
            if rank == 1:
                model.module.blocks[2].fc1.bias = nn.Parameter(torch.zeros(3))

    out["partial"] = _message(change, (ValueError, RuntimeError))
    _assert_unchanged(model, reference, "after a failed write-back")
    return out


class ReviewRegressionsTest(TestCase):
    def test_lifetimes_gradient_copies_and_all_or_nothing_write_back(self):
        first, second = self.pool.run(_lifetimes, 2)
        self.assertEqual((first["kept"], first["grad_untouched"]), ((0,), True))
        self.assertEqual(
            first["no_sync"],
            "summon_full_params(with_grads=True) inside no_sync() after a backward under it: the gradients are not "
            "averaged over the ranks yet; call it outside no_sync(), which averages them first",
        )
        self.assertEqual(
            first["partial"],
            "[rank 0] summon_full_params: nothing was written back, because rank 1 could not write back a replaced "
            "parameter (see its error)",
        )
        self.assertEqual(
            second["partial"],
            "summon_full_params(writeback=True): parameter 'blocks.2.fc1.bias' was replaced by shape (3,); only a "
            "tensor of its shape (16,) can be written back to the shards",
        )

"""Run-time behaviour: when units gather and free, unusual forward/backward patterns, no_sync,
inference, lazy init and the wrapper's conveniences."""

import contextlib

import pytest
import torch
from expecttest import TestCase

from flatshard import BackwardPrefetch, ShardedDataParallel, ShardingStrategy
from flatshard._base._common import HandleState, TrainingState
from tests._models import (
    Out,
    Outer,
    assert_same_training,
    batch,
    build,
    full_params,
    global_mean,
    handles,
    lm_loss,
    local,
    make_optim,
    unpack,
    wrap,
)

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


def _logits(out):
    return out.logits if isinstance(out, Out) else out


def _loss(model, tokens, targets):
    return lm_loss(_logits(model(tokens)), targets)


def _two_forwards_one_backward(model, tokens, targets):
    loss = _loss(model, tokens[:, :3], targets[:, :3]) + _loss(model, tokens, targets)
    loss.backward()
    return loss


def _two_backwards_without_zero_grad(model, tokens, targets):
    first = _loss(model, tokens[:, :3], targets[:, :3])
    first.backward()
    second = _loss(model, tokens, targets)
    second.backward()  # accumulates onto the gradient of the first backward
    return first + second


def _plain_step(model, tokens, targets):
    loss = _loss(model, tokens, targets)
    loss.backward()
    return loss


def _nested_outputs_step(model, tokens, targets):
    out = model(tokens)
    if isinstance(model, ShardedDataParallel) and model.sharding_strategy is ShardingStrategy.FULL_SHARD:
        # the block outputs were found inside their containers: blocks freed after forward
        inner = [m.handle for m in ShardedDataParallel.fsdp_modules(model) if m is not model]
        if any(h.state is not HandleState.SHARDED for h in inner if h is not None):
            raise AssertionError("a FULL_SHARD block kept its parameters after forward")
    loss = lm_loss(out.logits, targets)
    loss.backward()
    return loss


def _no_grad_forward_before_backward(model, tokens, targets):
    loss = _loss(model, tokens, targets)
    with torch.no_grad():
        model(tokens)  # e.g. an evaluation between forward and backward
    loss.backward()
    return loss


def _no_sync(model):
    return model.no_sync() if isinstance(model, ShardedDataParallel) else contextlib.nullcontext()


def _zero_grad_after_no_sync(set_to_none):
    def step(model, tokens, targets):
        with _no_sync(model):
            _loss(model, tokens[:, :3], targets[:, :3]).backward()
        model.zero_grad(set_to_none=set_to_none)  # discards what no_sync accumulated, as in DDP
        return _plain_step(model, tokens, targets)

    return step


def _raise(grad):
    raise RuntimeError("boom")


def _failed_backward_then_step(model, tokens, targets):
    def hook_output(module, inputs, output):
        unpack(output).register_hook(_raise)

    registration = model.blocks[0].register_forward_hook(hook_output)
    try:
        _loss(model, tokens, targets).backward()
    except RuntimeError as exc:
        if "boom" not in str(exc):
            raise
    else:
        raise AssertionError("the backward did not fail")
    finally:
        registration.remove()
    model.zero_grad(set_to_none=True)
    return _plain_step(model, tokens, targets)


# name: (model options, step function, wrapping mode)
SCENARIOS = {
    "two_forwards_one_backward": ({}, _two_forwards_one_backward, "nested"),
    "two_backwards_without_zero_grad": ({}, _two_backwards_without_zero_grad, "nested"),
    "module_used_twice": ({"reuse_first_block": True}, _plain_step, "nested"),
    "params_without_gradient": ({"unused": True}, _plain_step, "nested"),
    "nested_outputs": ({"output": "nested"}, _nested_outputs_step, "nested"),
    "passthrough_outputs": ({"output": "passthrough"}, _plain_step, "nested"),
    "hidden_outputs": ({"output": "hidden"}, _no_grad_forward_before_backward, "nested"),
    "no_grad_forward_before_backward": ({}, _no_grad_forward_before_backward, "nested"),
    "checkpoint_inside_units": ({"checkpoint": "inner"}, _plain_step, "nested"),
    "checkpoint_around_units": ({"checkpoint": "outer"}, _plain_step, "nested"),
    "reentrant_checkpoint_inside_units": ({"checkpoint": "inner-reentrant"}, _plain_step, "nested"),
    "reentrant_checkpoint_around_units": ({"checkpoint": "outer-reentrant"}, _plain_step, "nested"),
    "frozen_block_unit": ({"frozen_blocks": (1,)}, _plain_step, "nested"),
    "frozen_block_unit_used_twice": ({"frozen_blocks": (0,), "reuse_first_block": True}, _plain_step, "nested"),
    "frozen_embedding_unit": ({"untied_head": True, "frozen_embed": True}, _plain_step, "nested+embed"),
    "unit_returning_its_weight": ({"untied_head": True}, _plain_step, "nested+head"),
    "root_without_parameters": ({}, _plain_step, "empty_root"),
    "zero_grad_after_no_sync": ({}, _zero_grad_after_no_sync(True), "nested"),
    "zero_grad_in_place_after_no_sync": ({}, _zero_grad_after_no_sync(False), "nested"),
    "failed_backward_then_step": ({}, _failed_backward_then_step, "nested"),
}


def _scenario(rank, world_size, name, strategy_name, mode=None, steps=2):
    """Both the plain model (global batch) and the wrapped one (local batch) run the scenario's
    step function; AdamW without weight decay, so a zero gradient equals no gradient."""
    model_kwargs, step, default_mode = SCENARIOS[name]
    mode = mode or default_mode
    reference = Outer(build(**model_kwargs)) if mode == "empty_root" else build(**model_kwargs)
    ref_optim = make_optim(reference.parameters(), weight_decay=0.0)
    model = wrap(build(**model_kwargs), mode, sharding_strategy=ShardingStrategy[strategy_name])
    optim = make_optim(model.parameters(), weight_decay=0.0)
    ref_losses, losses = [], []
    for i in range(steps):
        tokens, targets = batch(i, world_size)
        ref_optim.zero_grad()
        ref_losses.append(step(reference, tokens, targets).item())
        ref_optim.step()
        optim.zero_grad()
        losses.append(global_mean(step(model, local(tokens, rank), local(targets, rank))))
        optim.step()
        for h in handles(model):
            if h.sharded and h.state is not HandleState.SHARDED:
                raise AssertionError(f"{name}: a handle is {h.state.name} after backward")
    ref_params = {n: p.detach().clone() for n, p in reference.named_parameters(remove_duplicate=False)}
    assert_same_training((ref_losses, ref_params), (losses, full_params(model)))


@pytest.mark.parametrize("strategy_name", STRATEGIES)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_matches_single_process(rank_pool, name, strategy_name):
    rank_pool.run(_scenario, 2, name, strategy_name)


@pytest.mark.parametrize("name", ["module_used_twice", "params_without_gradient", "nested_outputs", "passthrough_outputs"])
def test_scenario_single_unit_world_size_3(rank_pool, name):
    rank_pool.run(_scenario, 3, name, "FULL_SHARD", "single")


# -- gathering and freeing ---------------------------------------------------------------------


def _lifecycle(rank, world_size, strategy_name):
    """Handle states after forward, after backward, and after no_sync backward."""
    model = wrap(build(), "nested", sharding_strategy=ShardingStrategy[strategy_name])
    root, inner = model.handle, [m.handle for m in ShardedDataParallel.fsdp_modules(model)[1:]]
    tokens, targets = (local(t, rank) for t in batch(0, world_size))
    seen = {}
    loss = lm_loss(model(tokens), targets)
    seen["after_forward"] = (root.state.name, sorted({h.state.name for h in inner}))
    loss.backward()
    seen["after_backward"] = _states(model)
    with model.no_sync():
        lm_loss(model(tokens), targets).backward()
    seen["after_no_sync_backward"] = _states(model)
    seen["unreduced_grads_kept"] = all(h.has_unreduced_grad() for h in handles(model)) if root.sharded else None
    lm_loss(model(tokens), targets).backward()
    seen["after_synced_backward"] = _states(model)
    seen["unreduced_grads_left"] = any(h.has_unreduced_grad() for h in handles(model))
    seen["training_states"] = sorted({m.training_state.name for m in ShardedDataParallel.fsdp_modules(model)})
    return seen


def _states(model):
    """(states, bytes held by full flat tensors) over all handles."""
    hs = handles(model)
    return sorted({h.state.name for h in hs}), sum(h.full_storage_bytes() for h in hs if h.sharded)


class LifecycleTest(TestCase):
    def test_full_shard_frees_after_forward_except_root_and_after_backward(self):
        for seen in self.pool.run(_lifecycle, 2, "FULL_SHARD"):
            self.assertEqual(seen["after_forward"], ("UNSHARDED", ["SHARDED"]))
            for key in ("after_backward", "after_no_sync_backward", "after_synced_backward"):
                self.assertEqual(seen[key], (["SHARDED"], 0), key)
            self.assertTrue(seen["unreduced_grads_kept"])
            self.assertFalse(seen["unreduced_grads_left"])
            self.assertEqual(seen["training_states"], ["IDLE"])

    def test_shard_grad_op_keeps_parameters_from_forward_to_backward(self):
        for seen in self.pool.run(_lifecycle, 3, "SHARD_GRAD_OP"):
            self.assertEqual(seen["after_forward"], ("UNSHARDED", ["UNSHARDED"]))
            for key in ("after_backward", "after_no_sync_backward", "after_synced_backward"):
                self.assertEqual(seen[key], (["SHARDED"], 0), key)
            self.assertFalse(seen["unreduced_grads_left"])

    def test_no_shard_never_frees(self):
        for seen in self.pool.run(_lifecycle, 2, "NO_SHARD"):
            self.assertEqual(seen["after_forward"], ("UNSHARDED", ["UNSHARDED"]))
            self.assertEqual(seen["after_backward"], (["UNSHARDED"], 0))
            self.assertEqual(seen["training_states"], ["IDLE"])


def _inference(rank, world_size, strategy_name):
    """no_grad, inference_mode and eval forwards: no gradients, nothing left gathered."""
    model = wrap(build(), "nested", sharding_strategy=ShardingStrategy[strategy_name], forward_prefetch=True)
    tokens, targets = (local(t, rank) for t in batch(0, world_size))
    lm_loss(model(tokens), targets).backward()  # a training step first: grads exist
    grads = [h.flat_param.grad.clone() for h in handles(model)]
    report = {}
    model.eval()
    for label, context in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
        with context():
            out = model(tokens)
        report[label] = (out.requires_grad, _states(model))
    model.train()
    report["grads_untouched"] = all(torch.equal(g, h.flat_param.grad) for g, h in zip(grads, handles(model)))
    ref = build().eval()
    with torch.no_grad():
        expected = ref(tokens)
        model.eval()
        report["eval_output_matches"] = torch.allclose(model(tokens), expected, rtol=1e-5, atol=1e-6)
    return report


class InferenceTest(TestCase):
    def test_no_grad_and_inference_mode_leave_nothing_gathered(self):
        for strategy_name, gathered in (("FULL_SHARD", "SHARDED"), ("SHARD_GRAD_OP", "SHARDED"), ("NO_SHARD", "UNSHARDED")):
            for report in self.pool.run(_inference, 2, strategy_name):
                for label in ("no_grad", "inference_mode"):
                    self.assertEqual(report[label], (False, ([gathered], 0)), (strategy_name, label))
                self.assertTrue(report["grads_untouched"])
                self.assertTrue(report["eval_output_matches"])


# -- lazy init, root, conveniences -------------------------------------------------------------


def _structure(rank, world_size):
    model = wrap(build(), "nested")
    found = ShardedDataParallel.fsdp_modules(model)
    roots = ShardedDataParallel.fsdp_modules(model, root_only=True)
    inner = model.blocks[0]
    report = {
        "count": len(found),
        "roots_only_model": roots == [model],
        "module": type(model.module).__name__,
        "forwarded_attr": type(model.blocks).__name__,  # attribute of the wrapped module
        "forwarded_item": type(model.blocks[1]).__name__,
        "placeholder": (inner.module.fc1.weight.device.type, tuple(inner.module.fc1.weight.shape)),
        "repr": repr(inner),
    }
    report["placeholder_repr"] = repr(inner.module.fc1.weight)
    report["placeholder_errors"] = []
    for use in (lambda w: w.sum(), lambda w: torch.nn.init.zeros_(w), lambda w: w.grad):
        try:
            use(inner.module.fc1.weight)
            report["placeholder_errors"].append("no error")
        except RuntimeError as exc:
            report["placeholder_errors"].append(str(exc))
    report["root_is_root"] = model.check_is_root()
    report["inner_is_root"] = inner.check_is_root()
    model(local(batch(0, world_size)[0], rank))
    report["inner_state"] = inner.training_state.name
    return report


class StructureTest(TestCase):
    def test_root_nesting_and_forwarding(self):
        report = self.pool.run(_structure, 2)[1]
        self.assertEqual(report["count"], 4)
        self.assertTrue(report["roots_only_model"])
        self.assertEqual(report["module"], "TinyLM")
        self.assertEqual(report["forwarded_attr"], "ModuleList")
        self.assertEqual(report["forwarded_item"], "ShardedDataParallel")
        self.assertEqual(report["placeholder"], ("meta", (16, 8)))
        self.assertEqual(report["placeholder_repr"], "ParamPlaceholder('blocks.0.fc1.weight', shape=(16, 8), dtype=torch.float32; sharded)")
        sum_error, init_error, grad_error = report["placeholder_errors"]
        self.assertExpectedInline(
            sum_error,
            """parameter 'blocks.0.fc1.weight' is sharded by ShardedDataParallel: its full value exists only while its unit runs forward or backward, so 'sum' cannot be used on it here (to read or change full parameters outside forward, use ShardedDataParallel.summon_full_params(model)); optimizers work on model.parameters(), the FlatParameter shards""",
        )
        self.assertIn("so 'zero_' cannot be used", init_error)  # no silent no-op writes
        self.assertIn("so 'grad' cannot be used", grad_error)
        self.assertTrue(report["root_is_root"])
        self.assertFalse(report["inner_is_root"])
        self.assertEqual(report["inner_state"], TrainingState.IDLE.name)
        self.assertExpectedInline(
            report["repr"],
            """\
ShardedDataParallel(FULL_SHARD, world_size=2, device=cpu, 6 parameters, 296 elements (148 on this rank)
  (module): Block(
    (norm): LayerNorm((8,), eps=1e-05, elementwise_affine=True, bias=True)
    (fc1): Linear(in_features=8, out_features=16, bias=True)
    (fc2): Linear(in_features=16, out_features=8, bias=True)
  )
)""",
        )


def _divergent(rank, world_size):
    model = wrap(build(n_blocks=3 if rank == 0 else 2), "nested")
    model(local(batch(0, world_size)[0], rank))


def _divergent_options(rank, world_size):
    prefetch = BackwardPrefetch.BACKWARD_PRE if rank == 0 else BackwardPrefetch.BACKWARD_POST
    model = wrap(build(), "nested", backward_prefetch=prefetch)
    model(local(batch(0, world_size)[0], rank))


def _root_checks_on_one_rank(rank, world_size):
    """check_is_root() and no_sync() are local: calling them on one rank must not block."""
    model = wrap(build(), "nested")
    if rank == 0:
        with model.no_sync():
            pass
        flags = (model.check_is_root(), model.blocks[0].check_is_root())
    else:
        flags = None
    model(local(batch(0, world_size)[0], rank))
    return flags


def _conversions(rank, world_size):
    """No-op conversions pass, casts pass before the first forward (see test_fsdp1_conformance);
    re-allocating, moving, and casting after the first forward are refused."""
    model = wrap(build(), "nested")
    model.to("cpu").float()  # changes nothing: allowed
    outcome = []

    def after_forward(m):
        m(local(batch(0, world_size)[0], rank))
        m.double()

    for convert in (lambda m: m.to_empty(device="cpu"), lambda m: m.to("meta"), after_forward):
        try:
            convert(model)
            outcome.append("no error")
        except NotImplementedError as exc:
            outcome.append(str(exc))
    return outcome


class ConveniencesTest(TestCase):
    def test_root_checks_need_no_collective(self):
        results = self.pool.run(_root_checks_on_one_rank, 2, timeout=60)
        self.assertEqual(results, [(True, False), None])

    def test_moving_or_reallocating_after_wrapping_raises(self):
        (outcome,) = self.pool.run(_conversions, 1)
        self.assertExpectedInline(
            "\n".join(outcome),
            """\
moving or re-allocating (to_empty) a ShardedDataParallel unit after it is built (cpu/torch.float32 -> cpu/torch.float32) is not supported: move the model before wrapping, or pass device_id (a param_init_fn must not recurse into submodules: use module.to_empty(device=..., recurse=False))
moving or re-allocating (to_empty) a ShardedDataParallel unit after it is built (cpu/torch.float32 -> meta/torch.float32) is not supported: move the model before wrapping, or pass device_id (a param_init_fn must not recurse into submodules: use module.to_empty(device=..., recurse=False))
casting a ShardedDataParallel model (cpu/torch.float32 -> cpu/torch.float64) after its first forward is not supported: cast it right after wrapping, before it runs""",
        )


class RankAgreementTest(TestCase):
    def test_ranks_that_built_different_models_fail_at_first_forward(self):
        with self.assertRaises(ValueError) as caught:
            self.pool.run(_divergent, 2, timeout=60)
        self.assertExpectedInline(
            str(caught.exception),
            """\
[rank 0] the ranks wrapped different models (every rank must build the same units with the same parameters, shapes, dtypes and options):
  unit #3: rank 0 has 'blocks.2' (FULL_SHARD, backward_prefetch=BACKWARD_PRE, forward_prefetch=False; torch.float32, requires_grad=True: norm.weight (8,), norm.bias (8,), fc1.weight (16, 8), fc1.bias (16,), fc2.weight (8, 16), fc2.bias (8,))
             rank 1 has (no such unit)""",
        )
        self.assertIn("rank 1 also failed", "".join(getattr(caught.exception, "__notes__", [])))  # every rank raises

    def test_ranks_with_different_options_fail_at_first_forward(self):
        with self.assertRaisesRegex(ValueError, "backward_prefetch=BACKWARD_POST") as caught:
            self.pool.run(_divergent_options, 2, timeout=60)
        self.assertIn("rank 1 also failed", "".join(getattr(caught.exception, "__notes__", [])))

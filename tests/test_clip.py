"""clip_grad_norm_: the global gradient norm over shards, clipping, and when it may be called.

Truth is ``torch.nn.utils.clip_grad_norm_`` on the single-process model (``build()``) after a
backward on the global batch: the wrapped model's gradients are that model's gradients."""

import math
import warnings

import torch
import torch.distributed as dist
from expecttest import TestCase
from torch import nn

from flatshard import ShardedDataParallel, ShardingStrategy
from tests._models import ATOL, RTOL, VOCAB, _train, batch, build, full_params, global_mean, lm_loss, local, error_text as _message

summon = ShardedDataParallel.summon_full_params
INF = math.inf
NORM_RTOL = 1e-6


def _clip(model, *args):
    return model.clip_grad_norm_(*args)


class Float64LM(nn.Module):
    """``build()``'s model followed by a float64 linear map of the logits: a second dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = build()
        torch.manual_seed(1)
        self.scale = nn.Linear(VOCAB, VOCAB, dtype=torch.float64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.scale(self.lm(tokens).double()).float()


def _build(variant):
    """``plain``, ``frozen`` (block 1 frozen), ``ignored`` (the final norm ignored), ``float64``."""
    if variant == "float64":
        return Float64LM()
    return build(frozen_blocks=(1,) if variant == "frozen" else ())


def _wrap(variant, strategy_name, mode):
    """The variant wrapped: ``nested`` (each block a unit inside the root unit) or ``single``."""
    model = _build(variant)
    lm = model.lm if variant == "float64" else model
    options = {"sharding_strategy": ShardingStrategy[strategy_name]}
    if mode == "nested":
        for i, block in enumerate(lm.blocks):
            lm.blocks[i] = ShardedDataParallel(block, **options)
    ignored = {"ignored_modules": [lm.norm]} if variant == "ignored" else {}
    return ShardedDataParallel(model, **options, **ignored)


def _backward(rank, world_size, variant, model, reference, step=0):
    """Global-batch backward on the reference, this rank's slice on ``model``; gradients of
    ignored parameters averaged by hand (flatshard leaves them to the user)."""
    tokens, targets = batch(step, world_size)
    lm_loss(reference(tokens), targets).backward()
    loss = lm_loss(model(local(tokens, rank)), local(targets, rank))
    loss.backward()
    if variant == "ignored":
        for param in model.norm.parameters():
            dist.all_reduce(param.grad)
            param.grad.div_(world_size)
    return loss


def _check_norm(norm, expected, what):
    if norm.dtype != expected.dtype:
        raise AssertionError(f"{what}: norm dtype {norm.dtype}, torch's {expected.dtype}")
    if not math.isclose(norm.item(), expected.item(), rel_tol=NORM_RTOL):
        raise AssertionError(f"{what}: norm {norm.item()!r}, torch's {expected.item()!r}")


def _check_grads(model, reference, what):
    expected = dict(reference.named_parameters())
    with summon(model, with_grads=True):
        got = dict(model.named_parameters())
        if sorted(got) != sorted(expected):
            raise AssertionError(f"{what}: names {sorted(got)}")
        for name, param in got.items():
            ref = expected[name].grad
            if (param.grad is None) != (ref is None):
                raise AssertionError(f"{what}: {name}.grad is {param.grad!r}, torch's {ref!r}")
            if ref is not None:
                torch.testing.assert_close(param.grad, ref, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {name}.grad: {m}")


def _parity(rank, world_size, cases):
    """Each case (strategy, mode, variant, norm_type, max_norm): norm and clipped gradients as
    torch's on the single-process model; returns the norms (to compare across ranks)."""
    norms = []
    for strategy_name, mode, variant, norm_type, max_norm in cases:
        what = f"{strategy_name}/{mode}/{variant}/norm_type={norm_type}/max_norm={max_norm}"
        model, reference = _wrap(variant, strategy_name, mode), _build(variant)
        _backward(rank, world_size, variant, model, reference)
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
        norm = _clip(model, max_norm, norm_type)
        _check_norm(norm, expected, what)
        _check_grads(model, reference, what)
        norms.append(norm.item())
    return norms


def _cases(strategies, modes, variants, norm_types, max_norms=(0.05,)):
    return [(s, m, v, p, c) for s in strategies for m in modes for v in variants for p in norm_types for c in max_norms]


ALL_NORMS = (2.0, 1.0, 3.0, INF)
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


class ParityTest(TestCase):
    def _run(self, world_size, cases):
        per_rank = self.pool.run(_parity, world_size, cases)
        for rank, norms in enumerate(per_rank):
            self.assertEqual(norms, per_rank[0], f"rank {rank} got another norm")

    def test_norm_types_and_strategies(self):
        self._run(2, _cases(STRATEGIES, ("nested",), ("plain",), ALL_NORMS))
        self._run(2, _cases(("FULL_SHARD",), ("single",), ("plain",), (2.0, INF), max_norms=(1e3,)))  # no clipping

    def test_world_sizes_1_3_4(self):
        self._run(1, _cases(("FULL_SHARD", "NO_SHARD"), ("nested",), ("plain",), (2.0, INF)))
        padded = _cases(STRATEGIES, ("nested",), ("plain",), (3.0, INF)) + _cases(("SHARD_GRAD_OP",), ("single",), ("plain",), (2.0,))
        self._run(3, padded)
        self._run(4, _cases(("FULL_SHARD", "SHARD_GRAD_OP"), ("nested",), ("plain",), (1.0, INF)))

    def test_frozen_ignored_and_float64_parameters(self):
        variants = ("frozen", "ignored", "float64")
        self._run(3, _cases(("FULL_SHARD",), ("nested",), variants, (2.0, INF)) + _cases(("NO_SHARD",), ("nested",), variants, (1.0,)))
        self._run(2, _cases(("SHARD_GRAD_OP",), ("single",), ("frozen", "ignored", "float64"), (3.0,)))


# -- training, no gradients, repeated calls ---------------------------------------------------


def _train_clipped(rank, world_size, strategy_name, norm_type):
    """Three SGD steps with clipping: the same losses and parameters as single-process training."""
    model, reference = _wrap("plain", strategy_name, "nested"), build()
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference))
    losses, ref_losses = [], []
    for step in range(3):
        optim.zero_grad()
        ref_optim.zero_grad()
        tokens, targets = batch(step, world_size)
        ref_loss = lm_loss(reference(tokens), targets)
        ref_loss.backward()
        ref_losses.append(ref_loss.item())
        loss = lm_loss(model(local(tokens, rank)), local(targets, rank))
        loss.backward()
        losses.append(global_mean(loss))
        _check_norm(_clip(model, 0.1, norm_type), torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1, norm_type), f"step {step}")
        optim.step()
        ref_optim.step()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    got, expected = full_params(model), dict(reference.named_parameters(remove_duplicate=False))
    for name, param in expected.items():
        torch.testing.assert_close(got[name], param.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def _no_gradients(rank, world_size):
    """Before any backward, and after zero_grad(set_to_none): torch's 0 norm, nothing created,
    and FSDP1's warning (a clip without gradients is usually a mistake)."""
    model = _wrap("plain", "FULL_SHARD", "nested")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _clip(model, 1.0)
        _train(model, world_size, 1, 1, rank)  # lazy init, a step
        model.zero_grad(set_to_none=True)
        second = _clip(model, 1.0, INF)
    if any(p.grad is not None for p in model.parameters()):
        raise AssertionError("a gradient was created")
    said = [str(w.message) for w in caught if "no gradients" in str(w.message)]
    return [(t.item(), t.dtype) for t in (first, second)] + said


def _twice(rank, world_size):
    """Clipping twice: the second call measures the clipped norm and changes nothing more."""
    model, reference = _wrap("plain", "FULL_SHARD", "nested"), build()
    _backward(rank, world_size, "plain", model, reference)
    first = _clip(model, 0.05)
    second = _clip(model, 0.05)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    _check_grads(model, reference, "twice")
    return first.item(), second.item()


def _unsynchronised_ignored(rank, world_size, norm_type):
    """Ignored parameters keep each rank's own gradient; clipping still gives every rank the
    same norm (rank 0's ignored gradients count), so every shard is scaled alike."""
    model = _wrap("ignored", "FULL_SHARD", "nested")
    tokens, targets = (local(t, rank) for t in batch(0, world_size))
    lm_loss(model(tokens), targets).backward()
    return _clip(model, 0.05, norm_type).item()


class TrainingTest(TestCase):
    def test_unsynchronised_ignored_gradients_give_one_norm(self):
        for norm_type in (2.0, INF):
            norms = self.pool.run(_unsynchronised_ignored, 3, norm_type)
            self.assertEqual(norms, [norms[0]] * 3)


    def test_training_with_clipping_matches_one_process(self):
        self.pool.run(_train_clipped, 3, "FULL_SHARD", 2.0)
        self.pool.run(_train_clipped, 2, "NO_SHARD", INF)

    def test_without_gradients_the_norm_is_zero(self):
        for rank, result in enumerate(self.pool.run(_no_gradients, 2)):
            said = f"clip_grad_norm_() was called on rank {rank} with no gradients -- returning the total norm in the default dtype torch.float32"
            self.assertEqual(result, [(0.0, torch.float32), (0.0, torch.float32), said, said])

    def test_clipping_twice(self):
        first, second = self.pool.run(_twice, 2)[0]
        self.assertGreater(first, 0.05)
        self.assertAlmostEqual(second, 0.05, places=5)


# -- errors -----------------------------------------------------------------------------------


def _bad_arguments(rank, world_size):
    model = _wrap("plain", "FULL_SHARD", "nested")
    out = []
    for args, error in (
        (("1.0",), TypeError),
        ((True,), TypeError),
        ((1.0, "2"), TypeError),
        ((1.0, None), TypeError),
        ((-1.0,), ValueError),
        ((math.nan,), ValueError),
        ((1.0, 0), ValueError),
        ((1.0, -INF), ValueError),
        ((1.0, math.nan), ValueError),
    ):
        out.append(_message(lambda: _clip(model, *args), error))
    return out


def _wrong_time(rank, world_size):
    """Not on a nested unit; not inside summon_full_params, forward or backward; not after a
    no_sync backward. Each error leaves the model usable: clipping works after."""
    model = _wrap("plain", "FULL_SHARD", "nested")
    tokens, targets = (local(t, rank) for t in batch(0, world_size))
    out = {"nested": _message(lambda: _clip(model.blocks[1], 1.0), RuntimeError)}
    with summon(model):
        out["summon"] = _message(lambda: _clip(model, 1.0), RuntimeError)
    seen = {}

    def in_forward(module, args):
        seen["forward"] = _message(lambda: _clip(model, 1.0), RuntimeError)

    handle = model.blocks[1].register_forward_pre_hook(in_forward)
    logits = model(tokens)
    handle.remove()

    def in_backward(grad):
        seen["backward"] = _message(lambda: _clip(model, 1.0), RuntimeError)

    logits.register_hook(in_backward)
    lm_loss(logits, targets).backward()
    out.update(seen)
    with model.no_sync():
        lm_loss(model(tokens), targets).backward()
        out["no_sync"] = _message(lambda: _clip(model, 1.0), RuntimeError)
    model.zero_grad()  # drops the held gradient: clipping works again
    lm_loss(model(tokens), targets).backward()
    _clip(model, 1.0)
    return out


def _units_over_different_groups(rank, world_size):
    """A nested unit over another group object (of the same ranks) than the root's."""
    other = dist.new_group(list(range(world_size)))
    model = build()
    model.blocks[0] = ShardedDataParallel(model.blocks[0], process_group=other)
    model = ShardedDataParallel(model)
    tokens, targets = (local(t, rank) for t in batch(0, world_size))
    lm_loss(model(tokens), targets).backward()
    return _message(lambda: _clip(model, 1.0), NotImplementedError)


class ErrorsTest(TestCase):
    def test_units_sharded_over_different_process_groups_are_not_supported(self):
        messages = self.pool.run(_units_over_different_groups, 2)
        self.assertEqual(messages[0], messages[1])
        self.assertExpectedInline(messages[0], """clip_grad_norm_() with units sharded over different process groups is not supported""")

    def test_bad_arguments(self):
        messages = self.pool.run(_bad_arguments, 1)[0]
        self.assertExpectedInline(
            "\n".join(messages),
            """\
clip_grad_norm_: max_norm must be a real number; got '1.0'
clip_grad_norm_: max_norm must be a real number; got True
clip_grad_norm_: norm_type must be a real number; got '2'
clip_grad_norm_: norm_type must be a real number; got None
clip_grad_norm_: max_norm must be non-negative; got -1.0
clip_grad_norm_: max_norm must be non-negative; got nan
clip_grad_norm_: norm_type must be positive (e.g. 2.0) or inf; got 0.0
clip_grad_norm_: norm_type must be positive (e.g. 2.0) or inf; got -inf
clip_grad_norm_: norm_type must be positive (e.g. 2.0) or inf; got nan""",
        )

    def test_called_at_the_wrong_time_or_place(self):
        for rank, out in enumerate(self.pool.run(_wrong_time, 2)):
            text = "\n".join(f"{key}: {value}" for key, value in out.items()).replace(f"[rank {rank}]", "[rank R]")
            self.assertExpectedInline(text, """\
nested: [rank R] unit 'blocks.1': clip_grad_norm_() should only be called on the root FSDP instance (the outermost ShardedDataParallel), which holds every gradient of the model, not on a nested unit
summon: [rank R] unit the root module: clip_grad_norm_() cannot be used inside summon_full_params (the unit's full parameters are already summoned)
forward: [rank R] unit the root module: clip_grad_norm_() cannot be used while the unit is in FORWARD (during forward or backward); call it between iterations
backward: [rank R] unit the root module: clip_grad_norm_() cannot be used while the unit is in BACKWARD_PRE (during forward or backward); call it between iterations
no_sync: [rank R] unit the root module: clip_grad_norm_() inside no_sync() after a backward under it: the gradients are not averaged over the ranks yet; call it outside no_sync(), which averages them first""")


def _torch_clip_on_shards(rank, world_size, orig):
    """What docs/migrating.md says: torch.nn.utils.clip_grad_norm_ on the wrapped model's
    parameters sees only this rank's shard (each rank a different norm, none the model's);
    model.clip_grad_norm_ gives the single-process norm."""
    from tests._models import wrap

    plain = build()
    tokens, targets = batch(0, world_size)
    lm_loss(plain(tokens), targets).backward()
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9).item()
    model = wrap(build(), "nested", use_orig_params=orig)
    lm_loss(model(local(tokens, rank)), local(targets, rank)).backward()
    shard_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
    return expected, shard_norm, model.clip_grad_norm_(1e9).item()


class TorchClipOnShardsTest(TestCase):
    def test_torch_clip_grad_norm_sees_one_shard_model_clip_grad_norm_the_model(self):
        for orig in (True, False):
            results = self.pool.run(_torch_clip_on_shards, 2, orig)
            (expected, first, ours), (_, second, _) = results
            self.assertNotAlmostEqual(first, second, places=3)
            self.assertTrue(first < expected and second < expected)
            self.assertAlmostEqual(ours, expected, places=4)

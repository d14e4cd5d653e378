"""FSDP1 behaviours that code written for it relies on, found by running PyTorch's own FSDP1
unit tests against flatshard: construction with only a group object, FSDP1's public
attributes, ignoring the wrapped module itself, ``apply(fn)`` after wrapping, a no-op summon,
``param_init_fn`` on every module of a unit, FSDP1's warnings and exception classes."""

import warnings
from typing import Any, List

import torch
import torch.distributed as dist
from expecttest import TestCase
from torch import nn

from flatshard import CPUOffload, MixedPrecision, ShardedDataParallel, ShardingStrategy
from flatshard.wrap import ModuleWrapPolicy
from tests._models import _train, assert_same_training, batch, build, full_params, lm_loss, local, make_optim, train_reference, wrap


class _RankAndSize:
    """A group stand-in with only ``rank()`` and ``size()`` (what FSDP1's own tests wrap with
    while no default group exists)."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Sequential(nn.Linear(4, 4), nn.ReLU())


# -- construction with only a group object ------------------------------------------------------


class ExplicitGroupTest(TestCase):
    def test_a_group_object_is_all_construction_needs(self) -> None:
        self.assertFalse(dist.is_initialized())
        model = ShardedDataParallel(_Pair(), process_group=_RankAndSize(1, 2), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        units = ShardedDataParallel.fsdp_modules(model)
        self.assertEqual([type(u.module).__name__ for u in units], ["_Pair", "Linear", "Linear"])
        self.assertEqual([(u.rank, u.world_size) for u in units], [(1, 2)] * 3)
        self.assertEqual([h.shard_numel for u in units for h in u.handles], [10, 10])

    def test_without_a_group_the_default_group_is_still_required(self) -> None:
        with self.assertRaisesRegex(RuntimeError, "ShardedDataParallel needs torch.distributed to be initialised"):
            ShardedDataParallel(_Pair())

    def test_a_group_of_one_rank_runs_no_shard_and_says_so(self) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = ShardedDataParallel(_Pair(), process_group=_RankAndSize(0, 1))
            hybrid_offload = ShardedDataParallel(_Pair(), process_group=_RankAndSize(0, 1), cpu_offload=CPUOffload(offload_params=True))
        self.assertEqual(
            [str(w.message) for w in caught],
            ["FSDP is switching to use `NO_SHARD` instead of ShardingStrategy.FULL_SHARD since the world size is 1."],
        )
        self.assertEqual(caught[0].filename, __file__)
        self.assertIs(model.sharding_strategy, ShardingStrategy.NO_SHARD)
        self.assertIs(hybrid_offload.sharding_strategy, ShardingStrategy.FULL_SHARD)


# -- FSDP1's public attributes ------------------------------------------------------------------


class AttributesTest(TestCase):
    def test_fsdp1_public_attributes(self) -> None:
        group = _RankAndSize(0, 2)
        plain = ShardedDataParallel(_Pair(), process_group=group)
        mp = MixedPrecision(param_dtype=torch.float16)
        module = _Pair()
        given = ShardedDataParallel(
            module, process_group=group, cpu_offload=CPUOffload(offload_params=True), mixed_precision=mp,
            use_orig_params=True, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, forward_prefetch=True,
            limit_all_gathers=False, backward_prefetch=None,
        )
        described = [
            (m.cpu_offload, m.mixed_precision, m.use_orig_params, m.sharding_strategy, m.forward_prefetch,
             m.limit_all_gathers, m.backward_prefetch, m.process_group is group, m.rank, m.world_size,
             m.training_state.name, m.compute_device)
            for m in (plain, given)
        ]
        self.assertEqual(
            described,
            [
                (CPUOffload(), MixedPrecision(), False, ShardingStrategy.FULL_SHARD, False, True,
                 plain.backward_prefetch, True, 0, 2, "IDLE", torch.device("cpu")),
                (CPUOffload(offload_params=True), mp, True, ShardingStrategy.SHARD_GRAD_OP, True, False,
                 None, True, 0, 2, "IDLE", torch.device("cpu")),
            ],
        )
        self.assertIs(given.module, module)
        self.assertEqual([p is h.flat_param for p, h in zip(plain.params, plain.handles)], [True])

    def test_a_full_precision_unit_reports_no_mixed_precision(self) -> None:
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        mp = MixedPrecision(param_dtype=torch.float16)
        wrapped = ShardedDataParallel(model, process_group=_RankAndSize(0, 2), mixed_precision=mp, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        self.assertEqual([u.mixed_precision for u in ShardedDataParallel.fsdp_modules(wrapped)], [mp, mp, MixedPrecision()])


# -- param_init_fn --------------------------------------------------------------------------------


class _Container(nn.Module):
    """Initialised from its parent only (fms-style): its own init fills its children."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4, bias=False)
        self.k = nn.Sequential(nn.Linear(4, 4, bias=False))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = _Container()
        self.second = _Container()
        self.out = nn.Linear(4, 2, bias=False)


def _container_init(module: nn.Module, log: List[str]) -> None:
    """Materialises only containers, and their children with them (FSDP1 accepts this)."""
    log.append(type(module).__name__)
    if isinstance(module, _Container):
        module.to_empty(device="cpu", recurse=True)
        with torch.no_grad():
            module.q.weight.copy_(torch.arange(16.0).view(4, 4))
            module.k[0].weight.fill_(0.5)
    elif isinstance(module, _Model):
        module.out.to_empty(device="cpu")
        with torch.no_grad():
            module.out.weight.fill_(-1.0)


class ParamInitFnTest(TestCase):
    def test_param_init_fn_is_called_on_every_module_outermost_first(self) -> None:
        with torch.device("meta"):
            model = _Model()
        log: List[str] = []
        wrapped = ShardedDataParallel(
            model, process_group=_RankAndSize(0, 2), param_init_fn=lambda m: _container_init(m, log),
            auto_wrap_policy=ModuleWrapPolicy({_Container}),
        )
        self.assertEqual(
            log,
            ["_Container", "Linear", "Sequential", "Linear"] * 2 + ["_Model", "Linear"],
        )
        # (rank 0 of 2 keeps the first half of each unit's flat parameter)
        container = torch.cat([torch.arange(16.0), torch.full((16,), 0.5)])[:16]
        shards = [(type(u.module).__name__, u.handles[0].flat_param.detach()) for u in ShardedDataParallel.fsdp_modules(wrapped)]
        self.assertEqual([name for name, _ in shards], ["_Model", "_Container", "_Container"])
        for (_, shard), expected in zip(shards, [torch.full((4,), -1.0), container, container]):
            torch.testing.assert_close(shard, expected)


# -- summon_full_params and apply -----------------------------------------------------------------


class SummonNoUnitsTest(TestCase):
    def test_summon_over_a_module_without_units_is_a_no_op(self) -> None:
        module = nn.Linear(2, 2)
        before = module.weight.detach().clone()
        with ShardedDataParallel.summon_full_params(module):
            module.weight.data.add_(1.0)
        torch.testing.assert_close(module.weight.detach(), before + 1.0)


@torch.no_grad()
def _init_linears(module: nn.Module) -> None:
    """Values that depend only on each Linear's shape (the same on every rank)."""
    if type(module) is nn.Linear:
        gen = torch.Generator().manual_seed(module.weight.numel())
        module.weight.copy_(0.3 * torch.randn(module.weight.shape, generator=gen))
        if module.bias is not None:
            module.bias.fill_(0.1)


def _train_steps(model: nn.Module, rank: Any, world_size: int, steps: int = 3) -> List[float]:
    """AdamW steps: the plain model on the global batches (``rank=None``), else this rank's."""
    return _train(model, world_size, steps, 1, rank)


def _apply_then_train(rank: int, world_size: int, strategy: str, use_orig_params: bool) -> List[str]:
    """``apply(fn)`` on a wrapped model initialises the full parameters as on the plain model;
    training after it matches single-process training from the same values."""
    reference = build()
    reference.apply(_init_linears)
    _train_steps(reference, None, world_size)
    model = wrap(build(), "nested", sharding_strategy=ShardingStrategy[strategy], use_orig_params=use_orig_params)
    returned = model.apply(_init_linears)
    initialised = build()
    initialised.apply(_init_linears)
    got = full_params(model)
    for name, value in initialised.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(got[name], value.detach(), msg=lambda m: f"after apply, {name}: {m}")
    _train_steps(model, rank, world_size)
    got = full_params(model)
    for name, value in reference.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(got[name], value.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"after training, {name}: {m}")
    errors = []
    with ShardedDataParallel.summon_full_params(model):
        try:
            model.apply(_init_linears)
        except ValueError as exc:
            errors.append(str(exc))
    return [str(returned is model)] + errors


class ApplyTest(TestCase):
    def test_apply_initialises_the_full_parameters_and_training_matches(self) -> None:
        for strategy, orig in (("FULL_SHARD", False), ("SHARD_GRAD_OP", True), ("NO_SHARD", False)):
            with self.subTest(strategy=strategy, use_orig_params=orig):
                result = self.pool.run(_apply_then_train, 2, strategy, orig)[0]
                self.assertExpectedInline(
                    "\n".join(result),
                    """\
True
[rank 0] unit the root module: apply(fn) expected to be in states [TrainingState.IDLE] but the unit is in TrainingState.SUMMON_FULL_PARAMS: call it outside forward, backward and summon_full_params""",
                )


# -- ignoring the wrapped module itself -----------------------------------------------------------


def _ignore_root_then_train(rank: int, world_size: int) -> List[str]:
    """Ignoring the module being wrapped leaves its own parameters ordinary (FSDP1 warns); its
    nested units still shard. The user averages the ignored parameters' gradients (as for any
    ignored module), and training matches single-process training."""
    reference = train_reference(world_size, steps=3)
    model = build()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = ShardedDataParallel(block)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = ShardedDataParallel(model, ignored_modules=[model])
    ignored = [model.embed.weight, model.norm.weight, model.norm.bias]  # (the head is tied to the embedding)
    optim = make_optim(wrapped.parameters())
    losses = []
    for step in range(3):
        tokens, targets = (local(t, rank) for t in batch(step, world_size))
        optim.zero_grad()
        loss = lm_loss(wrapped(tokens), targets)
        loss.backward()
        for param in ignored:
            dist.all_reduce(param.grad)
            param.grad /= world_size
        optim.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / world_size)
    params = full_params(wrapped)
    params.update({"embed.weight": model.embed.weight.detach(), "head.weight": model.embed.weight.detach(),
                   "norm.weight": model.norm.weight.detach(), "norm.bias": model.norm.bias.detach()})
    assert_same_training(reference, (losses, params))
    return [str(w.message) for w in caught] + [f"root handles: {len(wrapped.handles)}", f"units: {len(ShardedDataParallel.fsdp_modules(wrapped))}"]


class IgnoredRootTest(TestCase):
    def test_ignoring_the_wrapped_module_warns_and_its_nested_units_still_shard(self) -> None:
        result = self.pool.run(_ignore_root_then_train, 2)[0]
        self.assertExpectedInline(
            "\n".join(result),
            """\
Trying to ignore the top-level module passed into the FSDP constructor itself will result in all parameters being ignored: the TinyLM being wrapped is in ignored_modules, so none of its parameters or buffers is sharded (its nested units still are)
root handles: 0
units: 4""",
        )


# -- loading through a plain parent ---------------------------------------------------------------


def _load_through_parent(rank: int, world_size: int, kind: str) -> List[Any]:
    """``parent.load_state_dict`` of a plain module holding a wrapped model loads the wrapped
    model exactly as its own ``load_state_dict`` would, for every state-dict type."""
    from flatshard import StateDictType

    source = wrap(build(seed=0), "nested")
    _train_steps(source, rank, world_size, steps=1)
    target = wrap(build(seed=5), "nested")
    outer = nn.Sequential(target)
    with ShardedDataParallel.state_dict_type(source, StateDictType[kind]), ShardedDataParallel.state_dict_type(target, StateDictType[kind]):
        state = source.state_dict()
        result = outer.load_state_dict({"0." + k: v for k, v in state.items()})
    expected, got = full_params(source), full_params(target)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=lambda m: f"{kind} {name}: {m}")
    return [result.missing_keys, result.unexpected_keys]


class LoadThroughParentTest(TestCase):
    def test_a_plain_parent_loads_the_wrapped_model(self) -> None:
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"):
            with self.subTest(kind=kind):
                self.assertEqual(self.pool.run(_load_through_parent, 2, kind), [[[], []]] * 2)


class ContainerWarningTest(TestCase):
    def test_a_container_without_forward_warns_as_in_fsdp1(self) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ShardedDataParallel(nn.ModuleList([nn.Linear(2, 2)]), process_group=_RankAndSize(0, 2))
            ShardedDataParallel(nn.Sequential(nn.Linear(2, 2)), process_group=_RankAndSize(0, 2))
        self.assertEqual(
            [str(w.message) for w in caught],
            [
                "FSDP will not all-gather parameters for containers that do not implement forward: a ModuleList is "
                "never called, so its unit's parameters are never gathered for compute; wrap the modules inside it instead"
            ],
        )


# -- LOCAL_STATE_DICT values ----------------------------------------------------------------------


def _local_values(rank: int, world_size: int) -> List[Any]:
    """FSDP1's keys only, and each flat shard a ShardedTensor whose local shard is this rank's
    part without padding (none where a rank holds only padding)."""
    from flatshard import StateDictType

    model = wrap(build(), "nested")
    with ShardedDataParallel.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        state = model.state_dict()
    out: List[Any] = [sorted(state)]
    for key in ("_flat_param", "blocks.0._flat_param"):
        value = state[key]
        handle = (model if key == "_flat_param" else model.blocks[0]).handles[0]
        shards = value.local_shards()
        out.append((key, type(value).__name__, tuple(value.metadata().size), [(s.metadata.shard_offsets, s.tensor.numel()) for s in shards]))
        if shards and not torch.equal(shards[0].tensor, handle.flat_param.detach()[: shards[0].tensor.numel()]):
            raise AssertionError(f"{key}: the local shard is not this rank's part of the FlatParameter")
    return out


class LocalStateDictTest(TestCase):
    def test_local_state_dict_values_are_fsdp1_sharded_tensors(self) -> None:
        results = self.pool.run(_local_values, 3)
        keys = ["_flat_param", "blocks.0._flat_param", "blocks.1._flat_param", "blocks.2._flat_param", "pos"]
        # 120 and 296 elements over 3 ranks: shards of 40 and 99 (rank 2 holds 98 and 1 of padding)
        self.assertEqual(
            results,
            [
                [keys, ("_flat_param", "ShardedTensor", (120,), [([0], 40)]), ("blocks.0._flat_param", "ShardedTensor", (296,), [([0], 99)])],
                [keys, ("_flat_param", "ShardedTensor", (120,), [([40], 40)]), ("blocks.0._flat_param", "ShardedTensor", (296,), [([99], 99)])],
                [keys, ("_flat_param", "ShardedTensor", (120,), [([80], 40)]), ("blocks.0._flat_param", "ShardedTensor", (296,), [([198], 98)])],
            ],
        )


# -- ranks that ignore different modules ----------------------------------------------------------


def _different_ignored(rank: int, world_size: int) -> str:
    """Rank r ignores r + 1 modules placed between managed ones: the managed parameters have the
    same shapes on every rank but different names. Refused, saying why (FSDP1 accepts it)."""
    layers = [nn.Linear(4, 4), *[nn.Linear(4, 4) for _ in range(rank + 1)], nn.Linear(4, 4)]
    model = nn.Sequential(*layers)
    wrapped = ShardedDataParallel(model, ignored_modules=layers[1:-1])
    try:
        wrapped(torch.ones(2, 4))
    except ValueError as exc:
        return str(exc)
    return "no error"


class DifferentIgnoredModulesTest(TestCase):
    def test_ranks_ignoring_different_modules_are_told_why_it_is_refused(self) -> None:
        self.assertExpectedInline(
            self.pool.run(_different_ignored, 2)[0],
            """\
[rank 0] the ranks wrapped different models (every rank must build the same units with the same parameters, shapes, dtypes and options):
  unit #0: rank 0 has the root module (FULL_SHARD, backward_prefetch=BACKWARD_PRE, forward_prefetch=False; torch.float32, requires_grad=True: 0.weight (4, 4), 0.bias (4,), 2.weight (4, 4), 2.bias (4,))
             rank 1 has the root module (FULL_SHARD, backward_prefetch=BACKWARD_PRE, forward_prefetch=False; torch.float32, requires_grad=True: 0.weight (4, 4), 0.bias (4,), 3.weight (4, 4), 3.bias (4,))
Only the parameters' names differ. FSDP1 accepts that; flatshard does not, because it cannot tell it from ranks that wrapped different parameters of the same shapes, whose gradients would then be averaged together silently, and because the ranks' state dicts would have different keys. If the ranks ignore different modules, register them where they do not shift the managed parameters' names (e.g. in a container of their own)""",
        )


# -- FSDP1's exception classes --------------------------------------------------------------------


class ExceptionClassesTest(TestCase):
    def test_misuse_raises_a_class_fsdp1_code_catches(self) -> None:
        from flatshard import FullStateDictConfig, ShardedStateDictConfig, StateDictType

        group = _RankAndSize(0, 2)
        pair = _Pair()
        model = ShardedDataParallel(_Pair(), process_group=group)
        cases = [
            (ValueError, TypeError, lambda: ShardedDataParallel(_Pair(), process_group=group, param_init_fn=42)),
            (ValueError, TypeError, lambda: ShardedDataParallel(pair, process_group=group, ignored_modules=[pair.a.weight])),
            (RuntimeError, TypeError, lambda: ShardedDataParallel.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, ShardedStateDictConfig())),
            (NotImplementedError, ValueError, lambda: ShardedDataParallel.summon_full_params(model, rank0_only=True, writeback=True).__enter__()),
        ]
        for fsdp1_class, own_class, call in cases:
            with self.assertRaises(fsdp1_class) as caught:
                call()
            self.assertIsInstance(caught.exception, own_class)
        ShardedDataParallel.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig())


def _state_and_order_errors(rank: int, world_size: int) -> List[str]:
    """summon_full_params from forward (FSDP1: AssertionError) and ranks that built different
    models (FSDP1: RuntimeError, at the first forward)."""
    model = wrap(build(), "nested")
    caught = []

    def summon_in_forward(*_: Any) -> None:
        try:
            with ShardedDataParallel.summon_full_params(model):
                pass
        except AssertionError as exc:
            caught.append(f"{type(exc).__name__} is a RuntimeError: {isinstance(exc, RuntimeError)}")

    hook = model.blocks[0].module.fc1.register_forward_pre_hook(summon_in_forward)
    with torch.no_grad():
        model(local(batch(0, world_size)[0], rank))
    hook.remove()
    plain = build(n_blocks=3 if rank == 0 else 2)
    divergent = wrap(plain, "nested")
    try:
        divergent(local(batch(0, world_size)[0], rank))
    except RuntimeError as exc:
        caught.append(f"{type(exc).__name__} is a ValueError: {isinstance(exc, ValueError)}")
    return caught


class StateAndOrderErrorsTest(TestCase):
    def test_state_and_divergence_errors_are_fsdp1s_classes_too(self) -> None:
        self.assertEqual(
            self.pool.run(_state_and_order_errors, 2),
            [["WrongStateError is a RuntimeError: True", "DivergedRanksError is a ValueError: True"]] * 2,
        )


# -- casting after wrapping -----------------------------------------------------------------------


def _cast_then_train(rank: int, world_size: int, strategy: str, use_orig_params: bool) -> List[str]:
    """``model.double()`` after wrapping trains exactly as the plain model cast the same way;
    ``model.half()`` (pure fp16, FSDP1's test) gives fp16 parameters, outputs and gradients."""
    reference = build().double()
    _train_steps(reference, None, world_size)
    options = {"sharding_strategy": ShardingStrategy[strategy], "use_orig_params": use_orig_params}
    model = wrap(build(), "nested", **options).double()
    _train_steps(model, rank, world_size)
    got = full_params(model)
    for name, value in reference.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(got[name], value.detach(), rtol=1e-12, atol=1e-14, msg=lambda m: f"{name}: {m}")
    half = wrap(build(), "nested", **options).half()
    optim = torch.optim.SGD(half.parameters(), lr=0.1)
    tokens, _ = (local(t, rank) for t in batch(0, world_size))
    logits = half(tokens)
    logits.float().pow(2).mean().backward()
    optim.step()
    return sorted({str(p.dtype) for p in half.parameters()} | {str(logits.dtype)} | {str(p.grad.dtype) for p in half.parameters() if p.grad is not None})


class CastAfterWrappingTest(TestCase):
    def test_casting_a_wrapped_model_before_it_runs(self) -> None:
        for strategy, orig in (("FULL_SHARD", False), ("SHARD_GRAD_OP", True), ("NO_SHARD", False), ("NO_SHARD", True)):
            with self.subTest(strategy=strategy, use_orig_params=orig):
                self.assertEqual(self.pool.run(_cast_then_train, 2, strategy, orig), [["torch.float16"]] * 2)


# -- keep_low_precision_grads with original parameters --------------------------------------------


def _low_precision_grads(rank: int, world_size: int, strategy: str) -> List[str]:
    """``MixedPrecision(keep_low_precision_grads=True)`` with ``use_orig_params=True``: the
    original parameters get bf16 gradients, and training (``no_sync`` micro-batches, gradients
    edited in place, clipping, SGD) equals the same training with ``use_orig_params=False``."""
    from flatshard import MixedPrecision

    bf16 = torch.bfloat16
    results, dtypes = [], []
    for orig in (False, True):
        mp = MixedPrecision(param_dtype=bf16, buffer_dtype=bf16, keep_low_precision_grads=True)
        model = wrap(build(), "nested", use_orig_params=orig, sharding_strategy=ShardingStrategy[strategy], mixed_precision=mp)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            tokens, targets = (local(t, rank) for t in batch(step, world_size))
            optim.zero_grad()
            with model.no_sync():
                lm_loss(model(tokens).float(), targets).backward()
            lm_loss(model(tokens).float(), targets).backward()
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.mul_(0.5)
            model.clip_grad_norm_(0.5)
            dtypes.append(sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}))
            optim.step()
        results.append(full_params(model))
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    return sorted({d for step in dtypes for d in step})


class LowPrecisionGradsTest(TestCase):
    def test_keep_low_precision_grads_with_original_parameters(self) -> None:
        for strategy in ("FULL_SHARD", "NO_SHARD"):
            with self.subTest(strategy=strategy):
                self.assertEqual(self.pool.run(_low_precision_grads, 2, strategy), [["torch.bfloat16"]] * 2)

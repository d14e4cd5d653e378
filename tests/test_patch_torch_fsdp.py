"""``flatshard.patch_torch_fsdp()`` against the installed torch's public FSDP1 import paths, the
FSDP1 private attributes frameworks read (docs/migrating.md), refusing a second FSDP, and the
wrapped module's ``forward`` signature on the wrapper.

Truth for training is single-process training of the unwrapped model (``tests/_models.py``)."""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types

import torch
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.fully_sharded_data_parallel as torch_fsdp_module
from expecttest import TestCase

import flatshard
from flatshard import ShardedDataParallel
from tests._models import Block, assert_same_training, build, error_text, train_reference, _train, full_params

_TORCH = (torch_fsdp_module.__dict__["FullyShardedDataParallel"],)
USERS_OWN_BINDING = torch_fsdp_module.FullyShardedDataParallel  # (the patch leaves it alone)
PATHS = ("torch.distributed.fsdp", "torch.distributed.fsdp.fully_sharded_data_parallel")


def _classes():
    return [importlib.import_module(path).FullyShardedDataParallel for path in PATHS]


class PatchTest(TestCase):
    """The patch itself: pure (nothing is built)."""

    def tearDown(self):
        for path in PATHS:  # (whatever a failing test left)
            importlib.import_module(path).FullyShardedDataParallel = _TORCH[0]

    def test_replaces_the_public_paths_and_framework_bindings_made_before(self):
        early = types.ModuleType("accelerate._flatshard_test_imported_before")  # a framework's module
        early.FSDP = _TORCH[0]
        early.unrelated = torch.nn.Linear
        other = types.ModuleType("some_framework_not_listed")
        other.FSDP = _TORCH[0]
        sys.modules[early.__name__] = early
        sys.modules[other.__name__] = other
        try:
            patch = flatshard.patch_torch_fsdp()
            self.assertEqual(_classes(), [ShardedDataParallel, ShardedDataParallel])
            from torch.distributed.fsdp import FullyShardedDataParallel as imported_after

            self.assertIs(imported_after, flatshard.FullyShardedDataParallel)
            self.assertIs(early.FSDP, ShardedDataParallel)
            self.assertIs(early.unrelated, torch.nn.Linear)
            self.assertEqual(patch.replaced, [
                "torch.distributed.fsdp.FullyShardedDataParallel",
                "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel",
                "accelerate._flatshard_test_imported_before.FSDP",
            ])
            # the user's own bindings (this module's) and torch's own modules keep torch's class
            self.assertIs(USERS_OWN_BINDING, _TORCH[0])
            self.assertIs(other.FSDP, _TORCH[0])
            self.assertIs(importlib.import_module("torch.distributed.fsdp._runtime_utils").__dict__.get("FullyShardedDataParallel", _TORCH[0]), _TORCH[0])
            self.assertEqual(error_text(lambda: flatshard.patch_torch_fsdp(packages=["some_framework_not_listed"]), ValueError),
                             "patch_torch_fsdp(packages=['some_framework_not_listed']): torch is patched already, by an earlier call; "
                             "pass the packages to that first call (this one would replace nothing)")
            patch.undo()
            self.assertEqual(_classes(), [_TORCH[0], _TORCH[0]])
            self.assertIs(early.FSDP, _TORCH[0])
            with flatshard.patch_torch_fsdp(packages=["some_framework_not_listed"]) as listed:
                self.assertIs(other.FSDP, ShardedDataParallel)
                self.assertEqual(listed.replaced[-1], "some_framework_not_listed.FSDP")
            self.assertIs(other.FSDP, _TORCH[0])
            self.assertEqual(error_text(lambda: flatshard.patch_torch_fsdp(packages="accelerate"), TypeError),
                             "patch_torch_fsdp(packages=...) takes a sequence of package names; got 'accelerate'")
        finally:
            del sys.modules[early.__name__], sys.modules[other.__name__]

    def test_a_lazily_loaded_module_is_not_loaded_by_the_patch(self):
        import importlib.abc
        import importlib.util

        loaded = []

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return None

            def exec_module(self, module):
                loaded.append(module.__name__)

        spec = importlib.util.spec_from_loader("transformers._flatshard_test_lazy", importlib.util.LazyLoader(Loader()))
        lazy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(lazy)
        sys.modules[spec.name] = lazy
        try:
            with flatshard.patch_torch_fsdp() as patch:
                self.assertEqual(len(patch.replaced), 2)
            self.assertEqual(loaded, [])
        finally:
            del sys.modules[spec.name]

    def test_idempotent_undoable_and_a_context_manager(self):
        with flatshard.patch_torch_fsdp() as outer:
            inner = flatshard.patch_torch_fsdp()
            self.assertEqual(inner.replaced, [])
            self.assertEqual(repr(inner), "TorchFSDPPatch(found torch patched already, replaced=[])")
            inner.undo()  # (the outermost patch undoes it)
            self.assertEqual(_classes(), [ShardedDataParallel, ShardedDataParallel])
            self.assertTrue(outer.active)
        self.assertFalse(outer.active)
        self.assertEqual(_classes(), [_TORCH[0], _TORCH[0]])
        outer.undo()  # a no-op the second time
        self.assertEqual(_classes(), [_TORCH[0], _TORCH[0]])

    def test_undo_leaves_a_name_rebound_since(self):
        patch = flatshard.patch_torch_fsdp()
        mine = type("Mine", (), {})
        torch_fsdp.FullyShardedDataParallel = mine
        patch.undo()
        self.assertIs(torch_fsdp.FullyShardedDataParallel, mine)
        self.assertIs(torch_fsdp_module.FullyShardedDataParallel, _TORCH[0])


def _framework_style_build(rank, world_size):
    """What a framework does after the patch: torch's names, torch's configuration objects and
    policy, ``isinstance`` against torch's name, ``FSDP.fsdp_modules``, the private attributes;
    training equals one process."""
    import torch.distributed.fsdp.wrap as torch_wrap

    with flatshard.patch_torch_fsdp():
        FSDP = torch_fsdp.FullyShardedDataParallel  # what the framework reads, at run time
        model = FSDP(
            build(),
            sharding_strategy=torch_fsdp.ShardingStrategy.FULL_SHARD,
            auto_wrap_policy=functools.partial(torch_wrap.transformer_auto_wrap_policy, transformer_layer_cls={Block}),
            backward_prefetch=torch_fsdp.BackwardPrefetch.BACKWARD_PRE,
            mixed_precision=None,
            cpu_offload=torch_fsdp.CPUOffload(offload_params=False),
            limit_all_gathers=True,
            use_orig_params=False,
        )
        units = FSDP.fsdp_modules(model)
        facts = {
            "isinstance": isinstance(model, FSDP),
            "units": len(units),
            "has_params": [u._has_params for u in units],
            "fqns": list(units[1]._flat_param._fqns),
            "flattened": all(getattr(p, "_fsdp_flattened", False) for p in model.parameters()),
            "orig_dtype": str(units[0]._handle._orig_param_dtype),
        }
        losses = _train(model, world_size, 3, 1, rank)
        with FSDP.state_dict_type(model, torch_fsdp.StateDictType.FULL_STATE_DICT, torch_fsdp.FullStateDictConfig(rank0_only=False)):
            state = model.state_dict()
    return facts, (losses, full_params(model)), sorted(state)[:2]


def _upcast_like_accelerate(rank, world_size):
    """accelerate's mixed-precision upcast of a model loaded in bf16: rebind the
    FlatParameter's ``.data`` to float32, then write ``_handle._orig_param_dtype``. Training
    then equals one process training the bf16 weights cast to float32."""
    plain = build().to(torch.bfloat16).float()
    model = ShardedDataParallel(build().to(torch.bfloat16), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}))
    for unit in ShardedDataParallel.fsdp_modules(model):
        param = unit._flat_param
        if unit._has_params and param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)
            unit._handle._orig_param_dtype = torch.float32
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    losses = _train(model, world_size, 3, 1, rank)
    plain_losses = _train(plain, world_size, 3, 1, None)
    return dtypes, (losses, full_params(model)), (plain_losses, {n: p.detach().clone() for n, p in plain.named_parameters(remove_duplicate=False)})


def _surface_errors(rank, world_size):
    """A unit with frozen and trainable parameters (LoRA beside a frozen base) gives its trainable
    FlatParameter, which accelerate's upcast acts on; one with two trainable dtypes raises."""
    model = build(frozen_blocks=[0])
    model.blocks[0].fc1.weight.requires_grad_(True)  # block 0: frozen and trainable parameters in one unit
    model.blocks[1].fc2.double()  # block 1: two trainable dtypes
    wrapped = ShardedDataParallel(model, auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}), use_orig_params=True)
    mixed = wrapped.module.blocks[0]
    given = (mixed._flat_param is mixed._handle.flat_param, mixed._flat_param.requires_grad, list(mixed._flat_param._fqns))
    two_dtypes = wrapped.module.blocks[1]
    messages = [error_text(lambda: two_dtypes._flat_param, ValueError), error_text(lambda: two_dtypes._handle, ValueError)]
    handle = ShardedDataParallel.fsdp_modules(wrapped)[0]._handle
    messages.append(error_text(lambda: setattr(handle, "_orig_param_dtype", torch.float64), ValueError))
    return given, messages


def _second_fsdp(rank, world_size):
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import fully_shard

    model = ShardedDataParallel(build(), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}))
    messages = [
        error_text(lambda: _TORCH[0](model, device_id=torch.device("cpu")), flatshard.frameworks.RewrapError),
        error_text(lambda: _TORCH[0](torch.nn.Sequential(model), device_id=torch.device("cpu")), ValueError),
        error_text(lambda: fully_shard(model.module.blocks[1].module.fc1), ValueError),
        error_text(lambda: fully_shard(model), ValueError),
    ]
    checkpoint(model.module.blocks[0].module.fc2)  # other composable APIs are let through
    # a composable API applied before wrapping keeps working, and fully_shard is still refused there
    early = build()
    checkpoint(early.blocks[1].fc1)
    early = ShardedDataParallel(early, auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}))
    early(torch.zeros(2, 4, dtype=torch.long)).sum().backward()
    messages.append(error_text(lambda: fully_shard(early.module.blocks[1].module.fc1), ValueError))
    # torch FSDP1 wrapping a module inside a unit on its own: the first forward refuses
    inner = ShardedDataParallel(build(), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}))
    inner.module.blocks[0].module.norm.__dict__["_is_fsdp_managed_module"] = True  # (what torch's constructor writes)
    messages.append(error_text(lambda: inner(torch.zeros(2, 4, dtype=torch.long)), ValueError))
    return messages


def _upcast_after_wrapping(rank, world_size, case):
    """accelerate's bf16 upcast through ``_flat_param`` / ``_handle`` of a model loaded in bf16,
    under mixed precision in bf16. ``frozen``: LoRA, frozen and trainable parameters in one unit
    (two FlatParameters). ``no_shard``: NO_SHARD, where the FlatParameter was the full flat
    tensor until the cast. Training equals the same model upcast before wrapping, bit for bit
    (the computation is in bf16 either way; frozen parameters keep their values). A second
    upcast after the first forward is refused."""
    from flatshard import MixedPrecision, ShardingStrategy

    def made(upcast_first):
        model = build(frozen_blocks=(0, 1) if case == "frozen" else ())
        if case == "frozen":
            for block in model.blocks[:2]:
                block.fc1.weight.requires_grad_(True)  # the "adapter" beside a frozen base
        model.to(torch.bfloat16)
        if upcast_first:
            model.float()
        strategy = ShardingStrategy.NO_SHARD if case == "no_shard" else ShardingStrategy.FULL_SHARD
        return ShardedDataParallel(model, auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}), use_orig_params=case == "frozen",
                                   sharding_strategy=strategy,
                                   mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16, cast_forward_inputs=True))

    model, reference = made(False), made(True)
    for unit in ShardedDataParallel.fsdp_modules(model):  # accelerator.py:2000-2038, as written there
        if not unit._has_params:
            continue
        param = unit._flat_param
        if param.dtype != torch.float32 and param.requires_grad:
            param.data = param.data.to(torch.float32)
            unit._handle._orig_param_dtype = torch.float32
    trainable = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
    losses, params = _train(model, world_size, 3, 1, rank), full_params(model)
    ref_losses, ref_params = _train(reference, world_size, 3, 1, rank), full_params(reference)
    same = losses == ref_losses and all(torch.equal(params[n].float(), ref_params[n].float()) for n in ref_params)
    again = ShardedDataParallel(build().to(torch.bfloat16))
    _train(again, world_size, 1, 1, rank)
    param = again._flat_param
    param.data = param.data.float()
    late = error_text(lambda: setattr(again._handle, "_orig_param_dtype", torch.float32), NotImplementedError)
    return trainable, same, late[late.index(" after the model"):]


class FrameworkSurfaceTest(TestCase):
    def test_a_framework_style_build_after_the_patch_trains_like_one_process(self):
        results = self.pool.run(_framework_style_build, 2)
        facts, trained, keys = results[0]
        self.assertEqual(facts, {
            "isinstance": True, "units": 4, "has_params": [True, True, True, True],
            "fqns": ["norm.weight", "norm.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"],
            "flattened": True, "orig_dtype": "torch.float32",
        })
        assert_same_training(train_reference(2, steps=3), trained)
        self.assertEqual(keys, ["blocks.0.fc1.bias", "blocks.0.fc1.weight"])

    def test_accelerates_upcast_through_orig_param_dtype(self):
        dtypes, trained, reference = self.pool.run(_upcast_like_accelerate, 2)[0]
        self.assertEqual(dtypes, ["torch.float32"])
        assert_same_training(reference, trained)

    def test_accelerates_upcast_beside_frozen_parameters_and_without_sharding(self):
        for case in ("frozen", "no_shard"):
            with self.subTest(case=case):
                trainable, same, late = self.pool.run(_upcast_after_wrapping, 2, case)[0]
                self.assertEqual(trainable, ["torch.float32"])
                self.assertTrue(same)
                self.assertEqual(late, " after the model's first forward is not supported (accelerate writes it in prepare_model, before training, accelerator.py:2038): cast before the first forward")

    def test_a_unit_with_several_flat_parameters_says_why(self):
        given, messages = self.pool.run(_surface_errors, 2)[0]
        self.assertEqual(given, (True, True, ["fc1.weight"]))
        self.assertExpectedInline("\n".join(messages), """\
_flat_param of unit 'blocks.1': FSDP1 has one FlatParameter per wrapper, in one dtype; this unit has 2 (torch.float32 requires_grad=True, torch.float64 requires_grad=True), so there is no one FlatParameter to give. Use .handles; code written for FSDP1 that reads _flat_param (accelerate's prepare_model under mixed precision, accelerator.py:2022) needs each unit's trainable parameters to share one dtype
_handle of unit 'blocks.1': FSDP1 has one FlatParameter per wrapper, in one dtype; this unit has 2 (torch.float32 requires_grad=True, torch.float64 requires_grad=True), so there is no one FlatParameter to give. Use .handles; code written for FSDP1 that reads _handle (accelerate's prepare_model under mixed precision, accelerator.py:2022) needs each unit's trainable parameters to share one dtype
[rank 0] _orig_param_dtype = torch.float64 for the FlatParameter (torch.float32, requires_grad=True: embed.weight (13, 8), norm.weight (8,), norm.bias (8,), head.weight = embed.weight): its .data is torch.float32; rebind the FlatParameter's .data to torch.float64 first (as accelerate does)""")

    def test_a_second_fsdp_is_refused_naming_the_patch(self):
        messages = self.pool.run(_second_fsdp, 2)[0]
        self.assertExpectedInline("\n".join(messages), """\
torch's FullyShardedDataParallel is wrapping a model that holds a flatshard ShardedDataParallel: a model must not be sharded twice. Call flatshard.patch_torch_fsdp() before the framework runs (it makes torch's FullyShardedDataParallel flatshard's), or pass the framework the unwrapped model
torch's FullyShardedDataParallel is wrapping a model that holds a flatshard ShardedDataParallel: a model must not be sharded twice. Call flatshard.patch_torch_fsdp() before the framework runs (it makes torch's FullyShardedDataParallel flatshard's), or pass the framework the unwrapped model
torch's fully_shard() was applied to 'blocks.1.fc1' (Linear), which flatshard already shards: a model must not be sharded twice. flatshard takes FSDP1's place only: choose FSDP version 1 in the framework (Trainer: fsdp_config={'version': 1}; accelerate: fsdp_version=1) and call flatshard.patch_torch_fsdp() before it runs, or pass the framework the unwrapped model
torch's fully_shard() was applied to the model (ShardedDataParallel), which flatshard already shards: a model must not be sharded twice. flatshard takes FSDP1's place only: choose FSDP version 1 in the framework (Trainer: fsdp_config={'version': 1}; accelerate: fsdp_version=1) and call flatshard.patch_torch_fsdp() before it runs, or pass the framework the unwrapped model
torch's fully_shard() was applied to 'blocks.1.fc1' (Linear), which flatshard already shards: a model must not be sharded twice. flatshard takes FSDP1's place only: choose FSDP version 1 in the framework (Trainer: fsdp_config={'version': 1}; accelerate: fsdp_version=1) and call flatshard.patch_torch_fsdp() before it runs, or pass the framework the unwrapped model
'blocks.0.norm' (LayerNorm), inside a flatshard model, was wrapped by another FSDP implementation (torch's FullyShardedDataParallel marked it): a model must not be sharded twice. Call flatshard.patch_torch_fsdp() before the framework runs (it makes torch's FullyShardedDataParallel flatshard's), or pass the framework the unwrapped model""")


def _signatures(rank, world_size):
    model = ShardedDataParallel(build(), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}))
    block = model.module.blocks[0]
    wrapped_calls = model(torch.zeros(2, 4, dtype=torch.long)).shape
    return [str(inspect.signature(model.forward)), str(inspect.signature(block.forward)), str(inspect.signature(ShardedDataParallel.forward)), tuple(wrapped_calls)]


class ForwardSignatureTest(TestCase):
    def test_the_wrappers_forward_shows_the_wrapped_modules_signature(self):
        plain = [str(inspect.signature(build().forward)), str(inspect.signature(build().blocks[0].forward))]
        shown = self.pool.run(_signatures, 2)[0]
        self.assertEqual(shown[:2], plain)
        self.assertEqual(shown[2], "(self, *args: 'Any', **kwargs: 'Any') -> 'Any'")

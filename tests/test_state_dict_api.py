"""torch's state-dict API (``torch.distributed.checkpoint.state_dict``) on flatshard models,
through ``flatshard.state_dict``: the same dicts as torch's functions give for the unwrapped
model trained the same steps, sharded checkpoints with ``torch.distributed.checkpoint`` resumed
at other world sizes, full dicts loaded with ``broadcast_from_rank0``, several optimizers, a
torch FSDP1 checkpoint loaded, errors.

Truth is single-process training of the unwrapped model (AdamW, two param groups) on the global
batch, as in ``test_optim_state``."""

import os
import shutil
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as torch_sd
import torch.distributed.fsdp as torch_fsdp
from expecttest import TestCase
from torch.distributed.tensor import DTensor

import flatshard
from flatshard import ModuleWrapPolicy, ShardedDataParallel
from flatshard._checkpoint._checkpointing import full_value
from flatshard.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from tests._models import Block, batch, build, error_text, guarded_comm, lm_loss

GLOBAL_ROWS = 12
K = 2
TOL = dict(rtol=1e-5, atol=1e-6)
FULL = StateDictOptions(full_state_dict=True)
SHARDED = StateDictOptions()


def _wrapped(seed=0, orig=False):
    return ShardedDataParallel(build(seed), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=orig)


def _groups(named):
    """Two param groups: the blocks (own learning rate) and the rest, each in model order."""
    named = [(n.replace("_fsdp_wrapped_module.", ""), p) for n, p in named]
    return [
        {"params": [p for n, p in named if not n.startswith("blocks.")]},
        {"params": [p for n, p in named if n.startswith("blocks.")], "lr": 0.02},
    ]


def _adamw(model):
    return torch.optim.AdamW(_groups(model.named_parameters()), lr=1e-2, weight_decay=0.05)


def _step(model, optims, step, rank=None, world_size=1):
    tokens, targets = batch(step, 1, per_rank=GLOBAL_ROWS)
    if rank is not None:
        rows = GLOBAL_ROWS // world_size
        tokens, targets = tokens[rank * rows : (rank + 1) * rows], targets[rank * rows : (rank + 1) * rows]
    lm_loss(model(tokens), targets).backward()
    for optim in optims:
        optim.step()
        optim.zero_grad()


def _reference(steps):
    plain = build(0)
    optim = _adamw(plain)
    for step in range(steps):
        _step(plain, [optim], step)
    return plain, optim


def _trained(rank, world_size, seed=0, orig=False):
    model = _wrapped(seed, orig)
    optim = _adamw(model)
    for step in range(K):
        _step(model, [optim], step, rank, world_size)
    return model, optim


def _full(value):
    """A DTensor's full value. (Not ``full_tensor()``: in the pool's long-lived processes, after
    earlier tests' process groups, torch's functional collectives can look up a stale group name.)"""
    return full_value(value, guarded_comm()) if isinstance(value, DTensor) else value


def _assert_same(actual, expected, where):
    """Nested dicts / lists with the same keys in the same order and close tensor values."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or list(actual) != list(expected):
            raise AssertionError(f"{where}: keys {list(actual) if isinstance(actual, dict) else actual!r} vs {list(expected)}")
        for key in expected:
            _assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)) and any(isinstance(e, (dict, list, torch.Tensor)) for e in expected):
        if len(actual) != len(expected):
            raise AssertionError(f"{where}: {len(actual)} items vs {len(expected)}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        torch.testing.assert_close(_full(actual), expected, **TOL, msg=lambda m: f"{where}: {m}")
    elif actual != expected:
        raise AssertionError(f"{where}: {actual!r} vs {expected!r}")


def _assert_params(model, plain, where):
    with ShardedDataParallel.summon_full_params(model):
        actual = {name: param.detach().clone() for name, param in model.named_parameters()}
    for name, expected in plain.named_parameters():
        torch.testing.assert_close(actual[name], expected, **TOL, msg=lambda m: f"{where}: {name}: {m}")


# -- the same dicts as torch's functions on the unwrapped model -----------------------------


def _same_as_torch(rank, world_size, orig=False):
    model, optim = _trained(rank, world_size, orig=orig)
    plain, plain_optim = _reference(K)
    expected_model = torch_sd.get_model_state_dict(plain, options=FULL)
    expected_optim = torch_sd.get_optimizer_state_dict(plain, plain_optim, options=FULL)
    for options in (FULL, SHARDED):
        where = "full" if options.full_state_dict else "sharded"
        model_state, optim_state = get_state_dict(model, optim, options=options)
        _assert_same(model_state, expected_model, f"{where} model")
        _assert_same(optim_state, expected_optim, f"{where} optimizer")
        _assert_same(get_model_state_dict(model, options=options), expected_model, f"{where} get_model_state_dict")
        _assert_same(get_optimizer_state_dict(model, optim, options=options), expected_optim, f"{where} get_optimizer_state_dict")
    sharded_kinds = {type(v).__name__ for v in get_model_state_dict(model).values()}
    sharded_optim = get_optimizer_state_dict(model, optim)["state"]["blocks.0.fc1.weight"]
    offloaded = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        _assert_same(offloaded, (expected_model, expected_optim), "full, cpu_offload")
    elif offloaded != ({}, {}):
        raise AssertionError(f"full_state_dict with cpu_offload: rank {rank} got {offloaded}")
    flat = get_optimizer_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    expected_flat = torch_sd.get_optimizer_state_dict(plain, plain_optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    _assert_same(flat, expected_flat, "flattened optimizer state")
    return sorted(sharded_kinds), type(sharded_optim["exp_avg"]).__name__, type(sharded_optim["step"]).__name__


def _frozen_and_submodules(rank, world_size):
    """``ignore_frozen_params`` and the deprecated ``submodules`` as torch gives them."""
    plain = build(0)
    model = ShardedDataParallel(build(0), auto_wrap_policy=ModuleWrapPolicy({Block}))
    for module in (plain, model):
        for name, param in module.named_parameters():
            if "blocks.1." in name.replace("_fsdp_wrapped_module.", ""):
                param.requires_grad_(False)
    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True)
    _assert_same(get_model_state_dict(model, options=options), torch_sd.get_model_state_dict(plain, options=options), "ignore_frozen_params")
    results = []
    for keep in (True, False):
        options = StateDictOptions(full_state_dict=True, keep_submodule_prefixes=keep)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours = get_model_state_dict(model, submodules={model.blocks[0]}, options=options)
            theirs = torch_sd.get_model_state_dict(plain, submodules={plain.blocks[0]}, options=options)
        _assert_same(ours, theirs, f"submodules, keep_submodule_prefixes={keep}")
        results.append((list(ours)[:2], sum(issubclass(w.category, FutureWarning) for w in caught)))
    return results


# -- sharded checkpoints with torch.distributed.checkpoint ----------------------------------


def _save_sharded(rank, world_size, directory, orig=False):
    model, optim = _trained(rank, world_size, orig=orig)
    model_state, optim_state = get_state_dict(model, optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    return True


def _resume_sharded(rank, world_size, directory, orig=False):
    """A fresh model and optimizer take the checkpoint through get_state_dict's template,
    dcp.load and set_state_dict, train K more steps: as 2K uninterrupted single-process steps."""
    model = _wrapped(seed=7, orig=orig)
    optim = _adamw(model)
    model_state, optim_state = get_state_dict(model, optim)
    if len(optim.state) != 0 or len(optim_state["state"]) != 21:
        raise AssertionError("the template must be complete and leave the optimizer as it was")
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory)
    result = set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for step in range(K, 2 * K):
        _step(model, [optim], step, rank, world_size)
    plain, _ = _reference(2 * K)
    _assert_params(model, plain, f"resumed at world size {world_size}")
    return tuple(result)


# -- full dicts ----------------------------------------------------------------------------


def _full_round_trips(rank, world_size, orig=False):
    """Full dicts (rank 0's only with cpu_offload) loaded with broadcast_from_rank0, and on
    every rank without it; the unwrapped model's dicts from torch's functions load too."""
    model, optim = _trained(rank, world_size, orig=orig)
    offload = StateDictOptions(full_state_dict=True, cpu_offload=True)
    on_rank0 = get_state_dict(model, optim, options=offload)
    everywhere = get_state_dict(model, optim, options=FULL)
    plain, plain_optim = _reference(K)
    from_torch = torch_sd.get_state_dict(plain, plain_optim, options=FULL)
    sources = {
        "broadcast_from_rank0": (on_rank0, StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)),
        "full on every rank": (everywhere, FULL),
        "cpu_offload on rank 0 (optimizer), full (model)": ((everywhere[0], on_rank0[1]), offload),
        "torch's, broadcast_from_rank0": (from_torch if rank == 0 else ({}, {}), StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)),
    }
    for where, ((model_state, optim_state), options) in sources.items():
        target = _wrapped(seed=5, orig=orig)
        target_optim = _adamw(target)
        set_state_dict(target, target_optim, model_state_dict=model_state, optim_state_dict=optim_state, options=options)
        for step in range(K, 2 * K):
            _step(target, [target_optim], step, rank, world_size)
        reference, _ = _reference(2 * K)
        _assert_params(target, reference, where)
    # ... and flatshard's full dicts load into the unwrapped model with torch's functions.
    other = build(3)
    other_optim = _adamw(other)
    torch_sd.set_state_dict(other, other_optim, model_state_dict=everywhere[0], optim_state_dict=everywhere[1], options=FULL)
    for step in range(K, 2 * K):
        _step(other, [other_optim], step)
    reference, _ = _reference(2 * K)
    for (name, expected), (_, actual) in zip(reference.named_parameters(), other.named_parameters()):
        torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"flatshard -> plain: {name}: {m}")
    return sorted(sources)


def _two_optimizers(rank, world_size, directory):
    """One optimizer per param group: the combined dict equals torch's for the same two
    optimizers on the unwrapped model, and a sharded checkpoint of it resumes."""
    def make(module):
        return [torch.optim.AdamW([group], lr=1e-2, weight_decay=0.05) for group in _groups(module.named_parameters())]

    model = _wrapped()
    optims = make(model)
    plain = build(0)
    plain_optims = make(plain)
    for step in range(K):
        _step(model, optims, step, rank, world_size)
        _step(plain, plain_optims, step)
    _assert_same(get_optimizer_state_dict(model, optims, options=FULL), torch_sd.get_optimizer_state_dict(plain, plain_optims, options=FULL), "two optimizers")
    model_state, optim_state = get_state_dict(model, optims)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    target = _wrapped(seed=9)
    target_optims = make(target)
    model_state, optim_state = get_state_dict(target, target_optims)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(target, state["model"])
    set_optimizer_state_dict(target, target_optims, state["optim"])
    for step in range(K, 2 * K):
        _step(target, target_optims, step, rank, world_size)
        _step(plain, plain_optims, step)
    _assert_params(target, plain, "two optimizers, resumed")
    return True


# -- torch FSDP1 -----------------------------------------------------------------------------


def _fsdp1_save(rank, world_size, directory):
    """torch FSDP1, saved through torch's own state-dict API (sharded) and dcp.save."""
    warnings.filterwarnings("ignore")
    model = torch_fsdp.FullyShardedDataParallel(build(0), auto_wrap_policy=torch_fsdp.wrap.ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    optim = _adamw(model)
    for step in range(K):
        _step(model, [optim], step, rank, world_size)
    model_state, optim_state = torch_sd.get_state_dict(model, optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    return True


# -- errors ----------------------------------------------------------------------------------


def _fqn_modifiers(rank, world_size):
    model, optim = _trained(rank, world_size)
    options = StateDictOptions(dsd_fqn_modifiers="_fqn_modifiers_of_my_own")
    calls = (lambda: get_model_state_dict(model, options=options), lambda: get_optimizer_state_dict(model, optim, options=options))
    return [f"NotImplementedError: {error_text(call, NotImplementedError)}" for call in calls]


def _errors(rank, world_size):
    model, optim = _trained(rank, world_size)
    full_model, full_optim = get_state_dict(model, optim, options=FULL)
    out = []

    def expect(call):
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the messages are the result
            out.append(f"{type(exc).__name__}: {exc}".replace(f"[rank {rank}] ", ""))
            return
        out.append("no error")

    expect(lambda: get_model_state_dict(model, options={"full_state_dict": True}))
    expect(lambda: get_model_state_dict(model, options=StateDictOptions(broadcast_from_rank0=True)))
    expect(lambda: get_model_state_dict(model, options=StateDictOptions(strict=1)))
    expect(lambda: get_optimizer_state_dict(model, []))
    expect(lambda: get_optimizer_state_dict(model, [optim, "sgd"]))
    expect(lambda: set_model_state_dict(model, [("pos", 1)]))
    missing = {k: v for k, v in full_model.items() if k != "pos"}
    expect(lambda: set_model_state_dict(model, missing, options=FULL))
    result = set_model_state_dict(model, missing, options=StateDictOptions(full_state_dict=True, strict=False))
    out.append(f"strict=False: {result}")
    no_state = {"state": {k: v for k, v in full_optim["state"].items() if k != "blocks.1.fc2.bias"}, "param_groups": full_optim["param_groups"]}
    expect(lambda: set_optimizer_state_dict(model, optim, no_state, options=FULL))
    expect(lambda: set_optimizer_state_dict(model, optim, {}, options=FULL))
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    expect(lambda: set_model_state_dict(model, full_model if rank else {}, options=broadcast))
    sharded_model = get_model_state_dict(model)
    expect(lambda: set_model_state_dict(model, {} if rank else sharded_model, options=broadcast))
    expect(lambda: set_optimizer_state_dict(model, optim, {} if rank else no_state, options=broadcast))
    # Only rank 0 has the dict, but the options say every rank has it: an error, not a hang.
    expect(lambda: set_model_state_dict(model, {} if rank else full_model, options=FULL))
    expect(lambda: set_optimizer_state_dict(model, optim, {} if rank else full_optim, options=FULL))
    return out


def _unwrapped_models_use_torch(rank, world_size):
    """A model without flatshard units: torch's functions, unchanged."""
    plain, optim = _reference(K)
    for options in (FULL, SHARDED):
        _assert_same(get_state_dict(plain, optim, options=options), torch_sd.get_state_dict(plain, optim, options=options), "plain model")
    model_state, optim_state = get_state_dict(plain, optim)
    set_state_dict(plain, optim, model_state_dict=model_state, optim_state_dict=optim_state)
    return True


class StateDictApiTest(TestCase):
    def setUp(self):
        self.directory = tempfile.mkdtemp(prefix="flatshard-sdapi-")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def test_same_dicts_as_torchs_functions_on_the_unwrapped_model(self):
        kinds, exp_avg, step = self.pool.run(_same_as_torch, 2)[0]
        self.assertEqual((kinds, exp_avg, step), (["DTensor", "Tensor"], "DTensor", "Tensor"))  # buffers stay plain

    def test_frozen_parameters_and_submodules(self):
        (keep, keep_warnings), (strip, strip_warnings) = self.pool.run(_frozen_and_submodules, 2)[0]
        self.assertEqual(keep, ["blocks.0.norm.weight", "blocks.0.norm.bias"])
        self.assertEqual(strip, ["norm.weight", "norm.bias"])
        self.assertEqual((keep_warnings, strip_warnings), (2, 2))  # torch's and ours: deprecated

    def test_sharded_checkpoint_resumes_at_other_world_sizes(self):
        for saved_at, resumed_at in ((2, 2), (2, 1), (2, 3), (3, 2)):
            with self.subTest(saved_at=saved_at, resumed_at=resumed_at):
                directory = os.path.join(self.directory, f"{saved_at}-{resumed_at}")
                self.pool.run(_save_sharded, saved_at, directory)
                results = self.pool.run(_resume_sharded, resumed_at, directory)
                self.assertEqual(results[0], ([], []))

    def test_original_parameters(self):
        """use_orig_params=True: the same dicts as torch's on the unwrapped model, sharded
        checkpoints resume at another world size (also into the other mode), full round trips."""
        kinds, exp_avg, step = self.pool.run(_same_as_torch, 2, True)[0]
        self.assertEqual((kinds, exp_avg, step), (["DTensor", "Tensor"], "DTensor", "Tensor"))
        for saved_orig, resumed_orig in ((True, True), (False, True), (True, False)):
            with self.subTest(saved_orig=saved_orig, resumed_orig=resumed_orig):
                directory = os.path.join(self.directory, f"orig-{saved_orig}-{resumed_orig}")
                self.pool.run(_save_sharded, 2, directory, saved_orig)
                self.assertEqual(self.pool.run(_resume_sharded, 3, directory, resumed_orig)[0], ([], []))
        self.assertEqual(len(self.pool.run(_full_round_trips, 2, True)[0]), 4)

    def test_full_dicts_with_and_without_broadcast_from_rank0(self):
        self.assertEqual(len(self.pool.run(_full_round_trips, 2)[0]), 4)

    def test_several_optimizers(self):
        self.pool.run(_two_optimizers, 2, self.directory)

    def test_torch_fsdp1_checkpoint_loads(self):
        self.pool.run(_fsdp1_save, 2, self.directory)
        for resumed_at in (2, 3):
            with self.subTest(resumed_at=resumed_at):
                self.pool.run(_resume_sharded, resumed_at, self.directory)

    def test_dsd_fqn_modifiers_other_than_the_default_are_not_supported(self):
        messages = self.pool.run(_fqn_modifiers, 2)
        self.assertEqual(messages[0], messages[1])
        self.assertExpectedInline("\n".join(messages[0]), """\
NotImplementedError: get_model_state_dict: StateDictOptions.dsd_fqn_modifiers other than the default is not supported on ShardedDataParallel models
NotImplementedError: get_optimizer_state_dict: StateDictOptions.dsd_fqn_modifiers other than the default is not supported on ShardedDataParallel models""")

    def test_errors(self):
        messages = self.pool.run(_errors, 2)[0]
        self.assertExpectedInline("\n".join(messages), """\
TypeError: get_model_state_dict: options must be a StateDictOptions (from flatshard.state_dict) or None; got dict
ValueError: get_model_state_dict: broadcast_from_rank0=True needs full_state_dict=True (rank 0 holds the full state dict)
TypeError: get_model_state_dict: StateDictOptions.strict must be a bool; got 1
RuntimeError: get_optimizer_state_dict: no optimizers were passed
TypeError: get_optimizer_state_dict: optimizers must be torch.optim.Optimizers; got str
TypeError: set_model_state_dict: model_state_dict must be a dict keyed by FQNs; got list
RuntimeError: Error(s) in loading state_dict for TinyLM:
	Missing key(s) in state_dict: "pos". 
strict=False: _IncompatibleKeys(missing_keys=['pos'], unexpected_keys=[])
RuntimeError: set_optimizer_state_dict: the state dict has no optimizer state for parameter 'blocks.1.fc2.bias', which requires gradients; pass StateDictOptions(strict=False) to load it anyway
RuntimeError: set_optimizer_state_dict: the optimizer state dict is empty; pass it on every rank (or on rank 0 with broadcast_from_rank0)
ValueError: set_model_state_dict(broadcast_from_rank0=True): rank 0 must pass the full model state dict; got an empty dict
ValueError: set_model_state_dict(broadcast_from_rank0=True): rank 0's state dict must hold full tensors, but 'embed.weight' is a DTensor
RuntimeError: set_optimizer_state_dict: the state dict has no optimizer state for parameter 'blocks.1.fc2.bias', which requires gradients; pass StateDictOptions(strict=False) to load it anyway
RuntimeError: load_state_dict failed on rank 1:
Error(s) in loading state_dict for TinyLM:
	Missing key(s) in state_dict: "pos", "embed.weight", "blocks.0.norm.weight", "blocks.0.norm.bias", "blocks.0.fc1.weight", "blocks.0.fc1.bias", "blocks.0.fc2.weight", "blocks.0.fc2.bias", "blocks.1.norm.weight", "blocks.1.norm.bias", "blocks.1.fc1.weight", "blocks.1.fc1.bias", "blocks.1.fc2.weight", "blocks.1.fc2.bias", "blocks.2.norm.weight", "blocks.2.norm.bias", "blocks.2.fc1.weight", "blocks.2.fc1.bias", "blocks.2.fc2.weight", "blocks.2.fc2.bias", "norm.weight", "norm.bias", "head.weight". 
RuntimeError: set_optimizer_state_dict (on rank 1): the optimizer state dict is empty; pass it on every rank (or on rank 0 with broadcast_from_rank0)""")

    def test_models_without_units_use_torchs_functions(self):
        self.pool.run(_unwrapped_models_use_torch, 2)

    def test_exported_from_flatshard(self):
        for name in flatshard.state_dict.__all__:
            self.assertIs(getattr(flatshard, name), getattr(flatshard.state_dict, name))
            self.assertIn(name, flatshard.__all__)
        self.assertIs(StateDictOptions, torch_sd.StateDictOptions)


def test_same_names_and_signatures_as_torchs_functions():
    import inspect

    assert set(flatshard.state_dict.__all__) == {"StateDictOptions"} | {
        name for name in torch_sd.__all__ if name.startswith(("get_", "set_"))
    }
    for name in flatshard.state_dict.__all__:
        if name == "StateDictOptions":
            continue
        theirs = inspect.signature(getattr(torch_sd, name)).parameters
        ours = inspect.signature(getattr(flatshard.state_dict, name)).parameters
        assert [(p.name, p.kind, p.default) for p in ours.values()] == [(p.name, p.kind, p.default) for p in theirs.values()], name

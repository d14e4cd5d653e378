"""State dicts of models with transparent wrappers in them (issue 28, item 9).

Activation checkpointing (torch's ``checkpoint_wrapper``, ``_checkpoint_wrapped_module``) and
``torch.compile`` of a submodule (an ``OptimizedModule``, ``_orig_mod``), put in before or after
wrapping, and flatshard's own ``_fsdp_wrapped_module``, must not show in any name a state-dict
function gives or takes (see [Note: wrapper prefixes] in ``flatshard/_checkpoint/_plain_view.py``).

A matrix of function x wrapper kind x ``use_orig_params``:

- the keys each function gives are exactly those torch's own
  ``torch.distributed.checkpoint.state_dict`` functions give for the unwrapped, uncheckpointed,
  uncompiled model (LOCAL state dicts: those of the model wrapped without the other wrappers);
- what it saves from a trained model with the wrappers loads into a fresh model without them,
  and the reverse, and the loaded values are the trained ones (single-process training of the
  unwrapped model on the global batch, as in ``test_state_dict_api``).

Each (kind, ``use_orig_params``) runs once on two ranks; the tests read its results. Besides:
``torch.compile(model)`` around the root given to the functions that take the model, and
(pure) ``clean_name`` and ``rekey_optim_state_dict`` on plain models with the wrappers.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as torch_sd
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing, checkpoint_wrapper
from torch.distributed.tensor import DTensor

from flatshard import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ModuleWrapPolicy,
    OptimStateKeyType,
    ShardedDataParallel,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from flatshard._checkpoint._checkpointing import full_value
from flatshard._base._common import clean_name
from flatshard.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from tests._models import Block, batch, build, guarded_comm, lm_loss, local

TOL = dict(rtol=1e-5, atol=1e-6)
FULL = StateDictOptions(full_state_dict=True)
SHARDED = StateDictOptions()
FLATTENED = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
SEED, OTHER_SEED = 0, 7  # the trained model's, the fresh model's (different values)

# none: flatshard's wrappers only; checkpoint-after: the llama-recipes flow (wrap, then
# apply_activation_checkpointing on the blocks: a unit wraps a CheckpointWrapper);
# checkpoint-before: the blocks checkpoint-wrapped, then wrapped (the wrapper holds a unit);
# compile-after / compile-before: a submodule of each block replaced by torch.compile of it
# after / before wrapping; stacked: checkpoint-before and compile-before together.
KINDS = ["none", "checkpoint-after", "checkpoint-before", "compile-after", "compile-before", "stacked"]


def _compile_unavailable() -> Optional[str]:
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile (dynamo) is not supported on this Python"
    return None


def _skip_without_compile(kind: str) -> None:
    """In the test process: skip a kind that compiles where torch.compile cannot run."""
    reason = _compile_unavailable() if kind in ("compile-after", "compile-before", "stacked", "compile-root") else None
    if reason is not None:
        pytest.skip(reason)


def _prepared(seed: int, kind: str) -> nn.Module:
    net = build(seed)
    for index, block in enumerate(net.blocks):
        if kind in ("compile-before", "stacked"):
            block.fc1 = torch.compile(block.fc1, backend="eager")  # (eager: no C compiler needed)
        if kind in ("checkpoint-before", "stacked"):
            net.blocks[index] = checkpoint_wrapper(block)
    return net


def _wrapped(seed: int, kind: str, orig: bool) -> ShardedDataParallel:
    model = ShardedDataParallel(_prepared(seed, kind), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=orig)
    if kind == "checkpoint-after":
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: isinstance(m, Block))
    elif kind == "compile-after":
        for unit in model.module.blocks:
            unit.module.norm = torch.compile(unit.module.norm, backend="eager")
    return model


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)


def _trained(rank: int, world_size: int, kind: str, orig: bool) -> Tuple[ShardedDataParallel, torch.optim.Optimizer]:
    model = _wrapped(SEED, kind, orig)
    optim = _adamw(model)
    tokens, targets = batch(0, world_size)
    lm_loss(model(local(tokens, rank)), local(targets, rank)).backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _reference(world_size: int) -> Tuple[nn.Module, torch.optim.Optimizer]:
    plain = build(SEED)
    optim = _adamw(plain)
    tokens, targets = batch(0, world_size)
    lm_loss(plain(tokens), targets).backward()
    optim.step()
    return plain, optim


# -- the functions under test: how each saves and loads ---------------------------------------


def _typed(model: nn.Module, kind: StateDictType, rank0_only: bool = False) -> Any:
    configs = {
        StateDictType.FULL_STATE_DICT: (FullStateDictConfig(), FullOptimStateDictConfig(rank0_only=rank0_only)),
        StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig(), ShardedOptimStateDictConfig()),
        StateDictType.LOCAL_STATE_DICT: (None, None),
    }[kind]
    return ShardedDataParallel.state_dict_type(model, kind, *configs)


def _save_model(kind: StateDictType) -> Callable[..., Any]:
    def save(model: ShardedDataParallel, optim: torch.optim.Optimizer) -> Any:
        with _typed(model, kind):
            return model.state_dict()

    return save


def _load_model(kind: StateDictType) -> Callable[..., Any]:
    def load(model: ShardedDataParallel, optim: torch.optim.Optimizer, saved: Any) -> None:
        with _typed(model, kind):
            model.load_state_dict(saved)

    return load


def _save_optim(kind: StateDictType, rank0_only: bool = False) -> Callable[..., Any]:
    def save(model: ShardedDataParallel, optim: torch.optim.Optimizer) -> Any:
        with _typed(model, kind, rank0_only):
            return ShardedDataParallel.optim_state_dict(model, optim)

    return save


def _load_optim(kind: StateDictType, rank0_only: bool = False) -> Callable[..., Any]:
    def load(model: ShardedDataParallel, optim: torch.optim.Optimizer, saved: Any) -> None:
        with _typed(model, kind, rank0_only):
            ShardedDataParallel.optim_state_dict_to_load(model, optim, saved, load_directly=True)

    return load


def _loaded_by(convert: Callable[..., Dict[str, Any]]) -> Callable[..., Any]:
    """A load through a function returning ``optim.load_state_dict``'s input."""

    def load(model: ShardedDataParallel, optim: torch.optim.Optimizer, saved: Any) -> None:
        optim.load_state_dict(convert(saved, model, optim))

    return load


def _scatter(saved: Any, model: ShardedDataParallel, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    mine = saved if dist.get_rank() == 0 else None
    return ShardedDataParallel.scatter_full_optim_state_dict(mine, model, optim=optim)


def _shard(saved: Any, model: ShardedDataParallel, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    return ShardedDataParallel.shard_full_optim_state_dict(saved, model, optim=optim)


def _routed_save(model: ShardedDataParallel, optim: torch.optim.Optimizer) -> Any:
    return model.module.state_dict()  # (the wrapped module's own: the full state dict)


# name -> (what it holds: "model", "optim" or "both"; save(model, optim); load(model, optim, saved))
FUNCTIONS: Dict[str, Tuple[str, Callable[..., Any], Callable[..., Any]]] = {
    "state_dict[FULL]": ("model", _save_model(StateDictType.FULL_STATE_DICT), _load_model(StateDictType.FULL_STATE_DICT)),
    "state_dict[SHARDED]": ("model", _save_model(StateDictType.SHARDED_STATE_DICT), _load_model(StateDictType.SHARDED_STATE_DICT)),
    "state_dict[LOCAL]": ("local", _save_model(StateDictType.LOCAL_STATE_DICT), _load_model(StateDictType.LOCAL_STATE_DICT)),
    "module.state_dict": ("model", _routed_save, _load_model(StateDictType.FULL_STATE_DICT)),
    "optim_state_dict[FULL]": ("optim", _save_optim(StateDictType.FULL_STATE_DICT), _load_optim(StateDictType.FULL_STATE_DICT)),
    "optim_state_dict[FULL,rank0_only]": (
        "optim",
        _save_optim(StateDictType.FULL_STATE_DICT, rank0_only=True),
        _load_optim(StateDictType.FULL_STATE_DICT, rank0_only=True),
    ),
    "optim_state_dict[SHARDED]": ("optim", _save_optim(StateDictType.SHARDED_STATE_DICT), _load_optim(StateDictType.SHARDED_STATE_DICT)),
    "full_optim_state_dict+shard_full": (
        "optim",
        lambda model, optim: ShardedDataParallel.full_optim_state_dict(model, optim, rank0_only=False),
        _loaded_by(_shard),
    ),
    "full_optim_state_dict+scatter_full": (
        "optim",
        lambda model, optim: ShardedDataParallel.full_optim_state_dict(model, optim, rank0_only=True),
        _loaded_by(_scatter),
    ),
    "sharded_optim_state_dict+flatten_sharded": (
        "optim",
        ShardedDataParallel.sharded_optim_state_dict,
        _loaded_by(ShardedDataParallel.flatten_sharded_optim_state_dict),
    ),
    "get_model_state_dict[full]": (
        "model",
        lambda model, optim: get_model_state_dict(model, options=FULL),
        lambda model, optim, saved: set_model_state_dict(model, saved, options=FULL),
    ),
    "get_model_state_dict[sharded]": (
        "model",
        lambda model, optim: get_model_state_dict(model, options=SHARDED),
        lambda model, optim, saved: set_model_state_dict(model, saved, options=SHARDED),
    ),
    "get_optimizer_state_dict[full]": (
        "optim",
        lambda model, optim: get_optimizer_state_dict(model, optim, options=FULL),
        lambda model, optim, saved: set_optimizer_state_dict(model, optim, saved, options=FULL),
    ),
    "get_optimizer_state_dict[sharded]": (
        "optim",
        lambda model, optim: get_optimizer_state_dict(model, optim, options=SHARDED),
        lambda model, optim, saved: set_optimizer_state_dict(model, optim, saved, options=SHARDED),
    ),
    "get_optimizer_state_dict[flattened]": (
        "flat-optim",
        lambda model, optim: get_optimizer_state_dict(model, optim, options=FLATTENED),
        lambda model, optim, saved: set_optimizer_state_dict(model, optim, saved, options=FLATTENED),
    ),
    "get_state_dict[sharded]": (
        "both",
        lambda model, optim: get_state_dict(model, optim, options=SHARDED),
        lambda model, optim, saved: set_state_dict(model, optim, model_state_dict=saved[0], optim_state_dict=saved[1], options=SHARDED),
    ),
}


# -- in the rank processes ---------------------------------------------------------------------


def _keys(holds: str, saved: Any) -> Any:
    """The names a saved state carries, in order: its keys; for nested optimizer state also
    each param group's parameter names."""
    if holds == "optim":
        return (list(saved["state"]), [group["params"] for group in saved["param_groups"]]) if saved else []
    if holds == "both":
        return (_keys("model", saved[0]), _keys("optim", saved[1]))
    return list(saved)


def _expected_keys(world_size: int, local_keys: List[str]) -> Dict[str, Any]:
    """What torch's functions give for the unwrapped model, by what a function holds."""
    plain, optim = _reference(world_size)
    model_keys = list(torch_sd.get_model_state_dict(plain, options=FULL))
    optim_keys = _keys("optim", torch_sd.get_optimizer_state_dict(plain, optim, options=FULL))
    flat_keys = list(torch_sd.get_optimizer_state_dict(plain, optim, options=FLATTENED))
    return {"model": model_keys, "optim": optim_keys, "flat-optim": flat_keys, "both": (model_keys, optim_keys), "local": local_keys}


def _full(value: Any) -> Any:
    """A DTensor's full value (not ``full_tensor()``: see ``test_state_dict_api._full``)."""
    return full_value(value, guarded_comm()) if isinstance(value, DTensor) else value


def _differences(actual: Dict[str, Any], expected: Dict[str, Any], where: str, exact: bool = True) -> List[str]:
    """Where ``actual`` (name -> tensor or nested dict) differs from ``expected``: other keys,
    other values (``exact``: equal, else close within ``TOL``)."""
    if list(actual) != list(expected):
        return [f"{where}: keys {list(actual)} instead of {list(expected)}"]
    out = []
    for key, value in expected.items():
        if isinstance(value, dict):
            out += _differences(actual[key], value, f"{where}.{key}", exact)
            continue
        mine, theirs = _full(actual[key]).detach().cpu(), _full(value).detach().cpu()
        same = torch.equal(mine, theirs) if exact else torch.allclose(mine.float(), theirs.float(), **TOL)
        if not same:
            out.append(f"{where}.{key}: {mine} instead of {theirs}")
    return out


def _params(model: ShardedDataParallel) -> Dict[str, Any]:
    """The model's parameters and buffers by name, full values."""
    with _typed(model, StateDictType.FULL_STATE_DICT):
        return dict(model.state_dict())


def _optimizer_state(model: ShardedDataParallel, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    """The optimizer's state by parameter name, full values."""
    return ShardedDataParallel.full_optim_state_dict(model, optim, rank0_only=False)["state"]


def _single_process(world_size: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The values of the unwrapped model trained on the global batch, and its optimizer's
    state, by name."""
    plain, optim = _reference(world_size)
    names = [name for name, _ in plain.named_parameters()]
    return dict(plain.state_dict()), {names[pid]: state for pid, state in optim.state_dict()["state"].items()}


def _trained_as_single_process(trained: Dict[Tuple[str, bool], Any], world_size: int) -> List[str]:
    """Where the trained models' values (as read back through the full state dicts that the
    moves compare with) differ from single-process training: the original values are right."""
    params, state = _single_process(world_size)
    problems = []
    for (kind, _), (model, optim) in trained.items():
        problems += _differences(_params(model), params, f"{kind} parameters", exact=False)
        problems += _differences(_optimizer_state(model, optim), state, f"{kind} optimizer state", exact=False)
    return problems


def _moved(name: str, source: Tuple[str, bool], target: Tuple[str, bool], trained: Dict[Tuple[str, bool], Any]) -> List[str]:
    """Save with ``name`` from the trained model of ``source`` (kind, use_orig_params), load into
    a fresh model of ``target``: where its values then differ from the trained model's."""
    holds, save, load = FUNCTIONS[name]
    model, optim = trained[source]
    saved = save(model, optim)
    fresh = _wrapped(OTHER_SEED, *target)
    fresh_optim = _adamw(fresh)
    load(fresh, fresh_optim, saved)
    problems = []
    if holds in ("model", "local", "both"):
        problems += _differences(_params(fresh), _params(model), "parameters")
    if holds in ("optim", "flat-optim", "both"):
        problems += _differences(_optimizer_state(fresh, fresh_optim), _optimizer_state(model, optim), "optimizer state")
    return problems


def _run_kind(rank: int, world_size: int, kind: str, orig: bool) -> Dict[str, Any]:
    """For every function: the keys it gives on the model of ``kind``, the keys expected, and
    what differs after moving a state from that model to one without the wrappers and back;
    and whether the trained models are single-process training."""
    trained = {(k, orig): _trained(rank, world_size, k, orig) for k in dict.fromkeys(["none", kind])}
    local_keys = list(_save_model(StateDictType.LOCAL_STATE_DICT)(*trained[("none", orig)]))
    expected_keys = _expected_keys(world_size, local_keys)
    model, optim = trained[(kind, orig)]
    results = {}
    for name, (holds, save, _) in FUNCTIONS.items():
        results[name] = {
            "keys": _reported(lambda: _keys(holds, save(model, optim))),
            "expected": expected_keys[holds],
            "to plain": _reported(lambda: _moved(name, (kind, orig), ("none", orig), trained), listed=True),
            "from plain": _reported(lambda: _moved(name, ("none", orig), (kind, orig), trained), listed=True),
        }
    return {"functions": results, "trained": _reported(lambda: _trained_as_single_process(trained, world_size), listed=True)}


def _reported(compute: Callable[[], Any], listed: bool = False) -> Any:
    """``compute()``, or the error it raised as a result, so that one function failing leaves
    the other cells of the matrix their own results. (flatshard raises its errors on every
    rank, so the ranks stay in step.)"""
    try:
        return compute()
    except Exception as exc:  # noqa: BLE001 - the error is the result
        text = f"raised {type(exc).__name__}: {exc}"
        return [text] if listed else text


def _on_compiled_root(rank: int, world_size: int, orig: bool) -> Dict[str, Any]:
    """flatshard.state_dict's functions and the optimizer-state methods given
    ``torch.compile(model)`` (never run: only its ``_orig_mod`` matters here): the keys, and the
    values a fresh compiled model takes from them."""
    model, optim = _trained(rank, world_size, "none", orig)
    compiled = torch.compile(model, backend="eager")
    fresh = _wrapped(OTHER_SEED, "none", orig)
    fresh_optim = _adamw(fresh)
    fresh_compiled = torch.compile(fresh, backend="eager")
    model_state, optim_state = get_state_dict(compiled, optim, options=FULL)
    keys = {
        "get_state_dict": (_keys("model", model_state), _keys("optim", optim_state)),
        "optim_state_dict": _reported(lambda: _keys("optim", ShardedDataParallel.optim_state_dict(compiled, optim))),
        "full_optim_state_dict": _reported(lambda: _keys("optim", ShardedDataParallel.full_optim_state_dict(compiled, optim, rank0_only=False))),
    }
    try:
        set_state_dict(fresh_compiled, fresh_optim, model_state_dict=model_state, optim_state_dict=optim_state, options=FULL)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        problems = [f"set_state_dict raised {type(exc).__name__}: {exc}"]
    else:
        problems = _differences(_params(fresh), _params(model), "parameters")
        problems += _differences(_optimizer_state(fresh, fresh_optim), _optimizer_state(model, optim), "optimizer state")
    expected = _expected_keys(world_size, [])
    return {"keys": keys, "expected": (expected["model"], expected["optim"]), "problems": problems}


# -- the tests ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _results_of(pool: Any, kind: str, orig: bool) -> List[Dict[str, Any]]:
    return pool.run(_run_kind, 2, kind, orig, timeout=600.0)


def _ranks(rank_pool: Any, kind: str, orig: bool) -> List[Dict[str, Any]]:
    """Each rank's results for (``kind``, ``orig``), computed once."""
    _skip_without_compile(kind)
    return _results_of(rank_pool, kind, orig)


def _problems(ranks: List[Dict[str, Any]], pick: Callable[[Dict[str, Any]], List[str]]) -> List[str]:
    return [f"rank {rank}: {problem}" for rank, result in enumerate(ranks) for problem in pick(result)]


MATRIX = [pytest.param(f, k, o, id=f"{f}-{k}-{'orig' if o else 'flat'}") for k in KINDS for o in (False, True) for f in FUNCTIONS]


@pytest.mark.parametrize("function, kind, orig", MATRIX)
def test_keys_are_the_unwrapped_models(rank_pool: Any, function: str, kind: str, orig: bool) -> None:
    result = _ranks(rank_pool, kind, orig)[0]["functions"][function]  # (rank 0: rank0_only dicts)
    assert result["keys"] == result["expected"]


@pytest.mark.parametrize("function, kind, orig", MATRIX)
def test_saved_with_the_wrappers_loads_without_them(rank_pool: Any, function: str, kind: str, orig: bool) -> None:
    assert _problems(_ranks(rank_pool, kind, orig), lambda r: r["functions"][function]["to plain"]) == []


@pytest.mark.parametrize("function, kind, orig", MATRIX)
def test_saved_without_the_wrappers_loads_with_them(rank_pool: Any, function: str, kind: str, orig: bool) -> None:
    assert _problems(_ranks(rank_pool, kind, orig), lambda r: r["functions"][function]["from plain"]) == []


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("orig", [False, True], ids=["flat", "orig"])
def test_trained_values_are_single_process_training(rank_pool: Any, kind: str, orig: bool) -> None:
    """The values the moves compare with are the right ones."""
    assert _problems(_ranks(rank_pool, kind, orig), lambda r: r["trained"]) == []


@pytest.mark.parametrize("orig", [False, True], ids=["flat", "orig"])
def test_compiled_root(rank_pool: Any, orig: bool) -> None:
    """``torch.compile(model)`` given to the functions that take the model: no ``_orig_mod.``."""
    _skip_without_compile("compile-root")
    result = rank_pool.run(_on_compiled_root, 2, orig)[0]
    model_keys, optim_keys = result["expected"]
    assert result["keys"] == {"get_state_dict": (model_keys, optim_keys), "optim_state_dict": optim_keys, "full_optim_state_dict": optim_keys}
    assert result["problems"] == []


# -- pure: names and rekey_optim_state_dict on plain models -------------------------------------


@pytest.mark.parametrize(
    "path, name",
    [
        ("", ""),
        ("_fsdp_wrapped_module", ""),
        ("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.norm.weight", "layers.0.norm.weight"),
        ("layers.0._checkpoint_wrapped_module._fsdp_wrapped_module.fc1._orig_mod.weight", "layers.0.fc1.weight"),
        ("_orig_mod._fsdp_wrapped_module.embed.weight", "embed.weight"),
        ("my_orig_mod.x_checkpoint_wrapped_module.weight", "my_orig_mod.x_checkpoint_wrapped_module.weight"),
    ],
)
def test_clean_name(path: str, name: str) -> None:
    assert clean_name(path) == name


def _stepped(model: nn.Module, scale: float) -> torch.optim.Optimizer:
    """An AdamW on ``model`` after one step with made-up gradients (no forward: nothing is
    compiled), the same for every kind of ``model`` built from one seed."""
    optim = _adamw(model)
    for index, param in enumerate(model.parameters()):
        param.grad = torch.full_like(param, scale * (index + 1))
    optim.step()
    return optim


PLAIN_KINDS = ["checkpoint-before", "compile-before", "stacked"]  # (a plain model's wrappers)


@pytest.mark.parametrize("kind", PLAIN_KINDS)
def test_rekey_optim_state_dict(kind: str) -> None:
    """``rekey_optim_state_dict`` names a plain model's parameters without the wrappers' names,
    and a state keyed by name moves between the model with them and the model without."""
    _skip_without_compile(kind)
    wrapped, plain = _prepared(SEED, kind), build(SEED)
    names = [name for name, _ in plain.named_parameters()]
    for source, target in ((wrapped, plain), (plain, wrapped)):
        optim = _stepped(source, 0.5)
        by_name = ShardedDataParallel.rekey_optim_state_dict(optim.state_dict(), OptimStateKeyType.PARAM_NAME, source, optim=optim)
        assert list(by_name["state"]) == names
        assert by_name["param_groups"][0]["params"] == names
        target_optim = _stepped(target, 2.0)
        target_optim.load_state_dict(ShardedDataParallel.rekey_optim_state_dict(by_name, OptimStateKeyType.PARAM_ID, target, optim=target_optim))
        for moved, original in zip(target.parameters(), source.parameters()):
            for key, value in optim.state[original].items():
                torch.testing.assert_close(target_optim.state[moved][key], value)

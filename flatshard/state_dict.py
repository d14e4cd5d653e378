"""torch's distributed state-dict API for flatshard models.

``from flatshard.state_dict import get_state_dict, set_state_dict, StateDictOptions`` replaces
``from torch.distributed.checkpoint.state_dict import ...``: the same six functions with the
same signatures, giving and taking what torch's give and take for the unwrapped model (keys are
parameter FQNs without wrapper prefixes; optimizer state is keyed by FQNs and ``param_groups``
list FQNs), with full tensors for ``full_state_dict=True`` and ``DTensor`` parts otherwise, ready
for ``torch.distributed.checkpoint.save`` / ``load``. On a model without ``ShardedDataParallel``
units they are torch's own functions.

[Note: why not torch's functions] torch's functions recognise FSDP1 by its private per-module
state (``torch.distributed.fsdp``'s ``_FSDPState``), which a flatshard model does not have, so
they treat it as a plain model: the model state dict is whatever ``state_dict()`` is set to
(full tensors on every rank by default, even for ``full_state_dict=False``), the optimizer state
is keyed by the ``FlatParameter`` names with this rank's flat shards as plain tensors (not
``DTensor``s: nothing tells ``torch.distributed.checkpoint`` they are shards, and they fit only
the same world size), and loading a model state dict fails on the ``FlatParameter`` names. Making torch recognise flatshard would
take faking that private state (or subclassing torch's FSDP class), so these functions instead
map the options onto flatshard's own FSDP1 APIs (``state_dict_type``, ``optim_state_dict``,
``optim_state_dict_to_load``), exactly as torch maps them onto FSDP1's.

[Note: complete optimizer state] torch fills the state of an optimizer that has none by one
step with zero learning rate (which also counts that step). Here a parameter without state gets
a template instead (see [Note: optimizer state templates] in ``optim_state``): zeros with step
count 0, which loading treats as "never stepped", so a state dict has an entry for every
trainable parameter (what torch's ``strict`` loading expects) without changing the training.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed.checkpoint.state_dict as _torch_sd
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.nn.modules.module import _IncompatibleKeys

from ._base._common import clean_name
from ._checkpoint._checkpointing import guarded_call, model_root, named_units
from ._checkpoint._optim_dicts import optim_state_for, optim_state_to_load
from ._checkpoint._optim_state import OptimStateIndex
from ._checkpoint._optim_templates import template_state
from ._checkpoint._plain_view import wrapped_by
from ._checkpoint._state_dict import load_model_state, model_state, state_dict_type
from ._comm._collectives import all_gather_object, broadcast_object, default_group
from ._comm._peer_failures import together
from ._engine._unit import unit_of
from .api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictSettings,
    StateDictType,
)

__all__ = [
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]

Optimizers = Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer]]
_BOOL_OPTIONS = ("full_state_dict", "cpu_offload", "ignore_frozen_params", "keep_submodule_prefixes", "strict", "broadcast_from_rank0", "flatten_optimizer_state_dict")
_STATE, _GROUPS, _PARAMS = "state", "param_groups", "params"


# -- public functions ---------------------------------------------------------------------


def get_model_state_dict(
    model: nn.Module, *, submodules: Optional[Set[nn.Module]] = None, options: Optional[StateDictOptions] = None
) -> Dict[str, Any]:
    """The model's state dict keyed by parameter and buffer FQNs (no wrapper prefixes), as
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` gives for the unwrapped
    model. Collective: call on every rank.

    Args:
        model: the model (a ``ShardedDataParallel`` or a module containing them; any other
            module is passed to torch's function).
        submodules: deprecated in torch: keep only the entries of these submodules.
        options: ``full_state_dict`` (full tensors; with ``cpu_offload`` on rank 0 only, ``{}``
            elsewhere) or not (``DTensor`` parts), ``cpu_offload``, ``ignore_frozen_params``,
            ``keep_submodule_prefixes``.
    """
    if not _has_units(model):
        return _torch_sd.get_model_state_dict(model, submodules=submodules, options=options)
    with guarded_call(model, "get_model_state_dict()"):
        return _model_state(model, submodules, options)


def _model_state(model: nn.Module, submodules: Optional[Set[nn.Module]], options: Optional[StateDictOptions]) -> Dict[str, Any]:
    opts = _checked_options(options, "get_model_state_dict")
    _warn_submodules(submodules)
    settings, target = _settings(opts), _without_outer_wrappers(model)
    if unit_of(target) is not None:
        state = model_state(target, None, "", False, settings)
    else:  # a plain module holding roots: its own state_dict() walks them
        with state_dict_type(target, *_fields(settings)):
            state = target.state_dict()
    if opts.ignore_frozen_params:
        for name in _frozen_names(model):
            state.pop(name, None)
    if submodules:
        state = _only_submodules(model, state, submodules, opts.keep_submodule_prefixes)
    return state


def get_optimizer_state_dict(
    model: nn.Module, optimizers: Optimizers, *, submodules: Optional[Set[nn.Module]] = None, options: Optional[StateDictOptions] = None
) -> Dict[str, Any]:
    """The state of ``optimizers`` combined, keyed by parameter FQNs (``param_groups`` list
    FQNs), as torch's ``get_optimizer_state_dict`` gives for the unwrapped model: full tensors
    or ``DTensor`` parts per ``options``. Every trainable parameter has an entry (see
    [Note: complete optimizer state]). Collective.

    Args:
        model: the model the optimizers were built on.
        optimizers: one optimizer or several (each over its own parameters).
        submodules: deprecated in torch, and ignored by torch for optimizer state: ignored.
        options: as for ``get_model_state_dict``; ``flatten_optimizer_state_dict`` gives the
            one-level ``"state.<fqn>.<name>"`` / ``"param_groups.<fqn>.<name>"`` form.
    """
    optims = _optimizer_tuple(optimizers, "get_optimizer_state_dict")
    if not _has_units(model):
        return _torch_sd.get_optimizer_state_dict(model, optims, submodules=submodules, options=options)
    with guarded_call(model, "get_optimizer_state_dict()"):
        return _optimizer_state(model, optims, submodules, options)


def _optimizer_state(
    model: nn.Module, optims: Tuple[torch.optim.Optimizer, ...], submodules: Optional[Set[nn.Module]], options: Optional[StateDictOptions]
) -> Dict[str, Any]:
    opts = _checked_options(options, "get_optimizer_state_dict")
    _warn_submodules(submodules)
    combined: Dict[str, Any] = {_STATE: {}, _GROUPS: []}
    settings = _settings(opts)
    for optim in optims:
        with template_state(optim):
            osd = optim_state_for(model, optim, settings)
        if osd:
            combined[_STATE].update(osd[_STATE])
            combined[_GROUPS].extend(osd[_GROUPS])
    if opts.full_state_dict and (opts.cpu_offload or opts.broadcast_from_rank0) and _rank(model) != 0:
        return {}
    return _flatten_optim(combined) if opts.flatten_optimizer_state_dict else combined


def get_state_dict(
    model: nn.Module, optimizers: Optimizers, *, submodules: Optional[Set[nn.Module]] = None, options: Optional[StateDictOptions] = None
) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(get_model_state_dict(...), get_optimizer_state_dict(...))`` with the same arguments,
    as torch's ``get_state_dict``. Collective.

    Args:
        model: the model.
        optimizers: one optimizer or several.
        submodules: deprecated in torch: restricts the model state dict only.
        options: see ``get_model_state_dict`` and ``get_optimizer_state_dict``.
    """
    optims = _optimizer_tuple(optimizers, "get_state_dict")
    if not _has_units(model):
        return _torch_sd.get_state_dict(model, optims, submodules=submodules, options=options)
    with guarded_call(model, "get_state_dict()"):
        model_state = get_model_state_dict(model, submodules=submodules, options=options)
        return model_state, get_optimizer_state_dict(model, optims, options=options)


def set_model_state_dict(model: nn.Module, model_state_dict: Dict[str, Any], *, options: Optional[StateDictOptions] = None) -> _IncompatibleKeys:
    """Load a state dict keyed by FQNs (full tensors or ``DTensor`` parts saved at any world
    size) into ``model``, as torch's ``set_model_state_dict``. Collective.

    Args:
        model: the ``ShardedDataParallel`` model.
        model_state_dict: the state dict; with ``broadcast_from_rank0`` only rank 0's counts
            (the other ranks may pass ``{}``).
        options: ``strict``; ``broadcast_from_rank0`` (needs ``full_state_dict``): rank 0 sends
            the tensors one at a time and each rank keeps its part.

    Returns:
        ``missing_keys`` and ``unexpected_keys``, by FQN.
    """
    if not _has_units(model):
        return _torch_sd.set_model_state_dict(model, model_state_dict, options=options)
    with guarded_call(model, "set_model_state_dict()", clears=True):
        opts = _checked_options(options, "set_model_state_dict")
        if not isinstance(model_state_dict, Mapping):
            raise TypeError(f"set_model_state_dict: model_state_dict must be a dict keyed by FQNs; got {type(model_state_dict).__name__}")
        if any(isinstance(key, nn.Module) for key in model_state_dict):
            raise NotImplementedError("set_model_state_dict: a model_state_dict keyed by submodules (deprecated in torch) is not supported; key it by FQNs")
        return _load_model(model, model_state_dict, opts)


def set_optimizer_state_dict(
    model: nn.Module, optimizers: Optimizers, optim_state_dict: Dict[str, Any], *, options: Optional[StateDictOptions] = None
) -> None:
    """Load an optimizer state dict keyed by FQNs (e.g. from ``get_optimizer_state_dict``,
    here or of the unwrapped model with torch's, saved at any world size) into
    ``optimizers``, as torch's ``set_optimizer_state_dict``. Collective.

    Args:
        model: the model the optimizers were built on.
        optimizers: one optimizer or several; each takes the entries of its own parameters.
        optim_state_dict: the state dict (nested, or flattened as
            ``flatten_optimizer_state_dict`` gives it).
        options: ``strict`` (every trainable parameter must have state);
            ``broadcast_from_rank0``, or ``full_state_dict`` with ``cpu_offload``: only rank 0's
            dict counts (the others may pass ``{}``).
    """
    optims = _optimizer_tuple(optimizers, "set_optimizer_state_dict")
    if not _has_units(model):
        return _torch_sd.set_optimizer_state_dict(model, optims, optim_state_dict, options=options)
    with guarded_call(model, "set_optimizer_state_dict()"):
        opts = _checked_options(options, "set_optimizer_state_dict")
        _load_optims(model, optims, optim_state_dict, opts)
    return None


def set_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    model_state_dict: Dict[str, Any],
    optim_state_dict: Dict[str, Any],
    options: Optional[StateDictOptions] = None,
) -> _IncompatibleKeys:
    """Load the optimizers' state, then the model's, as torch's ``set_state_dict`` (an empty
    ``model_state_dict`` loads the optimizers only). Collective.

    Args:
        model: the model.
        optimizers: one optimizer or several.
        model_state_dict: see ``set_model_state_dict``.
        optim_state_dict: see ``set_optimizer_state_dict``.
        options: see both.

    Returns:
        The model's ``missing_keys`` and ``unexpected_keys``.
    """
    optims = _optimizer_tuple(optimizers, "set_state_dict")
    if not _has_units(model):
        return _torch_sd.set_state_dict(model, optims, model_state_dict=model_state_dict, optim_state_dict=optim_state_dict, options=options)
    loads_model = bool(model_state_dict) or bool(getattr(options, "broadcast_from_rank0", False))
    with guarded_call(model, "set_state_dict()", clears=loads_model):
        opts = _checked_options(options, "set_state_dict")
        if not isinstance(model_state_dict, Mapping):
            raise TypeError(f"set_state_dict: model_state_dict must be a dict keyed by FQNs; got {type(model_state_dict).__name__}")
        _load_optims(model, optims, optim_state_dict, opts)
        if not model_state_dict and not opts.broadcast_from_rank0:
            return _IncompatibleKeys([], [])
        return _load_model(model, model_state_dict, opts)


# -- checks and options ---------------------------------------------------------------------


def _has_units(model: nn.Module) -> bool:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module; got {type(model).__name__}")
    return bool(named_units(model))


def _checked_options(options: Any, what: str) -> StateDictOptions:
    if options is None:
        return StateDictOptions()
    if not isinstance(options, StateDictOptions):
        raise TypeError(f"{what}: options must be a StateDictOptions (from flatshard.state_dict) or None; got {type(options).__name__}")
    for field in _BOOL_OPTIONS:
        if not isinstance(getattr(options, field), bool):
            raise TypeError(f"{what}: StateDictOptions.{field} must be a bool; got {getattr(options, field)!r}")
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError(f"{what}: broadcast_from_rank0=True needs full_state_dict=True (rank 0 holds the full state dict)")
    if options.dsd_fqn_modifiers != StateDictOptions().dsd_fqn_modifiers:
        raise NotImplementedError(f"{what}: StateDictOptions.dsd_fqn_modifiers other than the default is not supported on ShardedDataParallel models")
    return options


def _optimizer_tuple(optimizers: Any, what: str) -> Tuple[torch.optim.Optimizer, ...]:
    optims = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
    if not optims:
        raise RuntimeError(f"{what}: no optimizers were passed")
    for optim in optims:
        if not isinstance(optim, torch.optim.Optimizer):
            raise TypeError(f"{what}: optimizers must be torch.optim.Optimizers; got {type(optim).__name__}")
    return optims


def _warn_submodules(submodules: Optional[Set[nn.Module]]) -> None:
    if submodules:
        warnings.warn(
            "submodules is deprecated in torch.distributed.checkpoint.state_dict; filter the returned state dict instead",
            FutureWarning,
            stacklevel=3,
        )


def _settings(opts: StateDictOptions) -> StateDictSettings:
    """The FSDP1 settings ``opts`` stand for: torch's own mapping of the options onto FSDP1's
    configs."""
    if opts.full_state_dict:
        kind = StateDictType.FULL_STATE_DICT
        config: Any = FullStateDictConfig(offload_to_cpu=opts.cpu_offload, rank0_only=opts.cpu_offload)
        optim_config: Any = FullOptimStateDictConfig(offload_to_cpu=opts.cpu_offload, rank0_only=opts.cpu_offload or opts.broadcast_from_rank0)
    else:
        kind = StateDictType.SHARDED_STATE_DICT
        config = ShardedStateDictConfig(offload_to_cpu=opts.cpu_offload)
        optim_config = ShardedOptimStateDictConfig(offload_to_cpu=opts.cpu_offload)
    return StateDictSettings(kind, config, optim_config)


def _fields(settings: StateDictSettings) -> Tuple[Any, Any, Any]:
    return settings.state_dict_type, settings.state_dict_config, settings.optim_state_dict_config


def _rank(model: nn.Module) -> int:
    return model_root(model).rank


# -- model state ----------------------------------------------------------------------------


def _frozen_names(model: nn.Module) -> List[str]:
    index = OptimStateIndex(model)
    return [name for param in model.parameters() if not param.requires_grad for name in index.names_of(param)]


def _only_submodules(model: nn.Module, state: Dict[str, Any], submodules: Set[nn.Module], keep_prefixes: bool) -> Dict[str, Any]:
    wanted = {id(m) for m in submodules}
    prefixes = {clean_name(path) for path, module in model.named_modules() if id(module) in wanted}
    out: Dict[str, Any] = {}
    for key, value in state.items():
        for prefix in prefixes:
            if not prefix or key.startswith(prefix + "."):
                out[key if keep_prefixes or not prefix else key[len(prefix) + 1 :]] = value
    return out


def _without_outer_wrappers(model: nn.Module) -> nn.Module:
    """``model`` without the checkpoint or compile wrappers around it, e.g. the root
    ``ShardedDataParallel`` of ``torch.compile(model)``, whose ``state_dict()`` would prefix
    every key with ``_orig_mod.`` (see [Note: wrapper prefixes] in ``_plain_view``)."""
    inner = None if unit_of(model) is not None else wrapped_by(model)
    while inner is not None:
        model = inner
        inner = None if unit_of(model) is not None else wrapped_by(model)
    return model


def _load_model(model: nn.Module, state_dict: Mapping[str, Any], opts: StateDictOptions) -> _IncompatibleKeys:
    model = _without_outer_wrappers(model)
    if unit_of(model) is None:
        raise NotImplementedError(
            f"set_model_state_dict: model is a {type(model).__name__} containing ShardedDataParallel modules; "
            f"loading needs the root ShardedDataParallel itself as the model"
        )
    if opts.broadcast_from_rank0:
        state_dict = _received_from_first(model, state_dict)
        # (DTensor parts of the full values)
        return load_model_state(model, state_dict, opts.strict, _settings(StateDictOptions()))
    if not state_dict and _empty_allowed(opts):
        # torch loads nothing here; every rank still joins the load's agreement check, so a
        # rank given a non-empty dict gets an error instead of waiting for this one.
        load_model_state(model, {}, False, _settings(opts))
        return _IncompatibleKeys([], [])
    return load_model_state(model, state_dict, opts.strict, _settings(opts))  # (an empty dict fails there, on every rank)


def _empty_allowed(opts: StateDictOptions) -> bool:
    return not opts.strict or opts.ignore_frozen_params or (opts.cpu_offload and opts.full_state_dict)


def _received_from_first(model: nn.Module, state_dict: Mapping[str, Any]) -> Dict[str, Any]:
    """Rank 0's full ``state_dict`` on every rank, sent one tensor at a time; each rank keeps
    its ``DTensor`` part of a sharded parameter (peak: one full tensor beyond the parts)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    comm = model_root(model).comm.sibling(default_group())
    skeleton = _skeleton(state_dict) if comm.rank == 0 else None
    skeleton = broadcast_object(skeleton, comm)
    if skeleton[0] == "error":
        raise ValueError(f"[rank {comm.rank}] set_model_state_dict(broadcast_from_rank0=True): {skeleton[1]}")
    template = model_state(model, None, "", False, _settings(StateDictOptions()))
    device = model_root(model).device
    out: Dict[str, Any] = {}
    for key, spec in skeleton[1]:
        if spec[0] == "value":
            out[key] = spec[1]
            continue
        _, shape, dtype = spec
        tensor = state_dict[key].to(device, copy=True) if comm.rank == 0 else torch.empty(shape, dtype=dtype, device=device)
        comm.broadcast_from_first(tensor)
        local = template.get(key)
        if isinstance(local, DTensor) and tuple(local.shape) == tuple(shape):
            out[key] = distribute_tensor(tensor, local.device_mesh, local.placements, src_data_rank=None)
        else:
            out[key] = tensor
    return out


def _skeleton(state_dict: Any) -> Tuple[str, Any]:
    """Rank 0's description of its full state dict: ``("ok", [(key, spec)])`` or ``("error", text)``."""
    if not isinstance(state_dict, Mapping) or not state_dict:
        got = "an empty dict" if isinstance(state_dict, Mapping) else type(state_dict).__name__
        return "error", f"rank 0 must pass the full model state dict; got {got}"
    from torch.distributed.tensor import DTensor

    entries = []
    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            return "error", f"rank 0's state dict must hold full tensors, but '{key}' is a DTensor"
        if isinstance(value, torch.Tensor):
            entries.append((key, ("tensor", tuple(value.shape), value.dtype)))
        else:
            entries.append((key, ("value", value)))
    return "ok", entries


# -- optimizer state --------------------------------------------------------------------------


def _load_optims(model: nn.Module, optims: Sequence[torch.optim.Optimizer], osd: Any, opts: StateDictOptions) -> None:
    only_first = opts.broadcast_from_rank0 or (opts.full_state_dict and opts.cpu_offload)
    mine = not only_first or _rank(model) == 0
    index = OptimStateIndex(model)
    parts: List[Dict[str, Any]] = [{} for _ in optims]
    error: Optional[Tuple[str, str]] = None
    if mine:
        try:
            parts = _parts(index, optims, osd, opts.strict)
        except (TypeError, ValueError, RuntimeError, NotImplementedError) as exc:
            error = (type(exc).__name__, str(exc))
    _raise_together(model, error, only_first)
    settings = _settings(opts)
    for optim, part in zip(optims, parts):
        optim_state_to_load(model, optim, part, settings, load_directly=True)


def _parts(index: OptimStateIndex, optims: Sequence[torch.optim.Optimizer], osd: Any, strict: bool) -> List[Dict[str, Any]]:
    if not isinstance(osd, Mapping):
        raise TypeError(f"optim_state_dict must be a dict; got {type(osd).__name__}")
    if not osd:
        raise RuntimeError("the optimizer state dict is empty; pass it on every rank (or on rank 0 with broadcast_from_rank0)")
    if _STATE not in osd:
        osd = _unflatten_optim(index, optims, osd)
    return [_part_for(index, optim, osd, strict) for optim in optims]


_ERRORS = {cls.__name__: cls for cls in (TypeError, ValueError, RuntimeError, NotImplementedError)}


def _raise_together(model: nn.Module, error: Optional[Tuple[str, str]], only_first: bool) -> None:
    """Raise ``error`` (or another rank's) on every rank: rank 0's when only it checked the
    input, else the first failing rank's. One small collective, so no rank waits for a rank
    that failed."""
    root = model_root(model)
    if only_first:
        errors = [broadcast_object(error, root.comm)]
    else:
        errors = all_gather_object(error, root.comm) if root.world_size > 1 else [error]
    for rank, reported in enumerate(errors):
        if reported is not None:
            kind, text = reported
            where = "" if only_first or reported == error else f" (on rank {rank})"
            raise together(_ERRORS[kind](f"set_optimizer_state_dict{where}: {text}"))


def _part_for(index: OptimStateIndex, optim: torch.optim.Optimizer, osd: Mapping[str, Any], strict: bool) -> Dict[str, Any]:
    """The entries of ``osd`` (keyed by FQNs, possibly for several optimizers) that belong to
    ``optim``, with one param group per group of ``optim``."""
    if _GROUPS not in osd or not isinstance(osd[_STATE], Mapping):
        raise ValueError("expected an optimizer state dict with 'state' and 'param_groups' keyed by FQNs")
    saved_group = {name: number for number, group in enumerate(osd[_GROUPS]) for name in group[_PARAMS]}
    state: Dict[str, Any] = {}
    groups = []
    for number, group in enumerate(optim.param_groups):
        names = [name for param in group[_PARAMS] for name in index.names_of(param)]
        found = sorted({saved_group[n] for n in names if n in saved_group})
        if len(found) > 1:
            raise ValueError(f"param group {number} of the optimizer holds parameters of the state dict's groups {found}")
        if not names:
            raise NotImplementedError(f"param group {number} of the optimizer has no parameters; such groups are not supported")
        if not found and strict:
            raise ValueError(f"no parameter of param group {number} of the optimizer (e.g. '{names[0]}') is in the state dict's param groups")
        hyper = osd[_GROUPS][found[0]] if found else group
        groups.append({**{k: v for k, v in hyper.items() if k != _PARAMS}, _PARAMS: names})
        for param in group[_PARAMS]:
            for name in index.names_of(param):
                if name in osd[_STATE]:
                    state[name] = osd[_STATE][name]
                elif strict and param.requires_grad:
                    raise RuntimeError(
                        f"the state dict has no optimizer state for parameter '{name}', which "
                        f"requires gradients; pass StateDictOptions(strict=False) to load it anyway"
                    )
    return {_STATE: state, _GROUPS: groups}


def _flatten_optim(osd: Mapping[str, Any]) -> Dict[str, Any]:
    """The one-level form of an FQN-keyed optimizer state dict (``flatten_optimizer_state_dict``)."""
    out: Dict[str, Any] = {}

    def put(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, inner in value.items():
                put(f"{prefix}.{key}", inner)
        else:
            out[prefix] = value

    for name, entry in osd[_STATE].items():
        put(f"{_STATE}.{name}", entry)
    for group in osd[_GROUPS]:
        for name in group[_PARAMS]:
            for key, value in group.items():
                if key != _PARAMS:
                    out[f"{_GROUPS}.{name}.{key}"] = value
    return out


def _unflatten_optim(index: OptimStateIndex, optims: Sequence[torch.optim.Optimizer], flat: Mapping[str, Any]) -> Dict[str, Any]:
    """The nested form of a flattened optimizer state dict, for the parameters of ``optims``."""
    state: Dict[str, Any] = {}
    groups: List[Dict[str, Any]] = []
    for optim in optims:
        for group in optim.param_groups:
            names = [name for param in group[_PARAMS] for name in index.names_of(param)]
            hyper: Dict[str, Any] = {}
            for name in names:
                prefix = f"{_GROUPS}.{name}."
                hyper.update({key[len(prefix) :]: value for key, value in flat.items() if key.startswith(prefix)})
                entry = _nested(flat, f"{_STATE}.{name}.")
                if entry:
                    state[name] = entry
            if hyper:
                groups.append({**hyper, _PARAMS: names})
    return {_STATE: state, _GROUPS: groups}


def _nested(flat: Mapping[str, Any], prefix: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in flat.items():
        if not key.startswith(prefix):
            continue
        *path, last = key[len(prefix) :].split(".")
        place = out
        for part in path:
            place = place.setdefault(part, {})
        place[last] = value
    return out

"""Model state dicts -- FULL, SHARDED and LOCAL -- and the state-dict type of each unit.

[Note: state dicts unit by unit] FULL and SHARDED state dicts have the unwrapped model's keys
(see [Note: plain view]); what differs is the values of the flattened parameters. Both are
built one unit at a time: gather the unit's handles, copy out what the output keeps (the whole
parameter, or this rank's ``torch.chunk`` part along dim 0 as a ``DTensor``), free the unit
again. So beyond the output no rank ever holds more than one unit's full parameters, and with
``rank0_only`` the other ranks keep nothing at all. Loading needs no gathering: a full value
already contains this rank's range, and a ``DTensor`` is assembled (``full_tensor()``) one
parameter at a time. LOCAL state dicts hold each handle's flat shard, in FSDP1's keys and as its
``ShardedTensor`` (see [Note: local shards as ShardedTensors] in ``_local_shards``), with a
layout record in the dict's ``_metadata`` that loading checks, since a shard only makes sense
at the same world size and rank.
Before loading, the ranks check that they were given the same structure (see [Note: load
agreement] in ``_checkpointing``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from ._checkpointing import agree_on_load, as_dtensor, check_idle, check_ranks_agree, full_value, is_dtensor, named_units, take_user_writes
from .._base._common import HandleState, coerce_config, coerce_enum, display_name, join_name
from .._base._errors import ConfigTypeError
from ._local_shards import as_sharded_tensor, local_shard_problem, local_tensor
from ._plain_view import plain_view
from .._engine._unit import Unit
from ..api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from .._flat._flat_param import FlatParamHandle

# Where a LOCAL state dict's layout record is kept: an entry of its root's ``_metadata`` (FSDP1's
# keys stay exactly its own); earlier development versions kept it under this name as a key.
LOCAL_LAYOUT_KEY = "_flatshard_local_layout"

_CONFIGS = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


# -- settings -----------------------------------------------------------------------------


def make_settings(state_dict_type: Any, state_dict_config: Any, optim_state_dict_config: Any) -> StateDictSettings:
    """Check and complete ``set_state_dict_type``'s arguments (FSDP1's rules: each config must
    belong to the type; a missing one gets the type's defaults)."""
    kind = coerce_enum(state_dict_type, StateDictType, "state_dict_type")
    config_cls, optim_cls = _CONFIGS[kind]  # type: ignore[index]
    config = _coerce_kind(state_dict_config, config_cls, StateDictConfig, "state_dict_config", kind)
    optim = _coerce_kind(optim_state_dict_config, optim_cls, OptimStateDictConfig, "optim_state_dict_config", kind)
    return StateDictSettings(kind, config or config_cls(), optim or optim_cls())  # type: ignore[arg-type]


def _coerce_kind(value: Any, expected: type, base: type, arg_name: str, kind: StateDictType) -> Any:
    if value is None:
        return None
    candidates = [expected] + [cls for pair in _CONFIGS.values() for cls in pair if cls is not expected] + [base]
    for cls in candidates:
        if isinstance(value, cls) or type(value).__name__ == cls.__name__:
            if cls is not expected:
                raise ConfigTypeError(
                    f"Expected {arg_name} of type {expected.__name__} for StateDictType.{kind.name}; "
                    f"got {type(value).__name__}"
                )
            return coerce_config(value, expected, arg_name)
    raise ConfigTypeError(f"{arg_name} must be a {expected.__name__} or None; got {value!r}")


def set_settings(module: nn.Module, settings: StateDictSettings) -> StateDictSettings:
    """Apply ``settings`` to every unit under ``module``; return the previous ones (of the
    outermost unit, should they differ)."""
    units = [unit for _, unit in named_units(module)]
    if not units:
        raise ValueError(f"set_state_dict_type: {type(module).__name__} contains no ShardedDataParallel module")
    previous = dataclasses.replace(units[0].state_dict_settings)
    for unit in units:
        unit.use_state_dict_settings(dataclasses.replace(settings))
    return previous


def snapshot_settings(module: nn.Module) -> List[Tuple[Unit, StateDictSettings]]:
    """Every unit's settings, for ``restore_settings``."""
    return [(unit, dataclasses.replace(unit.state_dict_settings)) for _, unit in named_units(module)]


def restore_settings(snapshot: Sequence[Tuple[Unit, StateDictSettings]]) -> None:
    for unit, settings in snapshot:
        unit.use_state_dict_settings(settings)


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module, state_dict_type: Any, state_dict_config: Any = None, optim_state_dict_config: Any = None
) -> Iterator[None]:
    """Every unit under ``module`` with the given settings for the length of a ``with`` block;
    each unit gets its own settings back afterwards."""
    previous = snapshot_settings(module)
    set_settings(module, make_settings(state_dict_type, state_dict_config, optim_state_dict_config))
    try:
        yield
    finally:
        restore_settings(previous)


def get_settings(module: nn.Module, full: bool = False) -> StateDictSettings:
    """The settings shared by every unit under ``module`` (an error if they differ). ``full``:
    each unit's settings as a ``FULL_STATE_DICT`` -- its own where its type is that, else the
    type's defaults (what the wrapped module's own ``state_dict()`` gives)."""
    named = named_units(module)
    if not named:
        raise ValueError(f"get_state_dict_type: {type(module).__name__} contains no ShardedDataParallel module")
    seen = [(name, _as_full(unit.state_dict_settings) if full else unit.state_dict_settings) for name, unit in named]
    first_name, first = seen[0]
    for name, settings in seen[1:]:
        if settings != first:
            raise ValueError(
                f"the ShardedDataParallel units under {type(module).__name__} have different state-dict "
                f"settings: {display_name(first_name)} has {first}, {display_name(name)} has "
                f"{settings}; use set_state_dict_type on the whole model"
            )
    return dataclasses.replace(first)


def _as_full(settings: StateDictSettings) -> StateDictSettings:
    if settings.state_dict_type is StateDictType.FULL_STATE_DICT:
        return settings
    return StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())


# -- saving -------------------------------------------------------------------------------


def model_state(
    wrapper: nn.Module, destination: Optional[Dict[str, Any]], prefix: str, keep_vars: bool, settings: StateDictSettings
) -> Dict[str, Any]:
    """``wrapper.state_dict()`` in the form ``settings`` select (see [Note: state dicts unit by
    unit]); the units' own settings are not read ([Note: direct checkpoint paths])."""
    named = named_units(wrapper)
    units = [unit for _, unit in named]
    for unit in units:
        unit.state_dict_route = None  # (a mark an exception left behind)
    check_idle(units, "state_dict()")
    take_user_writes(units, "state_dict()")
    kind, config = settings.state_dict_type, settings.state_dict_config
    handles = [h for unit in units for h in unit.handles]
    root = units[0]
    if kind is not StateDictType.LOCAL_STATE_DICT:  # (gathering follows)
        check_ranks_agree(root, [f"StateDictType.{kind.name}, {config}", f"{len(handles)} FlatParameters"], "state_dict()")
    if kind is StateDictType.FULL_STATE_DICT:
        values = _full_values(handles, config)  # type: ignore[arg-type]
        if config.rank0_only and root.rank != 0:  # type: ignore[attr-defined]
            return destination if destination is not None else OrderedDict()
    elif kind is StateDictType.SHARDED_STATE_DICT:
        values = _sharded_values(units, config.offload_to_cpu)
    else:
        values = None
    if keep_vars and values is not None:
        values = {h: [nn.Parameter(v, requires_grad=h.requires_grad) for v in vs] for h, vs in values.items()}
    with plain_view(wrapper, handles, values) as inner:
        out = inner.state_dict(prefix=prefix, keep_vars=keep_vars)
        _uncast_buffers(out, inner, units, prefix)
    if config.offload_to_cpu:
        for key, value in out.items():
            if isinstance(value, torch.Tensor) and value.device.type != "cpu" and not is_dtensor(value):
                out[key] = value.cpu()
    if kind is StateDictType.LOCAL_STATE_DICT:
        _add_local(out, named, prefix, config.offload_to_cpu, keep_vars)
    if destination is None:
        return out
    destination.update(out)
    metadata = getattr(destination, "_metadata", None)
    if metadata is not None:
        metadata.update(getattr(out, "_metadata", {}))
    return destination


def _uncast_buffers(out: Dict[str, Any], inner: nn.Module, units: Sequence[Unit], prefix: str) -> None:
    """Buffers cast to MixedPrecision.buffer_dtype go out in their original dtype."""
    original = {(id(module), name): dtype for unit in units for module, name, dtype in unit.cast_buffers}
    if not original:
        return
    for path, module in inner.named_modules(remove_duplicate=False):
        for name in module._buffers:
            key = prefix + join_name(path, name)
            dtype = original.get((id(module), name))
            if dtype is not None and key in out:
                out[key] = out[key].to(dtype)


def _gathered(handle: FlatParamHandle) -> Tuple[List[torch.Tensor], bool]:
    """Gather ``handle`` if needed: (its full per-parameter views, whether it was gathered
    already and so must stay so)."""
    before = handle.state is not HandleState.SHARDED
    views, in_full_tensor = handle.exact_views()
    return views, before or not in_full_tensor


def _full_values(handles: Sequence[FlatParamHandle], config: FullStateDictConfig) -> Dict[FlatParamHandle, List[torch.Tensor]]:
    values = {}
    for handle in handles:
        views, before = _gathered(handle)
        if config.rank0_only and handle.rank != 0:
            values[handle] = []  # gathered only because the collective needs every rank
        elif config.offload_to_cpu:
            values[handle] = [v.to("cpu", copy=True) for v in views]
        else:
            values[handle] = [v.clone() for v in views]
        if not before:
            handle.reshard()
    return values


def _sharded_values(units: Sequence[Unit], offload: bool) -> Dict[FlatParamHandle, List[torch.Tensor]]:
    values = {}
    for unit in units:
        for handle in unit.handles:
            views, before = _gathered(handle)
            values[handle] = [as_dtensor(view, unit, offload) for view in views]
            if not before:
                handle.reshard()
    return values


def _add_local(out: Dict[str, Any], named: Sequence[Tuple[str, Unit]], prefix: str, offload: bool, keep_vars: bool) -> None:
    for path, unit in named:
        for handle in unit.handles:
            shard = handle.flat_param if keep_vars else handle.flat_param.detach()
            shard = shard.to("cpu", copy=True) if offload else shard
            if handle.sharded:
                shard = as_sharded_tensor(shard.detach(), handle.numel, handle.rank, handle.world_size, handle.comm.group)
            out[prefix + join_name(path, handle.attr_name)] = shard
    metadata = getattr(out, "_metadata", None)
    if metadata is None:
        metadata = out._metadata = OrderedDict()  # type: ignore[attr-defined]
    metadata.setdefault(prefix[:-1], {})[LOCAL_LAYOUT_KEY] = _local_layout(named)


def _saved_layout(state_dict: Mapping[str, Any]) -> Optional[Any]:
    """The layout record a LOCAL state dict was saved with (``None`` if it has none: a dict
    rebuilt by hand, e.g. a comprehension over it, loses ``_metadata``)."""
    if LOCAL_LAYOUT_KEY in state_dict:
        return state_dict[LOCAL_LAYOUT_KEY]
    for entry in (getattr(state_dict, "_metadata", None) or {}).values():
        if isinstance(entry, Mapping) and LOCAL_LAYOUT_KEY in entry:
            return entry[LOCAL_LAYOUT_KEY]
    return None


def _local_layout(named: Sequence[Tuple[str, Unit]]) -> Dict[str, Any]:
    """What a LOCAL state dict's shards mean: checked on load."""
    root = named[0][1]
    handles = {
        join_name(path, h.attr_name): f"{h.describe()}; {h.numel} elements, {h.shard_numel} per rank"
        for path, unit in named
        for h in unit.handles
    }
    return {"world_size": root.world_size, "rank": root.rank, "handles": handles}


# -- loading ------------------------------------------------------------------------------


def load_model_state(wrapper: nn.Module, state_dict: Mapping[str, Any], strict: bool, settings: StateDictSettings) -> Any:
    """``wrapper.load_state_dict(state_dict, strict)`` for the state-dict type of ``settings``."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"load_state_dict: state_dict must be a mapping (e.g. a dict); got {type(state_dict).__name__}")
    named = named_units(wrapper)
    units = [unit for _, unit in named]
    check_idle(units, "load_state_dict()")
    take_user_writes(units, "load_state_dict()")
    kind = settings.state_dict_type
    handles = [h for unit in units for h in unit.handles]
    if kind is StateDictType.LOCAL_STATE_DICT:
        return _load_local(wrapper, named, handles, state_dict, strict)
    sinks = {h: [LoadSink(info.shape, h.dtype) for info in h.param_infos] for h in handles}
    error: Optional[BaseException] = None
    result = None
    with plain_view(wrapper, handles, sinks) as inner:
        try:
            result = inner.load_state_dict(state_dict, strict=strict)
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank
            error = exc
    agree_on_load(units[0], state_dict, error, "load_state_dict")
    for handle in handles:
        for index, sink in enumerate(sinks[handle]):
            if sink.loaded is not None:  # (the last registration of a tie wins, as in torch)
                handle.load_param(index, full_value(sink.loaded, handle.comm))
    return result


class LoadSink(torch.Tensor):
    """What a flattened parameter is while torch loads a state dict into the plain view: a
    shape-only tensor that records the value torch copies into it -- after the modules' load
    hooks had their say -- instead of copying, so that the shards can be loaded from it."""

    loaded: Optional[torch.Tensor]

    @staticmethod
    def __new__(cls, shape: torch.Size, dtype: torch.dtype) -> "LoadSink":
        return torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=dtype, device="meta"), False)

    def __init__(self, shape: torch.Size, dtype: torch.dtype) -> None:
        super().__init__()
        self.loaded = None

    def materialized(self, value: Any) -> Any:
        """A tensor-like value that is no ``torch.Tensor`` (one with ``__torch_function__``, which
        ``nn.Module.load_state_dict`` accepts: Lightning's lazily loaded checkpoint tensors,
        lightning/fabric/utilities/load.py ``_NotYetLoadedTensor``, loaded by its full-checkpoint
        resume, lightning/pytorch/strategies/fsdp.py:632) as a tensor: copied, as torch's load
        would copy it, into a CPU tensor of the value's own shape and dtype (so that the checks
        after it see a wrong shape as wrong, rather than broadcast). Anything else is left as
        it is, for those checks to name."""
        if not hasattr(type(value), "__torch_function__"):
            return value
        out = torch.empty(tuple(getattr(value, "shape", self.shape)), dtype=getattr(value, "dtype", self.dtype), device="cpu")
        out.copy_(value)  # (dispatches to the value's __torch_function__, which materializes it)
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_ and isinstance(args[0], LoadSink):
            args[0].loaded = args[1] if isinstance(args[1], torch.Tensor) else args[0].materialized(args[1])
            return args[0]
        descriptor = getattr(getattr(func, "__self__", None), "__name__", None)
        if getattr(func, "__name__", "") == "__get__" and descriptor == "is_meta":
            return False  # a stand-in, not an empty parameter (torch would warn the copy is a no-op)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _load_local(
    wrapper: nn.Module,
    named: Sequence[Tuple[str, Unit]],
    handles: Sequence[FlatParamHandle],
    state_dict: Mapping[str, Any],
    strict: bool,
) -> Any:
    shards = {join_name(path, h.attr_name): h for path, unit in named for h in unit.handles}
    rest: Dict[str, Any] = OrderedDict((k, v) for k, v in state_dict.items() if k not in shards and k != LOCAL_LAYOUT_KEY)
    if getattr(state_dict, "_metadata", None) is not None:
        rest._metadata = state_dict._metadata  # type: ignore[attr-defined]
    error: Optional[BaseException] = None
    result = None
    with plain_view(wrapper, handles, None) as inner:
        try:
            result = inner.load_state_dict(rest, strict=strict)
            _check_local(state_dict, shards, _local_layout(named), strict, result)
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank
            error = exc
    agree_on_load(named[0][1], {k: v for k, v in state_dict.items() if k != LOCAL_LAYOUT_KEY}, error, "load_state_dict")
    with torch.no_grad():
        for key, handle in shards.items():
            if key in state_dict:
                handle.flat_param.detach().copy_(local_tensor(state_dict[key], handle.shard_numel))
    return result


def _check_local(state_dict: Mapping[str, Any], shards: Mapping[str, FlatParamHandle], expected: Dict[str, Any], strict: bool, result: Any) -> None:
    saved = _saved_layout(state_dict)
    if saved is not None and saved != expected:
        raise RuntimeError(_layout_mismatch(saved, expected))
    for key, handle in shards.items():
        if handle.sharded and handle.state is not HandleState.SHARDED:
            raise RuntimeError(
                f"LOCAL_STATE_DICT: flat parameter '{key}' is still gathered from a forward whose backward "
                f"has not run, and a shard cannot update it; run the backward (or the forward under "
                f"torch.no_grad()) before loading"
            )
    missing = [key for key in shards if key not in state_dict]
    if missing and strict:
        raise RuntimeError(f"LOCAL_STATE_DICT: missing flat shard(s): {', '.join(repr(k) for k in missing)}")
    result.missing_keys.extend(missing)
    for key, handle in shards.items():
        if key in state_dict:
            problem = local_shard_problem(state_dict[key], key, handle.numel, handle.shard_numel, handle.rank, handle.world_size)
            if problem is not None:
                raise RuntimeError(f"LOCAL_STATE_DICT: {problem}{_LOCAL_TAIL}")


_LOCAL_TAIL = "; to change the world size, save and load a SHARDED_STATE_DICT (or FULL_STATE_DICT) instead"


def _layout_mismatch(saved: Any, expected: Dict[str, Any]) -> str:
    head = "LOCAL_STATE_DICT holds one rank's flat shards and loads only into the same rank of the same layout"
    tail = _LOCAL_TAIL
    if not isinstance(saved, dict):
        return f"{head}: its layout record is {saved!r}{tail}"
    for field in ("world_size", "rank"):
        if saved.get(field) != expected[field]:
            return f"{head}: it was saved with {field}={saved.get(field)}, but this is {field}={expected[field]}{tail}"
    for key in sorted(set(saved.get("handles", {})) | set(expected["handles"])):
        theirs, mine = saved.get("handles", {}).get(key), expected["handles"].get(key)
        if theirs != mine:
            return f"{head}: flat parameter '{key}' was saved as [{theirs}] but the model has [{mine}]{tail}"
    return f"{head}: the layout differs{tail}"

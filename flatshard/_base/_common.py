"""Shared vocabulary of the internals: state enums, naming, error helpers, storage and
nested-output helpers. Nothing here talks to other ranks."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections import OrderedDict
from enum import Enum, auto
from typing import Any, Callable, Dict, Iterable, Iterator, Mapping, Optional, Sequence, Type, TypeVar

import torch


# Attribute names. They match torch FSDP1's so that tools which strip FSDP1's prefixes from
# parameter names (e.g. torch.distributed.checkpoint helpers) strip ours too.
WRAPPED_MODULE = "_fsdp_wrapped_module"
FLAT_PARAM = "_flat_param"


class TrainingState(Enum):
    """What a unit is doing right now (see ``guard_transition``)."""

    IDLE = auto()
    FORWARD = auto()
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()
    SUMMON_FULL_PARAMS = auto()


class HandleState(Enum):
    """Whether a handle's full flat parameter is materialised: SHARDED (only the shard),
    GATHERING (its all-gather is in flight), UNSHARDED (gathered)."""

    SHARDED = auto()
    GATHERING = auto()
    UNSHARDED = auto()


_S = TypeVar("_S", bound=Enum)


def guard_transition(current: _S, allowed_from: Iterable[_S], target: _S, where: str) -> _S:
    """Return ``target`` if moving there from ``current`` is allowed, else raise.

    A refused transition is a broken invariant of flatshard (or an unsupported use that got
    past the checks), so it raises ``AssertionError`` saying where, from what and to what.
    """
    allowed = tuple(allowed_from)
    if current not in allowed:
        names = ", ".join(s.name for s in allowed)
        raise AssertionError(
            f"{where}: cannot move to {target.name} from {current.name} (expected one of {names})"
        )
    return target


def clean_name(name: str) -> str:
    """The user-facing name of a module or parameter from its path in the wrapped model: the
    attributes under which transparent wrappers hold the module they wrap left out --
    flatshard's (and FSDP1's) ``_fsdp_wrapped_module``, torch's activation-checkpoint and
    offload wrappers' ``_checkpoint_wrapped_module``, ``torch.compile``'s ``_orig_mod`` (see
    [Note: wrapper prefixes] in ``_plain_view``). Whole path components only, so a user's
    module named e.g. ``my_orig_mod`` keeps its name."""
    wrapper_attributes = (WRAPPED_MODULE, "_checkpoint_wrapped_module", "_orig_mod")
    return ".".join(part for part in name.split(".") if part not in wrapper_attributes)


def join_name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def display_name(name: str) -> str:
    """How a module name is shown in messages: the root module has the empty name."""
    return f"'{name}'" if name else "the root module"


def describe_module(name: str, module: object) -> str:
    """A module as messages name it: its path (relative to the module being wrapped) and class."""
    where = f"module '{name}'" if name else "the module"
    return f"{where} ({type(module).__name__})"


def rank_prefix(rank: int, unit_name: str) -> str:
    """Prefix of errors raised at run time, which may come out of any rank's hooks."""
    return f"[rank {rank}] unit {display_name(unit_name)}"


def alloc_storage(tensor: torch.Tensor, numel: int) -> None:
    """Give ``tensor`` (which must start at offset 0) storage for ``numel`` elements again."""
    storage = tensor.untyped_storage()
    nbytes = numel * tensor.element_size()
    if storage.size() != nbytes:
        if storage.size() != 0:
            raise AssertionError(f"expected freed storage, found {storage.size()} bytes")
        storage.resize_(nbytes)


def free_storage(tensor: torch.Tensor) -> None:
    """Release ``tensor``'s storage while keeping the tensor (and its views) alive.

    [Note: storage freeing] Autograd saves views of the full flat parameter for backward.
    Resizing the storage to zero bytes frees the memory but keeps those views pointing at the
    same storage object, so when the storage is refilled before backward the saved views see
    the gathered values again. A view must never be *read* while freed: that reads past the
    end of the storage. The handle therefore removes the views from their modules whenever it
    frees, and re-gathers before any backward that uses them.
    """
    if tensor.storage_offset() != 0:
        raise AssertionError(f"can only free a tensor that starts its storage; offset {tensor.storage_offset()}")
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes currently held by ``tensor``'s storage."""
    return tensor.untyped_storage().size()


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a forward output: nested tuples, lists, sets, dicts, dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            yield from iter_tensors(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name))


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """Rebuild ``obj`` (a forward input) with ``fn`` applied to each tensor in it."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, OrderedDict):
        return type(obj)((k, map_tensors(fn, v)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


_E = TypeVar("_E", bound=Enum)
_C = TypeVar("_C")


def coerce_enum(value: Any, enum_cls: Type[_E], arg_name: str, allow_none: bool = False) -> Optional[_E]:
    """``value`` as a member of ``enum_cls``; a same-named member of torch FSDP1's same-named
    enum is translated. Raises ``TypeError`` naming ``arg_name`` otherwise."""
    if value is None and allow_none:
        return None
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, Enum) and type(value).__name__ == enum_cls.__name__:
        member = enum_cls.__members__.get(value.name)
        if member is not None:
            return member
    choices = ", ".join(f"{enum_cls.__name__}.{name}" for name in enum_cls.__members__)
    if allow_none:
        choices += " or None"
    raise TypeError(f"{arg_name} must be one of {choices}; got {value!r}")


def coerce_config(value: Any, config_cls: Type[_C], arg_name: str) -> Optional[_C]:
    """``value`` (or ``None``) as an instance of the dataclass ``config_cls``; an instance of
    torch FSDP1's same-named config is copied field by field. Raises ``TypeError`` otherwise."""
    if value is None or isinstance(value, config_cls):
        return value
    names = [f.name for f in dataclasses.fields(config_cls)]  # type: ignore[arg-type]
    if type(value).__name__ == config_cls.__name__ and all(hasattr(value, n) for n in names):
        return config_cls(**{n: getattr(value, n) for n in names})
    raise TypeError(f"{arg_name} must be a {config_cls.__name__} or None; got {value!r}")


@contextlib.contextmanager
def attribute_set(objects: Sequence[Any], name: str, value: Any) -> Iterator[None]:
    """Set attribute ``name`` of every one of ``objects`` to ``value`` while inside; each gets
    its previous value back on exit, also after an error."""
    previous = [getattr(obj, name) for obj in objects]
    for obj in objects:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, old in zip(objects, previous):
            setattr(obj, name, old)


def copy_fields(obj: Any, memo: Dict[int, Any], given: Mapping[str, Any]) -> Any:
    """For ``__deepcopy__``: a new object of ``obj``'s class whose attributes are deep copies
    of ``obj``'s, except those named in ``given``, which get the values given (an object to
    share with the original, or per-copy state made anew). See [Note: deep copies] in
    ``_deepcopy``."""
    new = type(obj).__new__(type(obj))
    memo[id(obj)] = new
    for key, value in vars(obj).items():
        new.__dict__[key] = given[key] if key in given else copy.deepcopy(value, memo)
    return new


def runs_code_of(frame: Optional[Any], filename: str) -> bool:
    """Whether ``frame``, or a frame below it on its stack, runs code of ``filename``. (The
    walk's own local never holds this function's frame: see [Note: frames in locals] in
    ``_engine/_stale_optimizer`` for why that matters.)"""
    while frame is not None:
        if frame.f_code.co_filename == filename:
            return True
        frame = frame.f_back
    return False

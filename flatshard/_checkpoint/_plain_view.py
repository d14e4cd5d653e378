"""The model as the user built it, for the length of a ``with`` block: nested wrappers out of
the way, original parameters back under their names.

[Note: plain view] A state dict of a wrapped model must be exactly the unwrapped model's: its
keys in its order, its modules' state-dict hooks, torch's own strict / missing / unexpected /
size-mismatch handling and messages. Instead of re-implementing ``nn.Module.state_dict`` and
``load_state_dict``, flatshard briefly puts the model back the way it was built and lets torch
do the work: each nested wrapper is replaced in its parent by the module it wraps, and every
module whose parameters were flattened gets a ``_parameters`` dict in its original order (as
recorded by the handle before flattening) holding the tensors the caller supplies -- full
values, ``DTensor`` shards, or sinks that record what torch loads -- instead of the
``FlatParameter``. The same parameter object sits under every name of a tied parameter, as
in the plain model. Everything is restored on exit, also after an error; units must be idle
meanwhile (the caller checks).

[Note: wrapper prefixes] Besides flatshard's own wrappers, a model may hold modules that wrap
another one transparently: torch's activation-checkpoint and offload wrappers
(``apply_activation_checkpointing``: ``_checkpoint_wrapped_module``) and ``torch.compile``'s
``OptimizedModule`` (``_orig_mod``), put in before or after wrapping. None of them is part of
the model as the user names it: torch's ``torch.distributed.checkpoint.state_dict`` and FSDP1
drop their attribute names from every key. So the plain view takes them out of the tree too,
like the nested wrappers, and torch's ``state_dict`` / ``load_state_dict`` /
``named_parameters`` on it see the user's names whatever wraps what, in both directions.
Names that flatshard builds itself from module paths (units' paths, parameter names recorded
at wrapping, ``named_parameters()``) go through ``clean_name`` (``_common``), the one map from
a path to the user's name, which drops the same attribute names; the two agree because a
wrapper is taken out exactly where ``clean_name`` drops the attribute holding its module
(``wrapped_by`` asks it). The attribute names are reserved by their wrappers: a module of the
user's own under one of them would lose it from its names as well.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Type

import torch
from torch import nn

from .._engine._unit import IN_PLAIN_VIEW, unit_of
from .._base._common import attribute_set, clean_name
from .._flat._flat_param import FlatParamHandle

_MISSING = object()

# The values to install: for each handle, one tensor per original parameter (param_infos
# order), or None to leave its parameters out (only the flat shards exist, LOCAL state dicts).
Values = Optional[Mapping[FlatParamHandle, Sequence[torch.Tensor]]]


@contextlib.contextmanager
def plain_view(root: nn.Module, handles: Sequence[FlatParamHandle], values: Values) -> Iterator[nn.Module]:
    """Inside: ``root`` as built -- the module it wraps if it is a wrapper -- with every
    nested wrapper (flatshard's, activation checkpointing's, torch.compile's) replaced by its
    module and the original parameters of ``handles`` installed (see [Note: plain view] and
    [Note: wrapper prefixes])."""
    modules = list(root.modules())
    with swap_wrappers(modules, root), install_params(modules, handles, values), _marked_in_view(modules):
        yield unwrapped(root)


# Where torch defines its transparent wrappers (see [Note: wrapper prefixes]), by module and
# class name.
_TORCH_WRAPPERS = (
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper"),
    ("torch._dynamo.eval_frame", "OptimizedModule"),
)


def _torch_wrapper_types() -> Tuple[Type[nn.Module], ...]:
    # Only those torch has imported: a wrapper cannot exist before its module is imported, and
    # importing dynamo just to look would cost seconds.
    found = []
    for module_name, class_name in _TORCH_WRAPPERS:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            found.append(cls)
    return tuple(found)


def wrapped_by(module: nn.Module) -> Optional[nn.Module]:
    """The module that ``module`` wraps if it is a transparent wrapper -- a
    ``ShardedDataParallel``, torch's activation-checkpoint (or offload) wrapper, or
    ``torch.compile``'s ``OptimizedModule`` -- else ``None`` (see [Note: wrapper prefixes])."""
    if unit_of(module) is None and not isinstance(module, _torch_wrapper_types()):
        return None
    for name, child in module._modules.items():
        if child is not None and not clean_name(name):  # (the attribute clean_name drops)
            return child
    return None


def unwrapped(module: nn.Module) -> nn.Module:
    """``module`` with every transparent wrapper around it removed (``module`` itself if it
    is none); e.g. a ``ShardedDataParallel`` around a checkpoint wrapper gives the block."""
    inner = wrapped_by(module)
    while inner is not None:
        module, inner = inner, wrapped_by(inner)
    return module


@contextlib.contextmanager
def _marked_in_view(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Tell the wrapped modules' state-dict hooks that their ``state_dict()`` is the plain
    view's (see [Note: the wrapped module's state dict] in ``_module_state_dict``)."""
    units = [unit for unit in (unit_of(m) for m in modules) if unit is not None]
    with attribute_set(units, "state_dict_route", IN_PLAIN_VIEW):
        yield


@contextlib.contextmanager
def swap_wrappers(modules: Iterable[nn.Module], root: nn.Module) -> Iterator[None]:
    """Replace every wrapper among ``modules``' children (but ``root``) by the module it wraps,
    through any chain of wrappers (see [Note: wrapper prefixes])."""
    swapped: List[Tuple[nn.Module, str, nn.Module]] = []
    try:
        for parent in modules:
            if wrapped_by(parent) is not None:
                continue  # (out of the view itself; its child is swapped where it is reached)
            for name, child in list(parent._modules.items()):
                if child is not None and child is not root and wrapped_by(child) is not None:
                    parent._modules[name] = unwrapped(child)
                    swapped.append((parent, name, child))
        yield
    finally:
        for parent, name, child in reversed(swapped):
            parent._modules[name] = child


@contextlib.contextmanager
def install_params(modules: Iterable[nn.Module], handles: Sequence[FlatParamHandle], values: Values) -> Iterator[None]:
    """Give the modules holding the parameters of ``handles`` plain ``_parameters`` dicts with
    ``values`` installed and those handles' ``FlatParameter``s left out; attribute access
    (``module.weight``) reaches the installed tensors too."""
    slot_values: Dict[Tuple[int, str], Optional[torch.Tensor]] = {}
    slot_names: Dict[int, Tuple[str, ...]] = {}
    orders: Dict[int, Tuple[str, ...]] = {}
    for handle in handles:
        for module, attr, index in handle.slots():
            slot_values[(id(module), attr)] = None if values is None else values[handle][index]
            slot_names[id(module)] = slot_names.get(id(module), ()) + (attr,)
        for module, names in handle.param_order:  # the earliest recording has the most names
            if len(names) > len(orders.get(id(module), ())):
                orders[id(module)] = names
    flat_ids = {id(handle.flat_param) for handle in handles}
    replaced: List[Tuple[nn.Module, Dict[str, Optional[nn.Parameter]]]] = []
    hidden: List[Tuple[nn.Module, str, object]] = []
    try:
        for module in modules:
            current = module._parameters
            if id(module) not in orders and not any(id(p) in flat_ids for p in current.values()):
                continue
            new: Dict[str, Optional[torch.Tensor]] = {}
            # (the recorded order first; a name it lacks still goes in rather than vanishing)
            for name in orders.get(id(module), ()) + tuple(current) + slot_names.get(id(module), ()):
                value = slot_values.get((id(module), name), _MISSING)
                if name in new:
                    continue
                if value is _MISSING:
                    if name in current and id(current[name]) not in flat_ids:
                        new[name] = current[name]
                elif value is not None:
                    new[name] = value  # type: ignore[assignment]
                    hidden.append((module, name, module.__dict__.pop(name, _MISSING)))
            replaced.append((module, current))
            module.__dict__["_parameters"] = new
        yield
    finally:
        for module, name, old in reversed(hidden):
            module.__dict__.pop(name, None)
            if old is not _MISSING:
                module.__dict__[name] = old
        for module, current in reversed(replaced):
            module.__dict__["_parameters"] = current

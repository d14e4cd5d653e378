"""Deferred initialisation: a unit's parameters and buffers built on the ``meta`` device are
materialised on the compute device just before the unit flattens and shards them, so at
most about one unit's full parameters exist at a time.

Without ``param_init_fn`` the meta tensors get empty storage and ``reset_parameters()`` is
called on every module of the unit that defines it and holds or contains them; a module that
holds meta tensors with no ``reset_parameters()`` on it or around it is an error (its values
would be uninitialised memory). With
``param_init_fn`` it is called on each such module instead. Either way a parameter shared by
several modules stays one parameter (``Module.to_empty`` would split it).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ._common import describe_module, join_name
from .flat_param import OrigParam

_Modules = Sequence[Tuple[str, nn.Module]]


def has_meta(params: Sequence[OrigParam], modules: _Modules) -> bool:
    """Whether any of ``params`` or of ``modules``' own buffers is on the meta device."""
    return any(p.param.is_meta for p in params) or any(_meta_buffers(m) for _, m in modules)


def materialize(
    params: Sequence[OrigParam],
    modules: _Modules,
    device: torch.device,
    param_init_fn: Optional[Callable[[nn.Module], None]],
    prefix: str = "",
) -> List[OrigParam]:
    """Materialise and initialise ``params`` (the unit's registrations) and the buffers of
    ``modules`` (the unit's own modules, with names relative to its module at ``prefix``);
    returns the registrations with their new parameter objects."""
    modules = _with_outside_holders(params, modules)
    holders = {id(p.module) for p in params if p.param.is_meta}
    targets = [(name, m) for name, m in modules if id(m) in holders or _meta_buffers(m)]
    if param_init_fn is not None:
        for _, module in targets:
            param_init_fn(module)
    else:
        _empty_like_on(device, params, targets)
        _reset(modules, targets, prefix)
    refreshed = _retie(params)
    left = [join_name(prefix, p.name) for p in refreshed if p.param.is_meta]
    left += [join_name(prefix, join_name(name, b)) for name, m in targets for b in _meta_buffers(m)]
    if left:
        raise ValueError(f"param_init_fn left {', '.join(repr(n) for n in left)} on the meta device")
    return refreshed


def _with_outside_holders(params: Sequence[OrigParam], modules: _Modules) -> List[Tuple[str, nn.Module]]:
    """``modules`` and, after them, the modules outside them that register one of ``params``.

    [Note: ties owned from outside] A parameter tied between modules that became units of
    their own belongs to the unit enclosing both (see [Note: tied parameters in a plan] in
    ``_planning``), so its registering modules are not among that unit's own modules; they
    still are what initialises it (their ``reset_parameters()`` or ``param_init_fn``). Coming
    last, they are initialised first (children first), so the unit's own modules have the last
    word, and among them the first registration wins, as when the model is built on a real
    device and then tied.
    """
    known = {id(m) for _, m in modules}
    extra: List[Tuple[str, nn.Module]] = []
    for p in params:
        if p.param.is_meta and id(p.module) not in known:
            known.add(id(p.module))
            extra.append((p.module_name, p.module))
    return list(modules) + extra


def _reset(modules: _Modules, targets: _Modules, prefix: str) -> None:
    """Call ``reset_parameters()`` on every module of the unit that defines it and holds, or
    contains, materialised tensors: children first, so that a parent's own initialisation of
    its children (a common pattern) has the last word. A module holding such tensors needs
    ``reset_parameters()`` itself or on an ancestor."""
    target_names = [name for name, _ in targets]

    def involved(name: str) -> bool:
        return any(t == name or not name or t.startswith(name + ".") for t in target_names)

    resettable = {name for name, m in modules if callable(getattr(m, "reset_parameters", None))}
    for name, module in targets:
        covered = any(r == name or not r or name.startswith(r + ".") for r in resettable)
        if not covered:
            raise ValueError(
                f"{describe_module(join_name(prefix, name), module)} was built on the meta device but "
                f"neither it nor a module around it in its unit has reset_parameters() to initialise "
                f"it; pass param_init_fn to ShardedDataParallel"
            )
    for name, module in reversed(modules):
        if name in resettable and involved(name):
            module.reset_parameters()


def _meta_buffers(module: nn.Module) -> List[str]:
    return [name for name, b in module._buffers.items() if b is not None and b.is_meta]


def _empty_like_on(device: torch.device, params: Sequence[OrigParam], targets: _Modules) -> None:
    fresh: Dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for p in params:
            if p.param.is_meta:
                new = fresh.get(id(p.param))
                if new is None:
                    new = nn.Parameter(torch.empty_like(p.param, device=device), requires_grad=p.param.requires_grad)
                    fresh[id(p.param)] = new
                p.module._parameters[p.attr_name] = new
        for _, module in targets:
            for name in _meta_buffers(module):
                module._buffers[name] = torch.empty_like(module._buffers[name], device=device)


def _retie(params: Sequence[OrigParam]) -> List[OrigParam]:
    """The registrations with the parameters now on their modules; registrations of one
    original parameter all get the same (first materialised) one, in case an init function
    materialised them separately."""
    by_original: Dict[int, nn.Parameter] = {}
    for p in params:
        current = p.module._parameters[p.attr_name]
        if current is not None and not current.is_meta:
            by_original.setdefault(id(p.param), current)
    refreshed = []
    for p in params:
        chosen = by_original.get(id(p.param), p.module._parameters[p.attr_name])
        p.module._parameters[p.attr_name] = chosen
        refreshed.append(dataclasses.replace(p, param=chosen))
    return refreshed

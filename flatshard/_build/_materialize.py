"""Deferred initialisation: a unit's parameters and buffers built on the ``meta`` device are
materialised on the compute device just before the unit flattens and shards them, so at
most about one unit's full parameters exist at a time.

Without ``param_init_fn`` the meta tensors get empty storage and ``reset_parameters()`` is
called on every module of the unit that defines it and holds or contains them; a module that
holds meta tensors with no ``reset_parameters()`` on it or around it is an error (its values
would be uninitialised memory). With
``param_init_fn`` it is called instead on every module of the unit, outermost first, as FSDP1
calls it. Either way a parameter shared by
several modules stays one parameter (``Module.to_empty`` would split it).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._base._common import describe_module, join_name
from .._flat._flat_param import OrigParam

_Modules = Sequence[Tuple[str, nn.Module]]


def has_meta(params: Sequence[OrigParam], modules: _Modules) -> bool:
    """Whether a parameter or buffer of ``modules`` (their own), or a registration in
    ``params`` as it is now, is on the meta device."""
    return any(_current(p).is_meta for p in params) or any(_meta_tensors(m) for _, m in modules)


def materialize(
    params: Sequence[OrigParam],
    modules: _Modules,
    device: torch.device,
    param_init_fn: Optional[Callable[[nn.Module], None]],
    prefix: str = "",
) -> List[OrigParam]:
    """Materialise and initialise the meta tensors of ``modules`` (the unit's own modules,
    with names relative to its module at ``prefix``); returns ``params`` (the unit's
    registrations) with the parameter objects now registered (see ``retie``).

    [Note: ties owned from outside] Every meta tensor registered on a unit's modules is
    materialised with that unit, also a parameter another unit owns: a tie between modules
    that became units of their own belongs to a unit enclosing both (see [Note: tied
    parameters in a plan] in ``_planning``), which is built after them and whose own modules
    do not include theirs. Each holder initialises its registration (with its own
    ``reset_parameters()`` or ``param_init_fn``) while it is whole; the owner then takes the
    first registration's value for all of them, as a model built on a real device and then
    tied keeps the first module's.
    """
    targets = [(name, m) for name, m in modules if _meta_tensors(m)]
    if param_init_fn is not None:
        # Every module of the unit, containers included, outermost first (breadth-first), as
        # FSDP1 calls it: init functions written for it initialise blocks from their parents.
        for _, module in sorted(modules, key=lambda named: _depth(named[0])):
            param_init_fn(module)
    else:
        _empty_like_on(device, targets)
        _reset(modules, targets, prefix)
    left = [join_name(prefix, join_name(name, t)) for name, m in targets for t in _meta_tensors(m)]
    if left:
        raise ValueError(f"param_init_fn left {', '.join(repr(n) for n in left)} on the meta device")
    return retie(params, prefix)


def retie(params: Sequence[OrigParam], prefix: str = "") -> List[OrigParam]:
    """The registrations with the parameters now on their modules; registrations of one
    original parameter all get the same one: the first registration's (see [Note: ties owned
    from outside]). Raises if one is still on the meta device."""
    by_original: Dict[int, nn.Parameter] = {}
    for p in params:
        by_original.setdefault(id(p.param), _current(p))
    refreshed = []
    for p in params:
        chosen = by_original[id(p.param)]
        p.module._parameters[p.attr_name] = chosen
        refreshed.append(p if chosen is p.param else dataclasses.replace(p, param=chosen))
    left = [join_name(prefix, p.name) for p in refreshed if p.param.is_meta]
    if left:
        raise ValueError(
            f"{', '.join(repr(n) for n in left)} is still on the meta device: no module registering it was "
            f"materialised (build it on a real device, or give its module reset_parameters() or a param_init_fn)"
        )
    return refreshed


def _current(p: OrigParam) -> nn.Parameter:
    current = p.module._parameters.get(p.attr_name)
    return p.param if current is None else current


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


def _depth(name: str) -> int:
    """How deep a module sits below the unit's module (named relative to it)."""
    return name.count(".") + 1 if name else 0


def _meta_tensors(module: nn.Module) -> List[str]:
    """The names of ``module``'s own parameters and buffers on the meta device."""
    tensors = list(module._parameters.items()) + list(module._buffers.items())
    return [name for name, t in tensors if t is not None and t.is_meta]


def _empty_like_on(device: torch.device, targets: _Modules) -> None:
    """Give every meta tensor of ``targets`` (uninitialised) storage on ``device``; a
    parameter registered several times gets one new parameter."""
    fresh: Dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for _, module in targets:
            for name, param in list(module._parameters.items()):
                if param is not None and param.is_meta:
                    if id(param) not in fresh:
                        fresh[id(param)] = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                    module._parameters[name] = fresh[id(param)]
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.is_meta:
                    module._buffers[name] = torch.empty_like(buf, device=device)

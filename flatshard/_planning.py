"""Auto-wrapping, decided before anything is wrapped and without a process group: which
modules become units, and which parameters each unit flattens.

[Note: tied parameters in a plan] A parameter registered on several modules (a tied
embedding and output head) belongs to the lowest unit that contains every module using it:
the longest common prefix of the chains of units enclosing its registrations. That unit is
gathered whenever any of the users computes (units nest, so an enclosing unit is gathered
around its inner units' forward and backward), and it gets the whole gradient. Placing the
parameter anywhere lower would train two copies apart.

The wrapper builds exactly this plan and ``flatshard.plan`` reports it, so they agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Set, Tuple, Type

from torch import nn

from ._common import display_name, join_name
from .flat_param import OrigParam
from .wrap import select_units

_NOT_PER_UNIT = ("module", "auto_wrap_policy", "ignored_modules", "ignored_states")


@dataclass
class PlannedUnit:
    """One unit of a plan."""

    name: str  # the module's path from the root, as the user names it ("" for the root)
    module: nn.Module
    overrides: Dict[str, Any]  # constructor arguments that differ from the root's
    params: List[OrigParam] = field(default_factory=list)  # names relative to ``module``
    slots: List[Tuple[nn.Module, str]] = field(default_factory=list)  # (parent, attribute) to put the wrapper in
    tied: List[Tuple[str, ...]] = field(default_factory=list)  # full names of each tied parameter placed here


@dataclass
class _Registration:
    path: str
    module_path: str
    module: nn.Module
    attr: str
    param: nn.Parameter
    chain: Tuple[int, ...]  # indices (into the unit list) of the units enclosing the module, outermost first


def make_plan(
    root: nn.Module,
    policy: Any,
    *,
    wrapper_cls: Type[nn.Module],
    ignored_modules: Dict[int, nn.Module],
    ignored_params: Dict[int, nn.Parameter],
) -> List[PlannedUnit]:
    """The units to build for ``root`` under ``policy``, innermost first, the root last.

    Modules that already are ``wrapper_cls`` units are left alone (they own their parameters);
    ignored modules and parameters are left out.
    """
    targets = select_units(
        root,
        policy,
        is_wrapped=lambda m: isinstance(m, wrapper_cls),
        ignored_modules=set(ignored_modules.values()),
        ignored_params=set(ignored_params.values()),
    )
    for module, overrides in targets.items():
        bad = [key for key in overrides if key in _NOT_PER_UNIT]
        if bad:
            raise ValueError(f"the auto-wrap policy cannot override {bad[0]!r} for one unit (module {type(module).__name__})")
    units = [PlannedUnit("", root, {})]
    registrations = _walk(root, targets, units, wrapper_cls, ignored_modules, ignored_params)
    _assign(registrations, units)
    return _innermost_first(units)


def _walk(
    root: nn.Module,
    targets: Dict[nn.Module, Dict[str, Any]],
    units: List[PlannedUnit],
    wrapper_cls: Type[nn.Module],
    ignored_modules: Dict[int, nn.Module],
    ignored_params: Dict[int, nn.Parameter],
) -> List[_Registration]:
    """Visit the tree once: create a planned unit per target, note where each one sits and
    every parameter registration with the chain of units around it."""
    registrations: List[_Registration] = []
    unit_of_module: Dict[int, int] = {id(root): 0}
    seen: Set[int] = set()

    def visit(module: nn.Module, path: str, chain: Tuple[int, ...]) -> None:
        seen.add(id(module))
        for attr, param in module._parameters.items():
            if param is not None and id(param) not in ignored_params:
                registrations.append(_Registration(join_name(path, attr), path, module, attr, param, chain))
        for name, child in module._modules.items():
            if child is None or id(child) in ignored_modules or isinstance(child, wrapper_cls):
                continue
            child_path = join_name(path, name)
            child_chain = chain
            if child in targets:
                index = unit_of_module.get(id(child))
                if index is None:
                    index = unit_of_module[id(child)] = len(units)
                    units.append(PlannedUnit(child_path, child, dict(targets[child])))
                    child_chain = chain + (index,)
                    units[index].slots.append((module, name))
                    visit(child, child_path, child_chain)
                else:  # the same module registered twice: one wrapper in both places
                    units[index].slots.append((module, name))
            elif id(child) not in seen:
                visit(child, child_path, child_chain)

    visit(root, "", (0,))
    return registrations


def _assign(registrations: List[_Registration], units: List[PlannedUnit]) -> None:
    """Give each parameter (all its registrations) to the lowest unit enclosing all of them."""
    by_param: Dict[int, List[_Registration]] = {}
    for reg in registrations:
        by_param.setdefault(id(reg.param), []).append(reg)
    owner_of: Dict[int, int] = {}
    for key, regs in by_param.items():
        common = regs[0].chain
        for reg in regs[1:]:
            common = _common_prefix(common, reg.chain)
        owner_of[key] = common[-1]
        if len(regs) > 1:
            units[common[-1]].tied.append(tuple(r.path for r in regs))
    for reg in registrations:
        owner = units[owner_of[id(reg.param)]]
        relative = _relative(reg.path, owner.name)
        owner.params.append(OrigParam(relative, _relative(reg.module_path, owner.name), reg.module, reg.attr, reg.param))


def _common_prefix(a: Tuple[int, ...], b: Tuple[int, ...]) -> Tuple[int, ...]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _relative(path: str, prefix: str) -> str:
    if not prefix:
        return path
    if path == prefix:
        return ""
    if not path.startswith(prefix + "."):
        raise AssertionError(f"{path!r} is not under unit {display_name(prefix)}")
    return path[len(prefix) + 1 :]


def _innermost_first(units: List[PlannedUnit]) -> List[PlannedUnit]:
    """Units in the order they must be built: every unit after all units inside it."""
    depth = {id(u): u.name.count(".") + (1 if u.name else 0) for u in units}
    inner = sorted(units[1:], key=lambda u: -depth[id(u)])
    return inner + [units[0]]


def unit_overrides(options: Dict[str, Any], unit: PlannedUnit) -> Dict[str, Any]:
    """The constructor arguments of a planned inner unit: the root's, with its overrides and
    without the policy."""
    return {**options, **unit.overrides, "auto_wrap_policy": None}


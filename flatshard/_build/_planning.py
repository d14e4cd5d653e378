"""Auto-wrapping, decided before anything is wrapped and without a process group: which
modules become units, and which parameters each unit flattens.

[Note: tied parameters in a plan] A parameter registered on several modules (a tied
embedding and output head, or a module shared by two blocks) belongs to the lowest unit that
contains every module using it: the lowest common ancestor, in the tree of units, of the
units enclosing its registrations. That unit is gathered whenever any of the users computes
(units nest, so an enclosing unit is gathered around its inner units' forward and backward),
and it gets the whole gradient; anywhere lower, two copies would train apart. Containers
without a forward of their own (``ModuleList``, ``ModuleDict``) never run, so they own
nothing: their parameters go to the unit around them.

The wrapper builds exactly this plan and ``flatshard.plan`` reports it, so they agree; both
also run the same checks, so a plan is refused exactly when the wrapper would refuse it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from torch import nn

from .._base._common import coerce_config, describe_module, display_name, join_name
from ._init import Ignored, check_options, check_params, check_ties, resolve_ignored
from .._base._options import NOT_PER_UNIT, ConstructionOptions
from .._engine._unit import Unit, unit_of
from ..api import MixedPrecision
from .._flat._flat_param import OrigParam
from ..wrap import ModuleWrapPolicy, select_units

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


@dataclass
class PlannedUnit:
    """One unit of a plan."""

    name: str  # the module's path from the root, as the user names it ("" for the root)
    module: nn.Module
    overrides: Dict[str, Any]  # a policy's constructor arguments for this unit (``ConstructionOptions`` field names)
    parent: Optional["PlannedUnit"]  # the enclosing planned unit (None for the root)
    params: List[OrigParam] = field(default_factory=list)  # names relative to ``module``
    slots: List[Tuple[nn.Module, str]] = field(default_factory=list)  # (parent module, attribute) to put the wrapper in
    tied: List[Tuple[str, ...]] = field(default_factory=list)  # full names of each tied parameter placed here
    # The enclosing units of its further places, when the module is registered in several
    # (it runs inside each of them).
    also_in: List["PlannedUnit"] = field(default_factory=list)


@dataclass
class _Registration:
    unit: PlannedUnit  # the innermost planned unit enclosing the registering module
    path: str  # full name: the unit's name, then the path below it
    module_path: str
    module: nn.Module
    attr: str
    param: nn.Parameter


def make_plan(root: nn.Module, options: ConstructionOptions) -> List[PlannedUnit]:
    """The units to build for ``root`` under ``options.auto_wrap_policy`` (``None``: only
    the root), innermost first, the root last, after every check the wrapper would make.

    Modules that already are units (``ShardedDataParallel``s) are left alone (they own their parameters);
    ignored modules and parameters are left out.
    """
    ignored = resolve_ignored(root, options.ignored_modules, options.ignored_states)
    policy = options.auto_wrap_policy if options.auto_wrap_policy is not None else ModuleWrapPolicy(())
    targets = select_units(
        root,
        policy,
        is_wrapped=lambda m: unit_of(m) is not None,
        ignored_modules=set(ignored[0].values()),
        ignored_params=set(ignored[1].values()),
    )
    _add_full_precision_units(root, options, targets, ignored)
    units = [PlannedUnit("", root, {}, None)]
    registrations, nested = _walk(root, targets, units, ignored)
    _assign(registrations, units)
    check_ties([OrigParam(r.path, r.module_path, r.module, r.attr, r.param) for r in registrations], nested)
    for unit in units:
        _check_overrides(unit)
        check_options(unit_options(options, unit))
        check_params(unit.params, unit.name)
    return _innermost_first(units)


def _add_full_precision_units(
    root: nn.Module, options: ConstructionOptions, targets: Dict[nn.Module, Dict[str, Any]], ignored: Ignored
) -> None:
    """With mixed precision and a policy, the module classes MixedPrecision keeps in full
    precision (BatchNorm) become units of their own, as FSDP1 wraps them (see ``_init.unit_precision``)."""
    mp = coerce_config(options.mixed_precision, MixedPrecision, "mixed_precision")
    if options.auto_wrap_policy is None or mp is None or not _casts(mp):
        return
    classes = tuple(mp._module_classes_to_ignore)
    inside_units = {id(m) for w in root.modules() if unit_of(w) is not None for m in w.modules()}
    for module in root.modules():
        if module is not root and isinstance(module, classes) and id(module) not in inside_units and id(module) not in ignored[0]:
            targets.setdefault(module, {})


def _casts(mp: MixedPrecision) -> bool:
    return any(d is not None for d in (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype))


def unit_options(options: ConstructionOptions, unit: PlannedUnit) -> ConstructionOptions:
    """The constructor arguments of a planned unit: the root's, with its overrides and
    without the policy (the overrides are checked by ``_check_overrides``)."""
    return options.for_unit(unit.overrides)


def _check_overrides(unit: PlannedUnit) -> None:
    bad = [key for key in unit.overrides if key in NOT_PER_UNIT]
    if bad:
        raise ValueError(
            f"the auto-wrap policy cannot override {bad[0]!r} for one unit "
            f"({describe_module(unit.name, unit.module)})"
        )


def _walk(
    root: nn.Module,
    targets: Dict[nn.Module, Dict[str, Any]],
    units: List[PlannedUnit],
    ignored: Ignored,
) -> Tuple[List[_Registration], List[Tuple[str, Unit]]]:
    """Create a planned unit per target, note where each one sits, and every parameter
    registration with its innermost unit. A module reachable by several paths is walked on
    each, so its parameters count as used by every unit around it; a target unit is created
    once (its wrapper is put in every place)."""
    ignored_modules, ignored_params = ignored
    registrations: List[_Registration] = []
    nested: Dict[int, Tuple[str, Unit]] = {}
    unit_of_module: Dict[int, PlannedUnit] = {id(root): units[0]}
    walking: Set[int] = set()

    def visit(module: nn.Module, unit: PlannedUnit, below: str) -> None:
        walking.add(id(module))
        here = join_name(unit.name, below)
        for attr, param in module._parameters.items():
            if param is not None and id(param) not in ignored_params:
                registrations.append(_Registration(unit, join_name(here, attr), here, module, attr, param))
        for name, child in module._modules.items():
            if child is None or id(child) in ignored_modules or id(child) in walking:
                continue
            wrapped = unit_of(child)
            if wrapped is not None:
                path = join_name(here, name)
                nested.setdefault(id(child), (path, wrapped))
                for inner_name, inner in wrapped.descendants:
                    nested.setdefault(id(inner), (join_name(path, inner_name), inner))
            elif child in targets:
                _place_unit(child, module, name, join_name(here, name), unit, units, targets, unit_of_module, visit)
            else:
                visit(child, unit, join_name(below, name))
        walking.discard(id(module))

    visit(root, units[0], "")
    return registrations, list(nested.values())


def _place_unit(child: nn.Module, parent: nn.Module, attr: str, path: str, enclosing: PlannedUnit,
                units: List[PlannedUnit], targets: Dict[nn.Module, Dict[str, Any]],
                unit_of_module: Dict[int, PlannedUnit], visit: Any) -> None:
    unit = unit_of_module.get(id(child))
    if unit is None:
        unit = unit_of_module[id(child)] = PlannedUnit(path, child, dict(targets[child]), enclosing)
        units.append(unit)
        unit.slots.append((parent, attr))
        visit(child, unit, "")
    elif not any(m is parent and a == attr for m, a in unit.slots):
        unit.slots.append((parent, attr))
        if enclosing is not unit.parent and enclosing not in unit.also_in:
            unit.also_in.append(enclosing)


def _assign(registrations: List[_Registration], units: List[PlannedUnit]) -> None:
    """Give each parameter (all its registrations) to the lowest unit enclosing all of them
    (see [Note: tied parameters in a plan]): the deepest unit on every path from the root to
    every registration. A unit whose module is registered in several places has a path
    through each (it runs inside each enclosing unit)."""
    by_param: Dict[int, List[_Registration]] = {}
    for reg in registrations:
        by_param.setdefault(id(reg.param), []).append(reg)
    for regs in by_param.values():
        paths = [path for reg in regs for path in _paths(reg.unit)]
        common = set.intersection(*({id(u) for u in path} for path in paths))
        owner = [u for u in paths[0] if id(u) in common][-1]
        while owner.parent is not None and isinstance(owner.module, _CONTAINERS):
            owner = owner.parent
        if len({r.path for r in regs}) > 1:
            owner.tied.append(tuple(r.path for r in regs))
        for reg in regs:
            owner.params.append(OrigParam(_relative(reg.path, owner.name), _relative(reg.module_path, owner.name), reg.module, reg.attr, reg.param))


def _paths(unit: PlannedUnit) -> List[List[PlannedUnit]]:
    """Every chain of units from the root down to ``unit``, one per place it runs in."""
    if unit.parent is None:
        return [[unit]]
    return [path + [unit] for enclosing in [unit.parent] + unit.also_in for path in _paths(enclosing)]


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
    def depth(unit: PlannedUnit) -> int:
        d = 0
        while unit.parent is not None:
            unit, d = unit.parent, d + 1
        return d

    return sorted(units[1:], key=lambda u: -depth(u)) + [units[0]]

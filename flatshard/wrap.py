"""Auto-wrap policies and ``enable_wrap``/``wrap``: which submodules become units.

The names, signatures and selections are FSDP1's (``torch.distributed.fsdp.wrap``), so a policy
written for FSDP1 picks the same units here. A *callable* policy is asked two questions per
module, bottom up: ``policy(module=m, recurse=True, nonwrapped_numel=n)`` "look inside ``m``?"
and, after its children have taken their share, ``policy(module=m, recurse=False,
nonwrapped_numel=remainder)`` "make ``m`` a unit?". ``ModuleWrapPolicy`` and ``CustomPolicy``
instead name their targets directly. ``select_units`` turns any of them into the list of units
without touching the model; the constructor does the wrapping.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from contextvars import ContextVar
from typing import (
    AbstractSet, Any, Callable, Dict, FrozenSet, Iterable, Iterator, List, Mapping, Optional, Set, Tuple, Type, Union,
)

from torch import nn

from ._base._callable_module import make_callable
from ._base._common import clean_name, display_name
from ._base._options import OPTION_NAMES

__all__ = [
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "enable_wrap",
    "wrap",
    "CustomPolicy",
    "ModuleWrapPolicy",
]


def _as_module_classes(value: Any, arg_name: str) -> Tuple[Type[nn.Module], ...]:
    """``value`` (a set or other iterable of ``nn.Module`` subclasses) as a tuple for
    ``isinstance``; raises ``TypeError`` naming ``arg_name`` otherwise."""
    expected = f"{arg_name} must be a set of nn.Module subclasses"
    if isinstance(value, type):  # the commonest slip: the class instead of a set holding it
        raise TypeError(f"{expected}, e.g. {{{value.__name__}}}; got the class {value.__name__} itself")
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{expected}, e.g. {{TransformerBlock}}; got {value!r}")
    classes = tuple(value)
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"{expected}; got {value!r}, which holds {cls!r}, not an nn.Module subclass")
    return classes


# --------------------------------------------------------------------------------------------
# Callable policies


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """A policy that descends into every module and makes every submodule a unit.

    Args:
        *args: ignored (a policy's ``module``, ``recurse``, ``nonwrapped_numel``).
        **kwargs: ignored.
    """
    return True


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable[[nn.Module], Any]
) -> bool:
    """A policy that descends everywhere and makes a unit of each module ``lambda_fn`` accepts.

    Args:
        module: the module being considered.
        recurse: ``True`` when asked whether to look inside ``module``, ``False`` when asked
            whether to make it a unit.
        nonwrapped_numel: the parameter elements under ``module`` not yet in a unit (unused).
        lambda_fn: ``lambda_fn(module)`` is truthy for the modules to wrap.
    """
    if recurse:
        return True
    return bool(lambda_fn(module))


def transformer_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, transformer_layer_cls: AbstractSet[Type[nn.Module]]
) -> bool:
    """A policy that descends everywhere and makes a unit of each instance of the given
    classes (typically the transformer block, and the embedding so tied weights share a unit).

    Args:
        module: the module being considered.
        recurse: ``True`` when asked whether to look inside ``module``, ``False`` when asked
            whether to make it a unit.
        nonwrapped_numel: the parameter elements under ``module`` not yet in a unit (unused).
        transformer_layer_cls: a set of ``nn.Module`` subclasses.
    """
    classes = _as_module_classes(transformer_layer_cls, "transformer_layer_cls")
    if recurse:
        return True
    return isinstance(module, classes)


def _or_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, policies: Iterable[Callable[..., Any]]) -> bool:
    """A policy that answers yes when any of ``policies`` does (asked in order, stopping at
    the first yes).

    Args:
        module: the module being considered.
        recurse: whether the question is "look inside" (``True``) or "make a unit".
        nonwrapped_numel: the parameter elements under ``module`` not yet in a unit.
        policies: callable policies.
    """
    return any(policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel) for policy in policies)


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: Optional[AbstractSet[Type[nn.Module]]] = None,
    exclude_wrap_modules: Optional[AbstractSet[Type[nn.Module]]] = None,
) -> bool:
    """A policy that makes a unit of any module whose not-yet-wrapped parameters reach a size.

    A module is looked into only if its unwrapped elements reach ``min_num_params`` and it is
    not a forced leaf; it becomes a unit if what its children left over still reaches
    ``min_num_params`` and its class is not excluded. A forced leaf is therefore never a unit
    itself either: its parameters go to the unit of an ancestor.

    Args:
        module: the module being considered.
        recurse: ``True`` when asked whether to look inside ``module``, ``False`` when asked
            whether to make it a unit.
        nonwrapped_numel: the parameter elements under ``module`` not yet in a unit.
        min_num_params: the threshold, in elements.
        force_leaf_modules: classes never looked into (default
            ``size_based_auto_wrap_policy.FORCE_LEAF_MODULES``: ``nn.MultiheadAttention``, whose
            forward reads its ``out_proj`` weight directly, so it cannot be split).
        exclude_wrap_modules: classes never made units (default
            ``size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES``: ``nn.ModuleList`` and
            ``nn.ModuleDict``, containers that have no forward of their own).
    """
    if force_leaf_modules is None:
        force_leaf_modules = size_based_auto_wrap_policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
    if exclude_wrap_modules is None:
        exclude_wrap_modules = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]
    big_enough = nonwrapped_numel >= min_num_params
    if recurse:
        return big_enough and not isinstance(module, _as_module_classes(force_leaf_modules, "force_leaf_modules"))
    return big_enough and not isinstance(module, _as_module_classes(exclude_wrap_modules, "exclude_wrap_modules"))


# FSDP1 publishes the defaults as attributes of the function. They are frozensets (FSDP1's are
# sets) so that no import can change another's defaults in place; combine them with ``|``.
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = frozenset({nn.MultiheadAttention})  # type: ignore[attr-defined]
size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = frozenset(  # type: ignore[attr-defined]
    {nn.ModuleList, nn.ModuleDict}
)


# --------------------------------------------------------------------------------------------
# Target-naming policies


class ModuleWrapPolicy:
    """Make a unit of every submodule that is an instance of one of ``module_classes``; each
    such unit gets the root's constructor arguments.

    Args:
        module_classes: a set (or other iterable) of ``nn.Module`` subclasses.
    """

    def __init__(self, module_classes: Iterable[Type[nn.Module]]) -> None:
        classes = _as_module_classes(module_classes, "module_classes")
        self._module_classes: FrozenSet[Type[nn.Module]] = frozenset(classes)

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        # Usable as a callable policy too (e.g. inside ``_or_policy``), as FSDP1's is.
        if recurse:
            return True
        return isinstance(module, tuple(self._module_classes))

    def __repr__(self) -> str:
        names = ", ".join(sorted(cls.__qualname__ for cls in self._module_classes))
        return f"ModuleWrapPolicy({{{names}}})"


class CustomPolicy:
    """Decide per module with ``lambda_fn(module)``: ``False`` or ``{}`` means not a unit,
    ``True`` a unit with the root's constructor arguments, a non-empty dict a unit whose
    constructor arguments are the root's updated with the dict.

    ``lambda_fn`` is called on every module that is neither ignored nor already wrapped, the
    root included (as FSDP1 does; the root is a unit anyway, so only the type of its answer
    is checked), in ``named_modules()`` order.

    Args:
        lambda_fn: ``module -> bool | dict`` of constructor keyword arguments.
    """

    def __init__(self, lambda_fn: Callable[[nn.Module], Union[bool, Dict[str, Any]]]) -> None:
        if not callable(lambda_fn):
            raise TypeError(f"CustomPolicy needs a callable lambda_fn (module -> bool or dict); got {lambda_fn!r}")
        self._lambda_fn = lambda_fn

    def __repr__(self) -> str:
        return f"CustomPolicy({self._lambda_fn!r})"


# --------------------------------------------------------------------------------------------
# Selecting units


@dataclasses.dataclass(frozen=True)
class _Scope:
    """What a policy may see under the root: modules and parameters, by ``id``, that are
    excluded because they are ignored or inside an already-wrapped module."""

    excluded_modules: FrozenSet[int]
    excluded_params: FrozenSet[int]

    def excludes(self, module: nn.Module) -> bool:
        return id(module) in self.excluded_modules

    def numel(self, module: nn.Module) -> int:
        # ``parameters()`` yields each (possibly tied) parameter once.
        return sum(p.numel() for p in module.parameters() if id(p) not in self.excluded_params)

    def walk(self, root: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
        """``root`` and its non-excluded submodules as ``named_modules()`` would list them."""
        return _preorder(root, "", self.excludes, {id(root)})


def _preorder(
    module: nn.Module, path: str, skip: Callable[[nn.Module], bool], seen: Set[int]
) -> Iterator[Tuple[str, nn.Module]]:
    # Recursive and marking on visit, like ``named_modules``, so that a module reachable by
    # two paths is listed once, under the same (first) path ``named_modules`` gives it.
    yield clean_name(path), module
    for name, child in module.named_children():
        if id(child) in seen or skip(child):
            continue
        seen.add(id(child))
        yield from _preorder(child, f"{path}.{name}" if path else name, skip, seen)


def _build_scope(
    root: nn.Module,
    is_wrapped: Callable[[nn.Module], bool],
    ignored_modules: AbstractSet[nn.Module],
    ignored_params: AbstractSet[nn.Parameter],
) -> _Scope:
    ignored = {id(m) for top in ignored_modules for m in top.modules()}
    wrapped: List[nn.Module] = []

    def stop(module: nn.Module) -> bool:
        if id(module) in ignored:
            return True
        if is_wrapped(module):
            wrapped.append(module)
            return True
        return False

    for _ in _preorder(root, "", stop, {id(root)}):
        pass
    tops = list(ignored_modules) + wrapped
    # An ignored module's parameters are ignored even if the caller left them out of
    # ``ignored_params`` (FSDP1 relies on the caller to include them).
    excluded_params = {id(p) for p in ignored_params} | {id(p) for top in tops for p in top.parameters()}
    excluded_modules = ignored | {id(m) for top in wrapped for m in top.modules()}
    excluded_modules.discard(id(root))
    return _Scope(frozenset(excluded_modules), frozenset(excluded_params))


def _select_recursive(root: nn.Module, policy: Callable[..., Any], scope: _Scope) -> Set[int]:
    """FSDP1's recursive selection (``only_wrap_children``): the ``id``s of chosen modules."""
    chosen: Set[int] = set()
    # A module reachable by two paths is decided once; the second path reuses the numel it
    # took (FSDP1 would wrap it a second time, or fail on its already-wrapped children).
    taken_by: Dict[int, int] = {id(root): 0}

    def visit(module: nn.Module) -> int:
        numel = scope.numel(module)
        if not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        taken = 0
        for _, child in module.named_children():
            if scope.excludes(child):
                continue
            if id(child) not in taken_by:
                taken_by[id(child)] = visit(child)
            taken += taken_by[id(child)]
        if module is not root and policy(module=module, recurse=False, nonwrapped_numel=numel - taken):
            chosen.add(id(module))
            return numel
        return taken

    visit(root)
    return chosen


def _custom_overrides(result: Any, path: str, module: nn.Module) -> Optional[Dict[str, Any]]:
    """A CustomPolicy answer as constructor overrides (``None``: not a unit), checked."""
    where = f"{'module ' if path else ''}{display_name(path)} ({type(module).__name__})"
    if not isinstance(result, (bool, dict)):
        raise TypeError(
            f"CustomPolicy's lambda_fn must return True, False or a dict of constructor keyword "
            f"arguments, but it returned {result!r} for {where}"
        )
    if not result:
        return None
    if result is True:
        return {}
    for key in result:
        if key == "module":
            raise TypeError(
                f"CustomPolicy's lambda_fn returned an override of 'module' for {where}; the module "
                f"of a unit is the module itself and cannot be overridden"
            )
        if key not in OPTION_NAMES:  # (the planner refuses those that hold for the whole plan)
            raise TypeError(
                f"CustomPolicy's lambda_fn returned the override {key!r} for {where}, which is not a "
                f"constructor argument; the arguments are {', '.join(OPTION_NAMES)}"
            )
    return dict(result)


def _as_policy(policy: Any) -> Any:
    """``policy`` as one of ours; torch FSDP1's ModuleWrapPolicy/CustomPolicy are translated
    (mixing import sources is not an error), other non-callables are refused."""
    if isinstance(policy, (ModuleWrapPolicy, CustomPolicy)):
        return policy
    cls = type(policy)
    if cls.__module__.startswith("torch.distributed"):
        if cls.__name__ == "ModuleWrapPolicy" and hasattr(policy, "_module_classes"):
            return ModuleWrapPolicy(policy._module_classes)
        if cls.__name__ == "CustomPolicy" and hasattr(policy, "_lambda_fn"):
            return CustomPolicy(policy._lambda_fn)
    if callable(policy):
        return policy
    type_name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    raise TypeError(
        f"auto_wrap_policy must be a callable policy (such as functools.partial("
        f"transformer_auto_wrap_policy, transformer_layer_cls={{Block}})), a ModuleWrapPolicy or a "
        f"CustomPolicy; got an object of type {type_name}"
    )


def select_units(
    root: nn.Module,
    policy: Any,
    *,
    is_wrapped: Callable[[nn.Module], bool],
    ignored_modules: AbstractSet[nn.Module],
    ignored_params: AbstractSet[nn.Parameter],
) -> Dict[nn.Module, Dict[str, Any]]:
    """The submodules of ``root`` that ``policy`` makes units, each with its constructor
    keyword overrides (``{}``: the root's arguments). ``root`` is always a unit and is never
    returned. Pure: ``root`` is not modified.

    Modules for which ``is_wrapped`` is true, ignored modules, and everything under either
    are neither selected nor looked into, and their parameters count toward no size. The
    result lists modules in ``root.named_modules()`` order, so a unit comes before the units
    nested in it (iterate it reversed to build innermost units first).

    Args:
        root: the module being wrapped.
        policy: a callable policy (FSDP1's protocol), a ``ModuleWrapPolicy`` or a
            ``CustomPolicy`` (ours or torch FSDP1's).
        is_wrapped: tells an already-wrapped submodule.
        ignored_modules: modules whose subtrees are left out.
        ignored_params: parameters left out of the sizes.
    """
    policy = _as_policy(policy)
    if any(root is m for m in ignored_modules):
        return {}
    scope = _build_scope(root, is_wrapped, ignored_modules, ignored_params)
    units: Dict[nn.Module, Dict[str, Any]] = {}
    if isinstance(policy, CustomPolicy):
        for path, module in scope.walk(root):
            overrides = _custom_overrides(policy._lambda_fn(module), path, module)
            if overrides is not None and module is not root:
                units[module] = overrides
    elif isinstance(policy, ModuleWrapPolicy):
        classes = tuple(policy._module_classes)
        units = {m: {} for _, m in scope.walk(root) if m is not root and isinstance(m, classes)}
    else:
        chosen = _select_recursive(root, policy, scope)
        units = {m: {} for _, m in scope.walk(root) if id(m) in chosen}
    return units


# --------------------------------------------------------------------------------------------
# enable_wrap / wrap


@dataclasses.dataclass(frozen=True)
class _WrapConfig:
    wrapper_cls: Callable[..., nn.Module]
    kwargs: Mapping[str, Any]


# [Note: wrap context] ``wrap()`` is called deep inside user model constructors, which
# ``enable_wrap`` cannot pass arguments through, so its configuration must live outside the call
# chain. A ContextVar (FSDP1 uses class attributes) keeps it to the current thread or asyncio
# task, and restoring it by token leaves no trace even when the ``with`` body raises.
_WRAP_CONFIG: ContextVar[Optional[_WrapConfig]] = ContextVar("flatshard_wrap_config", default=None)


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Callable[..., nn.Module], **wrapper_kwargs: Any) -> Iterator[None]:
    """Inside this context, ``wrap(module, **overrides)`` returns
    ``wrapper_cls(module, **wrapper_kwargs, **overrides)`` (overrides win).

    Args:
        wrapper_cls: the wrapper to build, e.g. ``ShardedDataParallel``.
        **wrapper_kwargs: constructor arguments shared by every ``wrap`` in the context.

    Raises:
        NotImplementedError: if entered inside another ``enable_wrap`` (as FSDP1).
    """
    if not callable(wrapper_cls):
        raise TypeError(
            f"enable_wrap needs a wrapper class as wrapper_cls, e.g. ShardedDataParallel; got {wrapper_cls!r}"
        )
    outer = _WRAP_CONFIG.get()
    if outer is not None:
        raise NotImplementedError(
            f"enable_wrap cannot be nested: this one is inside another enable_wrap (wrapper_cls="
            f"{getattr(outer.wrapper_cls, '__name__', outer.wrapper_cls)!s}); leave the outer one first"
        )
    token = _WRAP_CONFIG.set(_WrapConfig(wrapper_cls, types.MappingProxyType(dict(wrapper_kwargs))))
    try:
        yield
    finally:
        _WRAP_CONFIG.reset(token)


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` if inside ``enable_wrap``, else return it unchanged, so that one model
    definition serves both wrapped and unwrapped use.

    Args:
        module: the module to wrap.
        **wrap_overrides: constructor arguments that take precedence over ``enable_wrap``'s.
    """
    config = _WRAP_CONFIG.get()
    if config is None:
        return module
    return config.wrapper_cls(module, **{**config.kwargs, **wrap_overrides})


# ``flatshard.wrap`` is this module (as ``torch.distributed.fsdp.wrap`` is), and calling it calls
# ``wrap`` above; see [Note: callable modules].
make_callable(__name__)

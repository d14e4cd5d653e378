"""The wrapped module's own ``state_dict()``, called from outside the wrapper.

[Note: the wrapped module's state dict] Code that holds the wrapped module rather than the
wrapper -- ``model.module.state_dict()``, Hugging Face's ``save_pretrained`` (which calls
``self.state_dict()`` on the model whose method runs, the wrapped one when reached through the
wrapper's attribute forwarding), peft's adapter saving -- would get what the modules hold
outside forward: the root unit's parameters missing (or flat shards), the nested wrappers'
dicts under their prefixes. FSDP1 writes such a dict to disk without a word. Here the
wrapped module's ``state_dict()`` is the wrapper's full state dict instead:

- a state-dict pre-hook on the wrapped module marks the wrapper's units ``ROUTED`` (unless
  the call is the wrapper's own, from its plain view: ``IN_PLAIN_VIEW``);
- while torch walks the module tree, nested wrappers see the mark and add nothing (no
  gathering that would be thrown away); the modules add their shards or nothing;
- the post-hook removes everything under the call's prefix and puts the wrapper's
  ``FULL_STATE_DICT`` in its place (the unwrapped model's keys and full values), with the
  model's ``FullStateDictConfig`` when its type is ``FULL_STATE_DICT`` (so ``rank0_only`` /
  ``offload_to_cpu`` apply), else the default config.

[Note: loading through a parent] ``parent.load_state_dict(sd)`` on a plain module holding a
wrapper walks the tree: torch calls each module's ``_load_from_state_dict`` with the keys
under its prefix. The wrapper's loads its part of ``sd`` (the unwrapped model's keys) with its
own ``load_state_dict`` (non-strict: torch reports missing and unexpected keys at the end, as
for any module), marks the units under it ``ROUTED`` so the nested wrappers the walk reaches
next load nothing, and a load post-hook on the wrapper drops the keys the walk below it then
reports missing (the modules' own registrations, which the wrapper's load already covered)
and clears the marks.

So, like the wrapper's ``state_dict()``, it is collective: every rank calls it (Hugging Face's
``save_pretrained(..., is_main_process=rank == 0)`` on every rank does). A ``ROUTED`` mark that
an exception left behind is harmless: a later pre-hook starts afresh, the wrapper's own
``state_dict()`` clears it, and nested wrappers skip only inside a tree walk.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Optional

from torch import nn

from .._base._common import WRAPPED_MODULE
from ._checkpointing import guarded_call
from ._state_dict import get_settings, load_model_state, model_state
from .._engine._unit import IN_PLAIN_VIEW, ROUTED, Unit, unit_of


class _Route:
    """The hooks on one wrapped module (they hold the wrapper weakly: the module is its child)."""

    def __init__(self, wrapper: nn.Module) -> None:
        self.wrapper = weakref.ref(wrapper)
        self.keep_vars: Optional[bool] = None  # set while this module's call is routed
        self.loading_prefix: Optional[str] = None  # set while a parent's load walks below the wrapper

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_Route":
        """A copied model's hooks route to *its* wrapper (copied before its modules, so in
        ``memo``), never to the original's: a weak reference is copied as itself, which made a
        deep copy's ``state_dict()`` the original model's. Copied without its wrapper (only
        the wrapped module), the route leads nowhere and the module's own state dict stands."""
        new = _Route.__new__(_Route)
        memo[id(self)] = new
        wrapper = self.wrapper()
        copied = memo.get(id(wrapper)) if wrapper is not None else None
        new.wrapper = weakref.ref(copied) if copied is not None else _nothing
        new.keep_vars = None
        new.loading_prefix = None
        return new

    def _units(self) -> List[Unit]:
        wrapper = self.wrapper()
        unit = unit_of(wrapper) if wrapper is not None else None
        return unit.members() if unit is not None else []

    def before(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        units = self._units()
        if not units or units[0].state_dict_route == IN_PLAIN_VIEW:
            return
        for unit in units:
            unit.state_dict_route = ROUTED
        self.keep_vars = keep_vars

    def after(self, module: nn.Module, destination: Dict[str, Any], prefix: str, local_metadata: Dict[str, Any]) -> None:
        wrapper, keep_vars = self.wrapper(), self.keep_vars
        if wrapper is None or keep_vars is None:
            return
        self.keep_vars = None
        for unit in self._units():
            unit.state_dict_route = None
        for key in [k for k in destination if k.startswith(prefix)]:
            del destination[key]
        full = full_state(wrapper, prefix, keep_vars)
        destination.update(full)
        metadata = getattr(destination, "_metadata", None)
        if metadata is not None:
            metadata.update(getattr(full, "_metadata", {}))


    def load(self, state_dict: Mapping[str, Any], prefix: str, missing_keys: List[str], unexpected_keys: List[str]) -> None:
        """The wrapper's ``_load_from_state_dict`` in a parent's load: see [Note: loading
        through a parent]."""
        wrapper, units = self.wrapper(), self._units()
        if wrapper is None or not units or units[0].state_dict_route == ROUTED:
            return  # (nested in a wrapper that loads the whole of it)
        part: Dict[str, Any] = OrderedDict((k[len(prefix) :], v) for k, v in state_dict.items() if k.startswith(prefix))
        metadata = getattr(state_dict, "_metadata", None)
        if metadata is not None:
            own = prefix[:-1]
            part._metadata = OrderedDict(  # type: ignore[attr-defined]
                ("" if k == own else k[len(prefix) :], v) for k, v in metadata.items() if k == own or k.startswith(prefix)
            )
        with guarded_call(wrapper, "load_state_dict() of a module holding the model", clears=True):
            result = load_model_state(wrapper, part, strict=False, settings=get_settings(wrapper))
        missing_keys.extend(prefix + key for key in result.missing_keys)
        unexpected_keys.extend(prefix + key for key in result.unexpected_keys)
        for unit in units:
            unit.state_dict_route = ROUTED
        self.loading_prefix = prefix

    def after_load(self, wrapper: nn.Module, incompatible_keys: Any) -> None:
        prefix, self.loading_prefix = self.loading_prefix, None
        if prefix is None:
            return
        for unit in self._units():
            unit.state_dict_route = None
        below = prefix + WRAPPED_MODULE + "."
        incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if not k.startswith(below)]


def _nothing() -> None:
    return None


def route_state_dict(wrapper: nn.Module, module: nn.Module) -> "_Route":
    """Make ``module``'s ``state_dict()`` (``module`` wrapped by ``wrapper``) the wrapper's
    full state dict when called from outside the wrapper (see [Note: the wrapped module's
    state dict]), and let a parent's ``load_state_dict()`` load the wrapper (the returned
    route's ``load``; see [Note: loading through a parent]).

    Args:
        wrapper: the ``ShardedDataParallel`` wrapping ``module``.
        module: the wrapped module.
    """
    route = _Route(wrapper)
    # (partials: torch marks a post-hook by setting an attribute on it, which a bound method refuses)
    module.register_state_dict_pre_hook(functools.partial(_Route.before, route))
    module.register_state_dict_post_hook(functools.partial(_Route.after, route))
    wrapper.register_load_state_dict_post_hook(functools.partial(_Route.after_load, route))
    return route


def skips_in_tree_walk(unit: Unit, destination: Optional[Dict[str, Any]]) -> bool:
    """Whether a wrapper's ``state_dict()`` is part of a routed call's tree walk (it adds
    nothing then: the post-hook replaces the whole dict)."""
    return destination is not None and unit.state_dict_route == ROUTED


def full_state(wrapper: nn.Module, prefix: str, keep_vars: bool) -> Dict[str, Any]:
    """``wrapper``'s ``FULL_STATE_DICT`` with keys under ``prefix``: with the model's own
    ``FullStateDictConfig`` if its type is ``FULL_STATE_DICT``, else the default one.
    Collective."""
    with guarded_call(wrapper, "state_dict() of the wrapped module"):
        return model_state(wrapper, None, prefix, keep_vars, get_settings(wrapper, full=True))

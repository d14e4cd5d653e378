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

So, like the wrapper's ``state_dict()``, it is collective: every rank calls it (Hugging Face's
``save_pretrained(..., is_main_process=rank == 0)`` on every rank does). A ``ROUTED`` mark that
an exception left behind is harmless: a later pre-hook starts afresh, the wrapper's own
``state_dict()`` clears it, and nested wrappers skip only inside a tree walk.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Dict, List, Optional

from torch import nn

from ._checkpointing import named_units
from ._state_dict import model_state, restore_settings, snapshot_settings
from ._unit import IN_PLAIN_VIEW, ROUTED, Unit, unit_of
from .api import FullOptimStateDictConfig, FullStateDictConfig, StateDictSettings, StateDictType


class _Route:
    """The hooks on one wrapped module (they hold the wrapper weakly: the module is its child)."""

    def __init__(self, wrapper: nn.Module) -> None:
        self.wrapper = weakref.ref(wrapper)
        self.keep_vars: Optional[bool] = None  # set while this module's call is routed

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


def route_state_dict(wrapper: nn.Module, module: nn.Module) -> None:
    """Make ``module``'s ``state_dict()`` (``module`` wrapped by ``wrapper``) the wrapper's
    full state dict when called from outside the wrapper; see [Note: the wrapped module's
    state dict].

    Args:
        wrapper: the ``ShardedDataParallel`` wrapping ``module``.
        module: the wrapped module.
    """
    route = _Route(wrapper)
    # (partials: torch marks a post-hook by setting an attribute on it, which a bound method refuses)
    module.register_state_dict_pre_hook(functools.partial(_Route.before, route))
    module.register_state_dict_post_hook(functools.partial(_Route.after, route))


def skips_in_tree_walk(unit: Unit, destination: Optional[Dict[str, Any]]) -> bool:
    """Whether a wrapper's ``state_dict()`` is part of a routed call's tree walk (it adds
    nothing then: the post-hook replaces the whole dict)."""
    return destination is not None and unit.state_dict_route == ROUTED


def full_state(wrapper: nn.Module, prefix: str, keep_vars: bool) -> Dict[str, Any]:
    """``wrapper``'s ``FULL_STATE_DICT`` with keys under ``prefix``: with the model's own
    ``FullStateDictConfig`` if its type is ``FULL_STATE_DICT``, else the default one.
    Collective."""
    named = named_units(wrapper)
    for _, unit in named:
        unit.state_dict_route = None
    snapshot = snapshot_settings(wrapper)
    full = StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())
    try:
        for unit, settings in snapshot:
            if settings.state_dict_type is not StateDictType.FULL_STATE_DICT:
                unit.use_state_dict_settings(full)
        return model_state(wrapper, None, prefix, keep_vars)
    finally:
        restore_settings(snapshot)

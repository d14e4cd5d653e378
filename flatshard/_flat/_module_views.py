"""What a handle's modules hold in place of its original parameters while the unit is gathered,
and what users write through it.

[Note: writes through the views] While a unit is gathered, its modules hold views of the full
flat tensor: a copy of the shards that is freed, or gathered again, later. A write through a
view would vanish with that copy: in place (a weight clamped or renormalised inside forward, an
edit of a gathered unit's weight after its forward) or by rebinding a view's ``.data``. So
before the full flat tensor is freed or gathered again, and before new views replace these, the
handle takes such writes into the shard:

- an in-place write shows as a new version of the full flat tensor (views share its version
  counter; flatshard's own gathers write through an alias with a counter of its own), and then
  this rank's range of it is copied into the shard (under mixed precision only the elements
  that differ from the shard's value in the compute dtype, so the others keep their precision);
- a view whose ``.data`` was rebound is loaded into the shard like a state-dict value.

Between a unit's forward and its backward, autograd computes the gradients with these views,
so a view replaced or rebound then is refused at the backward (as FSDP1 refuses it): the
runtime asks ``changed``. A write through a view's ``.data`` alias in place (``w.data.mul_``)
changes no version counter and stays invisible; docs/training.md ("Writes to parameters")
says so.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from ._orig_params import OrigParams

__all__ = ["ModuleViews"]


class ModuleViews:
    """The views a handle puts on its modules (see [Note: writes through the views]).

    Args:
        slots: every registration: (module, attribute, index of the original parameter).
        offsets: where each original parameter starts in the full flat tensor.
        placeholders: what the modules hold while sharded (the default mode), one per parameter.
        orig: the original parameters (``use_orig_params``), which the modules hold instead.
        rank: this rank (for messages).
    """

    def __init__(
        self,
        slots: Sequence[Tuple[nn.Module, str, int]],
        offsets: Sequence[int],
        placeholders: Sequence[torch.Tensor],
        orig: Optional[OrigParams],
        rank: int,
    ) -> None:
        self._slots = list(slots)
        self._offsets = list(offsets)
        self._placeholders = list(placeholders)
        self._orig = orig
        self._rank = rank
        # The views on the modules now (None: none) and the full flat tensor's version then.
        self._views: Optional[List[torch.Tensor]] = None
        self._version = 0

    @property
    def installed(self) -> bool:
        return self._views is not None

    def views(self) -> List[torch.Tensor]:
        return list(self._views or [])

    def install(self, views: Sequence[torch.Tensor], full: torch.Tensor, as_params: bool, names: Sequence[str]) -> None:
        """Put ``views`` (of ``full``) on the modules; ``as_params``: also in their
        ``_parameters`` while a forward runs (``use_orig_params``, see [Note: original
        parameters])."""
        if self._orig is not None:
            self._orig.overlay(views, as_params)
        else:
            for module, attr, index in self._slots:
                if attr in module._parameters:
                    raise _replaced_error(self._rank, names[index], module, attr)
                module.__dict__[attr] = views[index]
        self._views = list(views)
        self._version = full._version

    def follow(self, views: Sequence[torch.Tensor], full: torch.Tensor) -> None:
        """The tensor the views are of was replaced (a ``NO_SHARD`` ``FlatParameter`` whose
        ``.data`` the user rebound): put ``views`` of the new one in their place."""
        for module, attr, index in self._slots:
            if module.__dict__.get(attr) is (self._views or [])[index]:
                module.__dict__[attr] = views[index]
        self._views = list(views)
        self._version = full._version

    def end_forward(self) -> None:
        """The forward that installed the views returned (they stay as attributes)."""
        if self._orig is not None:
            self._orig.end_forward()

    def remove(self) -> None:
        """Put placeholders (or the original parameters) back in place of the views. (A
        parameter the user registered meanwhile under a flattened name is refused at the next
        ``install``: a plain view or summon may have parameters installed right now.)"""
        self._views = None
        if self._orig is not None:
            self._orig.remove_overlay()
            return
        for module, attr, index in self._slots:
            module.__dict__[attr] = self._placeholders[index]

    # -- what users did through them ----------------------------------------------------------

    def written_in_place(self, full: torch.Tensor) -> bool:
        """Whether something wrote into ``full`` (the full flat tensor) through a view since
        the views were installed or ``taken`` last."""
        return self._views is not None and full._version != self._version

    def taken(self, full: torch.Tensor) -> None:
        self._version = full._version

    def rebound(self, full_data: torch.Tensor) -> List[Tuple[int, torch.Tensor]]:
        """(index, value) of every view on a module whose ``.data`` was rebound (``full_data``:
        the gathered full flat tensor). (Runs at every free and regather: one identity test
        and one data-pointer comparison per registration.)"""
        views = self._views
        if views is None:
            return []
        base, itemsize, offsets = full_data.data_ptr(), full_data.element_size(), self._offsets
        found = {}
        for module, attr, index in self._slots:
            view = views[index]
            if module.__dict__.get(attr) is view and view.data_ptr() != base + offsets[index] * itemsize:
                found[index] = view.detach()
        return sorted(found.items(), key=lambda item: item[0])

    def changed(self, full_data: torch.Tensor, names: Sequence[str]) -> Optional[str]:
        """The first view that was replaced or rebound on its module, described; ``None``."""
        views = self._views
        if views is None:
            return None
        base, itemsize, offsets = full_data.data_ptr(), full_data.element_size(), self._offsets
        for module, attr, index in self._slots:
            view = views[index]
            if module.__dict__.get(attr) is not view:
                return f"parameter '{names[index]}' was replaced"
            if view.data_ptr() != base + offsets[index] * itemsize:
                return f"the .data of parameter '{names[index]}' was rebound"
        return None


def _replaced_error(rank: int, name: str, module: nn.Module, attr: str) -> ValueError:
    return ValueError(
        f"[rank {rank}] parameter '{name}' was replaced by a new nn.Parameter ({type(module).__name__}.{attr} = ...), but with "
        f"use_orig_params=False its values live in its unit's FlatParameter, and the new object would be "
        f"ignored: change the values inside summon_full_params(writeback=True) or with load_state_dict, or "
        f"wrap the model with use_orig_params=True (where replacing a parameter is supported)"
    )

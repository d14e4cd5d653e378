"""The order units run in, and which unit to prefetch next.

[Note: execution order] Two orders are kept. The *forward order* is the order in which units
start their forward during the root's first forward; it is frozen afterwards and drives
``forward_prefetch``. The *post-forward order* is the order in which units finish their
forward in the current iteration (first occurrence only); backward runs roughly in its
reverse, so it drives ``backward_prefetch``. It is cleared at the end of each backward.
"""

from __future__ import annotations

from typing import Callable, Dict, Generic, Hashable, List, Optional, Set, TypeVar

_U = TypeVar("_U", bound=Hashable)


class ExecOrder(Generic[_U]):
    """Records the units' execution order for one root."""

    def __init__(self) -> None:
        self._forward: List[_U] = []
        self._forward_index: Dict[_U, int] = {}
        self._forward_frozen = False
        self._post_forward: List[_U] = []
        self._post_forward_index: Dict[_U, int] = {}
        self._this_forward: List[_U] = []  # every pre-forward of the current root forward
        self._ran: Set[_U] = set()  # the units of ``_this_forward``

    def record_pre_forward(self, unit: _U) -> None:
        self._this_forward.append(unit)
        self._ran.add(unit)
        if not self._forward_frozen and unit not in self._forward_index:
            self._forward_index[unit] = len(self._forward)
            self._forward.append(unit)

    def start_forward(self) -> None:
        """Called when the root's forward starts."""
        self._this_forward.clear()
        self._ran.clear()

    def this_forward(self) -> List[_U]:
        """The units, in the order their forward started, since the root's forward started."""
        return list(self._this_forward)

    def first_forward(self) -> List[_U]:
        """The units in the order of the first iteration (each once)."""
        return list(self._forward)

    def freeze_forward_order(self) -> None:
        """Called when the root's first forward ends."""
        self._forward_frozen = True

    def record_post_forward(self, unit: _U) -> None:
        if unit not in self._post_forward_index:
            self._post_forward_index[unit] = len(self._post_forward)
            self._post_forward.append(unit)

    def end_iteration(self) -> None:
        """Called at the end of each backward."""
        self._post_forward.clear()
        self._post_forward_index.clear()

    def next_in_forward(self, unit: _U) -> Optional[_U]:
        """The unit that started its forward after ``unit`` in the first iteration, unless it
        has run in this forward already.

        (A rank whose units run in another order than the first iteration's prefetches the
        same units as its peers then, each once: without that exception it would gather again
        a unit it ran and freed, one collective more than its peers, which would pair with
        their order check and abort the process on gloo instead of raising there.)"""
        index = self._forward_index.get(unit)
        if index is None or index + 1 >= len(self._forward):
            return None
        target = self._forward[index + 1]
        return None if target in self._ran else target

    def next_in_backward(self, unit: _U, wanted: Callable[[_U], bool]) -> Optional[_U]:
        """The latest unit that finished its forward before ``unit`` and is ``wanted``
        (i.e. has not started its backward yet)."""
        index = self._post_forward_index.get(unit)
        if index is None:
            return None
        for candidate in reversed(self._post_forward[:index]):
            if wanted(candidate):
                return candidate
        return None


# [Note: order check] Ranks must issue the same collectives in the same order; if one rank
# runs a different unit (data-dependent control flow), the collectives pair the wrong units
# silently when their sizes match, make gloo abort the process when they do not (torch's
# gloo enforces message sizes with an abort), or wait forever. Every root forward is a guarded
# call ([Note: one guarded path] in ``_comm/_guard``): it starts with the call's entry check
# and ends with one check that all ranks ran the same units in the same order (a digest of the
# order and of the optimizer steps taken, compared by ``Communicator.agree``: one collective
# whose cost does not grow with the world size), and every backward starts with one that the
# same units will receive gradients ([Note: backward agreement] in ``_agreement``); only when
# a digest differs do the ranks exchange their positions, to name the first unit that
# differs. Ranks that built different units never get this far: the root's first forward
# compares the units themselves (``check_same_units``). Under
# ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (and while ranks generate without ``synced_gpus``) the
# runtime is ``checking``: every collective of a unit is then preceded by one position check
# naming it (``describe`` of its ``token``), every backward ends with one, and since every
# check of the guard is the same kind of agreement, mismatched checks still pair up: every
# rank learns where every rank is and raises, naming what each rank was doing, before any
# mismatched collective can abort or hang.

GATHER, REDUCE, END_OF_BACKWARD = 1, 2, 3
_KIND_SCALE = 1 << 32
_WHAT = {GATHER: "gathering the parameters of unit {}", REDUCE: "reducing the gradients of unit {}"}


def token(kind: int, index: int = 0) -> int:
    """The integer that names a collective of unit ``index`` (see [Note: order check])."""
    return kind * _KIND_SCALE + index


def describe(value: int, names: List[str]) -> str:
    """What a rank whose check value is ``value`` was doing."""
    kind, index = divmod(value, _KIND_SCALE)
    if kind in _WHAT and index < len(names):
        return _WHAT[kind].format(names[index])
    if kind == END_OF_BACKWARD:
        return "at the end of its backward"
    return "at the end of its forward"



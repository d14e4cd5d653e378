"""The order units run in, and which unit to prefetch next.

[Note: execution order] Two orders are kept. The *forward order* is the order in which units
start their forward during the root's first forward; it is frozen afterwards and drives
``forward_prefetch``. The *post-forward order* is the order in which units finish their
forward in the current iteration (first occurrence only); backward runs roughly in its
reverse, so it drives ``backward_prefetch``. It is cleared at the end of each backward.
"""

from __future__ import annotations

from typing import Callable, Dict, Generic, Hashable, List, Optional, TypeVar

_U = TypeVar("_U", bound=Hashable)


class ExecOrder(Generic[_U]):
    """Records the units' execution order for one root."""

    def __init__(self) -> None:
        self._forward: List[_U] = []
        self._forward_index: Dict[_U, int] = {}
        self._forward_frozen = False
        self._post_forward: List[_U] = []
        self._post_forward_index: Dict[_U, int] = {}

    def record_pre_forward(self, unit: _U) -> None:
        if not self._forward_frozen and unit not in self._forward_index:
            self._forward_index[unit] = len(self._forward)
            self._forward.append(unit)

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
        """The unit that started its forward after ``unit`` in the first iteration."""
        index = self._forward_index.get(unit)
        if index is None or index + 1 >= len(self._forward):
            return None
        return self._forward[index + 1]

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

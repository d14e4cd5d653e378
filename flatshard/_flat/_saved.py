"""Autograd's saved tensors that are views of a unit's full parameters.

[Note: saved parameters] Operations save what their backward needs, often a parameter view
(``pow`` saves its input, ``linear`` its weight). Such a view points into a unit's full flat
tensor, whose storage is freed after forward and refilled when the unit's backward starts --
which flatshard learns from a gradient reaching one of the unit's forward outputs. Autograd
can reach a saved parameter by other paths first: a loss term computed from the parameters
after the output was produced (an auxiliary loss a module stores on itself), a parameter
used through ``.detach()``, a tied weight read by another unit. So while a root forward runs
with autograd on, saved-tensor hooks mark every saved tensor whose storage is a freeable full
flat tensor, and unpacking one (in backward) first has its owner gathered. Whatever path
autograd takes, it never reads freed memory.

The hooks compose with hooks already installed around the forward (activation checkpointing,
``save_on_cpu``): ours wrap theirs. Autograd does not check saved tensors' version counters
when hooks are installed, so the hooks do it themselves, with autograd's message: an in-place
change of a saved tensor is still an error, not a wrong gradient. Each saved tensor is kept as
a detached alias, because keeping an operation's output itself would tie it to its own graph
in a reference cycle the garbage collector cannot see.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Container, Iterator, Optional, Tuple

import torch

from .._base._compile import outside_graph
from ._flat_param import storage_key_of

_Hooks = Tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


class _SavedParam:
    """A saved tensor that views a freeable full flat tensor: what the hooks made of it, its
    version when saved, and the storage key of the full flat tensor. (Any other saved tensor
    is kept as a plain ``(value, version)`` pair: the hooks run for every saved tensor.)"""

    __slots__ = ("value", "version", "key")

    def __init__(self, value: Any, version: int, key: int) -> None:
        self.value = value
        self.version = version
        self.key = key


def _current_hooks() -> Optional[_Hooks]:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _hooks_enabled() -> bool:
    enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return enabled() if enabled is not None else True


class SavedParamGuard:
    """Saved-tensor hooks for one root: ``owned`` holds the storage keys of the freeable
    full flat tensors; ``gather(key)`` makes sure the one with ``key`` is gathered."""

    def __init__(self, owned: Container[int], gather: Callable[[int], None]) -> None:
        self._owned = owned
        self._gather = gather
        self._ours: set = set()  # the pack functions of this guard currently installed

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Install the hooks for the ``with`` block, unless they already are (an inner
        unit's forward inside the root's)."""
        outer = _current_hooks()
        if (outer is not None and outer[0] in self._ours) or not _hooks_enabled():
            yield
            return
        pack, unpack = self._hooks(outer)
        self._ours.add(pack)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            self._ours.discard(pack)

    def _hooks(self, outer: Optional[_Hooks]) -> _Hooks:
        owned, gather = self._owned, self._gather
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(tensor: torch.Tensor) -> Any:
            key = storage_key_of(tensor)
            value = outer_pack(tensor) if outer_pack is not None else tensor.detach()
            if key is not None and key in owned:
                return _SavedParam(value, tensor._version, key)
            return (value, tensor._version)

        def unpack(saved: Any) -> torch.Tensor:
            if type(saved) is tuple:
                value, version = saved
            else:
                gather(saved.key)
                value, version = saved.value, saved.version
            if outer_unpack is not None:
                return outer_unpack(value)
            if value._version != version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an "
                    f"inplace operation: a {value.dtype} tensor of shape {list(value.shape)} saved in a "
                    f"ShardedDataParallel forward is at version {value._version}; expected version "
                    f"{version} instead"
                )
            return value

        return outside_graph(pack), outside_graph(unpack)

"""The original parameters of one ``FlatParamHandle`` under ``use_orig_params=True``.

[Note: original parameters] The user's ``nn.Parameter`` objects stay registered on their
modules, so ``named_parameters()`` gives their names and an optimizer steps them (name-based
param groups, per-parameter learning rates, ...). Their data is a 1-D view of the part of the
handle's flat shard this rank holds (empty when it holds none of it), so the optimizer's update
lands in the shard. While the unit computes, each module attribute is overlaid (in the module's
``__dict__``, which attribute lookup consults before ``_parameters``) with a view of the
gathered full flat tensor in the parameter's shape, through which autograd accumulates into the
full flat tensor as in the default mode; a parameter that does not require grad gets a detached
view. After the gradient reduction each parameter that requires grad gets as ``.grad`` a view of
the flat shard's gradient.

The user owns those ``.grad``s: ``optimizer.zero_grad()`` sets them to ``None`` (or zeroes
them), an optimizer may replace one. So the flat shard's gradient is not trusted on its own: before
it is accumulated into or read (``flat_grad``), it is rebuilt from the parameters' ``.grad``s --
kept where a parameter still holds the view given to it, zeroed where it holds none, copied where
it holds another tensor. Before each use of a handle's views it is reconciled the same way, so
a shard gradient the user dropped (``zero_grad()`` setting every ``.grad`` to ``None``) is
released then rather than kept until the next reduction. A parameter frozen after it got its
``.grad`` view keeps it (as in single-process training, until it is zeroed); parameters frozen
when the model was wrapped are flattened apart from the trainable ones
(``_init.group_params``) and never get gradient memory.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

# (first element in the shard, number of elements) of one parameter on this rank; None: none held.
Range = Optional[Tuple[int, int]]


class OrigParams:
    """The original parameters of a handle (see [Note: original parameters]).

    Args:
        params: the parameter objects, one per flattened parameter, in layout order.
        ranges: where each one sits in this rank's shard.
        slots: every registration: (module, attribute, index into ``params``).
        shapes: the parameters' shapes when the handle is not sharded (the "shard" is the whole
            flat tensor, so outside compute the parameters keep their shapes too, as in FSDP1);
            ``None`` when sharded (outside compute they are 1-D pieces).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        ranges: Sequence[Range],
        slots: Sequence[Tuple[nn.Module, str, int]],
        shapes: Optional[Sequence[torch.Size]],
    ) -> None:
        self.params = list(params)
        self._ranges = list(ranges)
        self._slots = list(slots)
        self._shapes = list(shapes) if shapes is not None else None
        self._grad_views: List[Optional[torch.Tensor]] = [None] * len(self.params)

    @property
    def requires_grad(self) -> bool:
        return any(p.requires_grad for p in self.params)

    def _piece(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s part of a flat shard-shaped tensor, in its outside shape."""
        held = self._ranges[index]
        piece = flat[held[0] : held[0] + held[1]] if held is not None else flat[:0]
        return piece.view(self._shapes[index]) if self._shapes is not None else piece

    def show_shard(self, shard: torch.Tensor) -> None:
        """Make each parameter's data its piece of ``shard`` (the flat shard, 1-D)."""
        with torch.no_grad():
            for index, param in enumerate(self.params):
                param.data = self._piece(shard, index)

    def compute_views(self, chunks: Sequence[torch.Tensor], shapes: Sequence[torch.Size], track_grad: bool) -> List[torch.Tensor]:
        """Views in the parameters' shapes of the full flat tensor's ``chunks``; detached for
        parameters that need no gradient."""
        views = []
        for chunk, shape, param in zip(chunks, shapes, self.params):
            view = chunk.view(shape)
            views.append(view if track_grad and param.requires_grad else view.detach())
        return views

    def overlay(self, views: Sequence[torch.Tensor]) -> None:
        for module, attr, index in self._slots:
            module.__dict__[attr] = views[index]

    def remove_overlay(self) -> None:
        for module, attr, _ in self._slots:
            module.__dict__.pop(attr, None)

    # -- gradients --------------------------------------------------------------------------

    def flat_grad(self, flat_grad: Optional[torch.Tensor], like: torch.Tensor) -> Optional[torch.Tensor]:
        """The flat shard gradient the parameters' ``.grad``s describe now: ``flat_grad``
        where they still hold the views given to them (zeroed where they hold none), a new one
        if a parameter holds another tensor, ``None`` if none holds any. ``like``: the flat
        shard (shape, dtype, device of a new one)."""
        grads = [p.grad for p in self.params]
        if all(g is None for g in grads):
            return None
        if flat_grad is not None and all(g is None or g is v for g, v in zip(grads, self._grad_views)):
            with torch.no_grad():
                for index, grad in enumerate(grads):
                    if grad is None and self._grad_views[index] is not None:
                        self._piece(flat_grad, index).zero_()
                        self._grad_views[index] = None
            return flat_grad
        rebuilt = torch.zeros_like(like)
        with torch.no_grad():
            for index, grad in enumerate(grads):
                if grad is not None and self._ranges[index] is not None:
                    piece = self._piece(rebuilt, index)
                    piece.copy_(grad.reshape(piece.shape))
        self._grad_views = [None] * len(self.params)
        return rebuilt

    def give_grads(self, flat_grad: Optional[torch.Tensor]) -> None:
        """Each parameter that requires grad gets its piece of ``flat_grad`` as ``.grad``
        (none: ``None``). A parameter frozen since it got its view keeps it, as a frozen
        parameter keeps its ``.grad`` in single-process training until it is zeroed."""
        for index, param in enumerate(self.params):
            kept = param.grad is not None and param.grad is self._grad_views[index]
            if flat_grad is None or not (param.requires_grad or kept):
                view = None
            else:
                view = self._piece(flat_grad, index)
            if view is not None or self._grad_views[index] is not None:
                param.grad = view
            self._grad_views[index] = view

    def grads_untouched(self) -> bool:
        """Whether every parameter still holds the ``.grad`` view given to it last."""
        return all(p.grad is v for p, v in zip(self.params, self._grad_views) if v is not None) and not any(
            p.grad is not None and v is None for p, v in zip(self.params, self._grad_views)
        )

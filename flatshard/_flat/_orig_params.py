"""The original parameters of one ``FlatParamHandle`` under ``use_orig_params=True``.

[Note: original parameters] The user's ``nn.Parameter`` objects stay registered on their
modules, so ``named_parameters()`` gives their names and an optimizer steps them (name-based
param groups, per-parameter learning rates, ...). Their data is a 1-D view of the part of the
handle's flat shard this rank holds (empty when it holds none of it), so the optimizer's update
lands in the shard. While the unit computes, each module attribute is overlaid (in the module's
``__dict__``, which attribute lookup consults before ``_parameters``) with a view of the
gathered full flat tensor in the parameter's shape, through which autograd accumulates into the
full flat tensor as in the default mode; a parameter that does not require grad gets a detached
view. During the unit's forward the same view is also what ``_parameters`` holds, so
``named_parameters()`` inside forward gives the full-shape tensors the module computes with, as
attribute access does (FSDP1 does the same); the original objects are put back when the forward
returns. After the gradient reduction each parameter that requires grad and has a part in this
rank's shard gets as ``.grad`` a view of the flat shard's gradient (one with no part gets
``None``, as in FSDP1).

[Note: writes to original parameters] Users write to parameters outside forward in three ways:
in place (``p.mul_(0.9)``, an optimizer), which lands in the shard through the view; by
rebinding ``p.data`` (``p.data = p.data * 0.9``, ``vector_to_parameters``); and by registering
a new object (``module.weight = nn.Parameter(...)``). The last two leave the shard untouched,
so before the handle reads or overwrites its shard (every gather, state dict, summon, load,
copy), ``take_writes`` looks at every parameter: a new registered object is adopted (the
replaced one gets a copy of its values, so it no longer aliases the model, as after a
replacement in single-process PyTorch), and a parameter whose data is not its piece of the
shard has that data copied in and becomes a view of the shard again. A value of another shape or
dtype than the piece cannot be written back and raises, naming the parameter. The check is one
identity test and one data-pointer comparison per parameter.

[Note: original gradients] The user owns the ``.grad``s: ``optimizer.zero_grad()`` sets them to
``None`` (or zeroes them), an optimizer or a loop may replace one or rebind its ``.data``. So the
flat shard's gradient is not trusted on its own: before it is accumulated into or read
(``shard_grad``), it is rebuilt from the parameters' ``.grad``s -- kept where a parameter still
holds the view given to it, zeroed where it holds none, copied where it holds another tensor (or
its view's data was rebound). A parameter frozen after it got its ``.grad`` view keeps it (as in
single-process training, until it is zeroed); parameters frozen when the model was wrapped are
flattened apart from the trainable ones (``_init.group_params``) and never get gradient memory.

Inside ``no_sync()`` the gradient accumulated so far is unsharded and not yet averaged: it lives
in the full flat tensor's ``.grad``, in the compute dtype. There (``GradViews.LOCAL``) each
parameter's ``.grad`` is a full-shape view of it, as FSDP1 shows it -- of another shape and
dtype than the parameter outside compute, set through ``.grad.data``. Changes to those are taken
the same way (``take_local_grads``), and the next reduction gives the shard views back.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._base._common import copy_fields

__all__ = ["GradViews", "OrigParams", "Range", "stand_in"]

# (first element in the shard, number of elements, first element in the parameter) of one
# parameter on this rank; None: none held.
Range = Optional[Tuple[int, int, int]]


class GradViews(Enum):
    """What the original parameters' ``.grad``s are views of (see [Note: original gradients])."""

    SHARD = auto()  # pieces of the FlatParameter's gradient (this rank's averaged shard)
    LOCAL = auto()  # full-shape views of the unsharded gradient accumulated under no_sync()


def stand_in(param: torch.Tensor) -> torch.Tensor:
    """A tensor ``.grad``'s setter accepts for ``param`` (its shape, dtype and device) that
    allocates nothing and has a version counter of its own (so an in-place change of it shows
    on it alone), to take another tensor as its ``.data``."""
    return torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)


class OrigParams:
    """The original parameters of a handle (see [Note: original parameters]).

    Args:
        params: the parameter objects, one per flattened parameter, in layout order.
        ranges: where each one sits in this rank's shard.
        slots: every registration: (module, attribute, index into ``params``).
        shapes: the parameters' shapes when the handle is not sharded (the "shard" is the whole
            flat tensor, so outside compute the parameters keep their shapes too, as in FSDP1);
            ``None`` when sharded (outside compute they are 1-D pieces).
        full_shapes: the parameters' own shapes (what compute and ``no_sync()`` gradients have).
        rank: this rank (for messages).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        ranges: Sequence[Range],
        slots: Sequence[Tuple[nn.Module, str, int]],
        shapes: Optional[Sequence[torch.Size]],
        full_shapes: Sequence[torch.Size],
        rank: int,
    ) -> None:
        self.params = list(params)
        self._ranges = list(ranges)
        self._slots = list(slots)
        # Each parameter's registrations (a tied one has several).
        self._slots_of: List[List[Tuple[nn.Module, str]]] = [[] for _ in self.params]
        for module, attr, index in self._slots:
            self._slots_of[index].append((module, attr))
        self._shapes = list(shapes) if shapes is not None else None
        # Each parameter's shape outside compute (its piece of the shard), and where it starts
        # in the shard (elements; None: it has no part there): what ``take_writes`` compares.
        self._piece_shapes = [self._shapes[i] if self._shapes is not None else torch.Size([r[1] if r else 0]) for i, r in enumerate(self._ranges)]
        self._starts = [r[0] if r is not None else None for r in self._ranges]
        self._full_shapes = list(full_shapes)
        self._rank = rank
        # The user-facing names, for messages (``set_names`` once the root is known).
        self.names = [""] * len(self.params)
        # The .grad given to each parameter (None: none given) and the data pointer it had then.
        self._grad_views: List[Optional[torch.Tensor]] = [None] * len(self.params)
        self._grad_ptrs: List[int] = [0] * len(self.params)
        self.grad_views = GradViews.SHARD
        # The views registered in the modules' ``_parameters`` during the unit's forward.
        self._as_params: Optional[List[torch.Tensor]] = None

    def __deepcopy__(self, memo: Dict[int, Any]) -> "OrigParams":
        """For a copied model (see [Note: deep copies] in ``_deepcopy``): the copied parameters
        and modules, no gradients (a copied parameter has none); the copy's handle makes them
        views of its shard."""
        fresh = {"_grad_views": [None] * len(self.params), "_grad_ptrs": [0] * len(self.params), "grad_views": GradViews.SHARD, "_as_params": None}
        return copy_fields(self, memo, fresh)

    @property
    def requires_grad(self) -> bool:
        return any(p.requires_grad for p in self.params)

    def set_names(self, names: Sequence[str]) -> None:
        self.names = list(names)

    def _shape(self, index: int) -> torch.Size:
        """Parameter ``index``'s shape outside compute: its piece of the shard."""
        return self._piece_shapes[index]

    def _piece(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s part of a flat shard-shaped tensor, in its outside shape."""
        held = self._ranges[index]
        piece = flat[held[0] : held[0] + held[1]] if held is not None else flat[:0]
        return piece.view(self._shapes[index]) if self._shapes is not None else piece

    def _is_piece(self, tensor: torch.Tensor, flat: torch.Tensor, index: int) -> bool:
        """Whether ``tensor`` is exactly parameter ``index``'s piece of ``flat``."""
        return self._at(tensor, index, flat.data_ptr(), flat.element_size(), flat.dtype)

    def _at(self, tensor: torch.Tensor, index: int, base: int, itemsize: int, dtype: torch.dtype) -> bool:
        """``_is_piece`` with the shard's data pointer, element size and dtype given (once
        per pass: this runs for every parameter at every gather)."""
        start = self._starts[index]
        if start is None:
            return tensor.numel() == 0 and tensor.dtype == dtype
        return (
            tensor.data_ptr() == base + start * itemsize
            and tensor.shape == self._piece_shapes[index]
            and tensor.dtype == dtype
            and (self._shapes is None or tensor.is_contiguous())  # (a 1-D piece is)
        )

    def show_shard(self, shard: torch.Tensor) -> None:
        """Make each parameter's data its piece of ``shard`` (the flat shard, 1-D)."""
        with torch.no_grad():
            for index, param in enumerate(self.params):
                param.data = self._piece(shard, index)

    # -- writes outside compute --------------------------------------------------------------

    def take_writes(self, shard: torch.Tensor) -> bool:
        """Adopt replaced parameters and copy rebound data into ``shard`` (see [Note: writes to
        original parameters]); ``True`` if anything was copied."""
        wrote = False
        base, itemsize, dtype = shard.data_ptr(), shard.element_size(), shard.dtype
        for index, param in enumerate(self.params):
            slots = self._slots_of[index]
            if len(slots) != 1 or slots[0][0]._parameters.get(slots[0][1]) is not param:
                current = self._registered(index)
                if current is not param:
                    self._adopt(index, current, shard)
                    param = current
            if not self._at(param, index, base, itemsize, dtype):
                self._write_back(index, param, shard)
                wrote = True
        return wrote

    def changed(self, shard: torch.Tensor) -> Optional[str]:
        """The first parameter replaced on its modules, or whose data is not its piece of
        ``shard`` any more, described; ``None`` if none is (a backward about to compute with
        the values gathered before asks)."""
        base, itemsize, dtype = shard.data_ptr(), shard.element_size(), shard.dtype
        for index, param in enumerate(self.params):
            for module, attr in self._slots_of[index]:
                if module._parameters.get(attr) is not param:
                    return f"parameter '{self.names[index]}' was replaced"
            if not self._at(param, index, base, itemsize, dtype):
                return f"the .data of parameter '{self.names[index]}' was rebound"
        return None

    def _registered(self, index: int) -> nn.Parameter:
        """The object registered now under every name of parameter ``index``."""
        param = self.params[index]
        found: List[object] = []
        for module, attr in self._slots_of[index]:
            now = module._parameters.get(attr)
            if self._as_params is not None and now is self._as_params[index]:
                now = param  # (its forward is running: the view stands for it)
            found.append(now)
        if all(now is param for now in found):
            return param
        if any(now is not found[0] for now in found):
            raise NotImplementedError(
                f"[rank {self._rank}] parameter '{self.names[index]}' is shared by {len(found)} modules and was "
                f"replaced in only some of them; ShardedDataParallel cannot split a shared parameter (replace it "
                f"in every module that holds it, or change its values in place or through .data)"
            )
        if not isinstance(found[0], nn.Parameter):
            raise ValueError(
                f"[rank {self._rank}] parameter '{self.names[index]}' was removed from its module (it is "
                f"{found[0]!r} now); ShardedDataParallel keeps every parameter of a wrapped module: change its "
                f"values (in place, through .data, or with a new nn.Parameter of the same shape) instead"
            )
        return found[0]

    def _adopt(self, index: int, new: nn.Parameter, shard: torch.Tensor) -> None:
        """``new`` replaced parameter ``index`` on its modules: it becomes the parameter (its
        values are taken by ``take_writes``); the replaced object keeps copies of its data and
        gradient, so nothing the user still holds aliases the model."""
        old = self.params[index]
        with torch.no_grad():
            if self._is_piece(old, shard, index):
                old.data = old.data.clone()
            if old.grad is not None and old.grad is self._grad_views[index]:
                old.grad.data = old.grad.data.clone()  # (inside no_sync() not of its own shape)
        self.params[index] = new

    def _write_back(self, index: int, param: nn.Parameter, shard: torch.Tensor) -> None:
        """Copy ``param``'s data into its piece of ``shard``: a value shaped like the piece, or
        like the whole parameter (what its attribute shows while the unit is gathered), of
        which the piece's part is taken; then make the data the piece again."""
        value = param.detach()
        expected, full = self._shape(index), self._full_shapes[index]
        if value.shape not in (expected, full) or value.dtype != shard.dtype:
            raise RuntimeError(
                f"[rank {self._rank}] Cannot writeback parameter '{self.names[index]}': it was set to a tensor of "
                f"shape {tuple(value.shape)} and dtype {value.dtype}, but it has shape {tuple(full)} and its part of "
                f"this rank's shard shape {tuple(expected)}, dtype {shard.dtype} (with use_orig_params=True a "
                f"parameter is, outside forward, its part of this rank's shard: give it a value of either shape and "
                f"that dtype)"
            )
        if value.shape != expected:  # (the whole parameter: this rank's part of it)
            held = self._ranges[index]
            flat = value.reshape(-1)
            value = flat[held[2] : held[2] + held[1]] if held is not None else flat[:0]
        piece = self._piece(shard, index)
        with torch.no_grad():
            piece.copy_(value.reshape(piece.shape))
            param.data = piece

    # -- the views modules compute with ------------------------------------------------------

    def compute_views(self, chunks: Sequence[torch.Tensor], shapes: Sequence[torch.Size], track_grad: bool) -> List[torch.Tensor]:
        """Views in the parameters' shapes of the full flat tensor's ``chunks``; detached for
        parameters that need no gradient."""
        views = []
        for chunk, shape, param in zip(chunks, shapes, self.params):
            view = chunk.view(shape)
            views.append(view if track_grad and param.requires_grad else view.detach())
        return views

    def overlay(self, views: Sequence[torch.Tensor], as_params: bool) -> None:
        """Put ``views`` on the modules as attributes; ``as_params`` (a forward): also in their
        ``_parameters`` until ``end_forward``."""
        self.end_forward()
        for module, attr, index in self._slots:
            module.__dict__[attr] = views[index]
            if as_params:
                module._parameters[attr] = views[index]
        self._as_params = list(views) if as_params else None

    def end_forward(self) -> None:
        """Put the original parameters back into ``_parameters`` (a view the user replaced
        there meanwhile stays: ``take_writes`` adopts it)."""
        if self._as_params is None:
            return
        for module, attr, index in self._slots:
            if module._parameters.get(attr) is self._as_params[index]:
                module._parameters[attr] = self.params[index]
        self._as_params = None

    def remove_overlay(self) -> None:
        self.end_forward()
        for module, attr, _ in self._slots:
            module.__dict__.pop(attr, None)

    # -- gradients: this rank's shard ---------------------------------------------------------

    def _untouched(self, index: int) -> bool:
        """Whether parameter ``index`` still holds the ``.grad`` given to it, unchanged."""
        given = self._grad_views[index]
        grad = self.params[index].grad
        if grad is not given:
            return False
        return given is None or given.data_ptr() == self._grad_ptrs[index]

    def shard_grad(self, flat_grad: Optional[torch.Tensor], like: torch.Tensor) -> Optional[torch.Tensor]:
        """The flat shard gradient the parameters' ``.grad``s describe now: ``flat_grad``
        where they still hold the views given to them (zeroed where they hold none), a new one
        if a parameter holds another tensor, ``None`` if none holds any. ``like``: the flat
        shard (shape, dtype, device of a new one)."""
        grads = [p.grad for p in self.params]
        if all(g is None for g in grads):
            self._forget_grads()
            return None
        untouched = [self._untouched(i) for i in range(len(grads))]
        if flat_grad is not None and all(u or g is None for u, g in zip(untouched, grads)):
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
                    self._check_grad(index, grad, self._shape(index), like.dtype)
                    self._piece(rebuilt, index).copy_(grad)
        self._forget_grads()
        return rebuilt

    def _check_grad(self, index: int, grad: torch.Tensor, shape: torch.Size, dtype: Optional[torch.dtype]) -> None:
        """A gradient the user set must fit where it is copied (``dtype``: ``None``, any)."""
        if grad.shape != shape or (dtype is not None and grad.dtype != dtype):
            wanted = f"shape {tuple(shape)}" + (f" and dtype {dtype}" if dtype is not None else "")
            raise RuntimeError(
                f"[rank {self._rank}] Cannot writeback the gradient of parameter '{self.names[index]}': it is a "
                f"tensor of shape {tuple(grad.shape)} and dtype {grad.dtype}, where {wanted} was expected (a "
                f"gradient must keep the shape and dtype of the one given to it)"
            )

    def _forget_grads(self) -> None:
        self._grad_views = [None] * len(self.params)
        self.grad_views = GradViews.SHARD

    def _show(self, index: int, view: Optional[torch.Tensor]) -> None:
        """Make ``view`` parameter ``index``'s ``.grad`` (``None``: none), recording it."""
        param = self.params[index]
        if view is None:
            if self._grad_views[index] is not None or param.grad is not None:
                param.grad = None
        elif view.shape == param.shape and view.dtype == param.dtype and view.device == param.device:
            param.grad = view
        else:
            # (no_sync: the full, compute-dtype gradient of a 1-D shard piece; .grad's setter
            # would refuse it, so a stand-in of the parameter's kind takes it as its data)
            param.grad = stand_in(param)
            param.grad.data = view
        self._grad_views[index] = param.grad if view is not None else None
        self._grad_ptrs[index] = view.data_ptr() if view is not None else 0

    def give_grads(self, flat_grad: Optional[torch.Tensor], new: bool = True) -> None:
        """Each parameter that requires grad and has a part in the shard gets its piece of
        ``flat_grad`` as ``.grad`` (none: ``None``). A parameter frozen since it got its view
        keeps it, as a frozen parameter keeps its ``.grad`` in single-process training until it
        is zeroed. ``new=False`` (the same gradient, after ``shard_grad``): each parameter
        that holds a ``.grad`` gets its view, whether it requires grad or not, and one whose
        ``.grad`` the user set to ``None`` keeps ``None`` (an optimizer skips it, as in
        single-process training)."""
        for index, param in enumerate(self.params):
            kept = param.grad is not None and param.grad is self._grad_views[index]
            wanted = (param.requires_grad or kept) if new else param.grad is not None
            if flat_grad is None or self._ranges[index] is None or not wanted:
                self._show(index, None)
            else:
                self._show(index, self._piece(flat_grad, index))
        self.grad_views = GradViews.SHARD

    # -- gradients: no_sync()'s local, unsharded ones -----------------------------------------

    def _local_views(self, full_grad: torch.Tensor, sizes: Sequence[int]) -> List[torch.Tensor]:
        chunks = full_grad.split(list(sizes))
        return [chunk.view(shape) for chunk, shape in zip(chunks, self._full_shapes)]

    def give_local_grads(self, full_grad: torch.Tensor, sizes: Sequence[int]) -> None:
        """``no_sync()``: each parameter that requires grad gets the full-shape view of its
        local gradient in ``full_grad`` (the unsharded flat gradient, ``sizes``: its split)."""
        for index, (param, view) in enumerate(zip(self.params, self._local_views(full_grad, sizes))):
            kept = param.grad is not None and param.grad is self._grad_views[index]
            self._show(index, view if param.requires_grad or kept else None)
        self.grad_views = GradViews.LOCAL

    def grad_versions(self) -> Tuple[int, ...]:
        """The version counters of the ``.grad``s given (an in-place change of one bumps its
        own: a stand-in of another shape shares its parameter's, not the gradient's)."""
        return tuple(g._version for g in self._grad_views if g is not None)

    def take_local_grads(
        self, full_grad: torch.Tensor, flat_grad: Optional[torch.Tensor], sizes: Sequence[int]
    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``no_sync()``: apply what the user did to the local ``.grad``s. One set to ``None``
        drops its local gradient and its part of the shard's gradient (a ``zero_grad``); one
        replaced (or rebound) becomes its local gradient. Returns the unsharded and the shard
        gradient after that (``None``, ``None`` once no parameter holds a gradient)."""
        grads = [p.grad for p in self.params]
        if all(g is None for g in grads):
            self._forget_grads()
            return None, None
        changed = False
        with torch.no_grad():
            for index, (grad, view) in enumerate(zip(grads, self._local_views(full_grad, sizes))):
                if self._untouched(index):
                    continue
                changed = True
                if grad is None:
                    view.zero_()
                else:
                    self._check_grad(index, grad, view.shape, None)
                    view.copy_(grad)
                if flat_grad is not None and self._ranges[index] is not None:
                    self._piece(flat_grad, index).zero_()
        if changed:
            for index, (grad, view) in enumerate(zip(grads, self._local_views(full_grad, sizes))):
                self._show(index, view if grad is not None else None)
        return full_grad, flat_grad

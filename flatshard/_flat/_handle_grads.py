"""The gradient side of a ``FlatParamHandle``: the reduction of the full gradient into the
shard's, the ``no_sync()`` gradient held for later, and the original parameters' ``.grad``s.

``HandleGrads`` is a mixin of ``FlatParamHandle`` (``flat_param``), which sets every attribute
it uses in its constructor; it holds the gradient half of the handle's methods, so each file
stays one concept: flattening, sharding and views there, gradients here.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Callable, List, Optional, Tuple

import torch

from .._comm._collectives import Communicator, Pending
from .._base._common import guard_transition
from ._orig_params import OrigParams, stand_in

__all__ = ["HandleGrads", "HeldGrad", "to_host"]


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor``, in pinned memory when CUDA is there (see [Note: offloaded
    gradients]): copies between pinned memory and the GPU run without blocking the host."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=torch.cuda.is_available())
    return host.copy_(tensor)


class HandleGrads:
    """Gradient reduction and the gradients users see (see the module docstring)."""

    # (set by FlatParamHandle.__init__)
    flat_param: torch.nn.Parameter
    orig: Optional[OrigParams]
    comm: Communicator
    replicate: Optional[Communicator]
    rank: int
    world_size: int
    sharded: bool
    separate_full: bool
    offload: bool
    dtype: torch.dtype
    reduce_dtype: torch.dtype
    grad_dtype: torch.dtype
    shard_numel: int
    _full: torch.Tensor
    _split_sizes: List[int]
    _comm_hook: Optional[Tuple[Callable[..., Any], Any]]
    _names: List[str]
    _held_grad: Optional[Tuple["weakref.ref[torch.Tensor]", int]]
    _local_grad: bool
    _hold: "HeldGrad"
    _kept_grad: Optional[torch.Tensor]
    _held_version: Tuple[int, ...]
    _reduction: Optional["_Reduction"]
    _grad_copy: Optional[Any]  # a torch.cuda.Event

    def flat_grad(self) -> Optional[torch.Tensor]:
        """This rank's gradient of the shard as the user left it (``flat_param.grad``); with
        original parameters, rebuilt from their ``.grad``s and handed back to them as views
        (see [Note: original gradients] in ``_orig_params``)."""
        if self.orig is not None:
            self._take_user_grads()
        return self.flat_param.grad

    def _take_user_grads(self) -> None:
        """Apply what the user did to the original parameters' ``.grad``s (see [Note: original
        gradients]): to the local unsharded gradient inside ``no_sync()``, else to the shard's."""
        orig = self.orig
        if orig is None:
            return
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):  # (a gradient made here outlives an inference forward)
                self._take_user_grads()
            return
        if self._hold is HeldGrad.HELD:
            self.take_held_changes()
            return
        grad = orig.shard_grad(self.flat_param.grad, self.flat_param.detach())
        if grad is not self.flat_param.grad:
            self.flat_param.grad = grad
        orig.give_grads(grad, new=False)

    def has_unreduced_grad(self) -> bool:
        """Whether an unsharded gradient is waiting to be reduced (after ``no_sync``)."""
        return self.separate_full and self._full.grad is not None

    def holds_no_sync_grad(self) -> bool:
        """Whether the gradient includes a ``no_sync`` backward not yet averaged over the ranks."""
        return self.has_unreduced_grad() or self._local_grad

    def reduce_grad(self, async_op: bool = False) -> bool:
        """Start averaging the accumulated full gradient over the ranks into
        ``flat_param.grad``; ``finish_reduction()`` completes it (at once without
        ``async_op``). ``False`` if there was no gradient.

        [Note: gradient reduction] The full gradient is taken away from autograd's leaf
        (under ``NO_SHARD`` that leaf is the ``FlatParameter``, so its ``.grad`` is empty
        while the reduction is in flight) and averaged into a tensor nothing else can see:
        sharded, a reduce-scatter into a new shard gradient; unsharded, an all-reduce of the
        gradient itself. With hybrid sharding the result is then averaged over the replicas
        too (also when a shard group has a single rank). Only ``finish_reduction`` adds the
        result to ``.grad`` (onto a gradient the user did not zero), so a reduction that is
        abandoned (``discard_reduction``, after a backward that raised) never writes into a
        gradient the user has zeroed since. Meanwhile ``.grad`` exists, as it would in
        single-process training once autograd accumulated it: a ``FlatParameter`` without one
        gets an uninitialised placeholder, replaced by the result when the reduction completes,
        or zeroed if it is abandoned and nobody touched it (a loop that zeroes the gradients
        after the failed backward and steps anyway then steps exactly the parameters
        single-process training would).
        """
        self._held_grad = None
        self._local_grad = False
        self._release_held()
        full_grad = self._full.grad
        if full_grad is None:
            return False
        if self._reduction is not None:
            raise AssertionError(f"[rank {self.rank}] a gradient reduction is already in flight")
        self._full.grad = None
        grad = full_grad if full_grad.dtype == self.reduce_dtype else full_grad.to(self.reduce_dtype)
        pending, reduced = self._start_reduction(grad.contiguous())
        if self.orig is not None and self.separate_full:
            self.flat_grad()  # what the user left of the previous gradient
        placeholder, borrowed = None, False
        if self.flat_param.grad is None:
            data, borrowed = self._placeholder_data(grad)
            self._set_new_grad(data)
            placeholder = (self.flat_param.grad, self.flat_param.grad._version)
            if self.orig is not None:
                self.orig.give_grads(self.flat_param.grad)
        self._reduction = _Reduction(pending, reduced, grad, placeholder, borrowed=borrowed)
        if self._replicates():
            self._reduction.replicated = self.replicate.all_reduce_mean_after(pending, reduced)  # type: ignore[union-attr]
        if not async_op:
            self.finish_reduction()
        return True

    def _start_reduction(self, grad: torch.Tensor) -> Tuple[Pending, torch.Tensor]:
        """Average ``grad`` (full, in the reduce dtype) over the ranks: (the collective in
        flight, the tensor receiving this rank's part -- all of it when not sharded)."""
        hook = self._comm_hook
        if hook is not None:
            _guard_hook_state(hook[1], self.comm)
        if not self.sharded:
            if hook is not None:
                hook[0](hook[1], grad)
            elif self.world_size > 1:
                return self.comm.all_reduce_mean(grad, async_op=True), grad
            return Pending(None), grad
        shard_grad = torch.empty(self.shard_numel, dtype=grad.dtype, device=grad.device)
        if hook is not None:
            hook[0](hook[1], grad, shard_grad)
            return Pending(None), shard_grad
        return self.comm.reduce_scatter_mean(shard_grad, grad, async_op=True), shard_grad

    def _placeholder_data(self, full: torch.Tensor) -> Tuple[torch.Tensor, bool]:
        """The storage of a placeholder ``.grad`` (see [Note: gradient reduction]), and
        whether it is borrowed from ``full``, the gradient being reduced.

        [Note: a borrowed placeholder] While a reduction is in flight its full gradient is
        alive anyway (the collective reads it), and with overlap it stays in flight while the
        next unit's gradient is computed. A placeholder of its own would be one more shard in
        flight, beyond what FSDP1 holds; so a sharded handle whose full gradient is in the
        gradient's dtype and on its device borrows its first shard's worth of elements. Nothing
        writes into a reduction's input (its result goes to a tensor of its own), so a user's
        in-place change to the placeholder stays the user's. The placeholder gets storage of its
        own (``_return_borrowed``) before the full gradient is released: replaced by the result
        when the reduction completes, or copied out when the reduction is discarded, moves on to
        its all-reduce over the replicas, or finds the placeholder changed. Not with original
        parameters (their ``.grad``s are views of the placeholder) or a communication hook (it
        may change its input)."""
        if self.sharded and self.orig is None and self._comm_hook is None and full.dtype == self.grad_dtype and full.device == self._grad_device():
            # (through ``set_``, not a view: a view's ``_base`` would keep the full gradient
            # alive after the placeholder got storage of its own)
            data = full.new_empty(0)
            data.set_(full.untyped_storage(), full.storage_offset(), (self.shard_numel,))
            return data, True
        return torch.empty(self.flat_param.shape, dtype=self.grad_dtype, device=self._grad_device()), False

    def _return_borrowed(self, reduction: "_Reduction") -> None:
        """Give a placeholder that borrows its reduction's full gradient storage of its own
        (see [Note: a borrowed placeholder]): untouched, new storage; changed, a copy."""
        if not reduction.borrowed or reduction.placeholder is None:
            return
        reduction.borrowed = False
        placeholder = reduction.placeholder[0]
        data = placeholder.data
        placeholder.data = torch.empty_like(data) if reduction.is_placeholder(placeholder) else data.clone()

    def _grad_device(self) -> torch.device:
        return torch.device("cpu") if self.offload else self.flat_param.device

    def _set_new_grad(self, data: torch.Tensor) -> None:
        """Make ``data`` (shaped like the shard, in the gradient dtype) the ``FlatParameter``'s ``.grad``."""
        if data.dtype == self.dtype:
            self.flat_param.grad = data
            return
        # keep_low_precision_grads: .grad's dtype must match the parameter's, its data need not
        self.flat_param.grad = stand_in(self.flat_param)
        self.flat_param.grad.data = data

    def _replicates(self) -> bool:
        """Whether reduced gradients are averaged over replicas too (hybrid sharding)."""
        return self.replicate is not None and self.replicate.world_size > 1

    def advance_reduction(self) -> bool:
        """At a wait point of the runtime after the compute that the reduction in flight hid
        behind: complete it (``True``), or, where its all-reduce over the replicas could not be
        chained when it was issued (a host-driven backend: [Note: chained all-reduce]), wait
        for its reduce-scatter and issue that all-reduce, which stays in flight (``False``)."""
        reduction = self._reduction
        if reduction is None:
            return True
        if self._replicates() and reduction.replicated is None:
            reduction.pending.wait()
            self._return_borrowed(reduction)
            reduction.full = None  # (the reduce-scatter no longer reads it)
            reduction.replicated = self.replicate.all_reduce_mean(reduction.reduced, async_op=True)  # type: ignore[union-attr]
            return False
        self.finish_reduction(settle=False)
        return True

    def _accumulate(self, reduction: "_Reduction") -> None:
        reduction.pending.wait()
        shard_grad = reduction.reduced
        if reduction.replicated is not None:
            reduction.replicated.wait()  # (on CUDA the compute stream's first wait of the chain)
        elif self._replicates():
            self.replicate.all_reduce_mean(shard_grad)  # type: ignore[union-attr]
        reduction.full = None
        if shard_grad.dtype != self.grad_dtype:
            shard_grad = shard_grad.to(self.grad_dtype)
        if self.offload:
            shard_grad = self._copy_to_host(shard_grad)
        grad = self.flat_param.grad
        if grad is not None and not reduction.is_placeholder(grad):
            self.settle_grad_copy()  # (the host adds to it now)
        if grad is not None and reduction.is_placeholder(grad):
            grad.data = shard_grad  # (keeps a keep_low_precision_grads .grad's dtype)
            reduction.borrowed = False
        elif grad is None:
            self._set_new_grad(shard_grad)
        else:
            grad.add_(shard_grad)
        self._return_borrowed(reduction)
        if self.orig is not None:
            self.orig.give_grads(self.flat_param.grad)

    def _copy_to_host(self, shard_grad: torch.Tensor) -> torch.Tensor:
        """[Note: offloaded gradients] With ``CPUOffload(offload_params=True)`` the shard
        and its gradient live in pinned CPU memory. A reduced gradient is copied there without
        blocking the host (a blocking copy would stop the host once per unit, so that it
        could not queue the next units' backward while the GPU computes); the copy is settled
        (its event waited for) once at the end of the backward, before anything on the host
        reads the gradient, and at once where the host adds to an existing gradient or the
        reduction was not part of a backward (``finish_reduction``)."""
        if shard_grad.device.type != "cuda":
            return shard_grad.to("cpu")
        host = torch.empty(shard_grad.shape, dtype=shard_grad.dtype, device="cpu", pin_memory=True)
        host.copy_(shard_grad, non_blocking=True)
        self._grad_copy = torch.cuda.Event()
        self._grad_copy.record()
        return host

    def settle_grad_copy(self) -> None:
        """Wait for the offloaded gradient's copy to the CPU (see [Note: offloaded gradients])."""
        if self._grad_copy is not None:
            event, self._grad_copy = self._grad_copy, None
            event.synchronize()

    def set_comm_hook(self, hook: Callable[..., Any], state: Any) -> None:
        """Reduce gradients with ``hook(state, grad)`` (unsharded: all-reduce ``grad`` in place)
        or ``hook(state, grad, output)`` (sharded: write this rank's reduced shard into
        ``output``), as torch FSDP1 calls its communication hooks."""
        self._comm_hook = (hook, state)

    def has_comm_hook(self) -> bool:
        return self._comm_hook is not None

    def finish_reduction(self, settle: bool = True) -> None:
        """Complete a gradient reduction in flight (``flat_param.grad`` is final after it;
        with ``settle=False``, an offloaded one only after ``settle_grad_copy()``)."""
        if self._reduction is not None:
            reduction, self._reduction = self._reduction, None
            self._accumulate(reduction)
        if settle:
            self.settle_grad_copy()

    def discard_reduction(self) -> None:
        """Complete a gradient reduction in flight without using its result (the backward
        it belongs to raised); see [Note: gradient reduction]."""
        if self._reduction is not None:
            reduction, self._reduction = self._reduction, None
            reduction.pending.drain()
            if reduction.replicated is not None:
                reduction.replicated.drain()
            self._return_borrowed(reduction)
            grad = self.flat_param.grad
            if grad is not None and reduction.is_placeholder(grad):
                grad.zero_()

    def hold_grad_for_later(self) -> None:
        """``no_sync``: leave the accumulated full gradient for the next synchronised backward.

        [Note: no_sync and zero_grad] Under ``no_sync`` a unit accumulates its unsharded
        gradient, not averaged over the ranks yet, and the next synchronised backward averages
        it. The user sees it and what they do to it counts, as with DDP and FSDP1:

        - Where the full flat tensor is the ``FlatParameter`` (``NO_SHARD``), the gradient is
          ``flat_param.grad`` itself. Its version is recorded after each ``no_sync`` backward;
          if it changed before the next one and is all zeros, the user zeroed it and there is
          nothing left to average.
        - Elsewhere it is the full flat tensor's ``.grad`` (HELD): the ``FlatParameter``'s
          ``.grad`` is it (unsharded and in the compute dtype, as in FSDP1), with original
          parameters each ``.grad`` is its full-shape view ([Note: original gradients]). A
          gradient the ``FlatParameter`` held when holding began (an earlier step's, not
          zeroed since) is kept aside and added back after the reduction. Before the next
          backward accumulates, and before the reduction, ``take_held_changes`` applies what
          the user did: ``.grad`` set to ``None`` (``zero_grad()``) drops everything, a new
          tensor replaces it, in-place changes are already in it -- except that they cannot
          reach the kept gradient: zeroing (all zeros) zeroes it too, any other in-place change
          while it is not all zeros raises an error instead of being lost for that part.
        """
        if not self.separate_full:
            grad = self.flat_param.grad
            self._local_grad = grad is not None
            self._held_grad = (weakref.ref(grad), grad._version) if grad is not None else None
            return
        local = self._full.grad
        if local is None:
            return
        if self._hold is HeldGrad.NONE:
            if self.orig is not None:
                self._take_user_grads()  # (what the user left of the shard's gradient)
            self._kept_grad = self.flat_param.grad
            self.flat_param.grad = None
            self._hold = guard_transition(self._hold, (HeldGrad.NONE,), HeldGrad.HELD, f"[rank {self.rank}] no_sync gradient")
        if self.orig is not None:
            self.orig.give_local_grads(local, self._split_sizes)
        else:
            self.flat_param.grad = stand_in(self.flat_param)
            self.flat_param.grad.data = local
        self._held_version = self._held_versions(local)

    def take_held_changes(self) -> None:
        """Apply what the user did to the gradient ``no_sync()`` holds (see [Note: no_sync and
        zero_grad]); not after autograd accumulated into it again."""
        if self._hold is not HeldGrad.HELD:
            return
        local = self._full.grad
        if local is None:
            raise AssertionError(f"[rank {self.rank}] a no_sync gradient is held but there is none")
        if self.orig is not None:
            self._take_in_place_changes(local)
            full, self._kept_grad = self.orig.take_local_grads(local, self._kept_grad, self._split_sizes)
            if full is None:
                self._drop_held()
            else:
                self._held_version = self._held_versions(local)
            return
        grad = self.flat_param.grad
        if grad is None:
            self._drop_held()
        elif grad.data_ptr() == local.data_ptr() and grad.shape == local.shape:
            self._take_in_place_changes(local)
        else:
            # replaced: a gradient of the parameter's shape is the new gradient; through
            # ``.data`` one of the unsharded shape is the new local one
            if grad.shape == local.shape:
                with torch.no_grad():
                    local.copy_(grad)
                self._kept_grad = None
            else:
                self._drop_held()
                self.flat_param.grad = grad
                return
            self.flat_param.grad.data = local
            self._held_version = self._held_versions(local)

    def _held_versions(self, local: torch.Tensor) -> Tuple[int, ...]:
        """What changes when the user changes the held gradient in place: its version, and
        those of the ``.grad`` tensors that show it (stand-ins count their own)."""
        shown = self.orig.grad_versions() if self.orig is not None else (self.flat_param.grad._version,)  # type: ignore[union-attr]
        return (local._version,) + shown

    def _take_in_place_changes(self, local: torch.Tensor) -> None:
        kept = self._kept_grad
        if kept is None or self._held_versions(local) == self._held_version:
            return
        if torch.count_nonzero(local).item() == 0:
            with torch.no_grad():
                kept.zero_()  # zero_grad(set_to_none=False): the kept gradient is zeroed too
        if torch.count_nonzero(kept).item() == 0:  # (what any change of the whole leaves of it)
            self._held_version = self._held_versions(local)
            return
        names = ", ".join(f"'{n}'" for n in self._names[:2]) + (", ..." if len(self._names) > 2 else "")
        raise RuntimeError(
            f"[rank {self.rank}] the gradients of {names} were changed in place inside no_sync() while they also "
            f"hold the gradient of an earlier step (no zero_grad() since it): that part cannot be changed the same "
            f"way here; zero the gradients before accumulating again (optimizer.zero_grad()), or change them after "
            f"the synchronised backward"
        )

    def _drop_held(self) -> None:
        """The user dropped the held gradient (and the kept one): nothing is left to reduce."""
        self._full.grad = None
        self._kept_grad = None
        self._hold = guard_transition(self._hold, (HeldGrad.HELD,), HeldGrad.NONE, f"[rank {self.rank}] no_sync gradient")
        if self.orig is None:
            self.flat_param.grad = None

    def _release_held(self) -> None:
        """Before the held gradient is reduced: ``.grad`` is the kept gradient again (the
        reduced one is added to it). What the user did to the held one was taken before the
        backward accumulated into it (``drop_grad_if_zeroed``, which ``reduce_held`` calls too):
        since then autograd may even have replaced it (``create_graph=True``)."""
        if self._hold is not HeldGrad.HELD:
            return
        self.flat_param.grad = self._kept_grad
        self._kept_grad = None
        self._hold = guard_transition(self._hold, (HeldGrad.HELD,), HeldGrad.NONE, f"[rank {self.rank}] no_sync gradient")
        if self.orig is not None:
            self.orig.give_grads(self.flat_param.grad)

    def drop_grad_if_zeroed(self) -> None:
        """Before a backward: apply what the user did to a held ``no_sync`` gradient (see
        [Note: no_sync and zero_grad])."""
        if self.separate_full:
            self.take_held_changes()
            return
        if self._held_grad is None:
            return
        ref, version = self._held_grad
        grad = self.flat_param.grad
        if grad is None or ref() is not grad:
            self._local_grad = False
            self._held_grad = None
        elif grad._version != version:
            if torch.count_nonzero(grad).item() == 0:
                self._local_grad = False  # zeroed: nothing left to average
            self._held_grad = (weakref.ref(grad), grad._version)


class HeldGrad(Enum):
    """Whether a handle holds a ``no_sync()`` gradient in its full flat tensor's ``.grad``
    (see [Note: no_sync and zero_grad])."""

    NONE = auto()
    HELD = auto()


@dataclass
class _Reduction:
    """A gradient reduction in flight: the collective, the tensor receiving this rank's part,
    the full gradient it reduces, the placeholder ``.grad`` made for it with its version then
    (``None`` if ``.grad`` existed), and under hybrid sharding the all-reduce over the replicas
    once issued ([Note: chained all-reduce]).

    The full gradient must stay alive and unchanged until ``pending.wait()`` has returned, not
    only until the collective completes: with two ranks on gloo the finishing step reads this
    rank's own chunk from it ([Note: pair exchange]); on CUDA the compute stream must have
    waited for the collective before its memory is reused ([Note: streams and waits] in
    ARCHITECTURE.md). The
    reduction holds it until then (``None`` after)."""

    pending: Pending
    reduced: torch.Tensor
    full: Optional[torch.Tensor]
    placeholder: Optional[Tuple[torch.Tensor, int]]
    replicated: Optional[Pending] = None
    # Whether the placeholder's storage is the full gradient's ([Note: a borrowed placeholder]).
    borrowed: bool = False

    def is_placeholder(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is the untouched placeholder."""
        return self.placeholder is not None and grad is self.placeholder[0] and grad._version == self.placeholder[1]


def _guard_hook_state(state: Any, comm: Communicator) -> None:
    """A communication hook's collectives belong to the call of the model that runs it (a deep
    copy shares the hook and its state): flatshard's own hook states reduce through a
    ``Communicator``, bound here to the guard of ``comm``, this handle's ([Note: one guarded
    path] in ``_comm/_guard``)."""
    theirs = getattr(state, "comm", None)
    if isinstance(theirs, Communicator) and theirs.guard is not comm.guard:
        theirs.guard = comm.guard

"""``FlatParameter`` and ``FlatParamHandle``: one unit's parameters as a single flat tensor.

A handle takes a unit's original parameters, concatenates them (each shared parameter once)
into one flat tensor, pads it to a multiple of the world size and keeps only this rank's
equal-sized shard as the ``FlatParameter`` the optimizer sees. For compute it all-gathers the
full flat tensor and puts views of it on the modules in place of the original parameters;
after backward it reduce-scatters the full gradient into the shard's ``.grad``.

[Note: two tensors per handle] The ``FlatParameter`` always holds the shard, so its shape
never changes and optimizers, ``.grad`` and ``zero_grad`` behave as for any parameter. A
second tensor, the *full* flat tensor, is what the module views point into and what autograd
accumulates the unsharded gradient into (``grad_leaf``). Its storage is freed between uses
(see [Note: storage freeing] in ``_common``). Under ``NO_SHARD`` the two are one tensor.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._comm._collectives import Communicator, Pending, ProcessGroup
from .._base._common import FLAT_PARAM, HandleState, alloc_storage, clean_name, copy_fields, free_storage, guard_transition, storage_bytes
from ._layout import OrigParam, ParamInfo, SharedParamInfo, ShardParamInfo, flatten, layout, shard_param_infos, shard_sizes
from ._handle_grads import HandleGrads, HeldGrad, to_host
from ._module_views import ModuleViews
from ._orig_params import OrigParams
from ._placeholder import ParamPlaceholder

__all__ = ["FlatParameter", "FlatParamHandle", "storage_key_of", "ParamInfo", "SharedParamInfo", "ShardParamInfo", "OrigParam", "Precision"]


class FlatParameter(nn.Parameter):
    """The parameter of one unit that the optimizer updates.

    It holds this rank's shard of the unit's flattened (and padded) original parameters, or
    all of them under ``NO_SHARD``. Its :class:`FlatParamHandle` knows the layout.
    """

    # [Note: FSDP1's names on a FlatParameter] Code written for FSDP1 reads two attributes of
    # its FlatParameter: ``_fsdp_flattened`` (Lightning's check that an optimizer holds FSDP
    # parameters; torch's FSDP1 skips such parameters when it flattens) and ``_fqns`` (the
    # names of the original parameters it holds, relative to the wrapped module, as accelerate
    # logs them). Both have FSDP1's meaning here; see docs/migrating.md.
    _fsdp_flattened = True

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True, fqns: Sequence[str] = ()) -> "FlatParameter":
        param = super().__new__(cls, data, requires_grad)  # type: ignore[call-arg]
        param._fqns = tuple(fqns)
        return param

    def __deepcopy__(self, memo: Dict[int, Any]) -> "FlatParameter":
        # (nn.Parameter's copy would drop _fqns)
        if id(self) in memo:
            return memo[id(self)]
        copied = type(self)(self.data.clone(memory_format=torch.preserve_format), self.requires_grad, self._fqns)
        memo[id(self)] = copied
        return copied


@dataclass(frozen=True)
class Precision:
    """A handle's mixed precision (see [Note: mixed precision]); ``None``: the parameters' dtype.

    [Note: mixed precision] The ``FlatParameter`` (what the optimizer updates) always keeps
    the parameters' own dtype. Each unshard casts the shard to ``param_dtype`` and gathers
    it into the full flat tensor, which is then in ``param_dtype``: modules compute in it and
    autograd produces the unsharded gradient in it. The gradient is cast to ``reduce_dtype``
    for its reduction, and the reduced shard back to the parameters' dtype (or kept in
    ``param_dtype`` with ``keep_low_precision_grads``). Without sharding, the full flat
    tensor is then a cast copy of the ``FlatParameter`` rather than the parameter itself.
    State dicts and ``summon_full_params`` gather the parameters' own dtype separately.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    keep_low_precision_grads: bool = False


class FlatParamHandle(HandleGrads):
    """Owns one unit's ``FlatParameter``: flattening, sharding, unshard/reshard, gradient reduction.

    Construction removes the original parameters from their modules and registers the
    ``FlatParameter`` on ``owner`` as ``_flat_param``. Callers pass only valid parameters: one
    floating dtype and one ``requires_grad`` value (``_init`` checks and names them); they may
    be on any device, and are copied to ``device`` as they are flattened.

    Args:
        params: every registration of the parameters to flatten, in module order; a
            parameter registered twice (tied) is flattened once.
        owner: the wrapped module the ``FlatParameter`` is registered on.
        device: where the flat tensors live.
        group: the process group the parameters are sharded over.
        sharded: shard over ``group`` (``False``: keep everything, all-reduce gradients).
        attr_name: the name the ``FlatParameter`` is registered under on ``owner``.
        sync_from_first_rank: replace the values by those of the group's first rank before
            sharding (``sync_module_states``).
        replicate_group: hybrid sharding: the group of the ranks holding the same shard, over
            which the gradient shards are averaged after the reduce-scatter.
        offload: keep the shard and its gradient on the CPU (a no-op on CPU devices).
        precision: mixed precision (see [Note: mixed precision]); ``None``: compute, reduce and
            keep gradients in the parameters' dtype.
        use_orig_params: keep the original parameters registered, as views of the shard (see
            [Note: original parameters] in ``_orig_params``); the ``FlatParameter`` is then
            not registered on ``owner`` (the optimizer steps the originals).
        guard: the ``Guard`` whose calls its collectives belong to (the constructor's; its
            root's binds it again).
    """

    def __init__(
        self,
        params: Sequence[OrigParam],
        owner: nn.Module,
        device: torch.device,
        group: ProcessGroup,
        sharded: bool,
        attr_name: str = FLAT_PARAM,
        sync_from_first_rank: bool = False,
        replicate_group: Optional[ProcessGroup] = None,
        offload: bool = False,
        precision: Optional["Precision"] = None,
        use_orig_params: bool = False,
        guard: Optional[Any] = None,
    ) -> None:
        if not params:
            raise AssertionError("a FlatParamHandle needs at least one parameter")
        self.comm = Communicator(group, guard)
        self.replicate = Communicator(replicate_group, guard) if replicate_group is not None else None
        # Shards on the CPU while computing elsewhere; on a CPU device there is nothing to move.
        self.offload = offload and device.type != "cpu"
        # A user's gradient reduction (register_comm_hook): (hook, state).
        self._comm_hook: Optional[Tuple[Callable[..., Any], Any]] = None
        self.rank = self.comm.rank
        self.world_size = self.comm.world_size
        # (one rank offloading keeps a CPU "shard" of everything and gathers it to the device)
        self.sharded = sharded and (self.world_size > 1 or self.offload)
        self.device = device
        self.dtype = params[0].param.dtype
        requires_grad = params[0].param.requires_grad
        precision = precision or Precision()
        self._precision = precision
        self.compute_dtype = precision.param_dtype or self.dtype
        self.reduce_dtype = precision.reduce_dtype or self.compute_dtype
        self.grad_dtype = self.compute_dtype if precision.keep_low_precision_grads else self.dtype
        # Whether the full flat tensor is a tensor of its own (sharded, computing in another
        # dtype, or original parameters, which must be the modules' attributes outside compute)
        # rather than the FlatParameter itself.
        self.separate_full = self.sharded or self.compute_dtype != self.dtype or use_orig_params
        primaries, self.param_infos, self.shared_param_infos, slots = layout(params)
        self.numel = sum(info.numel for info in self.param_infos)
        self.padded_numel, self.shard_numel = shard_sizes(self.numel, self.world_size, self.sharded)
        self.shard_param_infos = shard_param_infos(self.param_infos, self.shard_numel, self.rank if self.sharded else 0)
        self._split_sizes = [info.numel for info in self.param_infos]
        if self.padded_numel > self.numel:
            self._split_sizes.append(self.padded_numel - self.numel)
        # Where each view goes: (module, attribute, index of the original parameter).
        self._slots: List[Tuple[nn.Module, str, int]] = slots
        self._originals = [(p.param, p.name) for p in primaries]
        # The parameters' user-facing names (from the root once it is known: set_name_prefix).
        self._names = [info.name for info in self.param_infos]
        self.attr_name = attr_name
        self.flat_param, self._full = self._make_tensors([p.param for p in primaries], requires_grad, sync_from_first_rank)
        # Writes go through this alias: it shares the storage but not the version counter,
        # so refilling the storage does not invalidate views autograd saved in forward.
        self._full_data = self._full.data
        self._placeholders = [] if use_orig_params else [
            ParamPlaceholder(info.name, info.shape, self.dtype, requires_grad) for info in self.param_infos
        ]
        # The placeholders' requires_grad: only sync_requires_grad changes it (a placeholder
        # refuses requires_grad_), and reading it back costs a __torch_function__ call.
        self._placeholders_require_grad = requires_grad
        # use_orig_params: the original parameters, views of the shard (None otherwise).
        self.orig: Optional[OrigParams] = None
        if use_orig_params:
            ranges: List[Optional[Tuple[int, int, int]]] = [None] * len(self.param_infos)
            for held in self.shard_param_infos:
                ranges[held.index] = (held.shard_offset, held.numel, held.param_offset)
            full_shapes = [info.shape for info in self.param_infos]
            self.orig = OrigParams([p.param for p in primaries], ranges, slots, None if self.sharded else full_shapes, full_shapes, self.rank)
            self.orig.set_names([info.name for info in self.param_infos])
        # What the modules hold while the unit is gathered ([Note: writes through the views]).
        self._module_views = ModuleViews(slots, [info.offset for info in self.param_infos], self._placeholders, self.orig, self.rank)
        # Where the shard the full flat tensor was last gathered from was (its data pointer).
        self._gathered_from = 0
        # Set by hold_grad_for_later: the .grad (weakly) and its version after a no_sync
        # backward. See [Note: no_sync and zero_grad].
        self._held_grad: Optional[Tuple["weakref.ref[torch.Tensor]", int]] = None
        # NO_SHARD: whether .grad holds a no_sync gradient not yet averaged over the ranks.
        self._local_grad = False
        # Elsewhere: whether the full flat tensor's .grad holds one, the gradient the
        # FlatParameter held when holding began, and the held one's version when the user last
        # saw it (see [Note: no_sync and zero_grad]).
        self._hold = HeldGrad.NONE
        self._kept_grad: Optional[torch.Tensor] = None
        self._held_version: Tuple[int, ...] = ()
        self._gather: Optional[Pending] = None  # the all-gather in flight (GATHERING)
        # The gradient reduction in flight (see [Note: gradient reduction]).
        self._reduction = None  # (typed in HandleGrads)
        # The offloaded gradient's copy to the CPU in flight (see [Note: offloaded gradients]).
        self._grad_copy: Optional[torch.cuda.Event] = None
        self.state = HandleState.UNSHARDED
        # Whether its root's runtime is made (its first forward): from then on the runtime holds
        # buffers and exchanges typed for this dtype, so a cast is refused (Unit.bind sets it:
        # an outer unit adopting this one drops the old runtime, and a new one is made later).
        self.runtime_made = False
        # Each touched module's parameter names in registration order, before flattening:
        # state dicts list the originals in that order (see [Note: plain view]).
        self.param_order = _param_order(params)
        if self.orig is not None:
            self.orig.show_shard(self.flat_param.detach())
        else:
            for p in params:
                p.module._parameters.pop(p.attr_name, None)
            _empty_originals(primaries)
            owner.register_parameter(attr_name, self.flat_param)
        if self.separate_full:
            self.reshard()
        else:
            self.use_views(track_grad=False)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "FlatParamHandle":
        """The handle of a copied model (see [Note: deep copies] in ``_deepcopy``): a copy of
        the shard, a full flat tensor of its own (freed), no gradient, nothing in flight, the
        same groups (through communicators of its own) and communication hook. ``after_copy``
        finishes it once the whole model is copied."""
        if self._reduction is not None or self.state is HandleState.GATHERING:
            raise AssertionError(f"[rank {self.rank}] {self.attr_name}: copied with a collective in flight")
        full = None
        if self.separate_full:
            full = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=self.device)
            free_storage(full)
            full.requires_grad_(self._full.requires_grad)
        given = {
            "_comm_hook": self._comm_hook, "_full": full, "_full_data": None if full is None else full.data,
            "_module_views": None, "_held_grad": None, "_local_grad": False, "_gather": None,
            "_hold": HeldGrad.NONE, "_kept_grad": None, "_held_version": (),
            "_reduction": None, "_grad_copy": None, "runtime_made": False,
            "state": HandleState.SHARDED if self.separate_full else HandleState.UNSHARDED,
        }
        new = copy_fields(self, memo, given)
        if new._full is None:  # (its full flat tensor is its FlatParameter)
            new._full = new.flat_param
            new._full_data = new.flat_param.data
        return new

    def after_copy(self) -> None:
        """The copied model is complete: put this handle's placeholders, parameters or views on
        its modules (see [Note: deep copies] in ``_deepcopy``)."""
        self._module_views = ModuleViews(self._slots, [info.offset for info in self.param_infos], self._placeholders, self.orig, self.rank)
        if self.orig is not None:
            self.orig.show_shard(self.flat_param.detach())
        if self.separate_full:
            self._module_views.remove()
        else:
            self.use_views(track_grad=False)

    def adopt_cast(self, shard: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
        """Make ``shard`` (this shard converted to another floating-point dtype, on the same
        device) and ``grad`` (its gradient, converted alike) the ``FlatParameter``'s data and
        gradient: ``model.half()`` / ``model.to(torch.float64)`` after wrapping, as FSDP1
        allows, before the model's first forward.

        [Note: casting a built unit] Pure low-precision training converts the wrapped model
        (``model.half()``), which reaches each handle through ``ShardedDataParallel._apply``.
        The shard is converted in place of the ``FlatParameter``'s data (the parameter objects
        an optimizer may already hold stay), and so is everything whose dtype derives from it:
        the compute, reduce and gradient dtypes (unless mixed precision fixed them), the full
        flat tensor (freed, re-made in the new compute dtype), the placeholders, the original
        parameters' views. Only before the first forward: the runtime made then holds buffers
        and exchanges sized and typed for the old dtype. Device moves stay refused: a unit's
        device is fixed when it is built (``device_id``)."""
        if self.state is HandleState.GATHERING or self._reduction is not None or self._hold is not HeldGrad.NONE:
            raise AssertionError(f"[rank {self.rank}] {self.attr_name}: cast while gathering or holding gradients")
        self.take_user_writes()
        precision = self._precision
        compute = precision.param_dtype or shard.dtype
        if self.separate_full and not (self.sharded or compute != shard.dtype or self.orig is not None):
            raise NotImplementedError(
                f"casting a NO_SHARD unit to {shard.dtype} after wrapping under mixed precision "
                f"(param_dtype={precision.param_dtype}) is not supported: cast the model before wrapping"
            )
        if not self.separate_full and (self.sharded or compute != shard.dtype or self.orig is not None):
            # NO_SHARD (or one rank) computing in param_dtype, cast away from it (accelerate's
            # upcast of a model loaded in param_dtype): the full flat tensor, the FlatParameter
            # itself until now, becomes a tensor of its own, gathered (a copy) for each use.
            self.drop_views()
            self._move((HandleState.UNSHARDED,), HandleState.SHARDED, "cast")
            self.separate_full = True
        elif self.separate_full and self.state is HandleState.UNSHARDED:
            self.reshard()
        with torch.no_grad():
            self.flat_param.data = shard
            self.flat_param.grad = grad
        self.dtype, self.compute_dtype = shard.dtype, compute
        self.reduce_dtype = precision.reduce_dtype or compute
        self.grad_dtype = compute if precision.keep_low_precision_grads else shard.dtype
        if self.separate_full:
            full = torch.empty(self.padded_numel, dtype=compute, device=self.device)
            free_storage(full)
            self._full = full.requires_grad_(self._full.requires_grad)
        else:
            self._full = self.flat_param
        self._full_data = self._full.data
        if self.orig is None:
            self._placeholders = [ParamPlaceholder(i.name, i.shape, shard.dtype, self._placeholders_require_grad) for i in self.param_infos]
        self.after_copy()  # (the modules' placeholders, parameters or views, anew)

    def installed_views(self) -> List[torch.Tensor]:
        """The views on the modules now (none while sharded)."""
        return self._module_views.views()

    def _make_tensors(self, params: Sequence[nn.Parameter], requires_grad: bool, sync: bool) -> Tuple[FlatParameter, torch.Tensor]:
        """The ``FlatParameter`` (this rank's shard) and the full flat tensor (see
        [Note: two tensors per handle])."""
        full = flatten(params, self.padded_numel, self.device)
        fqns = [clean_name(info.name) for info in self.param_infos]  # (FSDP1's _fqns: relative to the owner)
        if sync:  # (hybrid: first across the replicas, then within each shard group)
            if self.replicate is not None:
                self.replicate.broadcast_from_first(full)
            self.comm.broadcast_from_first(full)
        if not self.sharded:
            flat_param = FlatParameter(full, requires_grad, fqns)
            if not self.separate_full:
                return flat_param, flat_param
            return flat_param, full.to(self.compute_dtype, copy=True).requires_grad_(requires_grad)
        start = self.rank * self.shard_numel
        shard = full[start : start + self.shard_numel]
        flat_param = FlatParameter(to_host(shard) if self.offload else shard.clone(), requires_grad, fqns)
        return flat_param, full.to(self.compute_dtype).requires_grad_(requires_grad)

    # -- layout -------------------------------------------------------------------------

    @property
    def _orig_param_dtype(self) -> torch.dtype:
        """FSDP1's name for the original parameters' dtype (the ``FlatParameter``'s)."""
        return self.dtype

    @_orig_param_dtype.setter
    def _orig_param_dtype(self, dtype: torch.dtype) -> None:
        # accelerate upcasts a low-precision model under mixed precision by rebinding the
        # FlatParameter's .data to float32 and then writing this; the handle adopts the cast
        # (see [Note: casting a built unit]).
        if dtype == self.dtype:
            return
        if self.runtime_made:
            raise NotImplementedError(
                f"[rank {self.rank}] _orig_param_dtype = {dtype} for the FlatParameter ({self.describe()}) after the "
                f"model's first forward is not supported (accelerate writes it in prepare_model, before training, "
                f"accelerator.py:2038): cast before the first forward"
            )
        shard = self.flat_param.detach()
        if shard.dtype != dtype:
            raise ValueError(
                f"[rank {self.rank}] _orig_param_dtype = {dtype} for the FlatParameter ({self.describe()}): its .data "
                f"is {shard.dtype}; rebind the FlatParameter's .data to {dtype} first (as accelerate does)"
            )
        with torch.no_grad():
            self.flat_param.data = shard.to(self.dtype)  # (exactly: the cast is from this dtype)
        grad = self.flat_param.grad
        self.adopt_cast(shard, None if grad is None else grad.to(dtype))

    @property
    def requires_grad(self) -> bool:
        """Whether this handle's parameters train: the ``FlatParameter``'s own flag, which the
        user may change at any time (staged fine-tuning); see [Note: requires_grad follows
        the FlatParameter]. With original parameters: whether any of them requires grad."""
        return self.orig.requires_grad if self.orig is not None else self.flat_param.requires_grad

    def sync_requires_grad(self) -> None:
        """[Note: requires_grad follows the FlatParameter] Users freeze and unfreeze through
        ``module.parameters()``, which yields the ``FlatParameter``. The full flat tensor that
        modules compute with (and autograd accumulates into) is a tensor of its own when
        sharded, so before each use it takes the ``FlatParameter``'s flag: a frozen handle gets
        no gradient (and so no reduction), an unfrozen one trains again."""
        flag = self.requires_grad
        if self.orig is not None and self.flat_param.requires_grad != flag:
            self.flat_param.requires_grad_(flag)  # (not the user's: it follows the originals)
        if self._full is not self.flat_param and self._full.requires_grad != flag:
            self._full.requires_grad_(flag)
        if self._placeholders and self._placeholders_require_grad != flag:
            with torch._C.DisableTorchFunctionSubclass():
                for placeholder in self._placeholders:
                    placeholder.requires_grad_(flag)
            self._placeholders_require_grad = flag

    def originals(self) -> List[Tuple[nn.Parameter, str]]:
        """The original parameter objects this handle flattened, with names (emptied, unless
        they are kept as views: ``use_orig_params``)."""
        return list(self._originals)

    def emptied_originals(self) -> List[Tuple[nn.Parameter, str]]:
        """The original parameters emptied by flattening (none with ``use_orig_params``)."""
        return [] if self.orig is not None else list(self._originals)

    def set_name_prefix(self, prefix: str) -> None:
        """Name the placeholders as the user does, from the root (``prefix`` is this unit's
        module path); called when the root is known."""
        names = [f"{prefix}.{info.name}" if prefix else info.name for info in self.param_infos]
        for placeholder, name in zip(self._placeholders, names):
            placeholder.param_name = name
        if self.orig is not None:
            self.orig.set_names(names)
        self._names = names

    def describe(self) -> str:
        """The layout in one line, e.g. for telling which unit differs between ranks (names
        without wrapper attributes: see [Note: wrapper prefixes] in ``_plain_view``)."""
        params = ", ".join(f"{clean_name(i.name)} {tuple(i.shape)}" for i in self.param_infos)
        tied = "".join(f", {clean_name(s.name)} = {clean_name(self.param_infos[s.primary].name)}" for s in self.shared_param_infos)
        return f"{self.dtype}, requires_grad={self.requires_grad}: {params}{tied}"

    # -- unshard / reshard --------------------------------------------------------------

    @property
    def grad_leaf(self) -> torch.Tensor:
        """The full flat tensor autograd accumulates this unit's unsharded gradient into."""
        return self._full

    # [Note: handle states] SHARDED --unshard--> GATHERING --wait--> UNSHARDED --reshard-->
    # SHARDED; refresh: UNSHARDED/GATHERING --> GATHERING. Each method checks the state it
    # starts from and raises (with the expected and actual state) when called in another: the
    # caller decides, from ``state``, whether a gather or a free is needed. A handle whose
    # full flat tensor is the ``FlatParameter`` itself (``NO_SHARD`` without mixed precision)
    # is always UNSHARDED: there is nothing to free, and ``reshard``/``refresh`` say so.

    def _move(self, allowed_from: Sequence[HandleState], target: HandleState, what: str) -> None:
        self.state = guard_transition(self.state, allowed_from, target, f"[rank {self.rank}] {self.attr_name}.{what}()")

    def unshard(self, async_op: bool = False) -> None:
        """Materialise the full flat tensor (all-gather): SHARDED -> GATHERING, and on to
        UNSHARDED unless ``async_op`` (then ``wait()``, or any use of the full tensor,
        completes it)."""
        self.take_user_writes()
        self._move((HandleState.SHARDED,), HandleState.GATHERING, "unshard")
        alloc_storage(self._full_data, self.padded_numel)
        self._start_gather(async_op, HandleState.SHARDED)

    def _start_gather(self, async_op: bool, before: HandleState) -> None:
        """Fill the (allocated) full flat tensor from the shards (state GATHERING).

        A gather that could not start (an error or ``KeyboardInterrupt`` in the copy or the
        collective call) returns the handle to ``before`` -- freed again if it was SHARDED --
        so the clean-up that follows finds a state it can leave, not GATHERING with nothing
        in flight."""
        try:
            shard = self.flat_param.detach()
            self._gathered_from = shard.data_ptr()
            if self.offload:
                shard = shard.to(self.device, non_blocking=True)
            if shard.dtype != self.compute_dtype:
                shard = shard.to(self.compute_dtype)
            # (not sharded: a cast copy, mixed precision without sharding)
            self._gather = self._gather_padded_into(self._full_data, shard, async_op=True)
        except BaseException:
            self._move((HandleState.GATHERING,), before, "unshard" if before is HandleState.SHARDED else "refresh")
            if before is HandleState.SHARDED:
                free_storage(self._full_data)
            raise
        if not async_op:
            self.wait()

    def refresh(self, async_op: bool = False) -> bool:
        """Gather again into the full flat tensor kept from an earlier forward (UNSHARDED or
        GATHERING -> GATHERING); ``False`` if it is the ``FlatParameter`` itself.

        [Note: stale gathers] A full flat tensor is a copy of the shards as they were when it
        was gathered. Normally it is freed at the end of the backward, but a forward whose
        backward never runs (a metric computed with autograd on) leaves units gathered (the
        root, ``SHARD_GRAD_OP`` units); after an optimizer step (or a checkpoint load, or any
        write to the shards) that copy is stale. The runtime refreshes every unit still
        gathered when a new forward starts; this is rank-consistent (every rank knows the
        same units are gathered), unlike comparing version counters, and it updates the
        views in place, so tensors that alias them (an output that returned a weight) see
        the current values as they would in single-process training."""
        if not self.separate_full:
            return False
        self.finish_gather()
        self.take_user_writes()
        self._move((HandleState.UNSHARDED,), HandleState.GATHERING, "refresh")
        self._start_gather(async_op, HandleState.UNSHARDED)
        return True

    def wait(self) -> None:
        """Complete the all-gather in flight: GATHERING -> UNSHARDED."""
        self._move((HandleState.GATHERING,), HandleState.UNSHARDED, "wait")
        if self._gather is None:
            raise AssertionError(f"[rank {self.rank}] {self.attr_name}: GATHERING without an all-gather in flight")
        gather, self._gather = self._gather, None
        gather.wait()

    def finish_gather(self) -> None:
        """``wait()`` if an all-gather is in flight (before reading or freeing the full tensor)."""
        if self.state is HandleState.GATHERING:
            self.wait()

    def reshard(self) -> bool:
        """Free the full flat tensor: UNSHARDED or GATHERING -> SHARDED (a gather in flight is
        completed first). ``False`` if there is nothing to free (the full flat tensor is the
        ``FlatParameter``)."""
        if not self.separate_full:
            return False
        self.finish_gather()  # never free memory a collective is still writing
        self.drop_views()  # (taking what was written through them first)
        self._move((HandleState.UNSHARDED,), HandleState.SHARDED, "reshard")
        free_storage(self._full_data)
        return True

    def use_views(self, track_grad: bool, in_forward: bool = False, before_full_grad: Optional[Callable[[Any], None]] = None) -> None:
        """Put views of the full flat tensor on the modules in place of the original parameters.

        With ``track_grad`` the views are made under autograd, so gradients flow into
        ``grad_leaf``; without it they are plain aliases (for ``no_grad`` forwards).
        ``in_forward``: the unit's forward is about to run (original parameters: the views are
        what ``named_parameters()`` gives until ``end_forward``). ``before_full_grad``: called
        (with the pieces' gradients) just before a backward assembles the full gradient from
        the views' gradients, i.e. before it allocates it.
        """
        self.finish_gather()
        if self.state is not HandleState.UNSHARDED:
            raise AssertionError(f"[rank {self.rank}] views requested while {self.state.name}")
        self._take_view_writes()  # (before new views replace the ones written through)
        self.sync_requires_grad()
        if self.orig is not None:
            self.flat_grad()  # (frees a shard gradient whose views the user dropped: zero_grad)
        with torch.set_grad_enabled(track_grad and self.requires_grad):
            chunks = self._full.split(self._split_sizes)
            if before_full_grad is not None and chunks and chunks[0].grad_fn is not None:
                chunks[0].grad_fn.register_prehook(before_full_grad)
            if self.orig is not None:
                views = self.orig.compute_views(chunks, [info.shape for info in self.param_infos], track_grad)
            else:
                views = [chunk.view(info.shape) for chunk, info in zip(chunks, self.param_infos)]
        self._module_views.install(views, self._full, in_forward and self.orig is not None, self._names)

    def end_forward(self) -> None:
        """The unit's forward returned (its views stay on the modules while it is gathered)."""
        self._module_views.end_forward()

    def drop_views(self) -> None:
        """Replace the views on the modules by placeholders (see [Note: placeholders]), or by
        the original parameters (``use_orig_params``), taking what was written through them."""
        self._take_view_writes()
        self._module_views.remove()

    # -- writes the user made outside flatshard's sight --------------------------------------

    def take_user_writes(self) -> None:
        """Take into the shard what the user wrote to the parameters where the shard does not
        see it (see [Note: writes through the views] in ``_module_views`` and [Note: writes to
        original parameters] in ``_orig_params``): before anything reads or overwrites it."""
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):  # (what is made here outlives an inference forward)
                self.take_user_writes()
            return
        self._take_view_writes()
        if self.orig is not None:
            self.orig.take_writes(self.flat_param.detach())

    def _take_view_writes(self) -> None:
        views = self._module_views
        if not views.installed:
            self._check_flat_param()
            return
        if self.separate_full and views.written_in_place(self._full):
            self._shard_from_range()
            views.taken(self._full)
        rebound = views.rebound(self._full_data)
        self._check_flat_param()
        for index, value in rebound:
            shape = self.param_infos[index].shape
            if value.shape != shape:
                raise RuntimeError(
                    f"[rank {self.rank}] Cannot writeback parameter '{self._names[index]}': the .data of its full "
                    f"view was rebound to a tensor of shape {tuple(value.shape)}, where the parameter has shape "
                    f"{tuple(shape)}"
                )
            self._load(index, value)

    def _check_flat_param(self) -> None:
        """The ``FlatParameter`` is what ``model.parameters()`` gives (the default mode), so a
        loop may rebind its ``.data`` (``vector_to_parameters``): that is fine -- gathers read
        it -- as long as it keeps its shape and dtype; where it is also the full flat tensor
        (``NO_SHARD``), the alias that views are made of follows it."""
        shard = self.flat_param
        if shard.shape != (self.shard_numel,) or shard.dtype != self.dtype:
            names = ", ".join(f"'{n}'" for n in self._names[:3]) + (", ..." if len(self._names) > 3 else "")
            raise RuntimeError(
                f"[rank {self.rank}] Cannot writeback the FlatParameter of parameters {names}: its .data was set to a "
                f"tensor of shape {tuple(shard.shape)} and dtype {shard.dtype}, but this rank's shard has shape "
                f"({self.shard_numel},) and dtype {self.dtype}"
            )
        if not self.separate_full and self._full_data.data_ptr() != shard.data_ptr():
            self._full_data = shard.data
            if self._module_views.installed:  # (the views on the modules alias the old data)
                self._module_views.follow(self.split_full(self._full_data), self._full)

    def views_changed(self) -> Optional[str]:
        """For a backward about to compute with what the forward gathered: a view on the
        modules replaced or rebound since it was put there, or a parameter the optimizer
        steps (an original one, or the ``FlatParameter``) replaced or rebound, described;
        ``None`` if none was."""
        change = self._module_views.changed(self._full_data, self._names)
        if change is None and self.orig is not None:
            change = self.orig.changed(self.flat_param.detach())
        if change is None and self.separate_full and self.flat_param.data_ptr() != self._gathered_from:
            names = ", ".join(f"'{n}'" for n in self._names[:2]) + (", ..." if len(self._names) > 2 else "")
            change = f"the .data of the FlatParameter of {names} was rebound"
        return change

    def _shard_from_range(self) -> None:
        """Copy this rank's range of the gathered full flat tensor into the shard (under mixed
        precision only the elements that differ from the shard's in the compute dtype)."""
        start = self.rank * self.shard_numel if self.sharded else 0
        full = self._full_data[start : start + self.shard_numel]
        shard = self.flat_param.detach()
        with torch.no_grad():
            if full.dtype == shard.dtype:
                shard.copy_(full)
                return
            full = full.to(shard.device)
            changed = full != shard.to(full.dtype)
            shard[changed] = full[changed].to(shard.dtype)

    def named_full_views(self) -> List[Tuple[str, torch.Tensor]]:
        """(name, full tensor) for every registration, tied ones included; needs UNSHARDED."""
        views = self.full_views()
        named = [(info.name, views[i]) for i, info in enumerate(self.param_infos)]
        return named + [(s.name, views[s.primary]) for s in self.shared_param_infos]

    def full_views(self) -> List[torch.Tensor]:
        """One plain (autograd-free) view of the full flat tensor per original parameter, in
        ``param_infos`` order; needs UNSHARDED."""
        self.finish_gather()
        if self.state is not HandleState.UNSHARDED:
            raise AssertionError(f"[rank {self.rank}] full views requested while {self.state.name}")
        self._take_view_writes()
        return self.split_full(self._full_data)

    def slots(self) -> List[Tuple[nn.Module, str, int]]:
        """Every registration: (module, attribute, index into ``param_infos``)."""
        return list(self._slots)

    def load_param(self, index: int, value: torch.Tensor) -> None:
        """Set original parameter ``index`` to ``value`` (its full value, any dtype and
        device): this rank's part of it in the shard, and the full flat tensor if gathered."""
        info = self.param_infos[index]
        if tuple(value.shape) != tuple(info.shape):
            raise ValueError(f"[rank {self.rank}] parameter '{info.name}': cannot load a value of shape {tuple(value.shape)}; it has shape {tuple(info.shape)}")
        self.finish_gather()
        self._take_view_writes()  # (else one taken later would overwrite the loaded value)
        self._load(index, value)

    def _load(self, index: int, value: torch.Tensor) -> None:
        """``load_param`` without its checks (``value`` has the parameter's shape)."""
        info = self.param_infos[index]
        flat = value.detach().reshape(-1)
        with torch.no_grad():
            if self.separate_full and self.state is HandleState.UNSHARDED:
                self._full_data[info.offset : info.offset + info.numel].copy_(flat)
            shard = self.flat_param.detach()  # (under NO_SHARD: everything)
            for held in self.shard_param_infos:
                if held.index == index:
                    piece = flat[held.param_offset : held.param_offset + held.numel]
                    shard[held.shard_offset : held.shard_offset + held.numel].copy_(piece)

    def shard_from_full(self) -> None:
        """Copy this rank's range of the gathered full flat tensor into the shard (after the
        full parameters were changed in place)."""
        self.finish_gather()
        if self.state is not HandleState.UNSHARDED:
            raise AssertionError(f"[rank {self.rank}] write-back requested while {self.state.name}")
        if self.separate_full:  # (else the full flat tensor is the FlatParameter)
            self._shard_from_range()

    def exact_views(self) -> Tuple[List[torch.Tensor], bool]:
        """Every original parameter's full value in the parameters' own dtype, gathering as
        needed: views of the gathered full flat tensor (``True``) or, under mixed precision,
        of a separate full-precision gather that nothing else holds (``False``). A full
        flat tensor kept from an earlier forward is gathered again first: the shards may have
        changed since (see [Note: stale gathers])."""
        if self.compute_dtype != self.dtype:
            return self.split_full(self.gather_full_precision()), False
        if self.state is HandleState.SHARDED:
            self.unshard()
        else:
            self.refresh()
        return self.full_views(), True

    def gather_full_precision(self) -> torch.Tensor:
        """A new full (padded) flat tensor in the parameters' own dtype, e.g. for state dicts
        under mixed precision, where the gathered tensor is in the compute dtype.
        Collective when sharded."""
        self.take_user_writes()
        return self.gather_padded(self.flat_param.detach().to(self.device))

    def gather_grad(self) -> Optional[torch.Tensor]:
        """The full (padded) flat gradient assembled from every rank's shard gradient, or
        ``None`` without one. Collective when sharded; every rank must agree on ``None``."""
        grad = self.flat_grad()
        return None if grad is None else self.gather_padded(grad.detach().to(self.device))

    def gather_padded(self, shard_like: torch.Tensor) -> torch.Tensor:
        """A new full (padded) flat tensor assembled from every rank's ``shard_like``, a tensor
        shaped like this rank's shard (its gradient, an optimizer's state of it, ...), in
        ``shard_like``'s dtype and on its device: an all-gather when sharded (collective), a
        copy when not."""
        shard = shard_like.detach()
        full = shard.new_empty(self.padded_numel)
        self._gather_padded_into(full, shard, async_op=False)
        return full

    def _gather_padded_into(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool) -> Pending:
        """Fill ``full`` (``padded_numel`` elements) from every rank's ``shard`` (this rank's,
        ``shard_numel`` elements): the one place a handle assembles a full flat tensor."""
        if tuple(shard.shape) != (self.shard_numel,):
            raise AssertionError(f"[rank {self.rank}] {self.attr_name}: expected a shard of shape ({self.shard_numel},), got {tuple(shard.shape)}")
        if not self.sharded:
            full.copy_(shard)
            return Pending(None)
        return self.comm.all_gather(full, shard.contiguous(), async_op=async_op)

    def split_full(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """A full flat tensor (e.g. a gathered gradient) as per-parameter views."""
        chunks = flat.split(self._split_sizes)
        return [chunk.view(info.shape) for chunk, info in zip(chunks, self.param_infos)]

    def full_storage_bytes(self) -> int:
        """Bytes the full flat tensor holds right now (0 when resharded, unless ``NO_SHARD``)."""
        return storage_bytes(self._full_data)

    def storage_key(self) -> int:
        """Identifies the full flat tensor's storage (the same object, allocated or freed,
        for the handle's life); compare with ``storage_key_of`` of a tensor."""
        return storage_key_of(self._full_data)

    def aliases(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` shares the full flat tensor's memory (e.g. a module returned
        one of its parameters): then it must not be freed before that tensor's backward."""
        return (
            self.state is HandleState.UNSHARDED
            and tensor.layout is torch.strided
            and tensor.device == self.device
            and tensor.untyped_storage().data_ptr() == self._full_data.untyped_storage().data_ptr()
        )


def storage_key_of(tensor: torch.Tensor) -> Optional[int]:
    """The identity of ``tensor``'s storage (``None`` for tensors without one, e.g. sparse
    or wrapper subclasses)."""
    if tensor.layout is not torch.strided or type(tensor) not in _PLAIN_TENSOR_TYPES:
        return None
    return tensor.untyped_storage()._cdata


_PLAIN_TENSOR_TYPES = (torch.Tensor, nn.Parameter, FlatParameter)


def _empty_originals(primaries: Sequence[OrigParam]) -> None:
    """[Note: emptied originals] The original parameter objects are replaced by the flat
    parameter, but they may still be referenced: by a module outside this unit that shares
    them (a tied weight another unit would flatten a second time) or by the user (e.g. an
    optimizer built before wrapping). Their data is replaced by an empty tensor: their memory
    is released, any stale use fails loudly, and a later wrapper recognises them (see
    ``_init._check_params``), so a tie can never be split silently."""
    with torch.no_grad():
        for p in primaries:
            p.param.data = torch.empty(0, dtype=p.param.dtype, device=p.param.device)


def _param_order(params: Sequence[OrigParam]) -> List[Tuple[nn.Module, Tuple[str, ...]]]:
    """Each module's parameter names now, FlatParameters left out: a module flattened by
    several handles is recorded by each, and the first recording (made before anything of
    the module was flattened) is then the longest."""
    seen: Dict[int, Tuple[nn.Module, Tuple[str, ...]]] = {}
    for p in params:
        if id(p.module) not in seen:
            names = tuple(n for n, q in p.module._parameters.items() if not isinstance(q, FlatParameter))
            seen[id(p.module)] = (p.module, names)
    return list(seen.values())

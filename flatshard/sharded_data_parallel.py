"""``ShardedDataParallel``: the public wrapper. Thin: construction lives in ``_init``, the
forward/backward machinery in ``_runtime``, flattening and sharding in ``flat_param``."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from ._checkpoint._clip import clip_grad_norm_
from ._base._compile import dynamo_loaded
from ._comm._collectives import ProcessGroup
from ._base._common import WRAPPED_MODULE, TrainingState, clean_name, display_name
from ._engine._deepcopy import copy_model
from ._base._fsdp_markers import check_not_rewrapped, mark_fsdp_managed
from ._engine._generate import generate_gathered
from ._build._init import build_unit, construction_guard
from ._comm._guard import Guard
from ._checkpoint._module_state_dict import route_state_dict, skips_in_tree_walk
from ._build._node_groups import NodeGroups
from ._base._options import ConstructionOptions
from ._build._planning import make_plan, unit_options
from ._engine._forward import run_forward
from ._engine._fsdp1_surface import FSDP1Surface, SignedForward, show_forward_signature
from ._engine._runtime import no_sync
from ._engine._stale_optimizer import StaleOptimizerCheck, watch_stale_optimizers
from ._checkpoint._optim_dicts import (
    check_group,
    check_optim_args,
    flatten_sharded_optim_state,
    gather_full_optim_state,
    gather_sharded_optim_state,
    optim_state_for,
    optim_state_to_load,
    rekey_plain_optim_state,
    scatter_full_optim_state,
    shard_full_optim_state,
)
from ._checkpoint._state_dict import get_settings, load_model_state, make_settings, model_state, set_settings
from ._checkpoint._state_dict import state_dict_type as settings_applied
from ._checkpoint._checkpointing import guarded_call
from ._checkpoint._summon import forward_while_summoned, summon_full_params
from ._engine._unit import bind_units
from .api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from ._flat._flat_param import FlatParamHandle, OrigParam

__all__ = ["ShardedDataParallel"]


class ShardedDataParallel(FSDP1Surface):
    """Shards a module's parameters, gradients and optimizer state over the ranks.

    The parameters of ``module`` that no nested ``ShardedDataParallel`` owns are flattened
    into one ``FlatParameter`` of which each rank keeps an equal shard. The full parameters
    are all-gathered just before this unit computes (forward and backward) and freed after;
    gradients are reduce-scattered so each rank keeps the mean gradient of its shard. Build
    nested wrappers first (innermost first) so each unit holds only part of the model.

    The arguments are those of ``torch.distributed.fsdp.FullyShardedDataParallel``.

    Args:
        module: the module to wrap.
        process_group: the ranks to shard over (default: the default process group); for
            ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2`` a ``(shard_group, replicate_group)`` pair.
        sharding_strategy: a ``ShardingStrategy`` (default ``FULL_SHARD``).
        cpu_offload: ``CPUOffload(offload_params=True)`` keeps the shards and their gradients
            on the CPU (the optimizer steps there); a no-op when computing on the CPU.
        auto_wrap_policy: a policy from ``flatshard.wrap`` (or any FSDP1-style policy) that
            picks the submodules to wrap as units; the module itself is always a unit.
            Tied parameters go to the lowest unit containing all their users.
        backward_prefetch: ``BACKWARD_PRE`` (default), ``BACKWARD_POST`` or ``None``: when the
            next unit's all-gather is issued in backward.
        mixed_precision: a ``MixedPrecision``: compute in ``param_dtype``, reduce gradients in
            ``reduce_dtype``, buffers in ``buffer_dtype``; the shards (and state dicts) keep
            the parameters' dtype. With a policy, BatchNorm-style modules become full-precision units.
        ignored_modules: modules whose parameters and buffers stay ordinary (not flattened,
            sharded or reduced).
        param_init_fn: for a unit built (partly) on the meta device, called on every module
            of the unit, containers included, outermost first (as in FSDP1), to materialise
            and initialise it (default: ``to_empty`` + ``reset_parameters()``).
        device_id: the compute device (an int is a CUDA index); parameters on the CPU are
            moved there. Default: the device the parameters are on.
        sync_module_states: broadcast the first rank's parameters and buffers before
            sharding, so ranks may start from different initial values.
        forward_prefetch: issue the next unit's all-gather (by the first iteration's order)
            before this unit's forward computes; with communication overlap on (the default,
            ``set_communication_overlap``) that happens anyway.
        limit_all_gathers: bound the units gathered ahead of their use (by prefetches) to two.
        use_orig_params: keep the model's own ``nn.Parameter``s registered under their names
            (as views of this rank's shard outside compute), so that an optimizer can be built
            from ``named_parameters()`` with per-parameter groups, and parameters can be frozen
            one by one. ``False``: the model's parameters are its ``FlatParameter``s.
        ignored_states: parameters or modules to ignore (instead of ``ignored_modules``).
        device_mesh: a 1-D ``DeviceMesh`` instead of ``process_group`` (2-D, (replicate,
            shard), for hybrid sharding).
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: Optional[ProcessGroup] = None,
        sharding_strategy: Optional[ShardingStrategy] = None,
        cpu_offload: Optional[CPUOffload] = None,
        auto_wrap_policy: Optional[Callable[..., Any]] = None,
        backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: Optional[MixedPrecision] = None,
        ignored_modules: Optional[Iterable[nn.Module]] = None,
        param_init_fn: Optional[Callable[[nn.Module], None]] = None,
        device_id: Optional[Union[int, torch.device]] = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Optional[Iterable[Any]] = None,
        device_mesh: Optional[Any] = None,
    ) -> None:
        super().__init__()
        # Taken before any other local exists: exactly the arguments (see [Note: one list of options]).
        options = ConstructionOptions.from_constructor(locals())
        # Construction is a guarded call: [Note: one guarded path] in _comm/_guard.
        guard = construction_guard(options)
        with guard.call(f"the construction of ShardedDataParallel({type(module).__name__})"):
            node_groups = NodeGroups(guard)  # (hybrid sharding without groups: the default ones, per unit)
            owned = None
            if options.auto_wrap_policy is not None:
                owned = _wrap_planned_units(module, options, node_groups, guard)
                options = options.for_unit({})  # the root unit's own options: planned, so without the policy
            self._unit = build_unit(module, node_groups.fill(options), owned, guard=guard)
        bind_units(guard, self._unit.members())  # (units wrapped by hand before: their comms too)
        self._fsdp_wrapped_module = module
        self._state_dict_route = route_state_dict(self, module)  # see [Note: the wrapped module's state dict]
        mark_fsdp_managed(self, options.use_orig_params)  # see [Note: FSDP markers]
        show_forward_signature(self, module)  # see [Note: the forward signature]
        # Optimizers built before wrapping fail at their first step (see [Note: stale optimizers]).
        self._stale_optimizer_check: Optional[StaleOptimizerCheck] = watch_stale_optimizers(self, self._unit)

    @classmethod
    def _planned(cls, module: nn.Module, options: ConstructionOptions, owned: List[OrigParam], name: str, guard: Guard) -> "ShardedDataParallel":
        """An inner unit of an auto-wrap plan (``options`` without the policy), built in the
        root's constructor call (``guard``)."""
        wrapper = cls.__new__(cls)
        nn.Module.__init__(wrapper)
        wrapper._unit = build_unit(module, options, owned, name, guard)
        wrapper._fsdp_wrapped_module = module
        wrapper._state_dict_route = route_state_dict(wrapper, module)
        wrapper._stale_optimizer_check = None  # the root being built covers this unit
        show_forward_signature(wrapper, module)
        return wrapper

    def __deepcopy__(self, memo: Dict[Any, Any]) -> "ShardedDataParallel":
        """An independent copy of the model, as ``copy.deepcopy`` of the unwrapped model gives
        (EMA, ``torch.optim.swa_utils.AveragedModel``); see [Note: deep copies] in
        ``_deepcopy``. Call it on every rank, on the root, between iterations."""
        return copy_model(self, memo)  # type: ignore[return-value]

    # -- the wrapped module -------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in (WRAPPED_MODULE, "_unit"):
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: Any) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    # -- properties in FSDP1's names ----------------------------------------------------------

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._unit.config.sharding_strategy

    @property
    def cpu_offload(self) -> CPUOffload:
        return CPUOffload(offload_params=self._unit.config.offload_params)

    @property
    def mixed_precision(self) -> MixedPrecision:
        """The unit's ``MixedPrecision``: ``MixedPrecision()`` (every dtype ``None``) without
        one, and for a unit kept in full precision (BatchNorm), as in FSDP1."""
        config = self._unit.config
        return config.mixed_precision if config.mixed_precision is not None and not config.full_precision else MixedPrecision()

    @property
    def use_orig_params(self) -> bool:
        return self._unit.config.use_orig_params

    @property
    def params(self) -> List[nn.Parameter]:
        """This unit's ``FlatParameter``s (FSDP1's attribute; empty if it owns no parameters)."""
        return [handle.flat_param for handle in self._unit.handles]

    @property
    def backward_prefetch(self) -> Optional[BackwardPrefetch]:
        return self._unit.config.backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        return self._unit.config.forward_prefetch

    @property
    def limit_all_gathers(self) -> bool:
        return self._unit.config.limit_all_gathers

    @property
    def process_group(self) -> ProcessGroup:
        return self._unit.group

    @property
    def rank(self) -> int:
        return self._unit.rank

    @property
    def world_size(self) -> int:
        return self._unit.world_size

    @property
    def compute_device(self) -> torch.device:
        return self._unit.device

    @property
    def training_state(self) -> TrainingState:
        return self._unit.training_state

    @property
    def handles(self) -> List[FlatParamHandle]:
        """The handles of this unit's ``FlatParameter``s: one per group of its parameters that
        share dtype and ``requires_grad`` (none if it owns no parameters)."""
        return list(self._unit.handles)

    @property
    def handle(self) -> Optional[FlatParamHandle]:
        """This unit's only handle (``None`` if it owns no parameters)."""
        handles = self._unit.handles
        if len(handles) > 1:
            raise ValueError(f"unit {display_name(self._unit.name)} has {len(handles)} FlatParameters; use .handles")
        return handles[0] if handles else None

    # -- running ------------------------------------------------------------------------------

    @SignedForward  # (inspect.signature shows the wrapped module's: [Note: the forward signature])
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Dynamo traces this method when the model is compiled: see [Note: torch.compile] in _runtime.
        unit, module = self._unit, self._fsdp_wrapped_module
        # (not torch.compiler.is_compiling(): after a graph break, dynamo runs the rest of this
        # frame eagerly and compiles each frame it calls, the runtime's too)
        dynamo = dynamo_loaded()
        if unit.ctx is None and unit.parent is None:  # (the root's first forward)
            check_not_rewrapped(self)  # see [Note: a second FSDP]
        if unit.training_state is TrainingState.SUMMON_FULL_PARAMS:
            summoned = torch.compiler.disable(forward_while_summoned) if dynamo else forward_while_summoned
            return summoned(unit, module, args, kwargs)
        if dynamo:
            return torch.compiler.disable(run_forward, recursive=False)(unit, module, args, kwargs, torch.compiler.disable)
        return run_forward(unit, module, args, kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate`` (Hugging Face models), run with this unit's
        parameters gathered for the whole call and every nested unit gathered for each of its
        forwards, as in a forward without autograd. Collective: every rank calls it (with
        several ranks ``synced_gpus=True`` is passed unless given, so ranks that finish at
        different lengths keep running forwards together). Inside ``summon_full_params`` the
        wrapped model's ``generate`` runs on the summoned parameters (no gathering per token).

        Args:
            *args: the wrapped model's ``generate`` arguments.
            **kwargs: its keyword arguments.
        """
        method = getattr(self._fsdp_wrapped_module, "generate", None)
        if not callable(method):
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute 'generate': the wrapped "
                f"{type(self._fsdp_wrapped_module).__name__} has no generate method"
            )
        return generate_gathered(self._unit, method, args, kwargs)

    def apply(self, fn: Callable[[nn.Module], None]) -> "ShardedDataParallel":  # type: ignore[override]
        """As ``nn.Module.apply``, with this unit's full parameters summoned (and written back)
        while ``fn`` runs on its modules, so initialisation code works after wrapping; each
        nested unit does the same for its own modules. Collective.

        Args:
            fn: called on every module of the tree (children first), as by ``nn.Module.apply``.
        """
        unit = self._unit
        if unit.training_state is not TrainingState.IDLE:
            # (ValueError with FSDP1's words, which code written for it catches)
            raise ValueError(
                f"{unit.where()}: apply(fn) expected to be in states [TrainingState.IDLE] but the unit is "
                f"in {unit.training_state}: call it outside forward, backward and summon_full_params"
            )
        with guarded_call(unit, "apply()"):
            with summon_full_params(list(self.modules()), [unit], writeback=True, rank0_only=False, offload_to_cpu=False, with_grads=False):
                return super().apply(fn)  # type: ignore[return-value]

    def check_is_root(self) -> bool:
        """Whether this instance is the root: the outermost ``ShardedDataParallel``."""
        return self._unit.is_root

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient communication: backward passes inside accumulate unsharded
        gradients locally; the next backward outside reduces their sum. Call on the root.
        Gradients stay unsharded meanwhile, so this costs full-gradient memory per unit."""
        if not self._unit.is_root:
            raise RuntimeError(
                f"no_sync() must be called on the root ShardedDataParallel, not on the nested "
                f"unit {display_name(self._unit.name)}"
            )
        with no_sync([self._unit] + [unit for _, unit in self._unit.descendants]):
            yield

    def set_communication_overlap(self, enabled: bool) -> None:
        """Choose between speed and FSDP1's lowest peak memory (see docs/performance.md).

        ``True`` (the default): every all-gather and gradient reduction is issued before the
        computation it hides behind and waited for after it: each unit's forward gathers the
        next unit's parameters by the recorded order (as if ``forward_prefetch=True``; FSDP1
        gets that from its streams), and a unit's gradient reduction completes after the next
        unit's gradient computation, keeping that unit's full gradient meanwhile (on a GPU
        FSDP1 and FSDP2 keep one in flight too). ``False``: nothing is gathered ahead unless
        ``forward_prefetch``/``backward_prefetch`` ask for it, and each reduction completes
        before the backward allocates again: the peak per rank of FSDP1 on torch's fake
        process group, with the communication exposed.

        Args:
            enabled: whether communication overlaps compute. Call on the root, outside
                forward and backward; it holds for every unit of the root.
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"set_communication_overlap(enabled) takes a bool; got {type(enabled).__name__} {enabled!r}")
        unit = self._unit
        if not unit.is_root:
            raise RuntimeError(
                f"set_communication_overlap() must be called on the root ShardedDataParallel, not on the nested "
                f"unit {display_name(unit.name)}"
            )
        busy = [u for u in unit.members() if u.training_state is not TrainingState.IDLE]
        if busy:
            raise ValueError(
                f"set_communication_overlap() expected every unit in TrainingState.IDLE but {busy[0].where()} is in "
                f"{busy[0].training_state}: call it outside forward and backward"
            )
        unit.overlap_communication = enabled

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> List["ShardedDataParallel"]:
        """Every ``ShardedDataParallel`` in ``module``'s tree (``module`` included), in module
        order; with ``root_only``, only those not nested inside another one."""
        found = [m for m in module.modules() if isinstance(m, ShardedDataParallel)]
        if not root_only:
            return found
        return [m for m in found if m._unit.parent is None]

    # -- state dicts and full parameters -----------------------------------------------------

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: Optional[StateDictConfig] = None,
        optim_state_dict_config: Optional[OptimStateDictConfig] = None,
    ) -> StateDictSettings:
        """Choose what ``state_dict()`` / ``load_state_dict()`` of every unit under ``module``
        produce and take; returns the previous settings.

        Args:
            module: the model (or any module containing ``ShardedDataParallel`` units).
            state_dict_type: ``FULL_STATE_DICT`` (the unwrapped model's keys, full tensors),
                ``SHARDED_STATE_DICT`` (the same keys, ``DTensor`` parts for
                ``torch.distributed.checkpoint``) or ``LOCAL_STATE_DICT`` (this rank's flat shards).
            state_dict_config: the type's config (default: its defaults), e.g.
                ``FullStateDictConfig(offload_to_cpu=True, rank0_only=True)``.
            optim_state_dict_config: the matching optimizer-state config.
        """
        settings = make_settings(state_dict_type, state_dict_config, optim_state_dict_config)
        return set_settings(module, settings)

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The state-dict settings of the units under ``module`` (an error if they differ)."""
        return get_settings(module)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: Optional[StateDictConfig] = None,
        optim_state_dict_config: Optional[OptimStateDictConfig] = None,
    ) -> Iterator[None]:
        """``set_state_dict_type`` for the length of a ``with`` block (same arguments)."""
        with settings_applied(module, state_dict_type, state_dict_config, optim_state_dict_config):
            yield

    def state_dict(  # type: ignore[override]
        self, destination: Optional[Dict[str, Any]] = None, prefix: str = "", keep_vars: bool = False
    ) -> Dict[str, Any]:
        """The model's state in the form ``set_state_dict_type`` selected (default
        ``FULL_STATE_DICT``): the unwrapped model's keys, with full tensors, ``DTensor`` parts,
        or (``LOCAL_STATE_DICT``) this rank's flat shards. Collective: call on every rank."""
        unit = self._unit
        if skips_in_tree_walk(unit, destination):  # see [Note: the wrapped module's state dict]
            return destination  # type: ignore[return-value]
        with guarded_call(self, "state_dict()"):
            return model_state(self, destination, prefix, keep_vars, get_settings(self))

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load a state dict of the selected type into the shards; ``strict`` as in torch
        (missing and unexpected keys are reported by the unwrapped model's names). Collective:
        every rank passes the same keys."""
        with guarded_call(self, "load_state_dict()", clears=True):
            if assign:
                raise NotImplementedError("load_state_dict(assign=True) is not supported: the values are copied into the shards")
            if not isinstance(strict, bool):
                raise TypeError(f"load_state_dict: strict must be a bool; got {strict!r}")
            return load_model_state(self, state_dict, strict, get_settings(self))

    def _load_from_state_dict(
        self, state_dict: Mapping[str, Any], prefix: str, local_metadata: Any, strict: bool,
        missing_keys: List[str], unexpected_keys: List[str], error_msgs: List[str],
    ) -> None:
        # A parent's load_state_dict() walking the tree: see [Note: loading through a parent].
        self._state_dict_route.load(state_dict, prefix, missing_keys, unexpected_keys)

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Inside, the modules hold their full original parameters as ``nn.Parameter``s under
        their plain names, e.g. for evaluation, generation or inspection. Collective.

        Args:
            module: the model, or any module containing ``ShardedDataParallel`` units.
            recurse: summon every unit under ``module`` (``False``: only the outermost ones).
            writeback: copy changes to the parameters back into the shards on exit
                (``False``: discard them).
            rank0_only: only rank 0 gets the full parameters (needs ``writeback=False``).
            offload_to_cpu: give copies on the CPU (on a CPU device, the parameters themselves).
            with_grads: also give each parameter its full ``.grad`` (read-only: gradients are
                not written back).
        """
        if not isinstance(recurse, bool):
            raise TypeError(f"summon_full_params: recurse must be a bool; got {recurse!r}")
        wrappers = ShardedDataParallel.fsdp_modules(module)
        if not wrappers:  # (nothing to summon: a no-op, as in FSDP1)
            yield
            return
        if not recurse:
            inner = {id(u) for w in wrappers for _, u in w._unit.descendants}
            wrappers = [w for w in wrappers if id(w._unit) not in inner]
        with summon_full_params(list(module.modules()), [w._unit for w in wrappers], writeback, rank0_only, offload_to_cpu, with_grads):
            yield

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:  # type: ignore[override]
        """As ``nn.Module.named_parameters``; with ``use_orig_params``, and inside
        ``summon_full_params``, the names are the unwrapped model's (without wrapper prefixes)."""
        return self._plain_names(super().named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate))

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:  # type: ignore[override]
        """As ``nn.Module.named_buffers``; inside ``summon_full_params`` with the unwrapped
        model's names, like ``named_parameters``."""
        return self._plain_names(super().named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate))

    def _plain_names(self, named: Iterator[Tuple[str, Any]]) -> Iterator[Tuple[str, Any]]:
        # With original parameters the names are always the user's (FSDP1 keeps its prefixes).
        if self._unit.training_state is not TrainingState.SUMMON_FULL_PARAMS and not self._unit.config.use_orig_params:
            return named
        return ((clean_name(name), value) for name, value in named)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every parameter of the model by their total norm over all
        ranks (shards, unsharded and ignored parameters), like
        ``torch.nn.utils.clip_grad_norm_`` on the unwrapped model. Call it on the root, after
        backward, on every rank.

        Args:
            max_norm: the largest total norm allowed.
            norm_type: the p of the p-norm (``float("inf")`` for the largest absolute value).

        Returns:
            The total norm before clipping, as a tensor.
        """
        with guarded_call(self._unit, "clip_grad_norm_()"):
            return clip_grad_norm_(self._unit, self, max_norm, norm_type)

    def register_comm_hook(self, state: Any, hook: Callable[..., Any]) -> None:
        """Reduce every unit's gradients with ``hook`` instead of the default averaging, as in
        FSDP1: ``hook(state, grad)`` for units that are not sharded, ``hook(state, grad,
        output)`` for sharded ones. Call it on the root, before the first forward; see
        ``flatshard.comm_hooks`` for ready-made hooks (e.g. ``bf16_compress_hook`` with
        ``LowPrecisionState(model.process_group)``).

        Args:
            state: passed to every call of ``hook``.
            hook: the gradient reduction.
        """
        unit = self._unit
        if not unit.is_root:
            raise RuntimeError(f"register_comm_hook must be called on the root ShardedDataParallel, not on the nested unit {display_name(unit.name)}")
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable; got {hook!r}")
        units = [unit] + [u for _, u in unit.descendants]
        if unit.ctx is not None:
            raise RuntimeError("register_comm_hook must be called before training starts (before the first forward)")
        if any(u.replicate is not None for u in units):
            raise NotImplementedError("register_comm_hook with hybrid sharding (HYBRID_SHARD, _HYBRID_SHARD_ZERO2) is not supported")
        if any(h.has_comm_hook() for u in units for h in u.handles):
            raise RuntimeError("a communication hook is registered already; register_comm_hook can be called once")
        for member in units:
            for handle in member.handles:
                handle.set_comm_hook(hook, state)


    # -- optimizer state (see flatshard.optim_state) -----------------------------------------

    @staticmethod
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: Optional[Any] = None,
        rank0_only: bool = True,
        group: Optional[ProcessGroup] = None,
    ) -> Dict[str, Any]:
        """The optimizer's state as a plain optimizer on the unwrapped model holds it, keyed
        by parameter names (``state`` and ``param_groups``), with full tensors on the CPU.
        Collective; with ``rank0_only`` only rank 0 gets it (``{}`` elsewhere).

        Args:
            model: the ``ShardedDataParallel`` model ``optim`` was built on.
            optim: the optimizer.
            optim_input: not supported (FSDP1's deprecated alternative to ``optim``).
            rank0_only: materialise the dict on rank 0 only.
            group: the model's process group (``None``: the model's own).
        """
        with guarded_call(model, "full_optim_state_dict()"):
            check_optim_args(model, optim, optim_input, group)
            return gather_full_optim_state(model, optim, rank0_only)

    @staticmethod
    def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, group: Optional[ProcessGroup] = None) -> Dict[str, Any]:
        """The optimizer's state keyed by parameter names with ``DTensor`` parts (as in a
        ``SHARDED_STATE_DICT``), for ``torch.distributed.checkpoint``. Collective."""
        with guarded_call(model, "sharded_optim_state_dict()"):
            check_optim_args(model, optim, None, group)
            return gather_sharded_optim_state(model, optim)

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: Dict[str, Any], model: nn.Module, optim_input: Optional[Any] = None, optim: Optional[torch.optim.Optimizer] = None
    ) -> Dict[str, Any]:
        """This rank's part of a full (name-keyed) optimizer state dict, keyed by parameter
        ID for ``optim.load_state_dict()``. Every rank passes the full dict; no communication.

        Args:
            full_optim_state_dict: e.g. from ``full_optim_state_dict`` or a plain optimizer
                rekeyed with ``rekey_optim_state_dict(..., OptimStateKeyType.PARAM_NAME, ...)``.
            model: the ``ShardedDataParallel`` model.
            optim_input: the parameters (or param groups) the optimizer was built with, if
                not ``model.parameters()`` and ``optim`` is not given.
            optim: the optimizer to load into (its param groups give the parameter IDs).
        """
        with guarded_call(model, "shard_full_optim_state_dict()", collective=False):
            return shard_full_optim_state(full_optim_state_dict, model, optim_input, optim)

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: Optional[Dict[str, Any]],
        model: nn.Module,
        optim_input: Optional[Any] = None,
        optim: Optional[torch.optim.Optimizer] = None,
        group: Optional[ProcessGroup] = None,
    ) -> Dict[str, Any]:
        """``shard_full_optim_state_dict`` where only rank 0 has the full dict (the other
        ranks may pass ``None``): rank 0 sends each rank its part. Collective."""
        with guarded_call(model, "scatter_full_optim_state_dict()"):
            check_group(model, group)
            return scatter_full_optim_state(full_optim_state_dict, model, optim_input, optim)

    @staticmethod
    def flatten_sharded_optim_state_dict(sharded_optim_state_dict: Dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, Any]:
        """The inverse of ``sharded_optim_state_dict``, keyed by parameter ID for
        ``optim.load_state_dict()`` (works at any world size). Collective."""
        with guarded_call(model, "flatten_sharded_optim_state_dict()"):
            return flatten_sharded_optim_state(sharded_optim_state_dict, model, optim)

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: Dict[str, Any],
        optim_state_key_type: OptimStateKeyType,
        model: nn.Module,
        optim_input: Optional[Any] = None,
        optim: Optional[torch.optim.Optimizer] = None,
    ) -> Dict[str, Any]:
        """Re-key an optimizer state dict between parameter names (``PARAM_NAME``) and
        parameter IDs (``PARAM_ID``: positions in the optimizer's parameter order), e.g. to
        load a full state dict of a ``ShardedDataParallel`` model into a plain optimizer, or
        the reverse. ``model`` may be the plain model or, as in FSDP1, the wrapped one: with
        ``use_orig_params`` the IDs are then the optimizer's order, as in FSDP1; without, each
        ``FlatParameter`` stands for its original parameters, in the plain model's order within
        each param group (FSDP1 raises there), so the IDs are a plain optimizer's either way.

        Args:
            optim_state_dict: the optimizer state dict.
            optim_state_key_type: the key type wanted.
            model: the plain model, or the wrapped one.
            optim_input: the parameters the optimizer was built with, if not ``model.parameters()``.
            optim: the plain optimizer (instead of ``optim_input``).
        """
        return rekey_plain_optim_state(optim_state_dict, optim_state_key_type, model, optim_input, optim)

    @staticmethod
    def optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: Optional[Dict[str, Any]] = None, group: Optional[ProcessGroup] = None
    ) -> Dict[str, Any]:
        """The optimizer's state keyed by parameter names, in the form of the model's
        state-dict type: full tensors (``FULL_STATE_DICT``, per ``FullOptimStateDictConfig``)
        or ``DTensor`` parts (``SHARDED_STATE_DICT``). The sharded form has an entry for every
        parameter of the optimizer, stepped yet or not, so it is a complete template for
        ``torch.distributed.checkpoint.load`` also for a fresh optimizer.
        Collective.

        Args:
            model: the ``ShardedDataParallel`` model.
            optim: its optimizer.
            optim_state_dict: ``optim.state_dict()`` to convert instead of ``optim``'s own.
            group: the model's process group (``None``: the model's own).
        """
        with guarded_call(model, "optim_state_dict()"):
            check_optim_args(model, optim, None, group)
            return optim_state_for(model, optim, get_settings(model), optim_state_dict)

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: Dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: Optional[ProcessGroup] = None,
    ) -> Dict[str, Any]:
        """The inverse of ``optim_state_dict`` (full or sharded values, saved at any world
        size): this rank's state keyed by parameter ID for ``optim.load_state_dict()``.
        Collective.

        Args:
            model: the ``ShardedDataParallel`` model.
            optim: its optimizer.
            optim_state_dict: a name-keyed optimizer state dict.
            is_named_optimizer: not supported (torchrec's keyed optimizers).
            load_directly: also load the result into ``optim``.
            group: the model's process group (``None``: the model's own).
        """
        with guarded_call(model, "optim_state_dict_to_load()"):
            if is_named_optimizer:
                raise NotImplementedError("optim_state_dict_to_load(is_named_optimizer=True) is not supported")
            check_optim_args(model, optim, None, group)
            return optim_state_to_load(model, optim, optim_state_dict, get_settings(model), load_directly)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "ShardedDataParallel":
        # .half(), .double(), .to(dtype) convert the shards (see [Note: casting a built unit]);
        # .to(device), .cuda(), to_empty() would replace only the shards, not the full flat
        # tensors the units gather into: refused unless the conversion is a no-op.
        for handle in self._unit.handles:
            before = handle.flat_param.detach()
            after = fn(before)
            if after is before:
                continue
            change = f"{before.device}/{before.dtype} -> {after.device}/{after.dtype}"
            if not _is_cast(before, after):
                raise NotImplementedError(
                    f"moving or re-allocating (to_empty) a ShardedDataParallel unit after it is built ({change}) "
                    f"is not supported: move the model before wrapping, or pass device_id (a param_init_fn must "
                    f"not recurse into submodules: use module.to_empty(device=..., recurse=False))"
                )
            if handle.runtime_made:  # (every unit of the root is bound to its runtime at once)
                raise NotImplementedError(
                    f"casting a ShardedDataParallel model ({change}) after its first forward is not supported: "
                    f"cast it right after wrapping, before it runs"
                )
            grad = handle.flat_param.grad
            handle.adopt_cast(after, None if grad is None else fn(grad))
        return super()._apply(fn, recurse)  # type: ignore[call-arg]

    # -- display ------------------------------------------------------------------------------

    def extra_repr(self) -> str:
        unit = self._unit
        text = f"{unit.config.sharding_strategy.name}, world_size={unit.world_size}, device={unit.device}"
        if not unit.handles:
            return text + ", no parameters of its own"
        count = sum(len(h.param_infos) for h in unit.handles)
        numel = sum(h.numel for h in unit.handles)
        shard = sum(h.shard_numel for h in unit.handles)
        groups = "" if len(unit.handles) == 1 else f" in {len(unit.handles)} FlatParameters"
        return text + f", {count} parameters{groups}, {numel:,} elements ({shard:,} on this rank)"

    def __repr__(self) -> str:
        inner = repr(self._fsdp_wrapped_module).replace("\n", "\n  ")
        return f"{type(self).__name__}({self.extra_repr()}\n  (module): {inner}\n)"


def _is_cast(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether ``after`` is ``before`` converted to another floating-point dtype, in place."""
    return (
        after.device == before.device and after.shape == before.shape and after.dtype != before.dtype
        and after.dtype.is_floating_point and before.dtype.is_floating_point
    )


def _wrap_planned_units(root: nn.Module, options: ConstructionOptions, node_groups: NodeGroups, guard: Guard) -> List[OrigParam]:
    """Apply the auto-wrap policy in ``options``: check the whole plan, then build every
    inner unit (innermost first) in place and return what the root unit itself flattens. A
    unit the policy makes hybrid without groups gets the plan's default ones (``node_groups``)."""
    if not isinstance(root, nn.Module) or isinstance(root, ShardedDataParallel):
        return []  # build_unit reports it
    plan = make_plan(root, options)
    for unit in plan[:-1]:
        wrapper = ShardedDataParallel._planned(unit.module, node_groups.fill(unit_options(options, unit)), unit.params, unit.name, guard)
        for parent, attr in unit.slots:
            setattr(parent, attr, wrapper)
    return plan[-1].params

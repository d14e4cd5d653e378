"""``flatshard.plan``: the units a ``ShardedDataParallel`` would build, without a process group.

    python -m flatshard.plan my_models:build_gpt --world-size 8 --transformer-layer my_models:Block

prints, per unit, its parameters, full and per-rank bytes and its FlatParameter groups, where
tied parameters go, and an estimate of the per-rank peak parameter + gradient memory. The
wrapper builds from the same plan (``_planning``), so the two agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._base._callable_module import make_callable
from .._base._common import clean_name
import torch.distributed as dist

from .._build._init import check_options, group_params, unit_precision
from .._build._node_groups import ranks_per_node
from .._base._options import ConstructionOptions
from .._build._planning import PlannedUnit, make_plan, unit_options
from ..api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from .._flat._flat_param import Precision, shard_sizes
from ..sharded_data_parallel import ShardedDataParallel
from ..wrap import ModuleWrapPolicy, always_wrap_policy, size_based_auto_wrap_policy, transformer_auto_wrap_policy
from ._measure import NOT_MEASURABLE, PHASES, Fit, Measurement, fit_phases, measure_rank

__all__ = ["plan", "Plan", "UnitPlan", "GroupPlan", "Measurement"]


@dataclass(frozen=True)
class GroupPlan:
    """One FlatParameter of a unit: parameters sharing dtype and ``requires_grad``. Its
    shard is kept in ``dtype``; the other dtypes are mixed precision's ([Note: mixed
    precision] in ``_flat_param``), ``None`` given meaning no cast."""

    dtype: torch.dtype
    requires_grad: bool
    params: int
    numel: int
    padded_numel: int
    shard_numel: int
    compute_dtype: Optional[torch.dtype] = None  # gathered and computed in, its full gradient made in (None: dtype)
    reduce_dtype: Optional[torch.dtype] = None  # the full gradient reduced in (None: the compute dtype)
    grad_dtype: Optional[torch.dtype] = None  # the gradient shard kept in (None: dtype)
    # Whether the unit computes on a tensor of its own: gathered (sharded), cast to the compute
    # dtype, or for original parameters; else on the FlatParameter itself.
    computes_on_copy: bool = False

    def __post_init__(self) -> None:
        compute = self.compute_dtype or self.dtype
        object.__setattr__(self, "compute_dtype", compute)
        object.__setattr__(self, "reduce_dtype", self.reduce_dtype or compute)
        object.__setattr__(self, "grad_dtype", self.grad_dtype or self.dtype)

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the tensor the unit computes on while gathered (0 if that is the
        FlatParameter itself)."""
        return self.padded_numel * _itemsize(self.compute_dtype) if self.computes_on_copy else 0

    @property
    def grad_shard_bytes(self) -> int:
        """Bytes of the gradient shard kept after the reduction (0 if frozen)."""
        return self.shard_numel * _itemsize(self.grad_dtype) if self.requires_grad else 0

    @property
    def unsharded_grad_bytes(self) -> int:
        """Bytes of the full gradient before its reduction: in the compute dtype, and its copy
        in the reduce dtype where that differs (0 if frozen or computing on the FlatParameter)."""
        if not (self.requires_grad and self.computes_on_copy):
            return 0
        reduce = _itemsize(self.reduce_dtype) if self.reduce_dtype != self.compute_dtype else 0
        return self.padded_numel * (_itemsize(self.compute_dtype) + reduce)


def _itemsize(dtype: Any) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@dataclass(frozen=True)
class UnitPlan:
    """One unit: ``name`` is its module's path from the root (``""`` for the root)."""

    name: str
    module_type: str
    sharding_strategy: ShardingStrategy
    groups: Tuple[GroupPlan, ...]
    tied: Tuple[Tuple[str, ...], ...]  # full names of each tied parameter this unit holds
    parent: Optional[str] = None  # the enclosing unit's name (None for the root)
    world_size: int = 1  # of the group it shards over

    @property
    def params(self) -> int:
        return sum(g.params for g in self.groups)

    @property
    def numel(self) -> int:
        return sum(g.numel for g in self.groups)

    @property
    def full_bytes(self) -> int:
        """Bytes of the gathered (padded) flat tensors."""
        return sum(g.padded_numel * g.itemsize for g in self.groups)

    @property
    def shard_bytes(self) -> int:
        """Bytes each rank keeps."""
        return sum(g.shard_numel * g.itemsize for g in self.groups)

    @property
    def trainable_full_bytes(self) -> int:
        return sum(g.padded_numel * g.itemsize for g in self.groups if g.requires_grad)

    @property
    def trainable_shard_bytes(self) -> int:
        return sum(g.shard_numel * g.itemsize for g in self.groups if g.requires_grad)

    @property
    def gathered_bytes(self) -> int:
        """Bytes of what the unit computes on while gathered, in the compute dtype."""
        return sum(g.gathered_bytes for g in self.groups)

    @property
    def grad_shard_bytes(self) -> int:
        """Bytes of the gradient shards each rank keeps (as many as ``trainable_shard_bytes``
        unless mixed precision keeps them in low precision)."""
        return sum(g.grad_shard_bytes for g in self.groups)

    @property
    def unsharded_grad_bytes(self) -> int:
        return sum(g.unsharded_grad_bytes for g in self.groups)

    @property
    def freed_after_forward(self) -> bool:
        """Whether the unit frees what it computed on after its forward (gathering it again
        for its backward), as sharded ``FULL_SHARD`` and hybrid units other than the root
        do; the others keep it gathered from forward into backward (see [Note: when
        parameters are freed] in ``_runtime``; one rank runs a unit as ``NO_SHARD``)."""
        if self.name == "" or self.sharding_strategy not in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD):
            return False
        return self.world_size > 1 or self.sharding_strategy is ShardingStrategy.HYBRID_SHARD


# The table's columns; the numeric ones are right-aligned, the last is not padded.
_HEADER = ("unit", "module", "strategy", "params", "elements", "full", "per rank", "flat parameters")
_NUMERIC = frozenset({"params", "elements", "full", "per rank"})


@dataclass(frozen=True)
class Plan:
    """A model's units under a policy at a world size; ``str()`` is a table."""

    world_size: int
    units: Tuple[UnitPlan, ...]  # the root first, then the module order
    prefetch: bool  # whether a second unit is gathered ahead (backward or forward prefetch)
    # With ``measure=True``: what one rank allocated, the line fitted through it and a second
    # measurement, and (N, shard bytes) of each other world size asked about (see [Note:
    # measuring a plan]).
    measurement: Optional[Measurement] = None
    fit: Optional[Fit] = None
    other_sizes: Tuple[Tuple[int, int], ...] = ()
    # Whether communication overlaps compute (``set_communication_overlap``): a unit's
    # unsharded gradient stays in flight while the next one's is computed.
    overlap: bool = False

    @property
    def shard_bytes(self) -> int:
        """Bytes of parameter shards each rank keeps."""
        return sum(u.shard_bytes for u in self.units)

    @property
    def trainable_shard_bytes(self) -> int:
        """Bytes of the trainable parameter shards each rank keeps."""
        return sum(u.trainable_shard_bytes for u in self.units)

    @property
    def grad_shard_bytes(self) -> int:
        """Bytes of the gradient shards each rank keeps (as many as ``trainable_shard_bytes``
        unless ``MixedPrecision(keep_low_precision_grads=True)`` keeps them in ``param_dtype``)."""
        return sum(u.grad_shard_bytes for u in self.units)

    def memory(self) -> Tuple[Tuple[str, int], ...]:
        """The per-rank peak parameter + gradient memory estimate, by component.

        [Note: peak estimate] Kept all the time: each rank's parameter shards and the
        gradient shards of trainable groups (whole tensors for unsharded units). Added at the
        busiest moment of a step, for the units that compute on a tensor of their own
        (gathered, or, unsharded, cast to mixed precision's ``param_dtype`` or kept apart for
        original parameters), in the dtype they compute in: that tensor of the root and of
        every unit that keeps it from forward into backward (``SHARD_GRAD_OP``, ``NO_SHARD``),
        of the ``FULL_SHARD`` unit whose chain of enclosing ``FULL_SHARD`` units is largest
        (they stay gathered around it) and, with prefetch, of the next largest ``FULL_SHARD``
        unit; plus the largest trainable unit's unsharded gradient before it is reduced (with
        its copy in ``reduce_dtype`` where that differs) and, with overlap, the next largest
        one's, in flight meanwhile ([Note: overlap] in ``_engine/_runtime``). Activations,
        optimizer state and the other buffers of collectives in flight are not included.
        """
        by_name = {u.name: u for u in self.units}
        copying = [u for u in self.units if u.gathered_bytes]
        computing = [u for u in copying if u.freed_after_forward]
        kept = [u for u in copying if not u.freed_after_forward]

        def chain_bytes(unit: UnitPlan) -> int:
            total, parent = unit.gathered_bytes, unit.parent
            while parent is not None and parent in by_name:
                enclosing = by_name[parent]
                total += enclosing.gathered_bytes if enclosing in computing else 0
                parent = enclosing.parent
            return total

        busiest = max((chain_bytes(u) for u in computing), default=0)
        ahead = sorted((u.gathered_bytes for u in computing), reverse=True)[1:2] if self.prefetch else []
        return (
            ("parameter shards", self.shard_bytes),
            ("gradient shards", self.grad_shard_bytes),
            ("gathered parameters", sum(u.gathered_bytes for u in kept) + busiest + sum(ahead)),
            ("unsharded gradient", sum(sorted((u.unsharded_grad_bytes for u in copying), reverse=True)[: 2 if self.overlap else 1])),
        )

    @property
    def peak_bytes(self) -> int:
        return sum(value for _, value in self.memory())

    def __str__(self) -> str:
        rows = [_HEADER]
        for u in self.units:
            groups = ", ".join(_group_text(g) for g in u.groups) or "-"
            rows.append((u.name or "<root>", u.module_type, u.sharding_strategy.name, f"{u.params:,}", f"{u.numel:,}", _size(u.full_bytes), _size(u.shard_bytes), groups))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        count = len(self.units)
        lines = [f"flatshard plan: {count} unit{'' if count == 1 else 's'}, world size {self.world_size}"]
        for row in rows:
            cells = [cell.rjust(w) if _HEADER[i] in _NUMERIC else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
            lines.append("  ".join(cells + [row[-1]]).rstrip())
        tied = [(names, u.name) for u in self.units for names in u.tied]
        if tied:
            lines.append("tied parameters:")
            lines.extend(f"  {' = '.join(names)}  ->  {name or '<root>'}" for names, name in tied)
        parts = " + ".join(f"{label} {_size(value)}" for label, value in self.memory())
        lines.append(f"estimated peak per rank (parameters + gradients): {_size(self.peak_bytes)} = {parts}")
        if self.measurement is not None:
            lines.extend(self._measurement_lines(self.measurement))
        return "\n".join(lines)

    def _measurement_lines(self, m: Measurement) -> List[str]:
        lines = [
            f"measured: rank {m.rank} of {m.world_size} on torch's fake process group ({m.device}), step {m.steps} of {m.steps}",
            f"  {'':<22}{'planned':>12}{'measured':>12}",
            f"  {'parameter shards':<22}{_size(self.shard_bytes):>12}{_size(m.shards):>12}",
            f"  {'gradient shards':<22}{_size(self.grad_shard_bytes):>12}{_size(m.gradients):>12}",
            f"  {'optimizer state':<22}{'-':>12}{_size(m.optimizer_state):>12}",
        ]
        for phase in ("construction",) + PHASES:
            planned = _size(self.peak_bytes) + "*" if phase in ("forward", "backward") else "-"
            if phase == "between steps":
                planned, measured = _size(self.shard_bytes + m.optimizer_state), _size(m.end(phase))
            else:
                measured = _size(m.peak(phase))
            lines.append(f"  {phase + (' peak' if phase != 'between steps' else ''):<22}{planned:>12}{measured:>12}")
        lines.append("  (* the planner's parameters + gradients estimate, without activations)")
        if self.fit is not None and self.other_sizes:
            header = "".join(f"{p + ' peak':>22}" for p in PHASES[:3]) + f"{'between steps':>16}"
            first, second = self.fit.world_sizes
            lines.append(f"predicted at other world sizes (each phase fitted to its measurements at N = {first} and {second}):")
            lines.append(f"  {'N':>6}{'parameter shards':>18}{header}")
            for n, shards in self.other_sizes:
                values = "".join(f"{_size(self.fit.at(p, shards)):>22}" for p in PHASES[:3])
                lines.append(f"  {n:>6}{_size(shards):>18}{values}{_size(self.fit.at('between steps', shards)):>16}")
        lines.append(NOT_MEASURABLE)
        return lines


def plan(
    module: nn.Module,
    auto_wrap_policy: Optional[Any] = None,
    world_size: int = 1,
    sharding_strategy: Optional[ShardingStrategy] = None,
    backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
    forward_prefetch: bool = False,
    ignored_modules: Optional[Iterable[nn.Module]] = None,
    ignored_states: Optional[Iterable[Any]] = None,
    print_table: bool = True,
    measure: bool = False,
    example_input: Any = None,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
    optimizer: Optional[Callable[[Any], torch.optim.Optimizer]] = None,
    rank: Optional[int] = None,
    device: Any = "cpu",
    steps: int = 2,
    at: Optional[Sequence[int]] = None,
    *,
    mixed_precision: Optional[MixedPrecision] = None,
    cpu_offload: Optional[CPUOffload] = None,
    use_orig_params: bool = False,
    limit_all_gathers: bool = True,
    sync_module_states: bool = False,
    param_init_fn: Optional[Callable[[nn.Module], None]] = None,
    process_group: Any = None,
    device_id: Any = None,
    device_mesh: Any = None,
    overlap_communication: bool = True,
) -> Plan:
    """The units ``ShardedDataParallel(module, auto_wrap_policy=..., ...)`` would build on
    ``world_size`` ranks, computed without a process group (``module`` may be on the meta
    device). Submodules that already are ``ShardedDataParallel`` units are reported as they are.

    Takes every constructor option by its name (see [Note: the planner's options]); the
    planner applies them as the constructor does, the root included, and a ``CustomPolicy``
    may override them per unit.

    Args:
        module: the model to wrap.
        auto_wrap_policy: as for ``ShardedDataParallel``.
        world_size: the number of ranks to shard over.
        sharding_strategy: as for ``ShardingStrategy`` (default ``FULL_SHARD``).
        backward_prefetch: as for ``ShardedDataParallel`` (affects the peak estimate).
        forward_prefetch: as for ``ShardedDataParallel`` (affects the peak estimate).
        ignored_modules: as for ``ShardedDataParallel``.
        ignored_states: as for ``ShardedDataParallel``.
        print_table: print the plan as a table.
        measure: also run one rank of ``world_size`` for real on torch's fake process group
            (no other process group may exist) and measure what it allocates, phase by phase,
            beside the planner's numbers; then the same as the last rank of four times
            ``world_size``, and predict the peaks at the world sizes ``at`` (see [Note:
            measuring a plan]). ``module`` is copied, not wrapped: build it on the meta device.
        example_input: with ``measure``: one batch, the model's positional argument (a tuple
            for several).
        loss_fn: with ``measure``: the loss of the model's output (default: the sum of its
            floating-point tensors).
        optimizer: with ``measure``: makes the optimizer from the parameters (default AdamW).
        rank: with ``measure``: which rank to be (default the last).
        device: with ``measure``: ``"cpu"`` or a CUDA device.
        steps: with ``measure``: training steps to run; the last one is measured.
        at: with ``measure``: other world sizes to predict (default 8 and 64 times ``world_size``).
        mixed_precision: as for ``ShardedDataParallel``: the gathered parameters and the
            unsharded gradients are estimated in its dtypes.
        cpu_offload: as for ``ShardedDataParallel``; ``CPUOffload(offload_params=True)`` is
            not supported (the estimate does not tell host from device memory).
        use_orig_params: as for ``ShardedDataParallel``.
        limit_all_gathers: as for ``ShardedDataParallel`` (the estimate counts one unit
            gathered ahead either way).
        sync_module_states: as for ``ShardedDataParallel`` (used when measuring).
        param_init_fn: as for ``ShardedDataParallel``: materialises a meta model when
            measuring (default: the modules' ``reset_parameters()``, else small random values).
        process_group, device_id, device_mesh: not supported: the planner needs no process
            group (``world_size`` stands for it) and ``device`` says where a measurement runs.
        overlap_communication: as ``ShardedDataParallel.set_communication_overlap`` (default
            on): with it a unit is gathered ahead in the forward too, and a second unsharded
            gradient is in flight in the backward.

    Returns:
        The ``Plan``; ``str(plan)`` is the table.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    if not isinstance(overlap_communication, bool):
        raise TypeError(f"overlap_communication must be a bool; got {type(overlap_communication).__name__} {overlap_communication!r}")
    given = dict(  # (every constructor option: OPTION_NAMES)
        process_group=process_group, sharding_strategy=sharding_strategy, cpu_offload=cpu_offload,
        auto_wrap_policy=auto_wrap_policy, backward_prefetch=backward_prefetch, mixed_precision=mixed_precision,
        ignored_modules=ignored_modules, param_init_fn=param_init_fn, device_id=device_id,
        sync_module_states=sync_module_states, forward_prefetch=forward_prefetch, limit_all_gathers=limit_all_gathers,
        use_orig_params=use_orig_params, ignored_states=ignored_states, device_mesh=device_mesh,
    )
    _refuse_unplanned(given)
    options = ConstructionOptions(**given)
    planned = make_plan(module, options)
    units = [_unit_plan(u, options, world_size) for u in planned] + _existing_units(module, world_size)
    order = {clean_name(path): i for i, (path, _) in enumerate(module.named_modules())}
    units.sort(key=lambda u: order.get(u.name, len(order)))
    prefetch = check_options(options).backward_prefetch is not None or forward_prefetch or overlap_communication
    result = Plan(world_size, tuple(units), prefetch, overlap=overlap_communication)
    if measure:
        if example_input is None:
            raise ValueError("plan(measure=True) needs example_input: one batch to train on (the model's positional argument)")
        if world_size < 2:
            raise ValueError(f"plan(measure=True) measures one rank of a sharded world: world_size must be at least 2; got {world_size}")
        if rank is None:
            rank = world_size - 1
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in 0..{world_size - 1}; got {rank!r}")
        wrap_kwargs = {name: value for name, value in given.items() if name not in _NOT_PLANNED}

        def shards_at(n: int) -> int:
            return plan(module, world_size=n, print_table=False, **wrap_kwargs).shard_bytes

        run = (example_input, loss_fn, optimizer, steps, torch.device(device), overlap_communication)
        measured = measure_rank(module, wrap_kwargs, world_size, rank, *run)
        again = measure_rank(module, wrap_kwargs, 4 * world_size, 4 * world_size - 1, *run)
        fitted = fit_phases(measured, again, result.shard_bytes, shards_at(4 * world_size))
        others = tuple((n, shards_at(n)) for n in (at if at is not None else (8 * world_size, 64 * world_size)))
        result = dataclasses.replace(result, measurement=measured, fit=fitted, other_sizes=others)
    if print_table:
        print(result)
    return result


# [Note: the planner's options] ``plan`` takes every constructor option by its name
# (``OPTION_NAMES``; a test holds the two signatures together) and builds the same
# ``ConstructionOptions`` the constructor does, so the root unit gets them as the wrapper's
# root does, inner units inherit them, and a ``CustomPolicy`` overrides them per unit through
# the same ``for_unit``. Measuring passes them on to the wrapper it builds. The options that
# only say where the wrapper runs -- its process group, device mesh and device -- have no
# meaning without one: ``world_size`` and ``device`` stand for them, and giving them raises
# ``NotImplementedError``; so does ``cpu_offload=CPUOffload(offload_params=True)``, which puts
# the shards and their gradients in host memory the estimate does not tell apart.
_NOT_PLANNED = {
    "process_group": "the planner needs no process group: world_size gives the number of ranks to shard over",
    "device_mesh": "the planner needs no device mesh: world_size gives the number of ranks to shard over",
    "device_id": "the planner needs no device: device= (with measure=True) says where a measurement runs",
}


def _refuse_unplanned(given: Dict[str, Any]) -> None:
    """``NotImplementedError`` naming a given option the planner cannot honour (see [Note:
    the planner's options])."""
    for name, why in _NOT_PLANNED.items():
        if given[name] is not None:
            raise NotImplementedError(f"flatshard.plan does not support {name}={given[name]!r}: {why}")


def _unit_plan(unit: PlannedUnit, options: ConstructionOptions, world_size: int) -> UnitPlan:
    own = unit_options(options, unit)
    config = check_options(own)
    if config.offload_params:
        where = f" (a CustomPolicy's, for the unit at {unit.name!r})" if unit.name else ""
        raise NotImplementedError(
            f"flatshard.plan does not support cpu_offload=CPUOffload(offload_params=True){where}: it keeps the shards "
            f"and their gradients in host memory, which the estimate does not tell from the device's"
        )
    size = world_size
    group = own.process_group  # (``plan`` takes none: only a policy's override sets one)
    if group is not None:  # (a group exists only if initialised; hybrid: the shard group of the pair)
        size = dist.get_world_size(group[0] if isinstance(group, tuple) else group)
    elif config.sharding_strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2) and own.device_mesh is None:
        size = ranks_per_node(config.sharding_strategy, world_size)  # (the default groups: one per node)
    sharded = config.sharding_strategy is not ShardingStrategy.NO_SHARD
    _, precision = unit_precision(config, unit.module)
    groups = []
    for members in group_params(unit.params):
        primaries = {id(p.param): p.param for p in members}.values()
        numel = sum(p.numel() for p in primaries)
        padded, shard = shard_sizes(numel, size, sharded)
        first = members[0].param
        groups.append(_group_plan(first, len(primaries), numel, padded, shard, precision, sharded and size > 1, config.use_orig_params))
    parent = None if unit.parent is None else unit.parent.name
    return UnitPlan(unit.name, type(unit.module).__name__, config.sharding_strategy, tuple(groups), tuple(unit.tied), parent, size)


def _group_plan(
    first: nn.Parameter, params: int, numel: int, padded: int, shard: int, precision: Optional[Precision], sharded: bool, use_orig_params: bool
) -> GroupPlan:
    """A FlatParameter's plan, its dtypes as its handle takes them from ``precision`` (the
    unit's mixed precision, ``None`` for none; see ``FlatParamHandle``)."""
    compute = (precision.param_dtype if precision is not None else None) or first.dtype
    reduce = (precision.reduce_dtype if precision is not None else None) or compute
    grad = compute if precision is not None and precision.keep_low_precision_grads else first.dtype
    on_copy = sharded or compute != first.dtype or use_orig_params
    return GroupPlan(first.dtype, first.requires_grad, params, numel, padded, shard, compute, reduce, grad, on_copy)


def _existing_units(root: nn.Module, world_size: int) -> List[UnitPlan]:
    """Units the model already has (wrapped by hand), at the planned world size."""
    found = []
    for path, module in root.named_modules():
        if isinstance(module, ShardedDataParallel) and module is not root:
            groups = []
            for h in module.handles:
                sharded = module.sharding_strategy is not ShardingStrategy.NO_SHARD
                padded, shard = shard_sizes(h.numel, world_size, sharded)
                on_copy = (sharded and world_size > 1) or h.compute_dtype != h.dtype or module.use_orig_params
                groups.append(GroupPlan(h.dtype, h.requires_grad, len(h.param_infos), h.numel, padded, shard, h.compute_dtype, h.reduce_dtype, h.grad_dtype, on_copy))
            found.append(UnitPlan(clean_name(path), type(module.module).__name__, module.sharding_strategy, tuple(groups), (), None, world_size))
    return found


def _group_text(g: GroupPlan) -> str:
    kind = _dtype_name(g.dtype) + ("" if g.compute_dtype == g.dtype else f" as {_dtype_name(g.compute_dtype)}")
    return f"{kind}{'' if g.requires_grad else ' frozen'} {g.params}p/{g.numel:,}"


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


# -- command line -------------------------------------------------------------------------


def _load(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"expected MODULE:NAME, got {spec!r}")
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    return target


def _policy(args: argparse.Namespace) -> Any:
    chosen = [flag for flag in ("transformer_layer", "module_wrap", "min_num_params", "always") if getattr(args, flag)]
    if len(chosen) > 1:
        raise SystemExit(f"pick one policy; got --{' and --'.join(c.replace('_', '-') for c in chosen)}")
    if args.transformer_layer:
        return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={_load(s) for s in args.transformer_layer})
    if args.module_wrap:
        return ModuleWrapPolicy({_load(s) for s in args.module_wrap})
    if args.min_num_params:
        return functools.partial(size_based_auto_wrap_policy, min_num_params=args.min_num_params)
    return always_wrap_policy if args.always else None


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flatshard.plan", description="Show the units ShardedDataParallel would build.")
    parser.add_argument("model", help="MODULE:CALLABLE returning the model, e.g. my_models:build")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--strategy", choices=[s.name for s in ShardingStrategy], default="FULL_SHARD")
    parser.add_argument("--transformer-layer", action="append", metavar="MODULE:CLASS", help="transformer_auto_wrap_policy class (repeatable)")
    parser.add_argument("--module-wrap", action="append", metavar="MODULE:CLASS", help="ModuleWrapPolicy class (repeatable)")
    parser.add_argument("--min-num-params", type=int, help="size_based_auto_wrap_policy threshold")
    parser.add_argument("--always", action="store_true", help="always_wrap_policy")
    parser.add_argument("--no-meta", action="store_true", help="build the model for real instead of on the meta device")
    parser.add_argument("--no-overlap", action="store_true", help="as set_communication_overlap(False): FSDP1's lowest peak")
    parser.add_argument(
        "--mixed-precision", metavar="FIELD=VALUE,...",
        help="MixedPrecision fields, e.g. param_dtype=bfloat16,reduce_dtype=float32 (dtypes by their torch name; "
        "keep_low_precision_grads, cast_forward_inputs, cast_root_forward_inputs: true or false)",
    )
    measuring = parser.add_argument_group("measuring (one rank of --world-size, run on torch's fake process group)")
    measuring.add_argument("--measure", action="store_true", help="train a few steps as one rank and measure its memory by phase")
    measuring.add_argument("--input", metavar="MODULE:CALLABLE", help="returns one batch: the model's positional argument (a tuple for several)")
    measuring.add_argument("--loss", metavar="MODULE:CALLABLE", help="loss(output) (default: the sum of the output's floating-point tensors)")
    measuring.add_argument("--optimizer", metavar="MODULE:CALLABLE", help="optimizer(params) (default: AdamW)")
    measuring.add_argument("--rank", type=int, help="the rank to be (default: the last)")
    measuring.add_argument("--device", default="cpu", help="cpu, or cuda on a machine with a GPU")
    measuring.add_argument("--steps", type=int, default=2, help="training steps; the last is measured")
    measuring.add_argument("--at", help="other world sizes to predict, comma-separated (default: 8 and 64 times --world-size)")
    args = parser.parse_args(argv)
    if args.measure and not args.input:
        parser.error("--measure needs --input MODULE:CALLABLE (one batch to train on)")
    try:
        mixed_precision = _mixed_precision(args.mixed_precision) if args.mixed_precision is not None else None
    except ValueError as exc:
        parser.error(str(exc))
    factory = _load(args.model)
    if args.no_meta:
        model = factory()
    else:
        with torch.device("meta"):
            model = factory()
    extra: dict = {}
    if args.measure:
        extra = dict(
            measure=True, example_input=_load(args.input)(), rank=args.rank, device=args.device, steps=args.steps,
            loss_fn=_load(args.loss) if args.loss else None, optimizer=_load(args.optimizer) if args.optimizer else None,
            at=[int(n) for n in args.at.split(",")] if args.at else None,
        )
    plan(
        model, _policy(args), world_size=args.world_size, sharding_strategy=ShardingStrategy[args.strategy],
        mixed_precision=mixed_precision, overlap_communication=not args.no_overlap, **extra,
    )


_MP_DTYPES = ("param_dtype", "reduce_dtype", "buffer_dtype")
_MP_FLAGS = ("keep_low_precision_grads", "cast_forward_inputs", "cast_root_forward_inputs")


def _mixed_precision(text: str) -> MixedPrecision:
    """``--mixed-precision``: ``FIELD=VALUE`` pairs, comma-separated, as a ``MixedPrecision``."""
    fields: Dict[str, Any] = {}
    for item in text.split(","):
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or name not in _MP_DTYPES + _MP_FLAGS:
            raise ValueError(
                f"--mixed-precision: expected FIELD=VALUE with FIELD one of {', '.join(_MP_DTYPES + _MP_FLAGS)}; got {item.strip()!r}"
            )
        if name in fields:
            raise ValueError(f"--mixed-precision: {name} is given twice")
        if name in _MP_FLAGS:
            if value.lower() not in ("true", "false"):
                raise ValueError(f"--mixed-precision: {name} must be true or false; got {value!r}")
            fields[name] = value.lower() == "true"
            continue
        dtype = getattr(torch, value, None)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"--mixed-precision: {name} must name a floating-point torch dtype (such as bfloat16); got {value!r}")
        fields[name] = dtype
    return MixedPrecision(**fields)



# ``flatshard.plan`` is this package (``import flatshard.plan as P``, ``from flatshard.plan import
# Plan``) and ``flatshard.plan(...)`` calls ``plan`` above; see [Note: callable modules].
make_callable(__name__)

"""Forward and backward of a unit: when to gather, free and reduce.

[Note: unit life cycle] Per iteration a unit goes IDLE -> FORWARD -> IDLE (its forward),
then IDLE -> BACKWARD_PRE (a hook on one of its forward outputs received a gradient, so
its backward is about to run: gather) -> BACKWARD_POST (autograd accumulated the unit's full
gradient: reduce-scatter, free) -> IDLE (the root's end-of-backward callback). The callback is
queued by whichever hook fires first in a backward; it frees whatever is still gathered (a
unit whose parameters got no gradient, a mistargeted prefetch) and starts a new iteration.

[Note: when parameters are freed] After forward: FULL_SHARD units except the root (its
backward starts immediately). Without autograd (``no_grad``/``inference_mode``) every unit
frees right after its forward, the root too, since no backward can follow. After backward:
every sharded unit. A unit whose parameters require grad but whose outputs carry no tensor
that requires grad keeps its parameters until the end of backward: its outputs may hide
tensors in containers we cannot see, and freeing memory that backward then reads would crash.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.autograd import Variable

from ._collectives import ProcessGroup, all_gather_object, all_ranks_agree, rank_of, size_of
from ._common import HandleState, TrainingState, display_name, guard_transition, iter_tensors, map_tensors, rank_prefix
from ._exec_order import ExecOrder
from .api import BackwardPrefetch, ShardingStrategy
from .flat_param import FlatParamHandle

_IDLE = TrainingState.IDLE
_FORWARD = TrainingState.FORWARD
_BACKWARD_PRE = TrainingState.BACKWARD_PRE
_BACKWARD_POST = TrainingState.BACKWARD_POST


@dataclass(frozen=True)
class UnitConfig:
    """A unit's runtime options, as given to its constructor."""

    sharding_strategy: ShardingStrategy
    backward_prefetch: Optional[BackwardPrefetch]
    forward_prefetch: bool
    limit_all_gathers: bool


class BackwardState(Enum):
    """Whether the end-of-backward callback is queued for the current backward."""

    IDLE = auto()
    CALLBACK_QUEUED = auto()


class Unit:
    """Run-time state of one wrapper: its handle (``None`` if it owns no parameters), its
    options, its training state and the root context it belongs to."""

    def __init__(
        self,
        handle: Optional[FlatParamHandle],
        config: UnitConfig,
        group: ProcessGroup,
        device: torch.device,
    ) -> None:
        self.handle = handle
        self.config = config
        self.group = group
        self.rank = rank_of(group)
        self.world_size = size_of(group)
        self.device = device
        self.name = ""  # user-facing module name relative to the root, set by lazy_init
        self.training_state = _IDLE
        self.ctx: Optional[RootContext] = None
        self.parent: Optional[Unit] = None  # the nearest enclosing unit
        self.descendants: List[Tuple[str, Unit]] = []  # every unit under this one, named
        self.sync_gradients = True
        self._post_backward_hook = None
        if handle is not None and handle.requires_grad:
            self._post_backward_hook = handle.grad_leaf.register_post_accumulate_grad_hook(
                functools.partial(_post_backward, self)
            )

    @property
    def is_root(self) -> bool:
        return self.ctx is not None and self.ctx.root is self

    def adopt(self, nested: Sequence[Tuple[str, "Unit"]]) -> None:
        """Become the enclosing unit of ``nested`` (every unit under this one, any depth,
        named relative to this unit's module). They are initialised again by their root."""
        for name, unit in nested:
            if unit.training_state is not _IDLE:
                raise AssertionError(f"{unit.where()}: wrapped into an outer unit while {unit.training_state.name}")
            if unit.parent is None:
                unit.parent = self
            unit.ctx = None
        self.descendants = list(nested)

    def where(self) -> str:
        return rank_prefix(self.rank, self.name)

    def move(self, allowed_from: Sequence[TrainingState], target: TrainingState) -> None:
        self.training_state = guard_transition(self.training_state, allowed_from, target, self.where())


class RootContext:
    """State shared by all units of one root: the units, their order, the backward state."""

    def __init__(self, root: Unit, units: List[Unit]) -> None:
        self.root = root
        self.units = units
        self.exec_order: ExecOrder[Unit] = ExecOrder()
        self.backward_state = BackwardState.IDLE


def lazy_init(unit: Unit) -> None:
    """Initialise the units of ``unit``'s root (its outermost enclosing unit) if needed.

    Collective: the ranks of the root's group check here, once, that they built the same
    units.
    """
    root = unit
    while root.parent is not None:
        root = root.parent
    if root.ctx is not None:
        return
    named = [("", root)] + root.descendants
    ctx = RootContext(root, [u for _, u in named])
    for name, member in named:
        member.name = name
        member.ctx = ctx
    _check_ranks_agree(ctx)


def _describe(unit: Unit) -> str:
    layout = unit.handle.describe() if unit.handle is not None else "no parameters"
    return f"{display_name(unit.name)} ({unit.config.sharding_strategy.name}, {layout})"


def _check_ranks_agree(ctx: RootContext) -> None:
    root = ctx.root
    descriptions = [_describe(unit) for unit in ctx.units]
    if all_ranks_agree("\n".join(descriptions), root.group, root.device):
        return
    per_rank: List[List[str]] = all_gather_object(descriptions, root.group)
    lines = []
    for rank, units in enumerate(per_rank):
        first_diff = next(
            (i for i in range(max(len(units), len(per_rank[0]))) if units[i : i + 1] != per_rank[0][i : i + 1]),
            None,
        )
        if first_diff is not None:
            mine = units[first_diff] if first_diff < len(units) else "(no such unit)"
            ref = per_rank[0][first_diff] if first_diff < len(per_rank[0]) else "(no such unit)"
            lines.append(f"  unit #{first_diff}: rank 0 has {ref}\n             rank {rank} has {mine}")
    raise ValueError(
        f"[rank {root.rank}] the ranks wrapped different models (every rank must build the same "
        f"units with the same parameters, shapes and dtypes):\n" + "\n".join(lines)
    )


# -- forward ------------------------------------------------------------------------------


def run_forward(unit: Unit, module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """The wrapper's forward: gather, run the wrapped module, free or hook for backward."""
    if unit.ctx is None:
        raise AssertionError(f"{unit.where()}: forward before lazy init")
    if unit.is_root and unit.device.type != "cpu":
        args, kwargs = map_tensors(lambda t: t.to(unit.device, non_blocking=True), (args, kwargs))
    _pre_forward(unit)
    try:
        output = module(*args, **kwargs)
    except BaseException:
        if unit.training_state is _FORWARD:
            unit.move((_FORWARD,), _IDLE)  # the forward is abandoned; let the next one start
        raise
    _post_forward(unit, output)
    if unit.is_root:
        _root_post_forward(unit)
    return output


def _pre_forward(unit: Unit) -> None:
    # [Note: forward inside backward] Activation checkpointing re-runs forward code during
    # backward. A unit re-run inside its own backward stays BACKWARD_PRE; any unit re-run
    # while a backward is in progress keeps its parameters gathered until its backward
    # (the recomputed activations that backward reads are views of them).
    if unit.training_state is not _BACKWARD_PRE:
        unit.move((_IDLE,), _FORWARD)
    handle = unit.handle
    if handle is None:
        return
    recompute = unit.ctx.backward_state is BackwardState.CALLBACK_QUEUED  # type: ignore[union-attr]
    if not recompute:
        unit.ctx.exec_order.record_pre_forward(unit)  # type: ignore[union-attr]
    handle.unshard()
    handle.use_views(track_grad=torch.is_grad_enabled())
    if unit.config.forward_prefetch and not recompute:
        _prefetch(unit.ctx.exec_order.next_in_forward(unit))  # type: ignore[union-attr]


def _post_forward(unit: Unit, output: Any) -> None:
    if unit.training_state is _BACKWARD_PRE:
        return
    unit.move((_FORWARD,), _IDLE)
    handle = unit.handle
    ctx = unit.ctx
    if handle is None or ctx.backward_state is BackwardState.CALLBACK_QUEUED:  # type: ignore[union-attr]
        return
    ctx.exec_order.record_post_forward(unit)  # type: ignore[union-attr]
    if not torch.is_grad_enabled():
        handle.reshard()
        return
    grad_outputs = [t for t in iter_tensors(output) if t.requires_grad]
    hook = functools.partial(_pre_backward, unit)
    for tensor in grad_outputs:
        tensor.register_hook(hook)
    if not grad_outputs and not handle.requires_grad:
        handle.reshard()  # nothing in a backward can need these parameters
    elif grad_outputs and unit.config.sharding_strategy is ShardingStrategy.FULL_SHARD and not unit.is_root:
        handle.reshard()


def _root_post_forward(root: Unit) -> None:
    ctx = root.ctx
    ctx.exec_order.freeze_forward_order()  # type: ignore[union-attr]
    if not torch.is_grad_enabled():
        for unit in ctx.units:  # type: ignore[union-attr]
            if unit.handle is not None:
                unit.handle.reshard()  # also releases forward prefetches that went unused


def _prefetch(target: Optional[Unit]) -> None:
    if target is not None and target.handle is not None:
        target.handle.unshard()  # a no-op if it is already gathered: never gathered twice


# -- backward -----------------------------------------------------------------------------


def _pre_backward(unit: Unit, grad: torch.Tensor) -> None:
    """Hook on a forward output of ``unit``: its backward is about to run."""
    ctx = unit.ctx
    _queue_finalizer(ctx)  # type: ignore[arg-type]
    if unit.training_state is _BACKWARD_PRE:
        return None  # another output of the same unit (or a second use of it)
    unit.move((_IDLE,), _BACKWARD_PRE)
    handle = unit.handle
    if handle is None:
        return None
    handle.unshard()
    # Views back on the modules, under autograd, for code that re-runs forward pieces in
    # backward (activation checkpointing) and reads the parameters from the modules.
    handle.use_views(track_grad=True)
    if unit.config.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
        _prefetch_for_backward(unit)
    return None


def _post_backward(unit: Unit, leaf: torch.Tensor) -> None:
    """Hook after autograd accumulated ``unit``'s full gradient: reduce it and free."""
    handle = unit.handle
    if handle is None:
        raise AssertionError(f"{unit.where()}: post-backward hook without parameters")
    _queue_finalizer(unit.ctx)  # type: ignore[arg-type]
    if unit.training_state is _BACKWARD_POST:
        raise AssertionError(
            f"{unit.where()}: a second gradient reached the unit in one backward (reentrant "
            f"activation checkpointing inside a unit is not supported)"
        )
    if handle.state is not HandleState.UNSHARDED:
        raise AssertionError(f"{unit.where()}: gradient computed while the parameters were freed")
    unit.move((_BACKWARD_PRE, _IDLE), _BACKWARD_POST)
    if unit.sync_gradients:
        handle.reduce_grad()
    handle.reshard()
    if unit.config.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
        _prefetch_for_backward(unit)


def _prefetch_for_backward(unit: Unit) -> None:
    def pending(candidate: Unit) -> bool:
        return (
            candidate.training_state is _IDLE
            and candidate.handle is not None
            and candidate.handle.state is HandleState.SHARDED
        )

    _prefetch(unit.ctx.exec_order.next_in_backward(unit, pending))  # type: ignore[union-attr]


def _queue_finalizer(ctx: RootContext) -> None:
    if ctx.backward_state is BackwardState.IDLE:
        ctx.backward_state = BackwardState.CALLBACK_QUEUED
        Variable._execution_engine.queue_callback(functools.partial(_finalize_backward, ctx))


def _finalize_backward(ctx: RootContext) -> None:
    """End of a backward (queued on the autograd engine): free all, reset to IDLE."""
    for unit in ctx.units:
        if unit.handle is not None:
            unit.handle.reshard()
        unit.move((_IDLE, _BACKWARD_PRE, _BACKWARD_POST), _IDLE)
    ctx.exec_order.end_iteration()
    ctx.backward_state = BackwardState.IDLE


@contextlib.contextmanager
def no_sync(units: Sequence[Unit]) -> Iterator[None]:
    """Skip gradient reduction in ``units`` while inside; restore the previous setting after."""
    previous = [unit.sync_gradients for unit in units]
    for unit in units:
        unit.sync_gradients = False
    try:
        yield
    finally:
        for unit, value in zip(units, previous):
            unit.sync_gradients = value

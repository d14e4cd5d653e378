"""Forward and backward of a unit: when to gather, free and reduce.

[Note: unit life cycle] Per iteration a unit goes IDLE -> FORWARD -> IDLE (its forward),
then IDLE -> BACKWARD_PRE (a hook on one of its forward outputs received a gradient: its
backward is about to run, so gather) -> BACKWARD_POST (its backward is done: gradients
reduced, parameters freed) -> IDLE (the root's end-of-backward callback). A unit has one
handle per group of parameters sharing dtype and ``requires_grad``; each finishes on its own.
A trainable handle is done when autograd has accumulated its full gradient (nothing in the
backward can need its parameters after that); frozen handles are done when the gradients of
the unit's forward inputs and its trainable handles are (see [Note: frozen handles]). The callback is queued by whichever hook fires first
in a backward; it frees whatever is still gathered (a unit whose parameters got no gradient,
a frozen unit whose inputs need none, a mistargeted prefetch) and starts a new iteration.

[Note: when parameters are freed] After forward: FULL_SHARD units except the root (its
backward starts immediately), and units nothing in backward can need. Without autograd
(``no_grad``/``inference_mode``) every unit this forward gathered is freed right after it,
since no backward can follow. After backward: every sharded unit. Kept until the end of
backward instead: a unit whose parameters require grad but whose outputs carry no tensor
that requires grad (its outputs may hide tensors in containers we cannot see), and a unit
whose output shares its parameters' memory (e.g. it returns a weight) -- freeing memory that
backward then reads would crash.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook

from ._collectives import all_gather_object, fingerprint
from ._common import HandleState, TrainingState, display_name, iter_tensors, map_tensors
from ._exec_order import END_OF_BACKWARD, GATHER, REDUCE, mismatch, token
from ._unit import BackwardState, RootContext, Unit
from .api import BackwardPrefetch, ShardingStrategy
from .flat_param import FlatParamHandle

_IDLE = TrainingState.IDLE
_FORWARD = TrainingState.FORWARD
_BACKWARD_PRE = TrainingState.BACKWARD_PRE
_BACKWARD_POST = TrainingState.BACKWARD_POST


def register_hooks(unit: Unit) -> None:
    """Hook the gradient accumulation of a unit's trainable handles (once, at construction)."""
    for handle in unit.trainable:
        hook = functools.partial(_post_backward, unit, handle)
        unit.hook_handles.append(handle.grad_leaf.register_post_accumulate_grad_hook(hook))


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


# -- forward ------------------------------------------------------------------------------


def run_forward(unit: Unit, module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """The wrapper's forward: gather, run the wrapped module, free or hook for backward."""
    ctx = unit.ctx
    if ctx is None:
        raise AssertionError(f"{unit.where()}: forward before lazy init")
    if unit.is_root:
        _root_pre_forward(ctx)
        if unit.device.type != "cpu":
            args, kwargs = map_tensors(lambda t: t.to(unit.device, non_blocking=True), (args, kwargs))
    args, kwargs, input_dtype = _cast_inputs(unit, args, kwargs)
    _pre_forward(unit, ctx, (args, kwargs))
    try:
        output = module(*args, **kwargs)
    except BaseException:
        if unit.training_state is _FORWARD:
            unit.move((_FORWARD,), _IDLE)  # the forward is abandoned; let the next one start
        raise
    if input_dtype is not None:  # a full-precision unit hands back the dtype it was given
        output = map_tensors(lambda t: t.to(input_dtype) if t.is_floating_point() else t, output)
    _post_forward(unit, ctx, output)
    if unit.is_root:
        _root_post_forward(ctx)
    return output


def _cast_inputs(unit: Unit, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any], Optional[torch.dtype]]:
    """Mixed precision: cast floating-point inputs to ``param_dtype`` (at the root with
    ``cast_root_forward_inputs``, at every unit with ``cast_forward_inputs``); a unit kept in
    full precision (BatchNorm) casts them to its parameters' dtype and returns the dtype its
    outputs go back to."""
    mp = unit.config.mixed_precision
    if mp is None or mp.param_dtype is None:
        return args, kwargs, None
    if unit.config.full_precision:
        target = unit.handles[0].dtype if unit.handles else torch.float32
        given = next((t.dtype for t in iter_tensors((args, kwargs)) if t.is_floating_point()), None)
    elif mp.cast_forward_inputs or (unit.is_root and mp.cast_root_forward_inputs):
        target, given = mp.param_dtype, None
    else:
        return args, kwargs, None
    args, kwargs = map_tensors(lambda t: t.to(target) if t.is_floating_point() else t, (args, kwargs))
    return args, kwargs, given if given != target else None


def _root_pre_forward(ctx: RootContext) -> None:
    if _in_backward():
        return
    ctx.gathered_in_forward.clear()
    ctx.exec_order.start_forward()
    if ctx.backward_state is BackwardState.CALLBACK_QUEUED:
        # The last backward raised, so autograd never ran its end-of-backward callback.
        _finalize_backward(ctx, failed=True)


def _pre_forward(unit: Unit, ctx: RootContext, inputs: Any) -> None:
    # [Note: forward inside backward] Activation checkpointing re-runs forward code during
    # backward. A unit re-run inside its own backward stays BACKWARD_PRE; any unit re-run
    # during a backward keeps its parameters gathered until its backward (the recomputed
    # activations that backward reads are views of them).
    if unit.training_state is not _BACKWARD_PRE:
        unit.move((_IDLE,), _FORWARD)
    if not unit.handles:
        return
    recompute = _in_backward()
    if not recompute:
        ctx.exec_order.record_pre_forward(unit)
    _consume_prefetch(ctx, unit)
    if _gather(unit, ctx):
        ctx.gathered_in_forward.add(unit)
    if unit.config.forward_prefetch and not recompute:
        target = ctx.exec_order.next_in_forward(unit)
        if _prefetch(ctx, target):
            ctx.gathered_in_forward.add(target)  # type: ignore[arg-type]
    for handle in unit.handles:  # waits for this unit's all-gather (the prefetch goes on)
        handle.use_views(track_grad=torch.is_grad_enabled())
    if unit.frozen and torch.is_grad_enabled() and not recompute:
        _hook_inputs_for_frozen_handles(unit, inputs)


def _post_forward(unit: Unit, ctx: RootContext, output: Any) -> None:
    if unit.training_state is _BACKWARD_PRE:
        return
    unit.move((_FORWARD,), _IDLE)
    if not unit.handles or _in_backward():
        return
    if not torch.is_grad_enabled():
        if unit in ctx.gathered_in_forward:
            _free(unit)
        return
    grad_outputs = [t for t in iter_tensors(output) if t.requires_grad]
    hook = functools.partial(_pre_backward, unit)
    for tensor in grad_outputs:
        tensor.register_hook(hook)
    if grad_outputs:
        ctx.exec_order.record_post_forward(unit)  # its backward will run: a prefetch target
    if not grad_outputs and not unit.trainable:
        _free(unit)  # nothing in a backward can need these parameters
    elif (
        grad_outputs
        and unit.config.sharding_strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
        and not unit.is_root
        and not any(h.aliases(t) for h in unit.handles for t in iter_tensors(output))
    ):
        _free(unit)


def _root_post_forward(ctx: RootContext) -> None:
    ctx.exec_order.freeze_forward_order()
    if _in_backward():
        return
    order = ctx.exec_order.this_forward()
    _check_forward_order(ctx, order)
    if not torch.is_grad_enabled():
        for unit in ctx.gathered_in_forward:
            _free(unit)  # also unused forward prefetches
        ctx.prefetched.clear()
        ctx.checking = False  # no backward follows: the first iteration is over
    elif order != ctx.exec_order.first_forward():
        ctx.checking = True  # the order changed: check this iteration's backward collectives
    ctx.gathered_in_forward.clear()


def _gather(unit: Unit, ctx: RootContext) -> bool:
    """Issue the all-gathers of ``unit``'s sharded handles (asynchronously); ``False`` if
    none was needed (a unit is never gathered twice)."""
    if not any(h.state is HandleState.SHARDED for h in unit.handles):
        return False
    _check_order(ctx, token(GATHER, ctx.index[unit]))
    for handle in unit.handles:
        handle.unshard(async_op=True)
    return True


def _prefetch(ctx: RootContext, target: Optional[Unit]) -> bool:
    """Gather ``target`` ahead of its use. With ``limit_all_gathers`` at most two units wait
    gathered ahead of their use at a time."""
    if target is None or (target.config.limit_all_gathers and len(ctx.prefetched) >= 2):
        return False
    if not _gather(target, ctx):
        return False
    ctx.prefetched.append(target)
    return True


def _consume_prefetch(ctx: RootContext, unit: Unit) -> None:
    if unit in ctx.prefetched:
        ctx.prefetched.remove(unit)


def _free(unit: Unit) -> None:
    for handle in unit.handles:
        handle.reshard()


def _check_order(ctx: RootContext, value: int) -> None:
    """One order check (see [Note: order check]) while checking."""
    if ctx.checking and ctx.comm.world_size > 1:
        values = ctx.comm.gather_ints(value, ctx.root.device)
        problem = mismatch(values, [_label(u) for u in ctx.units])
        if problem is not None:
            raise RuntimeError(
                f"[rank {ctx.comm.rank}] the ranks ran different units (every rank must run the same "
                f"units in the same order, e.g. no data-dependent skipping): {problem}"
            )


def _check_forward_order(ctx: RootContext, order: List[Unit]) -> None:
    """The one check every root forward makes: did all ranks run the same units in order?"""
    if ctx.comm.world_size == 1:
        return
    names = [_label(u) for u in order]
    values = ctx.comm.gather_ints(fingerprint("\n".join(names)), ctx.root.device)
    problem = mismatch(values, [_label(u) for u in ctx.units])
    if problem is None:
        return
    if all(v >= token(END_OF_BACKWARD + 1) for v in values):  # all at the end of a forward
        everyone = all_gather_object(names, ctx.root.group)
        first = next(i for i in range(max(map(len, everyone))) if len({tuple(o[i : i + 1]) for o in everyone}) > 1)
        ran = "; ".join(f"rank {r} ran {o[first] if first < len(o) else 'nothing'}" for r, o in enumerate(everyone))
        problem = f"unit #{first} of this forward differs: {ran}"
    raise RuntimeError(
        f"[rank {ctx.comm.rank}] the ranks ran different units (every rank must run the same units "
        f"in the same order, e.g. no data-dependent skipping): {problem}"
    )


def _label(unit: Unit) -> str:
    return display_name(unit.name)


def _hook_inputs_for_frozen_handles(unit: Unit, inputs: Any) -> None:
    """Frozen handles get no gradient to signal the end of their backward; the gradients of
    the unit's inputs do instead (see [Note: frozen handles])."""
    tensors = [t for t in iter_tensors(inputs) if t.requires_grad]
    if tensors:
        unit.open_input_hooks += 1
        register_multi_grad_hook(tensors, functools.partial(_post_backward_frozen, unit))


# -- backward -----------------------------------------------------------------------------


def _pre_backward(unit: Unit, grad: torch.Tensor) -> None:
    """Hook on a forward output of ``unit``: its backward is about to run."""
    ctx = unit.ctx
    _queue_finalizer(ctx)  # type: ignore[arg-type]
    state = unit.training_state
    if state is _IDLE:
        needed = list(unit.handles)
    else:
        # Another output or another use of the unit. Trainable handles whose gradient is
        # complete are not needed again in this backward (e.g. a hook on an input the unit
        # passed through); frozen handles freed meanwhile are gathered again.
        needed = [h for h in unit.frozen if h.state is HandleState.SHARDED]
        if not needed:
            return None
    if state is not _BACKWARD_PRE:
        unit.move((_IDLE, _BACKWARD_POST), _BACKWARD_PRE)
    unit.pending.update(needed)
    _consume_prefetch(ctx, unit)  # type: ignore[arg-type]
    for handle in needed:
        handle.drop_grad_if_zeroed()
    if any(h.state is HandleState.SHARDED for h in needed):
        _check_order(ctx, token(GATHER, ctx.index[unit]))  # type: ignore[union-attr]
        for handle in needed:
            handle.unshard(async_op=True)
    if state is not _BACKWARD_PRE and unit.config.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
        _prefetch_for_backward(unit)
    for handle in needed:
        # Views back on the modules, under autograd, for code that re-runs forward pieces
        # in backward (activation checkpointing) and reads the parameters from the modules.
        handle.use_views(track_grad=True)
    return None


def _post_backward(unit: Unit, handle: FlatParamHandle, leaf: torch.Tensor) -> None:
    """Hook after autograd accumulated ``handle``'s full gradient: reduce it and free."""
    _queue_finalizer(unit.ctx)  # type: ignore[arg-type]
    if unit.training_state is _IDLE:
        # No output hook fired (outputs we could not see into); everything stayed gathered.
        unit.move((_IDLE,), _BACKWARD_PRE)
        unit.pending.update(unit.handles)
    if handle not in unit.pending:
        raise AssertionError(
            f"{unit.where()}: a second gradient reached the unit in one backward (reentrant "
            f"activation checkpointing inside a unit is not supported)"
        )
    if handle.state is not HandleState.UNSHARDED:
        raise AssertionError(f"{unit.where()}: gradient computed while the parameters were freed")
    ctx = unit.ctx
    if unit.sync_gradients:
        if unit.world_size > 1:
            _check_order(ctx, token(REDUCE, ctx.index[unit]))  # type: ignore[union-attr]
        if handle.reduce_grad(async_op=True):
            _track_reduction(ctx, handle)  # type: ignore[arg-type]
    else:
        handle.hold_grad_for_later()
    handle.reshard()
    _done(unit, [handle])


def _track_reduction(ctx: RootContext, handle: FlatParamHandle) -> None:
    """Reductions run while later units compute their gradients; at most two stay in flight
    (each holds a full gradient), the end of backward completes the rest."""
    ctx.reducing.append(handle)
    while len(ctx.reducing) > 2:
        ctx.reducing.pop(0).finish_reduction()


def _post_backward_frozen(unit: Unit, grads: Sequence[Optional[torch.Tensor]]) -> None:
    """The gradients of one forward's inputs to ``unit`` are complete."""
    unit.open_input_hooks = max(0, unit.open_input_hooks - 1)
    if unit.training_state is _BACKWARD_PRE:
        _done(unit, [])


def _done(unit: Unit, finished: Sequence[FlatParamHandle]) -> None:
    """Mark handles finished for this backward; free frozen handles once nothing can need
    them; when all are finished the unit's backward is done.

    [Note: frozen handles] A frozen parameter is needed in backward only to compute the
    gradient of something upstream of it: an input of the unit, or (in a unit that also has
    trainable parameters) a trainable parameter. So frozen handles are freed once the input
    gradients of every forward of this iteration are complete (a unit may run several times)
    and all trainable handles are done.
    """
    unit.pending.difference_update(finished)
    frozen_pending = [h for h in unit.frozen if h in unit.pending]
    if frozen_pending and unit.open_input_hooks == 0 and not any(h in unit.pending for h in unit.trainable):
        for handle in frozen_pending:
            handle.reshard()
        unit.pending.difference_update(frozen_pending)
    if not unit.pending:
        unit.move((_BACKWARD_PRE,), _BACKWARD_POST)
        if unit.config.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            _prefetch_for_backward(unit)


def _prefetch_for_backward(unit: Unit) -> None:
    def waiting(candidate: Unit) -> bool:
        return candidate.training_state is _IDLE and any(h.state is HandleState.SHARDED for h in candidate.handles)

    ctx = unit.ctx
    _prefetch(ctx, ctx.exec_order.next_in_backward(unit, waiting))  # type: ignore[union-attr, arg-type]


def _queue_finalizer(ctx: RootContext) -> None:
    if ctx.backward_state is BackwardState.IDLE:
        ctx.move((BackwardState.IDLE,), BackwardState.CALLBACK_QUEUED)
        Variable._execution_engine.queue_callback(functools.partial(_finalize_backward, ctx))


def _finalize_backward(ctx: RootContext, failed: bool = False) -> None:
    """End of a backward (queued on the autograd engine, or run by the next forward after a
    backward that raised): complete the reductions, free all, reset to IDLE."""
    for handle in ctx.reducing:
        handle.finish_reduction()
    ctx.reducing.clear()
    if not failed:
        _check_order(ctx, token(END_OF_BACKWARD))
        ctx.checking = False
    for unit in ctx.units:
        _free(unit)
        unit.pending.clear()
        unit.open_input_hooks = 0
        unit.move((_IDLE, _BACKWARD_PRE, _BACKWARD_POST), _IDLE)
    ctx.prefetched.clear()
    ctx.exec_order.end_iteration()
    ctx.move((BackwardState.CALLBACK_QUEUED,), BackwardState.IDLE)


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

"""Forward and backward of the units of one root: when to gather, free and reduce.

``_forward.lazy_init`` binds a root's units to one ``RootRuntime`` (the root's ``RootContext``,
with the behaviour); from then on the wrapper's forward, the autograd hooks (bound to it when
registered) and the end-of-backward callback are its methods.

[Note: unit life cycle] Per iteration a unit goes IDLE -> FORWARD -> IDLE (its forward),
then IDLE -> BACKWARD_PRE (its backward is about to run: a hook on one of its forward outputs
received a gradient, or autograd unpacked one of its saved parameters, see [Note: saved
parameters] in ``_saved``) -> BACKWARD_POST (its backward is done: gradients reduced,
parameters freed) -> IDLE (the root's end-of-backward callback). A unit has one handle per
group of parameters sharing dtype and ``requires_grad``; each finishes on its own. A trainable
handle is done when autograd has accumulated its full gradient (nothing in the backward can
need its parameters to compute a gradient of them after that); frozen handles are done when
the gradients of the unit's forward inputs and its trainable handles are (see [Note: frozen
handles]). The callback is queued by whichever hook fires first in a backward; it reduces what
``no_sync`` left behind, frees whatever is still gathered (a unit whose parameters got no
gradient, a frozen unit whose inputs need none, a mistargeted prefetch, a parameter read again
after its unit's backward) and starts a new iteration.

[Note: when parameters are freed] After forward: FULL_SHARD units except the root (its
backward starts immediately), and units nothing in backward can need. Without autograd
(``no_grad``/``inference_mode``) every unit this forward gathered is freed right after it,
since no backward can follow. After backward: every sharded unit. Kept until the end of
backward instead: a unit whose parameters require grad but whose outputs carry no tensor
that requires grad (its outputs may hide tensors in containers we cannot see), and a unit
whose output shares its parameters' memory (e.g. it returns a weight) -- code outside any
forward may read that output in backward.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import torch
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook

from ._agreement import AgreementChecks
from .._base._compile import dynamo_loaded, outside_graph
from .._base._common import HandleState, TrainingState, attribute_set, display_name, iter_tensors, map_tensors, runs_code_of
from .._flat._exec_order import END_OF_BACKWARD, GATHER, REDUCE, token
from .._flat._saved import SavedParamGuard
from ._unit import BackwardState, RootContext, Unit
from ..api import BackwardPrefetch, ShardingStrategy
from .._flat._flat_param import FlatParamHandle

_IDLE = TrainingState.IDLE
_FORWARD = TrainingState.FORWARD
_BACKWARD_PRE = TrainingState.BACKWARD_PRE
_BACKWARD_POST = TrainingState.BACKWARD_POST

# [Note: overlap] flatshard computes on the one stream the user's code runs on and issues
# its collectives asynchronously. An asynchronous NCCL collective first makes its own stream
# wait for everything queued on the current stream, and a wait makes the current stream wait for
# the collective: a collective runs behind the compute queued between its issue and its wait,
# and behind nothing else (``tests/_overlap_trace.py`` measures exactly that, by dispatch order).
# So, with overlap on (the default), every collective is issued before the compute it should
# hide behind and waited for after it:
# - forward: each unit's pre-forward issues the next unit's all-gather (by the first
#   iteration's order, ``ExecOrder.next_in_forward``) before its own compute, whatever
#   ``forward_prefetch`` says (FSDP1 gets the same from its streams); ``limit_all_gathers``
#   still bounds how many units wait gathered ahead of their use;
# - backward: ``backward_prefetch`` gathers as in FSDP1, and each reduction is waited for
#   after the next unit's gradient computation ([Note: reductions in flight]), under hybrid
#   sharding with its all-reduce over the replicas chained ([Note: chained all-reduce] in
#   ``_comm/_collectives``).
# Two stay exposed: the first gather of the forward (nothing is queued before it) and the last
# reduction of the backward (nothing comes after it); a unit behind a lookup (an embedding) has
# only that lookup to hide behind. The memory it costs: one unit gathered ahead in the forward
# (FSDP1's rate limiter allows the same) and one unit's full gradient in flight in the backward.
# ``set_communication_overlap(False)`` gives both back: FSDP1's peak on the fake process group.

# [Note: reductions in flight] A unit's gradient reduction is issued in its post-backward,
# once autograd has queued the computation of its gradient. When it is waited for depends on
# the root's overlap setting (``ShardedDataParallel.set_communication_overlap``):
# - overlapping (the default): at the next unit's post-backward, before that unit's own
#   reduction is issued. The next unit's gradient computation has been queued by then, so the
#   reduction ran behind it ([Note: overlap]); meanwhile it holds its unit's full gradient,
#   one unit's gradient more than FSDP1 holds on the fake process group (FSDP1 and FSDP2 pay
#   the same on a GPU, where their streams keep one in flight). Under hybrid sharding on a
#   host-driven backend that wait issues the all-reduce over the replicas, which the wait
#   after the following unit's computation completes ([Note: chained all-reduce]).
# - not overlapping (FSDP1's lowest peak): as soon as the backward is about to allocate: when
#   the next unit's backward begins (``begin_backward``, before that unit gathers or
#   prefetches) and just before any unit assembles its full gradient (a hook on the node that
#   concatenates the views' gradients). The full gradient is gone before anything else is
#   allocated: the backward peak per rank is FSDP1's on the fake process group
#   (bench/RESULTS.md). At most this many are in flight at once (units whose backwards end
#   back to back).
MAX_REDUCTIONS_IN_FLIGHT = 2
# How many units a prefetch may gather ahead of their use under limit_all_gathers.
MAX_PREFETCHED = 2


class UnitForward:
    """One unit's forward in progress: its (cast) inputs, the dtype its outputs go back to,
    the saved-tensor guard installed around the wrapped module, and whether it is the guarded
    call ([Note: a forward is a guarded call]) or part of one."""

    __slots__ = ("runtime", "unit", "args", "kwargs", "input_dtype", "saved", "owns_call")

    def __init__(self, runtime: "RootRuntime", unit: Unit, args: Tuple[Any, ...], kwargs: Dict[str, Any], input_dtype: Optional[torch.dtype], owns_call: bool) -> None:
        self.runtime = runtime
        self.unit = unit
        self.args = args
        self.kwargs = kwargs
        self.input_dtype = input_dtype
        self.saved = contextlib.ExitStack()
        self.owns_call = owns_call


def settle(ctx: Optional[RootContext]) -> None:
    """Outside a backward: clean up after a backward that raised, if the last one did."""
    if isinstance(ctx, RootRuntime):
        ctx.settle()


def reduce_held(ctx: Optional[RootContext]) -> None:
    """Outside a backward: average the gradients ``no_sync()`` left that no synchronised
    backward averaged (see [Note: no_sync gradients at the step] in ``_stale_optimizer``).
    Collective when there are any (every rank has the same)."""
    if isinstance(ctx, RootRuntime) and not in_backward():
        ctx.settle()
        ctx.reduce_held()


@contextlib.contextmanager
def no_sync(units: Sequence[Unit]) -> Iterator[None]:
    """Skip gradient reduction in ``units`` while inside; restore the previous setting after."""
    with attribute_set(units, "sync_gradients", False):
        yield


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


# Where torch runs an optimizer's step between its pre- and post-hooks.
_STEP_SOURCE = torch.optim.Optimizer.profile_hook_step.__code__.co_filename


def _inside_a_step() -> bool:
    """Whether this thread is inside an optimizer's ``step()`` now (a closure's forward and
    backward, as LBFGS runs them): a step under way, not one that raised."""
    return runs_code_of(sys._getframe(1), _STEP_SOURCE)


def _post_accumulate(runtime_ref: "weakref.ref[RootRuntime]", unit_ref: "weakref.ref[Unit]", handle_ref: "weakref.ref[FlatParamHandle]", leaf: torch.Tensor) -> None:
    # (lives on the full flat tensor, in C++ and out of the garbage collector's sight: it
    # holds everything weakly, or every deleted model would stay alive)
    runtime, unit, handle = runtime_ref(), unit_ref(), handle_ref()
    if runtime is not None and unit is not None and handle is not None:
        runtime.post_backward(unit, handle)


def _before_full_grad(runtime_ref: "weakref.ref[RootRuntime]", grads: Any) -> None:
    # (on an autograd node, out of the garbage collector's sight: holds the runtime weakly)
    runtime = runtime_ref()
    if runtime is not None and not runtime.overlap:
        runtime.finish_reductions()  # (see [Note: reductions in flight])


def _label(unit: Unit) -> str:
    return display_name(unit.name)


def where_of(unit: Unit) -> str:
    return f"unit {display_name(unit.name)}" if unit.name else "the root unit"


class RootRuntime(AgreementChecks, RootContext):
    """The forward and backward machinery of one root's units (see the module docstring)."""

    def __init__(self, root: Unit) -> None:
        super().__init__(root)
        self.saved_guard = SavedParamGuard(self.freeable, functools.partial(_gather_saved, weakref.ref(self)))
        self._make_hooks()
        self.watch = self.guard.watch
        self.optimizer_steps = 0  # optimizer.step() calls on this model (see [Note: steps agree])
        # Steps counted by ``before_step`` that ``after_step`` has not seen complete: one left
        # at the next call is a step that raised ([Note: a failed optimizer step]).
        self.stepping = 0
        # Whether the running backward is the guarded call it opened ([Note: a forward is a
        # guarded call]; a backward inside a forward is part of that forward's call).
        self.backward_owns_call = False

    @property
    def overlap(self) -> bool:
        """Whether communication overlaps compute ([Note: overlap]); the root's setting."""
        return self.root.overlap_communication

    def _full_grad_hook(self) -> Any:
        """The hook that completes the reductions in flight before a unit assembles its full
        gradient: only without overlap ([Note: reductions in flight]; it checks again when it
        fires, in case the setting changed between the forward and the backward)."""
        return None if self.overlap else self.on_full_grad

    def _make_hooks(self) -> None:
        """The callables registered with autograd, made once: opaque to dynamo if it is loaded
        (see ``_compile``); if it is loaded later, the next root forward makes them again and
        registers the gradient-accumulation hooks (registered once) again."""
        self.hooks_outside_graph = dynamo_loaded()
        self.on_output_grad = outside_graph(self.pre_backward_hook)
        self.on_inputs_done = outside_graph(self.inputs_done)
        self.on_backward_end = outside_graph(self.finalize_backward)
        self.on_accumulated = outside_graph(_post_accumulate)
        self.on_full_grad = outside_graph(functools.partial(_before_full_grad, weakref.ref(self)))

    # -- tracing (tests) ----------------------------------------------------------------------

    def _trace(self, kind: str, label: str) -> None:
        tracer = self.root.tracer
        if tracer is not None:
            tracer.event(kind, label)

    def _handle_label(self, unit: Unit, handle: FlatParamHandle) -> str:
        index = unit.handles.index(handle)
        return unit.label + (f"#{index}" if index else "")

    # -- forward --------------------------------------------------------------------------------

    def start_forward(self, unit: Unit, args: Tuple[Any, ...], kwargs: Dict[str, Any], owns_call: bool = False) -> "UnitForward":
        """The wrapper's forward up to running the wrapped module: gather, put the views on the
        modules, install the saved-tensor guard. Leaves nothing half done if it raises.
        ``owns_call``: this forward is the guarded call ([Note: a forward is a guarded call])."""
        if unit.is_root:
            self._root_pre_forward()
            if unit.device.type != "cpu":
                args, kwargs = map_tensors(lambda t: t.to(unit.device, non_blocking=True), (args, kwargs))
        args, kwargs, input_dtype = _cast_inputs(unit, args, kwargs)
        step = UnitForward(self, unit, args, kwargs, input_dtype, owns_call)
        try:
            self._pre_forward(unit, (args, kwargs))
            step.saved.enter_context(self._guard_saved())
        except BaseException as error:
            self.abandon_forward(step, error)
            raise
        return step

    def finish_forward(self, step: "UnitForward", output: Any) -> Any:
        """The wrapper's forward after the wrapped module returned: free or hook for backward.
        Closes the forward's guarded call, also when this raises (the check ending a root's
        forward, say)."""
        step.saved.close()
        unit = step.unit
        try:
            for handle in unit.handles:
                handle.end_forward()
            if step.input_dtype is not None:  # a full-precision unit hands back the dtype it was given
                dtype = step.input_dtype
                output = map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, output)
            self._post_forward(unit, output)
            if unit.is_root:
                self._root_post_forward()
        except BaseException as error:
            if step.owns_call:
                self.guard.close(error, self._forward_where(unit))
            raise
        if step.owns_call:
            self.guard.close(None, self._forward_where(unit))
        return output

    def _forward_where(self, unit: Unit) -> str:
        return f"the forward of {where_of(unit)} of step {self.watch.step if self.watch is not None else 0}"

    def abandon_forward(self, step: "UnitForward", error: Optional[BaseException] = None) -> None:
        """[Note: a forward that raised] The wrapped module (or a compiler compiling it) raised:
        the saved-tensor guard comes off and the unit goes back to IDLE, so the next forward
        starts as usual. Units it left gathered are refreshed by that forward (see [Note: stale
        gathers] in ``flat_param``), as after a forward whose backward never ran; outputs of
        units that finished are garbage and their hooks never fire. Every rank must raise alike
        (the forward's collectives stop there); a rank that raises alone tells the others,
        which would wait for it (see [Note: peer failures] in ``_peer_failures``)."""
        where = self._forward_where(step.unit)
        if self.watch is not None and error is not None and self.guard.depth and not in_backward():
            # (the innermost unit names it; the call's own record is the same. In a backward,
            # it is a recomputation that activation checkpointing stops early: not a failure)
            self.watch.leave(where, error)
        self.checking = self.every_collective_checked  # (an unsynced generate that raised)
        step.saved.close()
        for handle in step.unit.handles:
            handle.end_forward()
        if step.unit.training_state is _FORWARD:
            step.unit.move((_FORWARD,), _IDLE)
        if step.owns_call:
            self.guard.close(error or RuntimeError("the forward was abandoned"), where)

    def _guard_saved(self) -> Any:
        """See [Note: saved parameters] in ``_saved``. A forward re-run inside backward
        (activation checkpointing) keeps its unit gathered until its backward instead."""
        if not torch.is_grad_enabled() or in_backward() or not self.freeable:
            return contextlib.nullcontext()
        return self.saved_guard.active()

    def _root_pre_forward(self) -> None:
        if in_backward():
            return
        self.settle()
        if not self.hooks_outside_graph and dynamo_loaded():
            self._hook_trainables_again()
        self.gathered_in_forward.clear()
        self.exec_order.start_forward()
        self._refresh_stale()

    def settle(self) -> None:
        """If the last backward raised (autograd never ran its end-of-backward callback),
        clean up now: outside a backward, a queued callback means exactly that. If the last
        optimizer step raised, carry that into every later call of the guard.

        [Note: a failed optimizer step] An optimizer step that raises on one rank (in a step
        pre-hook, or partway through ``step()``, say out of memory after some parameters were
        updated), caught there, leaves that rank's shards or optimizer state different from the
        others': no collective would tell, and the ranks would train different models from then
        on (FSDP1 does). flatshard's step pre-hook counts the step and its post-hook, which
        torch runs only after a step that returned, marks it complete; a step still under way
        at the next call is one that raised. The rank carries it into the entry check of every
        later call ([Note: one guarded path] in ``_comm/_guard``), so every rank raises there,
        naming it, until a state dict is loaded into the model (which restores the parameters;
        load the optimizer's state from the same checkpoint too)."""
        if self.backward_state is BackwardState.CALLBACK_QUEUED and not in_backward():
            self.finalize_backward(failed=True)
        if self.stepping and not _inside_a_step():
            self.stepping = 0
            rank = self.watch.rank if self.watch is not None else self.root.rank
            self.guard.carried = (
                f"rank {rank} failed an optimizer step on this model (optimizer.step() raised after "
                f"flatshard's step pre-hook ran, before the step completed): its parameters or optimizer state "
                f"may differ from the other ranks' from then on, so the ranks cannot go on together; load the "
                f"model's and the optimizer's state from a checkpoint on every rank"
            )

    def check_forward_entry(self) -> None:
        """The entry check of a forward that is a guarded call ([Note: a forward is a guarded call])."""
        self.guard.enter_at("at the start of its forward", [])


    def _refresh_stale(self) -> None:
        """Gather again every unit still gathered from an earlier forward whose backward never
        ran: its shards may have changed since (see [Note: stale gathers] in ``flat_param``)."""
        for unit in self.units:
            if any(h.separate_full and h.state is not HandleState.SHARDED for h in unit.handles):
                self._check_order(token(GATHER, self.index[unit]))
                for handle in unit.handles:
                    handle.refresh(async_op=True)

    def _pre_forward(self, unit: Unit, inputs: Any) -> None:
        # [Note: forward inside backward] Activation checkpointing re-runs forward code during
        # backward. A unit re-run inside its own backward stays BACKWARD_PRE; any unit re-run
        # during a backward keeps its parameters gathered until its backward (the recomputed
        # activations that backward reads are views of them).
        self._trace("forward", unit.label)
        if unit.training_state is not _BACKWARD_PRE:
            unit.move((_IDLE,), _FORWARD)
        if not unit.handles:
            return
        self.hook_new_trainables(unit)
        recompute = in_backward()
        if not recompute:
            self.exec_order.record_pre_forward(unit)
        self._consume_prefetch(unit)
        if self._gather(unit, unit.handles):
            self.gathered_in_forward.add(unit)
        if (unit.config.forward_prefetch or self.overlap) and not recompute:
            target = self.exec_order.next_in_forward(unit)
            if target is not None and self._prefetch(target):
                self.gathered_in_forward.add(target)
        for handle in unit.handles:  # waits for this unit's all-gather (the prefetch goes on)
            handle.use_views(track_grad=torch.is_grad_enabled(), in_forward=True, before_full_grad=self._full_grad_hook())
        if unit.frozen and torch.is_grad_enabled() and not recompute:
            self._hook_inputs_for_frozen_handles(unit, inputs)

    def _post_forward(self, unit: Unit, output: Any) -> None:
        if unit.training_state is _BACKWARD_PRE:
            return
        unit.move((_FORWARD,), _IDLE)
        if not unit.handles or in_backward():
            return
        if not torch.is_grad_enabled():
            if unit in self.gathered_in_forward:
                self._free(unit)
            return
        grad_outputs = [t for t in iter_tensors(output) if t.requires_grad]
        hook = functools.partial(self.on_output_grad, unit)
        for tensor in grad_outputs:
            tensor.register_hook(hook)
        if grad_outputs:
            self.exec_order.record_post_forward(unit)  # its backward will run: a prefetch target
        if not grad_outputs and not unit.trainable:
            self._free(unit)  # nothing in a backward can need these parameters
        elif (
            grad_outputs
            and unit.config.sharding_strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
            and not unit.is_root
            and not any(h.aliases(t) for h in unit.handles for t in iter_tensors(output))
        ):
            self._free(unit)

    def _root_post_forward(self) -> None:
        self.exec_order.freeze_forward_order()
        if in_backward():
            return
        self._check_forward_order(self.exec_order.this_forward())
        if not torch.is_grad_enabled():
            for unit in self.gathered_in_forward:
                self._free(unit)  # also unused forward prefetches
            self.prefetched.clear()
            self.checking = self.every_collective_checked  # (no backward follows)
        self.gathered_in_forward.clear()

    # -- gathering and freeing ------------------------------------------------------------------

    def _gather(self, unit: Unit, handles: Sequence[FlatParamHandle]) -> bool:
        """Issue the all-gathers of those of ``handles`` that are sharded (asynchronously);
        ``False`` if none was (a handle is never gathered twice)."""
        sharded = [h for h in handles if h.state is HandleState.SHARDED]
        if not sharded:
            return False
        self._check_order(token(GATHER, self.index[unit]))
        for handle in sharded:
            handle.unshard(async_op=True)
            self._trace("gather", self._handle_label(unit, handle))
        return True

    def _prefetch(self, target: Unit) -> bool:
        """Gather ``target`` ahead of its use. With ``limit_all_gathers`` at most
        ``MAX_PREFETCHED`` units wait gathered ahead of their use at a time."""
        if target.config.limit_all_gathers and len(self.prefetched) >= MAX_PREFETCHED:
            return False
        if not self._gather(target, target.handles):
            return False
        self.prefetched.append(target)
        return True

    def _consume_prefetch(self, unit: Unit) -> None:
        if unit in self.prefetched:
            self.prefetched.remove(unit)

    def _free(self, unit: Unit, handles: Optional[Sequence[FlatParamHandle]] = None) -> None:
        for handle in unit.handles if handles is None else handles:
            if handle.state is not HandleState.SHARDED and handle.reshard():
                self._trace("free", self._handle_label(unit, handle))

    # -- backward ---------------------------------------------------------------------------------

    def hook_new_trainables(self, unit: Unit) -> None:
        """Hook the gradient accumulation of ``unit``'s handles that require grad and are
        not hooked yet (at binding, and at each forward for handles unfrozen since)."""
        for handle in unit.handles:
            handle.sync_requires_grad()
            if handle.requires_grad and handle not in unit.grad_hooks:
                hook = functools.partial(self.on_accumulated, weakref.ref(self), weakref.ref(unit), weakref.ref(handle))
                unit.grad_hooks[handle] = handle.grad_leaf.register_post_accumulate_grad_hook(hook)

    def _hook_trainables_again(self) -> None:
        """Register every gradient-accumulation hook again, now opaque to dynamo."""
        self._make_hooks()
        for unit in self.units:
            for hook in unit.grad_hooks.values():
                hook.remove()  # type: ignore[attr-defined]
            unit.grad_hooks.clear()
            self.hook_new_trainables(unit)

    def _hook_inputs_for_frozen_handles(self, unit: Unit, inputs: Any) -> None:
        """Frozen handles get no gradient to signal the end of their backward; the gradients of
        the unit's inputs do instead (see [Note: frozen handles])."""
        tensors = [t for t in iter_tensors(inputs) if t.requires_grad]
        if tensors:
            unit.open_input_hooks += 1
            register_multi_grad_hook(tensors, functools.partial(self.on_inputs_done, unit))

    def pre_backward_hook(self, unit: Unit, grad: torch.Tensor) -> None:
        """Hook on a forward output of ``unit``: its backward is about to run."""
        self._trace("pre-backward", unit.label)
        self.begin_backward(unit)
        return None

    def begin_backward(self, unit: Unit) -> None:
        """Gather what ``unit``'s backward needs: everything if its backward has not started in
        this backward pass; else the handles still pending or frozen that were freed meanwhile
        (another output or use of the unit). Trainable handles whose gradient is complete are
        not needed again (e.g. a hook on an input the unit passed through)."""
        self._queue_finalizer()
        state = unit.training_state
        if state is _IDLE:
            if not self.overlap:
                self.finish_reductions()  # (see [Note: reductions in flight])
            needed = list(unit.handles)
            unit.move((_IDLE,), _BACKWARD_PRE)
            unit.pending.update(needed)
        else:
            needed = [h for h in unit.handles if (h in unit.pending or not h.requires_grad) and h.state is HandleState.SHARDED]
            if not needed:
                return
            if state is _BACKWARD_POST:
                unit.move((_BACKWARD_POST,), _BACKWARD_PRE)
            unit.pending.update(needed)
        self._consume_prefetch(unit)
        self._refuse_changed_views(unit)
        for handle in needed:
            handle.drop_grad_if_zeroed()
        self._gather(unit, needed)
        if state is _IDLE and unit.config.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            self._prefetch_for_backward(unit)
        for handle in needed:
            # Views back on the modules, under autograd, for code that re-runs forward pieces
            # in backward (activation checkpointing) and reads the parameters from the modules.
            handle.use_views(track_grad=True, before_full_grad=self._full_grad_hook())

    def _refuse_changed_views(self, unit: Unit) -> None:
        """A unit kept gathered from its forward computes its backward with the views of that
        forward: a parameter replaced or rebound on its module since cannot be honoured (see
        [Note: writes through the views] in ``_module_views``); FSDP1 refuses it too."""
        for handle in unit.handles:
            if handle.state is HandleState.SHARDED:
                continue
            change = handle.views_changed()
            if change is not None:
                strategy = unit.config.sharding_strategy
                raise AssertionError(
                    f"{unit.where()}: {change} between the forward and the backward, while the unit kept its "
                    f"parameters gathered for the backward ({'the root' if unit.is_root else strategy.name}): FSDP "
                    f"does not support changing the parameters between forward and backward for {strategy}; "
                    f"change them before the forward or after the backward"
                )

    def gather_saved(self, key: int) -> None:
        """Autograd unpacks a saved parameter view of the full flat tensor with storage ``key``
        (see [Note: saved parameters] in ``_saved``): make sure it is gathered."""
        unit, handle = self.freeable[key]
        if handle.state is HandleState.SHARDED and unit.training_state in (_IDLE, _BACKWARD_PRE):
            self.begin_backward(unit)  # its backward starts here (before any output hook fired)
        if handle.state is HandleState.SHARDED:
            # Its backward is done (or it is frozen and was freed); read again, e.g. through a
            # .detach(): gather it once more, until the end of the backward.
            self._queue_finalizer()
            self._gather(unit, [handle])
        handle.finish_gather()

    def post_backward(self, unit: Unit, handle: FlatParamHandle) -> None:
        """After autograd accumulated ``handle``'s full gradient: reduce it and free."""
        self._trace("post-backward", unit.label)
        self._queue_finalizer()
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
            raise AssertionError(f"{unit.where()}: gradient computed while the parameters were {handle.state.name}")
        if unit.sync_gradients:
            if self.overlap:
                self._advance_reductions(unit)
            if unit.world_size > 1:
                self._check_order(token(REDUCE, self.index[unit]))
            if handle.reduce_grad(async_op=True):
                self._trace("reduce", self._handle_label(unit, handle))
                self._track_reduction(unit, handle)
        else:
            handle.hold_grad_for_later()
        self._free(unit, [handle])
        self._done(unit, [handle])

    def _track_reduction(self, unit: Unit, handle: FlatParamHandle) -> None:
        """A reduction stays in flight until its wait point (see [Note: reductions in
        flight]), without overlap at most ``MAX_REDUCTIONS_IN_FLIGHT`` at once; the end of
        backward completes the rest."""
        self.reducing.append((unit, handle))
        while not self.overlap and len(self.reducing) > MAX_REDUCTIONS_IN_FLIGHT:
            self._finish_reduction(*self.reducing.pop(0))

    def _advance_reductions(self, unit: Unit) -> None:
        """``unit``'s gradient computation is queued: the reductions of other units, issued
        before it, have run behind it; complete them (or, under hybrid sharding on a
        host-driven backend, move them on to their all-reduce over the replicas: [Note:
        chained all-reduce]). ``unit``'s own handles finishing one after another stay in flight."""
        staying = []
        for other, handle in self.reducing:
            if other is unit or not handle.advance_reduction():
                staying.append((other, handle))
            else:
                self._trace("reduced", self._handle_label(other, handle))
        self.reducing[:] = staying

    def finish_reductions(self) -> None:
        """Complete every reduction in flight, oldest first."""
        while self.reducing:
            self._finish_reduction(*self.reducing.pop(0))

    def _finish_reduction(self, unit: Unit, handle: FlatParamHandle) -> None:
        handle.finish_reduction(settle=False)  # (settled at the end of the backward)
        self._trace("reduced", self._handle_label(unit, handle))

    def inputs_done(self, unit: Unit, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """The gradients of one forward's inputs to ``unit`` are complete."""
        self._trace("post-backward", unit.label)
        unit.open_input_hooks = max(0, unit.open_input_hooks - 1)
        if unit.training_state is _BACKWARD_PRE:
            self._done(unit, [])

    def _done(self, unit: Unit, finished: Sequence[FlatParamHandle]) -> None:
        """Mark handles finished for this backward; free frozen handles once nothing can need
        them; when all are finished the unit's backward is done.

        [Note: frozen handles] A frozen parameter is needed in backward only to compute the
        gradient of something upstream of it: an input of the unit, or (in a unit that also has
        trainable parameters) a trainable parameter. So frozen handles are freed once the input
        gradients of every forward of this iteration are complete (a unit may run several times)
        and all trainable handles are done. (Autograd reading one later anyway, e.g. a side
        loss term, gathers it again: [Note: saved parameters] in ``_saved``.)
        """
        unit.pending.difference_update(finished)
        frozen_pending = [h for h in unit.frozen if h in unit.pending]
        if frozen_pending and unit.open_input_hooks == 0 and not any(h in unit.pending for h in unit.trainable):
            self._free(unit, frozen_pending)
            unit.pending.difference_update(frozen_pending)
        if not unit.pending:
            unit.move((_BACKWARD_PRE,), _BACKWARD_POST)
            if unit.config.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
                self._prefetch_for_backward(unit)

    def _prefetch_for_backward(self, unit: Unit) -> None:
        def waiting(candidate: Unit) -> bool:
            return candidate.training_state is _IDLE and any(h.state is HandleState.SHARDED for h in candidate.handles)

        target = self.exec_order.next_in_backward(unit, waiting)
        if target is not None:
            self._prefetch(target)

    def _queue_finalizer(self) -> None:
        if self.backward_state is BackwardState.IDLE:
            self.move((BackwardState.IDLE,), BackwardState.CALLBACK_QUEUED)
            Variable._execution_engine.queue_callback(_BackwardEnd(self))
            step = self.watch.step if self.watch is not None else 0
            # (no exit check: a rank whose backward raised is heard at once, see _BackwardEnd; a
            # backward inside another call, e.g. a forward's, is part of that one and opens nothing)
            self.backward_owns_call = self.guard.depth == 0 and self.guard.open(f"the backward of step {step}", exit_check=False)
            self._check_backward_agrees()

    def finalize_backward(self, failed: bool = False) -> None:
        """End of a backward (queued on the autograd engine, or run by ``settle`` after a
        backward that raised): complete the reductions (a failed backward's are completed but
        their results dropped: nothing of it may reach a gradient later), reduce what
        ``no_sync`` left in units this backward did not reach, free all, reset to IDLE."""
        if failed and self.backward_owns_call:
            self.backward_owns_call = False
            self.guard.abandon(self._failed_backward())
        for unit, handle in self.reducing:
            if failed:
                handle.discard_reduction()
            else:
                self._finish_reduction(unit, handle)
        self.reducing.clear()
        if not failed:
            self.reduce_held()
            self._check_order(token(END_OF_BACKWARD))
            self.checking = self.every_collective_checked
        for unit in self.units:
            for handle in unit.handles:
                handle.settle_grad_copy()
            self._free(unit)
            unit.pending.clear()
            unit.open_input_hooks = 0
            unit.move((_IDLE, _BACKWARD_PRE, _BACKWARD_POST), _IDLE)
        self.prefetched.clear()
        self.exec_order.end_iteration()
        self.move((BackwardState.CALLBACK_QUEUED,), BackwardState.IDLE)
        if self.backward_owns_call:
            self.backward_owns_call = False
            self.guard.close(None, "the backward")

    def _failed_backward(self) -> str:
        step = self.watch.step if self.watch is not None else 0
        rank = self.watch.rank if self.watch is not None else self.root.rank
        return f"rank {rank}'s backward of step {step} raised (it never reached its end)"

    def backward_dropped(self) -> None:
        """Autograd dropped this backward's end-of-backward callback without calling it: the
        backward raised. Tell the peers at once ([Note: a backward that raised]); the cleanup,
        and settling with them, wait for this rank's next call (``settle``)."""
        if self.backward_owns_call and self.watch is not None and self.backward_state is BackwardState.CALLBACK_QUEUED:
            self.watch.announce(self._failed_backward())

    def take_user_writes(self) -> None:
        """Before an optimizer step: what was written through the views of units left gathered
        (a forward whose backward never ran) goes into the shards the step updates, so that a
        later refresh of those units does not bring back values from before the step."""
        for unit in self.units:
            for handle in unit.handles:
                if handle.state is not HandleState.SHARDED:
                    handle.take_user_writes()

    def reduce_held(self) -> None:
        """A unit used under ``no_sync`` but not in the synchronised backward still holds its
        accumulated gradient: reduce it now (every rank holds the same units' gradients: they
        ran the same micro-batches)."""
        for unit in self.units:
            if not unit.sync_gradients:
                continue
            for handle in unit.handles:
                handle.drop_grad_if_zeroed()
                if handle.holds_no_sync_grad():
                    if unit.world_size > 1:
                        self._check_order(token(REDUCE, self.index[unit]))
                    if handle.reduce_grad():
                        self._trace("reduce", self._handle_label(unit, handle))
                        self._trace("reduced", self._handle_label(unit, handle))


class _BackwardEnd:
    """The end-of-backward callback of one backward.

    [Note: a backward that raised] Autograd runs a backward's queued callbacks only when the
    backward completes; one that raised drops them. A rank whose backward raised on it alone
    leaves its peers in the backward's collectives, and, were its record written only at its
    next flatshard call, a rank that makes none (it logs, saves, tears down) would leave them
    there until the timeout. So each backward queues its own callback object: called, it runs
    the end of the backward; dropped without being called, its finalizer writes this rank's
    record at once (``StepWatch.announce``: no waiting in a finalizer), and the rank settles
    with its peers at its next call."""

    __slots__ = ("runtime", "ran")

    def __init__(self, runtime: "RootRuntime") -> None:
        self.runtime = weakref.ref(runtime)
        self.ran = False

    def __call__(self) -> None:
        self.ran = True
        runtime = self.runtime()
        if runtime is not None:
            runtime.on_backward_end()

    def __del__(self) -> None:
        runtime = self.runtime() if not self.ran else None
        if runtime is not None:
            try:
                runtime.backward_dropped()
            except Exception:  # noqa: BLE001 - a finalizer must not raise; the next call settles it
                pass


def _gather_saved(runtime_ref: "weakref.ref[RootRuntime]", key: int) -> None:
    runtime = runtime_ref()
    if runtime is None:
        raise AssertionError("a saved parameter of a ShardedDataParallel model that no longer exists was unpacked")
    runtime.gather_saved(key)


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

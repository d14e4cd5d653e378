"""What happens when an optimizer steps a wrapped model's parameters: an optimizer built
before wrapping fails at its first ``step()`` instead of training nothing, gradients
accumulated under ``no_sync()`` that no synchronised backward averaged are averaged first, and
a step that raised partway is not taken for one that completed ([Note: a failed optimizer
step] in ``_runtime``: the step post-hook marks a step complete).

[Note: no_sync gradients at the step] A unit used in ``no_sync()`` micro-batches but in no
later backward outside ``no_sync()`` (the last micro-batch skipped it, or its loss needed no
gradient at all) still holds its accumulated, unaveraged gradient when the optimizer steps
(DDP and FSDP1 step with it unaveraged, or not at all). The step pre-hook averages such
gradients first, so the step sees what single-process training on the whole batch would. The
ranks hold the same units' gradients (they ran the same micro-batches) and step together, so the
collectives pair up; outside ``no_sync`` the check is a loop over the model's handles.

[Note: stale optimizers] Wrapping moves the original parameters' values into ``FlatParameter``s
and empties the original ``nn.Parameter`` objects (see [Note: emptied originals] in
``flat_param``). An optimizer built before wrapping still holds those objects; stepping them
would change nothing and raise nothing. So each root wrapper registers a torch global optimizer
step pre-hook that raises when an optimizer about to step holds one of its model's originals,
naming the parameter as the user names it at that moment (its path from the outermost wrapper,
so a unit nested into an outer one later is named from the outer one).

Cost per ``optimizer.step()`` (of every optimizer in the process, flatshard's or not): the
parameters of an optimizer are looked at only when its param groups have not been seen by this
hook: at its first step, after ``add_param_group``, or when ``param_groups`` or a group's
parameter list was replaced or changed length. Otherwise the hook compares those lists by
identity and length: O(number of param groups).

Lifetime: each wrapper registers when it is constructed, then is a root. A wrapper built by hand
and later nested into an outer one is covered by the outer wrapper's registration (every unit
under it), so its own registration is removed when the outer wrapper is built; the inner units of
an auto-wrap policy are built inside the root's constructor and never register. The hook holds
the unit weakly (it does not keep a model alive) and is removed when the wrapper is garbage
collected -- see [Note: removing a global hook safely].

[Note: weight decay chosen by p.dim()] Training scripts often choose which parameters to decay
by shape: matrices (``p.dim() >= 2``) in a group with weight decay, the rest without. After
wrapping every sharded parameter is 1-D (an original parameter's piece of the shard, or a
``FlatParameter``), so such a script builds an empty decaying group and decays nothing -- as it
would with FSDP1. When the hook first looks at an optimizer's groups it recognises that shape
of mistake cheaply -- a group with weight decay that holds no parameters, and a group without
weight decay that holds a parameter that was a matrix before wrapping -- and warns once per
model, naming the parameter and the fix.

[Note: removing a global hook safely] torch calls the global pre-hooks while iterating over its
hook dict, so removing an entry during that loop makes the optimizer step being run fail
("OrderedDict mutated during iteration"). A garbage collection can start inside that loop (any
hook that allocates) and collect a dead model. So a registration is removed only when no thread is
running code of ``torch.optim.optimizer``; otherwise the removal is retried after the next
garbage collection (until then the hook finds its unit gone and does nothing).
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from .._base._common import join_name, runs_code_of
from ._runtime import RootRuntime, in_backward
from ._unit import RootContext, Unit

__all__ = ["StaleOptimizerCheck", "watch_stale_optimizers"]

# Where torch iterates the global optimizer hooks (see [Note: removing a global hook safely]).
_OPTIMIZER_SOURCE = torch.optim.Optimizer.profile_hook_step.__code__.co_filename

# What an optimizer's param groups were when checked: the ``param_groups`` list and each group's
# parameter list with its length (kept, so that they are compared by identity).
# The last element: whether the optimizer holds any of the model's FlatParameters.
_Seen = Tuple[List[Dict[str, Any]], Tuple[Tuple[List[Any], int], ...], bool]


def watch_stale_optimizers(wrapper: nn.Module, unit: Unit) -> "StaleOptimizerCheck":
    """Register the check for ``unit`` (a new wrapper's, a root for now) and remove the checks of
    the wrappers nested in it, whose units it adopted. See [Note: stale optimizers]."""
    adopted = {id(u) for _, u in unit.descendants}
    for module in wrapper.modules():
        for value in vars(module).values():
            if isinstance(value, StaleOptimizerCheck) and value.unit_id in adopted:
                value.retire()
    return StaleOptimizerCheck(wrapper, unit)


def before_step(ctx: Optional[RootContext]) -> None:
    """Before an optimizer steps the model: refuse a step inside ``no_sync()`` after a backward
    there (the gradients the parameters show are each rank's own, see [Note: no_sync and
    zero_grad] in ``_handle_grads``); else take what was written through the views of units a
    forward left gathered (``RootRuntime.take_user_writes``) and ``reduce_held`` (a guarded
    call where there is anything to average). The step counts from here, and is under way until
    ``after_step`` ([Note: a failed optimizer step])."""
    if isinstance(ctx, RootRuntime) and not in_backward():
        ctx.settle()
        for unit in ctx.units:
            if not unit.sync_gradients and any(h.holds_no_sync_grad() for h in unit.handles):
                raise RuntimeError(
                    f"{unit.where()}: optimizer.step() inside no_sync() after a backward under it: the gradients "
                    f"are each rank's own, not averaged over the ranks yet; step outside no_sync(), after the "
                    f"synchronised backward that averages them"
                )
        ctx.take_user_writes()
        if any(h.holds_no_sync_grad() for unit in ctx.units for h in unit.handles):
            with ctx.guard.call("optimizer.step() (averaging the gradients no_sync() left)"):
                ctx.reduce_held()
        ctx.optimizer_steps += 1
        ctx.stepping += 1


def after_step(ctx: Optional[RootContext]) -> None:
    """After an optimizer stepped the model: the step ``before_step`` counted completed."""
    if isinstance(ctx, RootRuntime) and ctx.stepping:
        ctx.stepping -= 1


class StaleOptimizerCheck:
    """The global optimizer step pre-hook of one wrapper (see [Note: stale optimizers]).

    Args:
        wrapper: the wrapper; the hook is removed when it is garbage collected.
        unit: its unit; the hook checks the originals of this unit and every unit under it.
    """

    def __init__(self, wrapper: nn.Module, unit: Unit) -> None:
        self._unit = weakref.ref(unit)
        self.unit_id = id(unit)
        self._model_class = type(getattr(wrapper, "module", wrapper)).__name__
        self._seen: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _Seen]" = weakref.WeakKeyDictionary()
        self._handle = register_optimizer_step_pre_hook(self._before_step)
        # (the step completed: see [Note: a failed optimizer step] in ``_runtime``)
        self._post_handle = register_optimizer_step_post_hook(self._after_step)
        self._finalizer = weakref.finalize(wrapper, _remove_all_when_safe, (self._handle, self._post_handle))
        self._finalizer.atexit = False
        # Whether the warning of [Note: weight decay chosen by p.dim()] was given.
        self._warned_decay = False

    def __deepcopy__(self, memo: Dict[int, Any]) -> None:
        """A copied model registers a check of its own (see [Note: deep copies] in ``_deepcopy``)."""
        return None

    def retire(self) -> None:
        """Stop checking (an outer wrapper's check covers this unit now)."""
        self._finalizer.detach()
        _remove_all_when_safe((self._handle, self._post_handle))

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        unit = self._unit()
        if unit is None:
            return None
        groups = optimizer.param_groups
        seen = self._seen.get(optimizer)
        if seen is None or not _unchanged(seen, groups):
            stale = _stale_params(unit, groups)
            if stale:
                raise ValueError(_message(optimizer, stale, self._model_class))
            seen = (groups, tuple((g["params"], len(g["params"])) for g in groups), _holds_flat_params(unit, groups))
            self._seen[optimizer] = seen
            if not self._warned_decay:
                problem = _decay_by_dim(unit, optimizer)
                if problem is not None:
                    self._warned_decay = True
                    warnings.warn(problem, UserWarning, stacklevel=3)
        if seen[2] and unit.ctx is not None:
            before_step(unit.ctx)  # see [Note: no_sync gradients at the step]
        return None

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        unit = self._unit()
        seen = self._seen.get(optimizer)
        if unit is not None and seen is not None and seen[2] and unit.ctx is not None:
            after_step(unit.ctx)
        return None


def _holds_flat_params(unit: Unit, groups: List[Dict[str, Any]]) -> bool:
    """Whether the optimizer steps parameters of the model's handles (their ``FlatParameter``s,
    or with ``use_orig_params`` their original parameters)."""
    stepped = set()
    for member in [unit] + [u for _, u in unit.descendants]:
        for handle in member.handles:
            stepped.add(id(handle.flat_param))
            stepped.update(id(p) for p, _ in handle.originals())
    return any(id(p) in stepped for group in groups for p in group["params"])


def _unchanged(seen: _Seen, groups: List[Dict[str, Any]]) -> bool:
    groups_then, params_then, _ = seen
    if groups is not groups_then or len(groups) != len(params_then):
        return False
    for group, (params, length) in zip(groups, params_then):
        current = group["params"]
        if current is not params or len(current) != length:
            return False
    return True


def _stale_params(unit: Unit, groups: List[Dict[str, Any]]) -> List[str]:
    """The user-facing names of the original parameters of ``unit`` and the units under it
    that the optimizer's param groups hold, in the optimizer's order."""
    names: Dict[int, Tuple[nn.Parameter, str]] = {}
    for member in [unit] + [u for _, u in unit.descendants]:
        prefix = member.name  # its path from the outermost wrapper ("" for that one)
        for handle in member.handles:
            for param, name in handle.emptied_originals():
                names[id(param)] = (param, f"{prefix}.{name}" if prefix else name)
    found = []
    for group in groups:
        for param in group["params"]:
            hit = names.get(id(param))
            if hit is not None and hit[0] is param:
                found.append(hit[1])
    return found


def _flattened_matrices(unit: Unit) -> Dict[int, str]:
    """id of each parameter an optimizer may hold that stands for a matrix of the unwrapped
    model but is 1-D now, to the (first) matrix's user-facing name."""
    found: Dict[int, str] = {}
    for member in [unit] + [u for _, u in unit.descendants]:
        for handle in member.handles:
            names = [(info.name, len(info.shape)) for info in handle.param_infos]
            if handle.orig is not None:
                for param, (name, dims) in zip(handle.orig.params, names):
                    if dims >= 2 and param.dim() < 2:
                        found[id(param)] = join_name(member.name, name)
            else:
                matrix = next((name for name, dims in names if dims >= 2), None)
                if matrix is not None:
                    found[id(handle.flat_param)] = join_name(member.name, matrix)
    return found


def _decay_by_dim(unit: Unit, optimizer: torch.optim.Optimizer) -> Optional[str]:
    """The warning of [Note: weight decay chosen by p.dim()] if ``optimizer``'s groups look
    chosen that way, else ``None``."""
    groups = optimizer.param_groups
    empty = next((i for i, g in enumerate(groups) if g.get("weight_decay", 0) and not g["params"]), None)
    if empty is None:
        return None
    matrices = _flattened_matrices(unit)
    for index, group in enumerate(groups):
        if group.get("weight_decay", 0):
            continue
        name = next((matrices[id(p)] for p in group["params"] if id(p) in matrices), None)
        if name is not None:
            kind = type(optimizer).__name__
            fix = (
                "choose the groups by name (named_parameters() gives the unwrapped model's names), or build the "
                "optimizer before wrapping"
                if unit.config.use_orig_params
                else "wrap with use_orig_params=True and choose the groups by name, or build the optimizer before "
                "wrapping with use_orig_params=True"
            )
            return (
                f"{kind} param group {empty} (weight_decay={groups[empty]['weight_decay']}) holds no parameters, "
                f"while group {index} (weight_decay={group.get('weight_decay', 0)}) holds '{name}', a matrix "
                f"before wrapping: groups chosen by p.dim() after wrapping see every sharded parameter as 1-D and "
                f"decay nothing (as with FSDP1); {fix}"
            )
    return None


def _message(optimizer: torch.optim.Optimizer, stale: List[str], model_class: str) -> str:
    kind = type(optimizer).__name__
    more = f" (and {len(stale) - 1} more of its parameters)" if len(stale) > 1 else ""
    return (
        f"{kind}.step(): this optimizer holds parameter '{stale[0]}' of the wrapped {model_class}{more} as "
        f"it was before ShardedDataParallel wrapped the model; wrapping moved its values into a "
        f"FlatParameter and left it empty (0 elements), so this optimizer would train nothing. Create the "
        f"optimizer after wrapping, from the wrapped model's parameters: {kind}(model.parameters(), ...)"
    )


def _remove_all_when_safe(handles: Tuple[RemovableHandle, ...]) -> None:
    for handle in handles:
        _remove_when_safe(handle)


def _remove_when_safe(handle: RemovableHandle) -> None:
    """Remove a global optimizer hook now, or after the next garbage collection if an optimizer
    step may be iterating the hooks (see [Note: removing a global hook safely])."""
    if _in_optimizer_code():
        _Retry.arm(handle)
    else:
        handle.remove()


def _in_optimizer_code() -> bool:
    """Whether any thread is running code of ``torch.optim.optimizer`` (e.g. a step's hook loop).

    [Note: frames in locals] ``sys._current_frames()`` includes this function's own frame, so a
    local bound to it makes the frame refer to itself: a reference cycle. When the function
    returns, that frame, and every frame above it on the stack (each returning one takes over
    its locals), stays alive until the garbage collector runs. This runs inside garbage
    collections (a model's finalizer), and those can start anywhere, e.g. inside a forward:
    the cycle then held the forward's activations, whose autograd graph holds the runtime's
    hooks, and a model dropped later needed two collections to go (the flaky
    ``FreedModelsTest``). So every local that may hold a frame is cleared before returning."""
    frames: Optional[Dict[int, Any]] = sys._current_frames()
    try:
        return any(runs_code_of(frame, _OPTIMIZER_SOURCE) for frame in frames.values())
    finally:
        frames = None


class _Retry:
    """An object in a reference cycle: garbage at once, freed by the next garbage collection,
    which then calls ``_remove_when_safe`` again."""

    def __init__(self) -> None:
        self.cycle = self

    @staticmethod
    def arm(handle: RemovableHandle) -> None:
        weakref.finalize(_Retry(), _remove_when_safe, handle).atexit = False

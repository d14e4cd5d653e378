"""Entering a forward: the root's runtime made at its first forward (``lazy_init``), and a
unit's forward as the wrapper runs it (``run_forward``: start, the wrapped module, finish or
abandon), a guarded call of the root's guard ([Note: a forward is a guarded call]).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .._comm._collectives import timeout_of
from .._comm._guard import Guard
from .._comm._shared_memory import SharedMemoryChannel
from .._base._common import display_name
from ._runtime import RootRuntime, UnitForward, in_backward, settle, where_of
from ._unit import Unit, bind_units, check_same_units, root_guard, root_of
from .._flat._flat_param import FlatParamHandle

__all__ = ["Opaque", "lazy_init", "run_forward", "start_forward"]


def lazy_init(unit: Unit) -> "RootRuntime":
    """The runtime of ``unit``'s root, made (and bound to all its units) at the root's first
    forward. Collective then: the ranks check once that they built the same units."""
    if isinstance(unit.ctx, RootRuntime):
        return unit.ctx
    root = root_of(unit)
    if isinstance(root.ctx, RootRuntime):
        return root.ctx
    check_same_units(root)
    runtime = RootRuntime(root)
    for member in runtime.units:
        member.bind(runtime)
        runtime.hook_new_trainables(member)
    _share_memory(runtime.units, runtime.guard)
    bind_units(runtime.guard, runtime.units)  # (again: the channels just made)
    return runtime


def _share_memory(units: Sequence[Unit], guard: Guard) -> None:
    """Give the sharded handles of two ranks on gloo one shared-memory channel per process
    group (whether it is used is settled at its first exchange): [Note: shared-memory
    exchange] in ``_shared_memory``."""
    by_group: Dict[int, List[Tuple[FlatParamHandle, str]]] = {}
    for unit in units:
        for index, handle in enumerate(unit.handles):
            comm = handle.comm
            if handle.sharded and comm.gloo and comm.world_size == 2 and comm.channel is None and handle.flat_param.device.type == "cpu":
                label = ("unit " if unit.name else "") + display_name(unit.name)
                label += f" (parameter group {index})" if len(unit.handles) > 1 else ""
                by_group.setdefault(id(comm.group), []).append((handle, label))
    for labelled in by_group.values():
        group = labelled[0][0].comm.group
        largest = max(h.shard_numel * max(4, h.flat_param.element_size()) for h, _ in labelled)
        channel = SharedMemoryChannel(labelled[0][0].comm.sibling(group), largest, timeout_of(group))
        for handle, label in labelled:
            handle.comm.use_channel(channel, label)


# What ``run_forward`` is given, under torch.compile, to make a callable opaque to dynamo.
Opaque = Callable[[Callable[..., Any]], Callable[..., Any]]


def run_forward(unit: Unit, module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], opaque: Optional[Opaque] = None) -> Any:
    """The wrapper's forward: start (gather, views, guard), run the wrapped module, finish
    (free or hook for backward); abandon if anything raises.

    [Note: torch.compile] Dynamo must not trace the runtime: it resizes storages, issues
    collectives, changes unit and handle states and registers hooks, none of which belongs in
    a graph (inductor cannot lower a storage resize, and a traced state change that a failed
    compile never applies leaves the unit stuck). Torch's FSDP1 gets this for free (dynamo
    skips torch.distributed's files); flatshard asks for it: when dynamo traces a wrapper's
    forward, the wrapper calls this function through ``torch.compiler.disable(...,
    recursive=False)``, so this frame runs eagerly while the frames it calls are compiled,
    and passes ``opaque=torch.compiler.disable``, which keeps start, finish and abandon (and
    everything they call) out of dynamo. So only the wrapped module's own code is compiled,
    with a graph break at each unit's boundary, and an exception from it (a compile error
    included) reaches the ``except`` here. The autograd hooks and callbacks the runtime
    registers are opaque too once dynamo is loaded (``_compile``): a compiled function that
    calls ``backward()`` runs them with dynamo's frame hook installed. flatshard itself never
    imports dynamo (it costs a second, and warns without NumPy).
    """
    start = start_forward if opaque is None else opaque(start_forward)
    step = start(unit, args, kwargs)
    try:
        output = module(*step.args, **step.kwargs)
    except BaseException as error:
        abandon = step.runtime.abandon_forward if opaque is None else opaque(step.runtime.abandon_forward)
        abandon(step, error)
        raise
    finish = step.runtime.finish_forward if opaque is None else opaque(step.runtime.finish_forward)
    return finish(step, output)


def start_forward(unit: Unit, args: Tuple[Any, ...], kwargs: Dict[str, Any], check_every_collective: bool = False) -> UnitForward:
    """[Note: a forward is a guarded call] A root's forward (and a nested unit's forward run
    outside its root's, and ``generate``) is a call of the root's guard ([Note: one guarded
    path] in ``_comm/_guard``): a backward that raised is settled first (its record is written
    before the call counts), then the call's entry check runs at once -- before the runtime is
    made, before stale gathers are refreshed -- so a rank that skipped the backward the others
    are in, or a call they made, or whose optimizer step failed, meets them in a check rather
    than in a gather. The order check at the end of the root's forward is the call's exit check.
    ``check_every_collective``: precede every collective of this forward by an order check
    (an unsynced ``generate``)."""
    guard = root_guard(unit)
    if not in_backward():
        settle(root_of(unit).ctx)  # (closes the call of a backward that raised)
    owner = not in_backward() and guard.depth == 0
    if owner:
        if unit.is_root and guard.watch is not None:
            guard.watch.begin_step()
        guard.open(f"the forward of {where_of(unit)}", exit_check=not unit.is_root)
    try:
        runtime = lazy_init(unit)
        if check_every_collective:
            runtime.checking = True
        if owner:
            runtime.check_forward_entry()
        return runtime.start_forward(unit, args, kwargs, owner)
    except BaseException as error:
        if owner and guard.depth:
            guard.close(error, f"the forward of {where_of(unit)}")
        raise



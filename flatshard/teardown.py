"""Ending a distributed job so that its processes exit 0.

[Note: ending cleanly] A gloo process group runs its collectives on worker threads, and a
worker drops its reference to a finished collective's tensors only after the waiting thread
has been woken. When that last reference belongs to a tensor whose Python object is already
gone, the worker must take the GIL to free it. If the interpreter is shutting down by then,
Python ends the worker with ``pthread_exit``, and the unwinding through gloo's ``noexcept``
destructor calls ``std::terminate``: the process dies of ``SIGABRT`` ("terminate called
without an active exception") after all its work is done. This was seen under a gdb
backtrace in ``~AsyncAllgatherWork`` on a ``pt_gloo_runloop`` thread.

It can only happen while the group's C++ object, and so its worker threads, outlive
``torch.distributed.destroy_process_group()``. Its destructor joins the workers, and it runs
when the last Python reference goes. Three things keep that reference past
``destroy_process_group()``:

- torch's ``DTensor`` caches (sharding propagation, redistribution plans and planners, mesh
  topology) keep every ``DeviceMesh`` they have seen, and a mesh keeps its process groups.
  ``DTensor`` operations fill them, e.g. a ``SHARDED_STATE_DICT`` with
  ``torch.distributed.checkpoint``.
- ``torch.distributed.nn.functional`` (``torch.distributed.checkpoint`` imports it) binds
  the default group as a default argument when it is imported after
  ``init_process_group()``. ``import flatshard`` imports it, so import flatshard first.
- the user's own references: a group, mesh or state dict of ``DTensor`` values kept in a
  variable.

flatshard's models and ``RunCheckpoints`` hold their groups weakly ([Note: weak process group]
in ``_collectives``). ``destroy_process_group`` here destroys the groups, clears torch's
``DTensor`` caches (``_collectives.release_cached_meshes``), collects garbage, and checks
through weak references that every group it destroyed is really gone. A group that is not
gets a warning naming what still holds it ([Note: finding holders] in ``_holders``). A group
passed explicitly (not the default group) is not checked: the caller's own reference holds
it until the caller drops it.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import List, Optional

import torch.distributed as dist

from ._comm._collectives import ProcessGroup, registered_groups, release_cached_meshes
from ._base._holders import describe_holders

__all__ = ["destroy_process_group"]


def destroy_process_group(group: Optional[ProcessGroup] = None) -> None:
    """``torch.distributed.destroy_process_group`` that also makes sure the destroyed
    groups are freed while Python is still running, so a gloo job exits 0 (see
    [Note: ending cleanly]).

    Call it where you would call torch's, as a rank's last distributed step, e.g. in a
    ``finally`` after training. It does not communicate, so a rank may call it after a peer
    failed.

    Args:
        group: the group to destroy; ``None`` (the default) or the default group destroys
            every group, as torch's does. A group passed explicitly is destroyed but not
            checked: your own reference to it holds it until you drop it.

    Raises:
        ValueError: no process group is initialized (e.g. ``init_process_group`` itself
            failed).

    Warns:
        RuntimeWarning: a destroyed group is still referenced (the warning names the group
            and what holds it). Drop those references before the interpreter exits.
    """
    if not dist.is_initialized():
        raise ValueError("flatshard.destroy_process_group: there is no process group to destroy (torch.distributed is not initialized)")
    everything = group is None or group is dist.group.WORLD
    watched = [(weakref.ref(g), _name(g)) for g in registered_groups()] if everything else []
    dist.destroy_process_group(group)
    release_cached_meshes()
    gc.collect()
    for ref, name in watched:
        alive = ref()
        if alive is not None:
            warnings.warn(_still_held(name, describe_holders(alive, [__file__])), RuntimeWarning, stacklevel=2)
        del alive


def _name(group: ProcessGroup) -> str:
    if group is dist.group.WORLD:
        return "the default process group"
    return f"the process group of ranks {list(dist.get_process_group_ranks(group))}"


def _still_held(name: str, holders: List[str]) -> str:
    hint = " (here: import flatshard or torch.distributed.checkpoint before init_process_group)" if any("torch.distributed.nn" in h for h in holders) else ""
    return (
        f"flatshard.destroy_process_group: {name} is still referenced after it was destroyed "
        f"(by {', '.join(holders)}). With gloo, a group that lives until interpreter exit can abort "
        f"the process ('terminate called without an active exception'). Drop these references "
        f"before exit{hint}."
    )

"""Where the per-step agreement checks run: on the host, never waiting for the GPU.

[Note: agreement checks on the host] Every root forward and every backward compare a digest
over the ranks (did they run the same units; will the same units receive gradients? see [Note:
order check] in ``_exec_order`` and [Note: backward agreement] in ``_agreement``), in one or two
small integers. Gathered through NCCL, they live on the GPU, and reading them on the host waits
for everything queued on the
GPU before it: two host synchronisations per step, after which the GPU idles until the host
has queued work again (measured on an H100: the step ~25% slower than torch FSDP1's, which
checks nothing). So the checks gather CPU tensors: through the group itself where its backend
takes them (gloo, a ``cpu:gloo,cuda:nccl`` group, the fake backend), otherwise through a gloo
group of the same ranks made once per root (``dist.new_group`` over the group's ranks, which
only those ranks join, with the group's own timeout). The host then waits only for the other
ranks' hosts to reach the same point, which the collectives that follow would wait for anyway.

Where a gloo group cannot be made (gloo cannot reach the other hosts on this network), the
checks run on the device, as before, with a warning that says what it costs.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ._collectives import Communicator, ProcessGroup, backend_of, timeout_of

__all__ = ["check_device", "host_check_comm", "takes_cpu_tensors"]


def takes_cpu_tensors(group: ProcessGroup) -> bool:
    """Whether ``group``'s collectives accept CPU tensors."""
    backend = backend_of(group).lower()
    return "gloo" in backend or "fake" in backend or backend.startswith("cpu:")


def host_check_comm(comm: Communicator, make_group: Optional[Callable[..., ProcessGroup]] = None) -> Communicator:
    """A communicator over ``comm``'s ranks whose collectives take CPU tensors: ``comm`` itself
    where it can, else one over a new gloo group (see [Note: agreement checks on the host]).
    ``make_group`` stands in for ``dist.new_group`` (tests)."""
    group = comm.group
    if takes_cpu_tensors(group):
        return comm
    make = make_group or dist.new_group
    ranks = dist.get_process_group_ranks(group)
    try:
        # (the user's timeout, not torch's default: a check that waits is a step that waits)
        side = make(ranks=ranks, backend="gloo", use_local_synchronization=True, timeout=timeout_of(group))
    except (RuntimeError, ValueError) as exc:
        warnings.warn(
            f"flatshard could not make a gloo group of ranks {ranks} for its per-step agreement "
            f"checks ({type(exc).__name__}: {exc}); the checks run on the device instead, which "
            f"makes the host wait for the GPU twice per step",
            RuntimeWarning,
            stacklevel=2,
        )
        return comm
    return Communicator(side)


def check_device(comm: Communicator, fallback: torch.device) -> torch.device:
    """Where ``comm``'s check tensors live: the CPU where its backend takes them."""
    return torch.device("cpu") if takes_cpu_tensors(comm.group) else fallback

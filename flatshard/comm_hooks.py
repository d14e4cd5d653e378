"""Gradient communication hooks for ``ShardedDataParallel.register_comm_hook``.

A hook replaces how a unit's gradient is averaged over the ranks, with torch FSDP1's calling
convention: ``hook(state, grad)`` for units that are not sharded (``NO_SHARD``; all-reduce
``grad`` in place) and ``hook(state, grad, output)`` for sharded ones (write this rank's part
of the reduced gradient into ``output``). The hooks here are the usual ones: the default
averaging, and averaging in ``float16`` / ``bfloat16`` to halve the bytes sent.

[Note: pre- and post-division] Summing many low-precision gradients can overflow, and
dividing the sum by the world size only afterwards can underflow, so the division is split:
each rank divides by ``gradient_predivide_factor`` before the sum and by
``gradient_postdivide_factor`` after it, the two multiplying to the world size.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._comm._collectives import Communicator, ProcessGroup

__all__ = ["DefaultState", "LowPrecisionState", "allreduce_hook", "reduce_scatter_hook", "fp16_compress_hook", "bf16_compress_hook"]


def _predivide_factor(world_size: int) -> float:
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor)


class DefaultState:
    """What the default hooks need: the process group and the division factors (see
    [Note: pre- and post-division]).

    Args:
        process_group: the group the gradients are reduced over (the model's).
    """

    def __init__(self, process_group: ProcessGroup) -> None:
        if process_group is None:
            raise ValueError("DefaultState needs the process group the model is sharded over (model.process_group)")
        self.process_group = process_group
        self.comm = Communicator(process_group)
        self.world_size = self.comm.world_size
        self.gradient_predivide_factor = _predivide_factor(self.world_size)
        self.gradient_postdivide_factor = self.world_size / self.gradient_predivide_factor


class LowPrecisionState(DefaultState):
    """``DefaultState`` for the compressing hooks.

    Args:
        process_group: the group the gradients are reduced over.
        parameter_type: the dtype the reduced gradient is cast back to (the parameters').
    """

    def __init__(self, process_group: ProcessGroup, parameter_type: torch.dtype = torch.float32) -> None:
        super().__init__(process_group)
        self.parameter_type = parameter_type


def allreduce_hook(state: DefaultState, grad: torch.Tensor) -> None:
    """Average ``grad`` over the ranks in place (units that are not sharded)."""
    if state.gradient_predivide_factor > 1:
        grad.div_(state.gradient_predivide_factor)
    state.comm.all_reduce(grad, "sum")
    if state.gradient_postdivide_factor > 1:
        grad.div_(state.gradient_postdivide_factor)


def reduce_scatter_hook(state: DefaultState, grad: torch.Tensor, output: torch.Tensor) -> None:
    """Write this rank's part of the average of ``grad`` over the ranks into ``output``."""
    if state.gradient_predivide_factor > 1:
        grad = grad / state.gradient_predivide_factor
    state.comm.reduce_scatter_sum(output, grad)
    if state.gradient_postdivide_factor > 1:
        output.div_(state.gradient_postdivide_factor)


def _compressed(dtype: torch.dtype, state: LowPrecisionState, grad: torch.Tensor, output: Optional[torch.Tensor]) -> None:
    low = grad.to(dtype)
    if output is None:
        allreduce_hook(state, low)
        grad.copy_(low)
        return
    low_output = torch.empty(output.shape, dtype=dtype, device=output.device)
    reduce_scatter_hook(state, low, low_output)
    output.copy_(low_output)


def fp16_compress_hook(state: LowPrecisionState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Average in ``float16`` (half the bytes), then cast back into ``grad`` / ``output``."""
    _compressed(torch.float16, state, grad, output)


def bf16_compress_hook(state: LowPrecisionState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Average in ``bfloat16`` (half the bytes), then cast back into ``grad`` / ``output``."""
    _compressed(torch.bfloat16, state, grad, output)

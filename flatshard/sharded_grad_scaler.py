"""``ShardedGradScaler``: loss scaling for float16 training of a sharded model.

A drop-in for torch FSDP1's ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``
(same constructor), built on torch's public ``torch.amp.GradScaler``:

    scaler = ShardedGradScaler("cpu")            # or "cuda"
    scaler.scale(loss).backward()
    scaler.unscale_(optim)                       # optional: before clipping
    model.clip_grad_norm_(1.0)
    scaler.step(optim)                           # skipped on every rank if any rank found inf/nan
    scaler.update()

[Note: one verdict for all ranks] Every rank unscales and checks only the gradients its
optimizer holds: its own ``FlatParameter`` shards (plus unsharded and ignored parameters).
An overflow usually shows up in some ranks' shards only, so a rank's own finding is not
enough: if one rank skipped its step and another did not, the shards of one model would
belong to different iterations and the scales would drift apart. So each check (in
``unscale_``, or in ``step`` when ``unscale_`` was not called, or for optimizers that
unscale themselves) ends with one all-reduce (max) of the rank's finding over
``process_group``, and every rank records that common verdict. It is exactly one collective
per check, whatever devices the gradients are on (torch FSDP1 issues one per device holding
gradients, which can differ between ranks under CPU offload), and a rank that holds no
gradient at all still takes part. The verdict is kept on the scale's device as the only
entry of the per-device findings, so ``step`` and ``update`` see 0 or 1.

The default group is the default process group (all ranks). That covers hybrid sharding,
where the gradient shards are averaged within a shard group and across the replicas, and
parameters of ignored modules, whose gradients each rank keeps to itself. A smaller group is
only right if it contains every rank whose gradients can differ from those of the others.

Gradients may be in the parameters' dtype (float32 by default: the reduced float16
gradient is cast back) or in float16 (``MixedPrecision(keep_low_precision_grads=True)``):
torch's unscale-and-check kernel handles float16, bfloat16, float32 and float64 on the CPU
as on CUDA; torch's ``GradScaler`` refuses float16 gradients, which this scaler accepts.
"""

from __future__ import annotations

from collections import abc
from typing import Any, Dict, Iterable, Optional, Union

import torch
import torch.distributed as dist

from ._comm._collectives import Communicator, ProcessGroup, default_group, object_device
from ._comm._guard import Guard, make_guard

__all__ = ["ShardedGradScaler"]

_Outputs = Union[torch.Tensor, Iterable[Any]]


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for sharded gradients: an inf/nan found on any rank skips the
    optimizer step on every rank (see [Note: one verdict for all ranks]).

    Use it as torch's ``GradScaler``; ``unscale_`` unscales this rank's gradient shards, so
    ``model.clip_grad_norm_(max_norm)`` after it clips by the true global norm.

    Args:
        device: the device type of the loss (``"cuda"``, ``"cpu"``, ...). As with torch's
            scalers, ``"cuda"`` without CUDA disables scaling (with a warning).
        init_scale: the first scale factor.
        backoff_factor: what the scale is multiplied by after a step with inf/nan gradients.
        growth_factor: what the scale is multiplied by after ``growth_interval`` consecutive
            steps without.
        growth_interval: that number of steps.
        enabled: ``False`` makes ``step`` a plain ``optimizer.step()`` and the rest no-ops.
        process_group: the ranks that agree on skipping (default: the default process
            group, i.e. all ranks).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Optional[ProcessGroup] = None,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group
        # Made at the first unscale (``_guard``).
        self._comm: Optional[Communicator] = None
        self._guarded: Optional[Guard] = None

    def scale(self, outputs: _Outputs) -> _Outputs:  # type: ignore[override]
        """Multiply ``outputs`` (a tensor or an iterable of tensors) by the scale. Each result
        keeps its tensor's dtype (a float16 loss gives a float16 scaled loss), as with torch
        FSDP1's scaler; the gradients are the same either way."""
        if not self.is_enabled():
            return outputs
        if isinstance(outputs, torch.Tensor):
            return super().scale(outputs).to(outputs.dtype)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(value) for value in outputs)
        if isinstance(outputs, abc.Iterable):
            return map(self.scale, outputs)
        raise ValueError(f"outputs must be a Tensor or an iterable of Tensors; got {type(outputs).__name__}")

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> Dict[torch.device, torch.Tensor]:
        # (allow_fp16 is torch's guard against float16 gradients, which are expected here:
        # keep_low_precision_grads.)
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, True)
        verdict = torch.zeros_like(found_inf)
        for flag in per_device.values():
            verdict = torch.maximum(verdict, flag.to(verdict.device))
        with self._guard().call("ShardedGradScaler.unscale_()"):
            self._comm.all_reduce(verdict, "max")  # type: ignore[union-attr]
        return {verdict.device: verdict}

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state["_comm"] = state["_guarded"] = None  # (a copy makes its own at its first unscale)
        return state

    def _guard(self) -> Guard:
        """The guard of this scaler's calls ([Note: one guarded path] in ``_comm/_guard``), made
        at its first: the group may be the default one, made after the scaler."""
        if self._guarded is None:
            self._comm = Communicator(self._group())
            self._guarded = make_guard([self._comm], object_device(self._comm.group))
        return self._guarded

    def _group(self) -> ProcessGroup:
        if self.process_group is not None:
            return self.process_group
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ShardedGradScaler needs torch.distributed to be initialised (the ranks agree on "
                "skipping a step): call torch.distributed.init_process_group() first, or use "
                "torch.amp.GradScaler in a single process"
            )
        return default_group()

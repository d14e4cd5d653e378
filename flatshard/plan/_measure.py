"""``flatshard.plan(..., measure=True)``: one rank of a world of N, run for real on torch's fake
process group, its memory measured phase by phase beside the planner's numbers.

[Note: measuring a plan] The fake process group runs this process as rank r of N: collectives
return at once and exchange nothing, but every tensor a rank of N would allocate is allocated
([Note: the fake process group] in ``_collectives``). So wrapping the model as that rank and
training a step or two with the user's batch and optimizer shows what one rank of N needs,
without N machines. The model is built on the meta device and materialised one unit at a time
(as ``ShardedDataParallel`` does for any meta model), so a model far larger than this machine's
memory can be measured at a large N. What a rank holds at any moment splits into parts that
scale with its shards -- the shards, their optimizer state, the gradients that exist by then,
an optimizer step's temporaries -- and parts that do not: gathered units, unsharded gradients,
activations. How much of a phase's peak is which depends on when in the phase the peak comes
(a backward's may come before any gradient exists, or after most do), so the planner measures
twice, at N and at four times N, and fits each phase's peak as a fixed part plus a multiple of
the shard bytes; the layout gives the shard bytes at any other N exactly. The predictions are
held to within 10% of a measurement there (``tests/test_plan_measure.py``).
"""

from __future__ import annotations

import contextlib
import copy
import gc
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .._comm._collectives import init_fake_world
from .._base._memory_timeline import MemoryTimeline

__all__ = ["Fit", "Measurement", "fit_phases", "measure_rank", "NOT_MEASURABLE", "PHASES"]

# What cannot be measured on the fake process group (it raises there; see [Note: the fake
# process group]): said with every measurement.
NOT_MEASURABLE = (
    "not measured: steps that need data only another rank has -- loading a rank0_only optimizer state "
    "dict or set_state_dict(broadcast_from_rank0=True) on ranks other than 0 -- because torch's fake "
    "process group exchanges no data; and reductions take the path of a group that reduce-scatters "
    "natively (NCCL's): on gloo each adds a receive buffer of up to one unit while it runs"
)

# The phases of the last measured step, in order; "between steps" ends after zero_grad.
PHASES = ("forward", "backward", "optimizer step", "between steps")


@dataclass(frozen=True)
class Measurement:
    """What one rank allocated, in bytes: each phase's peak and end for the last step (and
    construction), and what the rank holds, counted from its tensors after the step."""

    world_size: int
    rank: int
    device: str
    steps: int
    peaks: Tuple[Tuple[str, int, int], ...]  # (phase, peak, end), construction first
    shards: int
    gradients: int
    optimizer_state: int

    def peak(self, phase: str) -> int:
        """The most bytes allocated during ``phase``."""
        return self._phase(phase)[1]

    def end(self, phase: str) -> int:
        """The bytes allocated when ``phase`` ended."""
        return self._phase(phase)[2]

    def _phase(self, phase: str) -> Tuple[str, int, int]:
        for entry in self.peaks:
            if entry[0] == phase:
                return entry
        raise ValueError(f"no phase {phase!r} was measured; the phases are {[name for name, _, _ in self.peaks]}")

    def value(self, phase: str) -> int:
        """``phase``'s peak (for "between steps": what stays allocated after it)."""
        return self.end(phase) if phase == "between steps" else self.peak(phase)


@dataclass(frozen=True)
class Fit:
    """Each phase's bytes as ``fixed + per_shard_byte * shards``, from two measurements at two
    world sizes (see [Note: measuring a plan])."""

    world_sizes: Tuple[int, int]
    lines: Tuple[Tuple[str, float, float], ...]  # (phase, fixed bytes, bytes per shard byte)

    def at(self, phase: str, shards: int) -> int:
        """``phase``'s bytes for a rank whose parameter shards are ``shards`` bytes (as the
        planner counts them)."""
        for name, fixed, per_shard in self.lines:
            if name == phase:
                return int(round(fixed + per_shard * shards))
        raise ValueError(f"no phase {phase!r} was fitted; the phases are {list(PHASES)}")


def fit_phases(first: Measurement, second: Measurement, first_shards: int, second_shards: int) -> Fit:
    """The line through two measurements of the same model at different world sizes, phase by
    phase, against the shard bytes the planner counts at each (``first_shards``,
    ``second_shards``: the same measure the predictions use, which leaves out ignored
    modules' parameters). Shards that do not differ give no slope (a flat line)."""
    span = first_shards - second_shards
    lines = []
    for phase in PHASES:
        y1, y2 = first.value(phase), second.value(phase)
        per_shard = (y1 - y2) / span if span else 0.0
        lines.append((phase, y1 - per_shard * first_shards, per_shard))
    return Fit((first.world_size, second.world_size), tuple(lines))


def measure_rank(
    module: nn.Module,
    wrap_kwargs: Dict[str, Any],
    world_size: int,
    rank: int,
    example_input: Any,
    loss_fn: Optional[Callable[[Any], torch.Tensor]],
    optimizer: Optional[Callable[[Any], torch.optim.Optimizer]],
    steps: int,
    device: torch.device,
    overlap: bool = True,
) -> Measurement:
    """Wrap a copy of ``module`` as rank ``rank`` of ``world_size`` on the fake process group,
    with the constructor arguments ``wrap_kwargs`` (a meta model without a ``param_init_fn``
    gets ``_init_for_measuring``'s) and communication overlapping compute or not (``overlap``),
    and train ``steps`` steps; see [Note: measuring a plan]. Needs no process group to exist."""
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "plan(measure=True) runs this process as one rank of world_size on torch's fake process group, "
            "which must be the only one: call it before init_process_group (or run python -m flatshard.plan "
            "... --measure in a process of its own)"
        )
    if steps < 1:
        raise ValueError(f"steps must be at least 1 (the first creates the optimizer state); got {steps}")
    from ..sharded_data_parallel import ShardedDataParallel

    model = copy.deepcopy(module)  # (the caller's model stays unwrapped; on meta this costs nothing)
    inputs = example_input if isinstance(example_input, tuple) else (example_input,)
    inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
    kwargs = dict(wrap_kwargs)
    if kwargs.get("param_init_fn") is None and any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        kwargs["param_init_fn"] = _init_for_measuring(device)
    if device.type == "cuda":
        kwargs["device_id"] = device
    init_fake_world(rank, world_size)
    try:
        gc.collect()  # (nothing freed during the measurement may be an earlier allocation)
        with MemoryTimeline(device) as timeline:
            with timeline.phase("construction"):
                wrapped = ShardedDataParallel(model, **kwargs)
                wrapped.set_communication_overlap(overlap)
                optim = (optimizer or _adamw)(wrapped.parameters())
            for step in range(steps):
                with _phases(timeline, step == steps - 1) as phase:
                    with phase("forward"):
                        loss = (loss_fn or _sum_of)(wrapped(*inputs))
                    with phase("backward"):
                        loss.backward()
                        del loss
                    gradients = sum(p.grad.numel() * p.grad.element_size() for p in wrapped.parameters() if p.grad is not None)
                    with phase("optimizer step"):
                        optim.step()
                    with phase("between steps"):
                        optim.zero_grad(set_to_none=True)
        params = list(wrapped.parameters())
        state = sum(t.numel() * t.element_size() for s in optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        measured = Measurement(
            world_size, rank, str(device), steps,
            tuple((name, timeline.phases[name].peak, timeline.phases[name].end) for name in ("construction",) + PHASES),
            sum(p.numel() * p.element_size() for p in params),
            gradients, state,
        )
        del wrapped, optim, params, model
        gc.collect()  # (a model is a reference cycle: gone before the next measurement starts)
        return measured
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _phases(timeline: MemoryTimeline, measured: bool) -> Iterator[Callable[[str], Any]]:
    """``phase(name)`` measures on the last step, and does nothing on the steps before it."""
    yield timeline.phase if measured else (lambda name: contextlib.nullcontext())


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def _sum_of(output: Any) -> torch.Tensor:
    """A loss from any output: the sum of its floating-point tensors."""
    found: List[torch.Tensor] = []
    _floats(output, found)
    if not found:
        raise ValueError("plan(measure=True) needs a loss_fn: the model's output holds no floating-point tensor")
    return sum(t.float().sum() for t in found)  # type: ignore[return-value]


def _floats(value: Any, found: List[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            found.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _floats(item, found)
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        for item in value:
            _floats(item, found)


def _init_for_measuring(device: torch.device) -> Callable[[nn.Module], None]:
    """The ``param_init_fn`` a measurement materialises meta modules with: the module's own
    ``reset_parameters()`` where it has one, else small random floats (and zero integers,
    which index safely); the values do not matter, the allocations do."""

    def init(module: nn.Module) -> None:
        module.to_empty(device=device, recurse=False)
        with torch.no_grad():
            for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                if tensor.is_floating_point():
                    tensor.normal_(0.0, 0.02)
                else:
                    tensor.zero_()
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()

    return init

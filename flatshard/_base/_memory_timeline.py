"""Bytes allocated over a run, phase by phase: what ``flatshard.plan(measure=True)`` and the
scale benchmark report.

[Note: measuring memory] On the CPU the allocator keeps no running count, so the timeline
records the allocator's own events (``torch.profiler`` with ``profile_memory``: one event per
allocation and free, storage resizes included) and adds them up in time order; phases are
``record_function`` ranges, located by their timestamps. What was allocated before the
timeline started is not counted, but its freeing is (as a negative change): start the timeline
before the model is built, after a garbage collection. On CUDA the caching
allocator counts allocated bytes and their peak itself (``memory_allocated``,
``max_memory_allocated``), read at each phase's ends. Either way the numbers are the bytes of
live tensors, not what the allocator reserves from the system.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

__all__ = ["MemoryTimeline", "PhaseMemory"]

_MARK = "flatshard.measure:"


@dataclass(frozen=True)
class PhaseMemory:
    """Bytes allocated when a phase started, at most during it, and when it ended."""

    start: int
    peak: int
    end: int


class MemoryTimeline:
    """Records allocated bytes by phase on ``device`` (``"cpu"`` or a CUDA device); use as a
    context manager around the whole run and ``phase(name)`` around each part of it.

    Args:
        device: where the measured tensors live.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.phases: Dict[str, PhaseMemory] = {}
        self._profiler: Optional[Any] = None
        self._cuda_base = 0
        self._order: List[str] = []

    def __enter__(self) -> "MemoryTimeline":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._profiler is None:
            return
        self._profiler.__exit__(*exc)
        if exc[0] is None:
            self._read_cpu_events(self._profiler.profiler.kineto_results.events())
        self._profiler = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure what runs inside as phase ``name`` (names must be unique)."""
        if name in self._order:
            raise ValueError(f"phase {name!r} was already measured")
        self._order.append(name)
        if self.device.type != "cuda":
            with torch.profiler.record_function(_MARK + name):
                yield
            return
        torch.cuda.synchronize(self.device)
        start = torch.cuda.memory_allocated(self.device) - self._cuda_base
        torch.cuda.reset_peak_memory_stats(self.device)
        yield
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - self._cuda_base
        self.phases[name] = PhaseMemory(start, peak, torch.cuda.memory_allocated(self.device) - self._cuda_base)

    def _read_cpu_events(self, events: List[Any]) -> None:
        ranges: Dict[str, Tuple[int, int]] = {}
        changes: List[Tuple[int, int]] = []
        for event in events:
            name = event.name()
            if name == "[memory]":
                if event.device_type() == torch.autograd.DeviceType.CPU:
                    changes.append((event.start_ns(), event.nbytes()))
            elif name.startswith(_MARK):
                ranges[name[len(_MARK):]] = (event.start_ns(), event.end_ns())
        changes.sort()
        for name in self._order:
            if name not in ranges:
                raise AssertionError(f"phase {name!r} was measured but the profiler recorded no range for it (ranges: {sorted(ranges)})")
            start_ns, end_ns = ranges[name]
            before = sum(n for t, n in changes if t < start_ns)
            running, peak = before, before
            for t, n in changes:
                if start_ns <= t <= end_ns:
                    running += n
                    peak = max(peak, running)
            self.phases[name] = PhaseMemory(before, peak, running)

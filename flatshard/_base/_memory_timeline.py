"""Bytes allocated over a run, phase by phase: what ``flatshard.plan(measure=True)`` and the
scale benchmark report.

[Note: measuring memory] On CUDA the caching allocator counts allocated bytes and their peak
itself (``memory_allocated``, ``max_memory_allocated``), read at each phase's ends. On the CPU
the timeline records the allocator's own events (``torch.profiler`` with ``profile_memory``:
one per allocation and free, storage resizes included); phases are ``record_function``
ranges, located by their timestamps. Either way the numbers are the bytes of live tensors,
not what the allocator reserves from the system.

The profiler hears of an allocation or a free only on a thread that runs under its
thread-local state: the thread that started it and those that inherit that state (autograd's,
and gloo's worker threads while they run a collective). A tensor whose last reference goes
on any other thread -- gloo's worker dropping a finished collective that held the only
reference left to its tensors (on plain gloo, now and then, the last reduction of a backward:
the unsharded gradient and its receive buffer), or a Python thread -- was never seen freed,
and everything after it read that much too high. So the timeline does not add up the events'
sizes: it reads the allocator's own running total, which each CPU event carries
(``total_allocated``). The CPU allocator keeps that total, under its own lock, for every
allocation and free on every thread while c10's flag ``caffe2_report_cpu_memory_usage`` is on
(otherwise only on profiled threads); the timeline turns the flag on while it runs (set
through ``ctypes``: torch has no Python call for it) and back off after, unless it found it on
(a torch that does not export it gets a warning, and counts the profiled threads only).
Each event gives the total just before it (the total less its own size) and just after it, so
a change made on another thread shows at the next event; a tiny allocation and free right
before and right after each phase (outside it) pins its start and end.

What was allocated before the timeline started is not counted, nor is its freeing -- except
for blocks allocated while an earlier profiler or timeline ran, which the allocator still
knows: their freeing counts as a negative change. So start the timeline before the model is
built, after a garbage collection.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import glob
import os
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

__all__ = ["MemoryTimeline", "PhaseMemory"]

_MARK = "flatshard.measure:"
_PROBE = "flatshard.measure.probe"
_REPORT_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


@dataclass(frozen=True)
class PhaseMemory:
    """Bytes allocated when a phase started, at most during it, and when it ended."""

    start: int
    peak: int
    end: int


def _cpu_report_flag() -> Optional[Any]:
    """c10's ``caffe2_report_cpu_memory_usage`` flag (a ``ctypes.c_bool`` over torch's own), or
    ``None`` with a warning where this torch does not export it: the timeline then counts what
    the profiled threads allocate and free only, as before it set the flag."""
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    candidates = sorted(glob.glob(os.path.join(libdir, "libc10.*")) + glob.glob(os.path.join(libdir, "c10.dll")))
    for path in candidates:
        try:
            return ctypes.c_bool.in_dll(ctypes.CDLL(path), _REPORT_FLAG)
        except (OSError, ValueError):
            continue
    warnings.warn(
        f"MemoryTimeline on the CPU counts allocations and frees on every thread through c10's flag "
        f"{_REPORT_FLAG}, which this torch ({torch.__version__}) does not export from {candidates or libdir}: "
        f"frees on threads other than the profiled ones (gloo's worker threads, for one) go uncounted, so "
        f"later numbers may read too high",
        RuntimeWarning,
        stacklevel=3,
    )
    return None


class MemoryTimeline:
    """Records allocated bytes by phase on ``device`` (``"cpu"`` or a CUDA device); use as a
    context manager around the whole run and ``phase(name)`` around each part of it. On the
    CPU it counts allocations and frees made on any thread (see [Note: measuring memory]).

    Args:
        device: where the measured tensors live.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.phases: Dict[str, PhaseMemory] = {}
        self._profiler: Optional[Any] = None
        self._cuda_base = 0
        self._order: List[str] = []
        self._flag: Optional[Any] = None  # c10's flag (CPU), from entering to leaving
        self._turned_flag_on = False  # whether entering turned it on (leaving turns it off)

    def __enter__(self) -> "MemoryTimeline":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)
            return self
        from torch.profiler import ProfilerActivity, profile

        self._flag = _cpu_report_flag()
        self._turned_flag_on = self._flag is not None and not self._flag.value
        if self._flag is not None:
            self._flag.value = True
        try:
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
        except BaseException:
            self._restore_flag()
            raise
        _probe()  # (the first event: the total when the timeline started)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._profiler is None:
            return
        _probe()
        profiler, self._profiler = self._profiler, None
        try:
            profiler.__exit__(*exc)
        finally:
            cleared = self._flag is not None and not self._flag.value
            self._restore_flag()
        if exc[0] is not None:
            return
        if cleared:
            raise RuntimeError(
                f"c10's flag {_REPORT_FLAG} was turned off by other code while this MemoryTimeline ran: "
                f"frees on other threads may have gone uncounted"
            )
        self._read_cpu_events(profiler.profiler.kineto_results.experimental_event_tree())

    def _restore_flag(self) -> None:
        if self._flag is not None and self._turned_flag_on:
            self._flag.value = False
        self._flag, self._turned_flag_on = None, False

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure what runs inside as phase ``name`` (names must be unique)."""
        if name in self._order:
            raise ValueError(f"phase {name!r} was already measured")
        self._order.append(name)
        if self.device.type != "cuda":
            _probe()
            try:
                with torch.profiler.record_function(_MARK + name):
                    yield
            finally:
                _probe()
            return
        torch.cuda.synchronize(self.device)
        start = torch.cuda.memory_allocated(self.device) - self._cuda_base
        torch.cuda.reset_peak_memory_stats(self.device)
        yield
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - self._cuda_base
        self.phases[name] = PhaseMemory(start, peak, torch.cuda.memory_allocated(self.device) - self._cuda_base)

    def _read_cpu_events(self, roots: List[Any]) -> None:
        ranges, totals = _ranges_and_totals(roots)
        if not totals:
            raise AssertionError(f"the profiler recorded no CPU allocation, not even the timeline's own probes (phases: {self._order})")
        times = [t for t, _, _, _ in totals]
        base = totals[0][1]  # (the total before the first probe)
        for name in self._order:
            if name not in ranges:
                raise AssertionError(f"phase {name!r} was measured but the profiler recorded no range for it (ranges: {sorted(ranges)})")
            first, after_last = bisect.bisect_left(times, ranges[name][0]), bisect.bisect_right(times, ranges[name][1])
            # just after the last event before the phase, and just before the first one after it
            start = (totals[first - 1][2] if first > 0 else base) - base
            end = (totals[after_last][1] if after_last < len(totals) else totals[-1][2]) - base
            inside = [most - base for _, _, _, most in totals[first:after_last]]
            self.phases[name] = PhaseMemory(start, max([start, end] + inside), end)


def _probe() -> None:
    """An allocation and free too small to matter, whose events carry the allocator's total
    at this moment (see [Note: measuring memory])."""
    with torch.profiler.record_function(_PROBE):
        torch.empty(1, dtype=torch.uint8)


def _ranges_and_totals(roots: List[Any]) -> Tuple[Dict[str, Tuple[int, int]], List[Tuple[int, int, int, int]]]:
    """From the profiler's event tree: each phase's (start, end) time, and for each CPU
    allocation or free in time order (time, allocator total just before it, just after it,
    and the most it says was allocated: for a probe's own events the lesser of the two)."""
    allocation = torch._C._profiler._EventType.Allocation
    ranges: Dict[str, Tuple[int, int]] = {}
    totals: List[Tuple[int, int, int, int]] = []
    stack = [(event, False) for event in roots]
    while stack:
        event, in_probe = stack.pop()
        in_probe = in_probe or event.name == _PROBE
        stack.extend((child, in_probe) for child in event.children)
        if event.tag == allocation:
            fields = event.typed[1]
            if fields.device.type == "cpu":
                before, after = fields.total_allocated - fields.alloc_size, fields.total_allocated
                totals.append((event.start_time_ns, before, after, min(before, after) if in_probe else max(before, after)))
        elif event.name.startswith(_MARK):
            ranges[event.name[len(_MARK):]] = (event.start_time_ns, event.end_time_ns)
    totals.sort()
    return ranges, totals

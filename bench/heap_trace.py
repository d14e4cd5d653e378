"""Where a training step's page faults come from: per aten op, the minor page faults it took
and how the C allocator's main heap changed around it (glibc's ``mallinfo2``).

    python bench/heap_trace.py --impl flatshard            # the default shape, 2 ranks
    python bench/heap_trace.py --impl ddp --shape wide

Rank 0 runs some warm-up steps, then traces a few more inside a ``TorchDispatchMode``. It prints
every op that took at least ``--min-faults`` faults or after which the heap's size had changed,
with the phase of the step (forward, backward, optimizer); then, per step, the faults and how
often the heap grew and shrank. A heap that shrinks in one step (glibc giving its free top back
to the kernel) and grows again in the next is memory faulted in anew every step: RESULTS.md
traces flatshard's extra faults to this. Linux with glibc 2.33 or later only.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import sys
import tempfile
from typing import Any, Dict, List, Optional

import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (the benchmark's model, wrapping and training step)

_MIB = float(2**20)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]


def heap_reader() -> Optional[Any]:
    """glibc's ``mallinfo2`` (None where the C library has none)."""
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return None
    function.restype = _MallInfo2
    return function


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class HeapTrace(TorchDispatchMode):
    """Records, per aten op, the faults it took and the heap's size after it."""

    def __init__(self, mallinfo: Any, min_faults: int) -> None:
        super().__init__()
        self.mallinfo = mallinfo
        self.min_faults = min_faults
        self.phase = ""
        self.step = 0
        self.lines: List[str] = []
        self.per_step: Dict[int, List[int]] = {}  # step: [faults, heap grew, heap shrank]
        self._heap = mallinfo().arena

    def start(self, step: int) -> None:
        """Step ``step`` begins (the heap may have changed outside traced ops meanwhile)."""
        self.step = step
        self._heap = self.mallinfo().arena

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        before = _faults()
        out = func(*args, **(kwargs or {}))
        faults = _faults() - before
        heap = self.mallinfo().arena
        counts = self.per_step.setdefault(self.step, [0, 0, 0])
        counts[0] += faults
        if heap != self._heap:
            counts[1 if heap > self._heap else 2] += 1
        if faults >= self.min_faults or heap != self._heap:
            self.lines.append(
                f"step {self.step} {self.phase:9s} {str(func):48s} {faults:6d} faults, "
                f"heap {self._heap / _MIB:7.1f} -> {heap / _MIB:7.1f} MiB"
            )
        self._heap = heap
        return out


def _rank(rank: int, world: int, init_file: str, impl: str, cfg: Dict[str, Any], args: argparse.Namespace) -> None:
    bench.start_rank(rank, world, init_file)
    model, optim = bench.make_trainee(impl, {}, cfg, rank)
    trace = HeapTrace(heap_reader(), args.min_faults)

    def mark(phase: str) -> None:
        trace.phase = phase

    one_step = bench.training_step(model, optim, cfg, rank, mark)
    for _ in range(args.warmup):
        one_step()
    for step in range(args.steps):
        trace.start(step)
        if rank == 0:
            with trace:  # (the other ranks run untraced: the collectives still pair up)
                one_step()
        else:
            one_step()
    if rank == 0:
        print("\n".join(trace.lines))
        print("\n| step | page faults | heap grew (ops) | heap shrank (ops) |\n|---|---|---|---|")
        for step, (faults, grew, shrank) in sorted(trace.per_step.items()):
            print(f"| {step} | {faults:,} | {grew} | {shrank} |")
    del model, optim
    bench.end_rank()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=("flatshard", "fsdp1", "ddp"), default="flatshard")
    bench.add_trace_arguments(p, shape="default", warmup=4, steps=3)
    p.add_argument("--min-faults", type=int, default=200, help="print ops that took at least this many faults")
    args = p.parse_args()
    if heap_reader() is None:
        p.error("needs the C library's mallinfo2 (glibc 2.33 or later)")
    cfg = bench.trace_config(args)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(2, os.path.join(tmp, "rdv"), args.impl, cfg, args), nprocs=2)


if __name__ == "__main__":
    main()

"""How long flatshard's forward all-gathers take on both ranks, and how far apart the ranks issue them.

    python bench/gather_waits.py --shape deep            # 2 ranks, 10 steps
    python bench/gather_waits.py --shape deep --no-yield # without [Note: yield after a gloo wait]

Each rank records, on the machine's monotonic clock (one clock for all processes), when each
unit's all-gather is issued and when the wait for it returns, in the forward of the measured
steps (default configuration: no forward prefetch, so every gather is waited on at once).
Per gather the script then prints the time from the later rank's issue to completion (the
transfer, plus any time a thread it needed was kept off a core) and how far apart the two
ranks issued it (a rank that was slower before the gather). RESULTS.md uses it to show that
a share of the gathers take a scheduler time slice (4 ms at 250 Hz) longer than the rest.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (the benchmark's model, wrapping and training step)

Event = Tuple[str, int, float]  # ("issue" or "done", handle, monotonic seconds)


def record(log: List[Event], in_forward: Callable[[], bool]) -> None:
    """Log every forward gather's issue and completion (patches the handle class of this process)."""
    from flatshard.flat_param import FlatParamHandle

    unshard, wait = FlatParamHandle.unshard, FlatParamHandle.wait

    def logged_unshard(handle: FlatParamHandle, async_op: bool = False) -> None:
        if in_forward():
            log.append(("issue", id(handle), time.monotonic()))
        unshard(handle, async_op)

    def logged_wait(handle: FlatParamHandle) -> None:
        wait(handle)
        if in_forward():
            log.append(("done", id(handle), time.monotonic()))

    FlatParamHandle.unshard = logged_unshard  # type: ignore[method-assign]
    FlatParamHandle.wait = logged_wait  # type: ignore[method-assign]


def gathers(log: List[Event]) -> List[Tuple[float, float]]:
    """(issued, done) per gather, in the order they completed."""
    issued: Dict[int, float] = {}
    out = []
    for kind, handle, when in log:
        if kind == "issue":
            issued[handle] = when
        elif handle in issued:
            out.append((issued.pop(handle), when))
    return out


def summary(per_rank: List[List[Tuple[float, float]]], steps: int) -> str:
    count = min(len(g) for g in per_rank)
    pairs = list(zip(*(g[:count] for g in per_rank)))
    after_later = [(ranks[0][1] - max(r[0] for r in ranks)) * 1e3 for ranks in pairs]  # rank 0's completion
    skew = [(max(r[0] for r in ranks) - min(r[0] for r in ranks)) * 1e3 for ranks in pairs]
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    lines = [
        f"{count} forward gathers in {steps} steps ({count // max(steps, 1)} per step)",
        "| ms | median | 90th percentile | max | > 3 ms |",
        "|---|---|---|---|---|",
    ]
    for name, xs in (("from the later rank's issue to completion", after_later), ("between the two ranks' issues", skew)):
        lines.append(f"| {name} | {statistics.median(xs):.2f} | {q(xs, 0.9):.2f} | {max(xs):.2f} | {sum(x > 3 for x in xs)} |")
    return "\n".join(lines)


def _rank(rank: int, world: int, init_file: str, cfg: Dict[str, Any], args: argparse.Namespace, out: str) -> None:
    bench.start_rank(rank, world, init_file)
    if args.no_yield:
        import flatshard._comm._collectives as collectives

        collectives._sched_yield = None  # (before any collective: Pending reads it when made)
    log: List[Event] = []
    phase = {"now": ""}
    record(log, lambda: phase["now"] == "forward")
    model, optim = bench.make_trainee("flatshard", {}, cfg, rank)

    def mark(name: str) -> None:
        phase["now"] = name

    one_step = bench.training_step(model, optim, cfg, rank, mark)
    for _ in range(args.warmup):
        one_step()
    log.clear()
    for _ in range(args.steps):
        one_step()
    torch.save(gathers(log), f"{out}.{rank}")
    del model, optim
    bench.end_rank()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_trace_arguments(p, shape="deep", warmup=3, steps=10)
    p.add_argument("--no-yield", action="store_true", help="without the yield after gloo waits, for comparison")
    args = p.parse_args()
    cfg = bench.trace_config(args)
    print(f"python bench/gather_waits.py {' '.join(sys.argv[1:])}\n")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gathers")
        mp.spawn(_rank, args=(2, os.path.join(tmp, "rdv"), cfg, args, out), nprocs=2)
        print(summary([torch.load(f"{out}.{rank}") for rank in range(2)], args.steps))


if __name__ == "__main__":
    main()

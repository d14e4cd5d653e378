"""What the per-step host checks cost as the world grows (issue 44, item 4).

Two parts, each printed as a Markdown table:

1. ``--simulate N`` (default 4096), in this process: the agreement check's algorithm (gloo's
   ring all-reduce against the recursive doubling of [Note: agreement by recursive doubling]:
   messages one after another, messages sent per rank), and the store requests a rank waiting
   on a slow peer makes per slice (every peer's record read each slice, as before [Note: one
   counter of changes], against the counter), through a counting store.
2. ``--gloo 8,16``: that many local gloo processes. Per world size: the time of one per-step
   agreement check (a guard's position check, as every root forward and backward makes it),
   through the recursive doubling and, for comparison, through gloo's ring all-reduce of the
   same two integers; and the store requests per second of each rank waiting in a check while
   rank 0 sleeps, with and without the counter of changes.

Run: ``python bench/host_checks.py --simulate 4096 --gloo 8,16``. Times on a shared machine
vary from run to run; the counts do not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flatshard._comm._collectives import Communicator  # noqa: E402
from flatshard._comm._doubling import SEND, SWAP, rounds, schedule  # noqa: E402
from flatshard._comm._guard import make_guard  # noqa: E402
from flatshard._comm._peer_failures import StepWatch  # noqa: E402

CPU = torch.device("cpu")
CHANGES = "flatshard/watch/changes"  # (the counter of [Note: one counter of changes])
CHECKS = 100  # timed checks per world size
SLEEP_S = 4.0  # how long rank 0 keeps the others waiting


class CountingStore:
    """A store that counts the requests made of it; ``counter=False``: the counter of changes
    cannot be read, so every look reads every record (the behaviour before the counter)."""

    def __init__(self, inner: Any, counter: bool = True) -> None:
        self.inner = inner
        self.counter = counter
        self.requests = 0

    def _count(self, name: str, *args: Any) -> Any:
        self.requests += 1
        return getattr(self.inner, name)(*args)

    def set(self, key: str, value: Any) -> None:
        self._count("set", key, value)

    def get(self, key: str) -> bytes:
        return self._count("get", key)

    def check(self, keys: List[str]) -> bool:
        return self._count("check", keys)

    def add(self, key: str, amount: int) -> int:
        if key == CHANGES and not self.counter:
            raise RuntimeError("no counter of changes (as before it)")
        return self._count("add", key, amount)


# -- 1. simulated ----------------------------------------------------------------------------------


def simulate(world: int) -> str:
    sends = [sum(step.kind in (SEND, SWAP) for step in schedule(rank, world)) for rank in range(world)]
    per_slice = {}
    for counter in (False, True):
        store = CountingStore(dist.HashStore(), counter)
        watch = StepWatch(store, 1, 0, list(range(1, world)), timedelta(seconds=60))
        watch.look(time.monotonic(), "x")  # (each watch's first look reads every record)
        store.requests = 0
        for _ in range(10):
            watch.look(time.monotonic(), "x")
        per_slice[counter] = store.requests / 10
    lines = [
        f"| N = {world} | gloo ring all-reduce (before) | recursive doubling (now) |",
        "|---|---|---|",
        f"| agreement check: messages one after another | {2 * (world - 1)} | {rounds(world)} |",
        f"| agreement check: messages sent per rank, at most | (2 segments of 8 bytes, each passed on by every rank twice) | {max(sends)} |",
        "",
        f"| N = {world}, one rank slow | every record each slice (before) | counter of changes (now) |",
        "|---|---|---|",
        f"| store requests per waiting rank per slice | {per_slice[False]:.0f} | {per_slice[True]:.0f} |",
        f"| store requests per slice, all {world - 1} waiting ranks | {per_slice[False] * (world - 1):.0f} | {per_slice[True] * (world - 1):.0f} |",
    ]
    return "\n".join(lines)


# -- 2. gloo --------------------------------------------------------------------------------------


def _rank(rank: int, world: int, init: str, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    comm = Communicator(dist.group.WORLD)
    comm.doubling_from = 3  # (the doubling at every size measured: it starts at 64 ranks)
    guard = make_guard([comm], CPU)
    watch = guard.watch
    out: Dict[str, Any] = {}
    with guard.call("the host checks benchmark", exit_check=False):
        check = lambda: guard.position("at a per-step check", ["unit a", "unit b"])  # noqa: E731
        out["doubling_ms"] = _time(check)
        comm.gloo = False  # (the check as before: one all-reduce, gloo's ring)
        out["ring_ms"] = _time(check)
        comm.gloo = True
        for counter in (False, True):
            store = CountingStore(watch.store, counter)
            watch.store, watch.seen = store, None
            if counter:  # (the steady state: a watch reads every record once, at its first look)
                watch.look(time.monotonic(), "the benchmark")
                store.requests = 0
            if rank == 0:
                time.sleep(SLEEP_S)
            started = time.monotonic()
            comm.agree(5, CPU)
            waited = time.monotonic() - started
            watch.store = store.inner
            out[f"requests_per_s_{counter}"] = store.requests / waited if rank else None
    results.put((rank, out))
    dist.destroy_process_group()


def _time(check: Any) -> float:
    """The median time of one ``check`` in ms, in batches of ten after a warm-up."""
    for _ in range(10):
        check()
    batches = []
    for _ in range(CHECKS // 10):
        started = time.perf_counter()
        for _ in range(10):
            check()
        batches.append((time.perf_counter() - started) / 10 * 1e3)
    return statistics.median(batches)


def over_gloo(world: int) -> List[Dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = os.path.join(tempfile.mkdtemp(prefix="flatshard-host-checks-"), "init")
    procs = [ctx.Process(target=_rank, args=(rank, world, init, results)) for rank in range(world)]
    for proc in procs:
        proc.start()
    outs = dict(results.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join()
    return [outs[rank] for rank in range(world)]


def gloo_table(worlds: List[int]) -> str:
    lines = [
        "| N (gloo, local) | agreement check, ring all-reduce (before) | agreement check, recursive doubling (now) "
        "| store requests/s per waiting rank, before | now |",
        "|---|---|---|---|---|",
    ]
    for world in worlds:
        outs = over_gloo(world)
        ring = statistics.median(o["ring_ms"] for o in outs)
        doubling = statistics.median(o["doubling_ms"] for o in outs)
        before = statistics.median(o["requests_per_s_False"] for o in outs[1:])
        now = statistics.median(o["requests_per_s_True"] for o in outs[1:])
        lines.append(f"| {world} | {ring:.2f} ms | {doubling:.2f} ms | {before:.1f} | {now:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", type=int, default=4096, help="world size of the simulated part (0: skip)")
    parser.add_argument("--gloo", default="8,16", help="world sizes over local gloo processes ('': skip)")
    args = parser.parse_args()
    if args.simulate:
        print(simulate(args.simulate), end="\n\n", flush=True)
    worlds = [int(w) for w in args.gloo.split(",") if w]
    if worlds:
        print(gloo_table(worlds), flush=True)


if __name__ == "__main__":
    main()

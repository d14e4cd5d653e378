"""flatshard's own CPU time in a training step, function by function, on the thread's CPU clock.

    python bench/own_cpu.py                    # the default shape, 2 ranks
    python bench/own_cpu.py --shape deep       # many small units

Rank 0 times the runtime's entry points (the hooks autograd and the wrappers call) and the
handle and collective methods they call, each with ``time.thread_time()`` around it, and
charges every function its exclusive time (its own minus that of the measured functions it
called) to the phase of the step it ran in (forward with the loss, backward, optimizer).
Unlike cProfile, which instruments every Python call and inflates small functions several
times over, this measures a few hundred calls per step; each adds the cost of two clock reads
and a Python wrapper, which the script measures and prints. Waiting on a collective costs the
thread no CPU, so what is listed is work: issuing collectives, copies, hooks and bookkeeping.
RESULTS.md uses it to say what flatshard's per-unit work consists of.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import platform
import sys
import tempfile
import time
from typing import Any, Callable, DefaultDict, Dict, List, Tuple

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (the benchmark's model, wrapping and training step)

PHASES = bench.PHASES

# (module, class, method): what is timed. Entry points first, then what they call.
MEASURED: List[Tuple[str, str, str]] = [
    ("flatshard._engine._runtime", "RootRuntime", name)
    for name in ("start_forward", "finish_forward", "pre_backward_hook", "post_backward", "inputs_done", "finalize_backward")
] + [
    ("flatshard.flat_param", "FlatParamHandle", name)
    for name in ("unshard", "wait", "use_views", "drop_views", "reshard", "sync_requires_grad", "take_user_writes")
] + [
    ("flatshard._flat._handle_grads", "HandleGrads", name) for name in ("reduce_grad", "finish_reduction")
] + [
    ("flatshard._comm._collectives", "Communicator", "all_gather"),
    ("flatshard._comm._collectives", "Communicator", "reduce_scatter_mean"),
    ("flatshard._comm._collectives", "Pending", "wait"),
]


class CpuAccount:
    """Exclusive thread CPU time and calls per (function, phase)."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.seconds: DefaultDict[Tuple[str, str], float] = collections.defaultdict(float)
        self.calls: DefaultDict[Tuple[str, str], int] = collections.defaultdict(int)
        self._children: List[float] = []  # per open measured call: CPU of the measured calls inside it

    def measure(self, label: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` with its exclusive CPU time charged to ``label``."""

        @functools.wraps(function)
        def measured(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            self._children.append(0.0)
            try:
                return function(*args, **kwargs)
            finally:
                spent = time.thread_time() - start
                inner = self._children.pop()
                key = (label, self.phase)
                self.seconds[key] += spent - inner
                self.calls[key] += 1
                if self._children:
                    self._children[-1] += spent

        return measured

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def instrument(account: CpuAccount) -> None:
    """Replace every MEASURED method by its measured version (before the model is built:
    the runtime binds its hook methods when it starts)."""
    import importlib

    for module_name, class_name, name in MEASURED:
        owner = getattr(importlib.import_module(module_name), class_name)
        raw = owner.__dict__.get(name)
        if raw is None:
            raise SystemExit(f"own_cpu.py: {module_name}.{class_name}.{name} does not exist (update MEASURED)")
        is_static = isinstance(raw, staticmethod)
        function = raw.__func__ if is_static else raw
        wrapped = account.measure(f"{class_name}.{name}", function)
        setattr(owner, name, staticmethod(wrapped) if is_static else wrapped)


def wrapper_cost(calls: int = 20000) -> float:
    """CPU seconds one measured call adds (an empty function, measured and not)."""
    plain: Callable[[], None] = lambda: None  # noqa: E731
    measured = CpuAccount().measure("empty", plain)
    spent = []
    for function in (measured, plain):
        start = time.thread_time()
        for _ in range(calls):
            function()
        spent.append(time.thread_time() - start)
    return max(0.0, (spent[0] - spent[1]) / calls)


def table(account: CpuAccount, steps: int, units: int, step_cpu: Dict[str, float], overhead: float) -> str:
    labels = sorted({label for label, _ in account.seconds}, key=lambda l: -sum(account.seconds[(l, p)] for p in PHASES))
    ms = lambda s: f"{s / steps * 1e3:.2f}"  # noqa: E731
    lines = [
        "| function | " + " | ".join(f"{p} (ms / step)" for p in PHASES) + " | calls / step | µs / call |",
        "|---|" + "---|" * (len(PHASES) + 2),
    ]
    total = {p: 0.0 for p in PHASES}
    calls = 0
    for label in labels:
        seconds = [account.seconds[(label, p)] for p in PHASES]
        count = sum(account.calls[(label, p)] for p in PHASES)
        for p, s in zip(PHASES, seconds):
            total[p] += s
        calls += count
        lines.append(f"| {label} | " + " | ".join(ms(s) for s in seconds) + f" | {count / steps:.1f} | {sum(seconds) / count * 1e6:.1f} |")
    lines.append("| **all measured** | " + " | ".join(ms(total[p]) for p in PHASES) + f" | {calls / steps:.1f} | |")
    lines.append("| step thread, all of it | " + " | ".join(ms(step_cpu[p]) for p in PHASES) + " | | |")
    own = sum(total.values()) / steps
    lines.append(
        f"\nflatshard's own CPU: {own * 1e3:.1f} ms per step, {own / units * 1e3:.2f} ms per unit ({units} units), "
        f"of which the measuring itself is about {calls / steps * overhead * 1e3:.1f} ms ({overhead * 1e6:.1f} µs per measured call)."
    )
    return "\n".join(lines)


def _rank(rank: int, world: int, init_file: str, cfg: Dict[str, Any], args: argparse.Namespace) -> None:
    bench.start_rank(rank, world, init_file)
    account = CpuAccount()
    if rank == 0:
        instrument(account)  # (the other rank runs as it is: its collectives pair up all the same)
    model, optim = bench.make_trainee("flatshard", {}, cfg, rank)
    clock = bench.PhaseClock()  # the step thread's own time per phase, for comparison

    def mark(phase: str) -> None:
        clock.mark(phase)
        account.phase = phase

    one_step = bench.training_step(model, optim, cfg, rank, mark)
    for _ in range(args.warmup):
        one_step()
    account.reset()
    clock.on = True
    for _ in range(args.steps):
        one_step()
    if rank == 0:
        from flatshard import ShardedDataParallel

        units = len(ShardedDataParallel.fsdp_modules(model))
        step_cpu = {phase: clock.totals[phase][bench.SPLIT.index("cpu")] for phase in PHASES}
        print(table(account, args.steps, units, step_cpu, wrapper_cost()))
    del model, optim
    bench.end_rank()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_trace_arguments(p, shape="default", warmup=3, steps=10)
    args = p.parse_args()
    cfg = bench.trace_config(args)
    print(f"python bench/own_cpu.py {' '.join(sys.argv[1:])}\n{platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__}, shape {args.shape}, world size 2, {args.steps} steps\n")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(2, os.path.join(tmp, "rdv"), cfg, args), nprocs=2)


if __name__ == "__main__":
    main()

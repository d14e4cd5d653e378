"""Where a flatshard step's time goes (``bench.py --profile``).

Rank 0 runs a few extra steps under ``cProfile`` after the timed ones and splits them into:

- **waiting on communication** (exposed): time blocked in gloo's ``Work.wait`` -- what the
  all-gathers and reduce-scatters cost beyond what compute hid;
- **issuing communication**: time in the calls that start collectives (gloo copies the send
  buffers there);
- **copies**: tensor copies, casts, sums and fills flatshard itself runs (filling the full flat
  tensor, summing reduce-scatter chunks, accumulating gradients);
- **runtime Python**: flatshard's own Python code (hooks, state checks, bookkeeping), per
  entry point (forward, pre-backward, post-backward, end of backward), per call;
- **compute**: everything else -- the model's forward and backward, the loss, the optimizer.

cProfile slows Python code down (by roughly 1.5-2x), so the runtime-Python share is an upper
bound; the profiled step time is printed next to the unprofiled median for comparison. The
communication the compute hid is estimated from the bytes sent and the loopback bandwidth
measured with one large all-gather: ``hidden ~= bytes / bandwidth - exposed``.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

# Python functions of flatshard's runtime reported per call (their cumulative time, waits and
# copies included), as ``file:function`` suffixes.
ENTRY_POINTS = {
    "pre-forward (per unit forward)": ("_runtime.py", "start_forward"),
    "post-forward (per unit forward)": ("_runtime.py", "finish_forward"),
    "pre-backward hook (per unit)": ("_runtime.py", "begin_backward"),
    "post-backward hook (per handle)": ("_runtime.py", "post_backward"),
    "end of backward (per step)": ("_runtime.py", "finalize_backward"),
}
_COPY_OPS = {"copy_", "add_", "add", "div_", "zero_", "to", "clone", "cat", "fill_", "mul_", "zeros", "empty", "split", "chunk"}


def _timed_all_gathers(numel: int, repeats: int) -> List[float]:
    """Seconds of each of ``repeats`` all-gathers of ``numel`` float32 per rank, after a warm-up,
    done the way flatshard does them (``Communicator.all_gather``)."""
    from flatshard._comm._collectives import Communicator
    from flatshard._comm._guard import make_guard

    comm = Communicator(dist.group.WORLD)
    # (flatshard's collectives run inside a guarded call: [Note: one guarded path])
    make_guard([comm], torch.device("cpu")).open("the loopback measurement", eager=True)
    shard = torch.ones(numel, dtype=torch.float32)
    out = torch.empty(numel * dist.get_world_size())
    comm.all_gather(out, shard)  # warm up
    dist.barrier()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        comm.all_gather(out, shard)
        times.append(time.perf_counter() - start)
    return times


def loopback_bandwidth(nbytes: int = 64 * 2**20) -> float:
    """Bytes per second one rank sends in a large all-gather over the machine's loopback."""
    world = dist.get_world_size()
    numel = nbytes // 4 // world
    return numel * 4 * (world - 1) / statistics.fmean(_timed_all_gathers(numel, 3))


def collective_latency(repeats: int = 50) -> float:
    """Median seconds of a small all-gather (4 KiB per rank) issued and waited on at once:
    what one exposed collective costs here whatever its size (the threads' wake-ups and the
    loopback round trip)."""
    return statistics.median(_timed_all_gathers(1024, repeats))


def _is_flatshard(filename: str) -> bool:
    return "/flatshard/" in filename


def profile_steps(step: Callable[[], None], steps: int) -> Tuple[float, Dict[str, Any]]:
    """Run ``step`` ``steps`` times under cProfile: (seconds per step, breakdown per step)."""
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    per_step = (time.perf_counter() - start) / steps
    return per_step, breakdown(pstats.Stats(profiler), steps)


def breakdown(stats: pstats.Stats, steps: int) -> Dict[str, Any]:
    """The categories of the module docstring, in seconds per step, and the entry points'
    seconds per call."""
    waiting = issuing = copies = runtime = 0.0
    entries: Dict[str, List[float]] = {name: [0.0, 0] for name in ENTRY_POINTS}
    raw: Dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    for (filename, _, function), (_, calls, tottime, cumtime, callers) in raw.items():
        if _is_flatshard(filename):
            runtime += tottime
            for name, (suffix, fn) in ENTRY_POINTS.items():
                # (a module-level function of the same name may call the method: keep the outer)
                if filename.endswith(suffix) and function == fn and cumtime > entries[name][0]:
                    entries[name] = [cumtime, calls]
            continue
        if "method 'wait' of" in function or function.endswith("_distributed_c10d.wait>"):
            waiting += tottime
            continue
        if filename.endswith("distributed_c10d.py") or "ProcessGroup' objects" in function:
            issuing += tottime  # (starting collectives: gloo copies the send buffers here)
            continue
        bare = function.split(" of ")[0].replace("<method '", "").replace("<built-in method ", "").strip("'>")
        if bare in _COPY_OPS:
            copies += sum(t for (caller_file, _, _), (_, _, t, _) in callers.items() if _is_flatshard(caller_file))
    per_call = {name: (total / calls if calls else 0.0, int(calls / steps)) for name, (total, calls) in entries.items()}
    return {
        "waiting on communication": waiting / steps,
        "issuing communication": issuing / steps,
        "copies": copies / steps,
        "runtime Python": runtime / steps,
        "entry points": per_call,
    }


def report(
    unprofiled: float, profiled: float, parts: Dict[str, Any], sent: float, bandwidth: float, latency: float = 0.0,
) -> str:
    """A markdown table of ``breakdown``'s parts and the physical limits."""
    known = sum(v for k, v in parts.items() if k != "entry points")
    lines = [
        f"step: {unprofiled * 1e3:.1f} ms unprofiled, {profiled * 1e3:.1f} ms under cProfile",
        "",
        "| part | ms / step (profiled) | share |",
        "|---|---|---|",
    ]
    for name in ("waiting on communication", "issuing communication", "copies", "runtime Python"):
        lines.append(f"| {name} | {parts[name] * 1e3:.1f} | {parts[name] / profiled:.0%} |")
    lines.append(f"| compute (the rest) | {(profiled - known) * 1e3:.1f} | {(profiled - known) / profiled:.0%} |")
    lines += ["", "| runtime entry point | ms per call (cumulative) | calls / step |", "|---|---|---|"]
    for name, (seconds, calls) in parts["entry points"].items():
        lines.append(f"| {name} | {seconds * 1e3:.2f} | {calls} |")
    wire = sent / bandwidth
    lines += [
        "",
        f"communication: {sent / 2**20:.1f} MiB sent per rank per step; loopback {bandwidth / 2**30:.2f} GiB/s "
        f"-> {wire * 1e3:.1f} ms on the wire per step, of which {parts['waiting on communication'] * 1e3:.1f} ms "
        f"exposed (waited on) and ~{max(wire - parts['waiting on communication'], 0.0) * 1e3:.1f} ms hidden behind compute",
    ]
    if latency:
        lines.append(f"latency: a 4 KiB all-gather takes {latency * 1e6:.0f} us from issue to completion here (each exposed collective costs at least that)")
    return "\n".join(lines)

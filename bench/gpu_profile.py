"""Where one flatshard training step's time goes on a GPU, as rank 0 of N on the fake backend.

    python bench/gpu_profile.py --json out/profile.json
    python bench/gpu_profile.py --config tiny --device cpu --seq 32     # dry run

After warm-up steps (the first step records the execution order and runs the agreement checks)
it reports for the steady-state steps:

- **flatshard Python per step**: the time ``cProfile`` counts inside flatshard's own functions
  (their self time, so torch's kernels launched from them are not in it; cProfile slows
  Python down, so this is an upper bound);
- **host syncs per step**: CUDA API calls that block the host until the GPU catches up
  (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, blocking
  ``cudaMemcpy``) and ``aten::_local_scalar_dense`` (``.item()``, ``.tolist()``), from
  ``torch.profiler``; the step itself ends with no synchronisation;
- **gaps between kernels**: over one step, the time the GPU runs no kernel or copy between the
  first and the last (idle time the host did not keep the GPU fed), and the largest gaps.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_throughput import emit, init_fake_world, make_step, wrap  # noqa: E402
from llama import CONFIGS, Llama  # noqa: E402

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
SCALAR_READS = ("aten::_local_scalar_dense",)
FLATSHARD = str(ROOT / "flatshard")


def python_per_step(step: Any, steps: int) -> float:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    own = sum(tottime for (path, _, _), (_, _, tottime, _, _) in stats.items() if path.startswith(FLATSHARD))
    return own / steps


def sync_and_gaps(step: Any, cuda: bool) -> Dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_stack=True) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    syncs = [e.name for e in events if e.name in SYNC_CALLS or e.name in SCALAR_READS]
    # (the synchronize after the step, the profiler's own, is not the step's)
    syncs_in_step = max(0, sum(1 for n in syncs if n == "cudaDeviceSynchronize") - 1) + sum(1 for n in syncs if n != "cudaDeviceSynchronize")
    result: Dict[str, Any] = {"host_syncs_per_step": syncs_in_step, "sync_calls": sorted(set(syncs)), "sync_sources": _sources(events)}
    kernels = sorted(
        ((e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
    )
    if kernels:
        busy_until, gaps = kernels[0][1], []
        for start, end, name in kernels[1:]:
            if start > busy_until:
                gaps.append((start - busy_until, name))
            busy_until = max(busy_until, end)
        span = busy_until - kernels[0][0]
        idle = sum(g for g, _ in gaps)
        result.update(gpu_span_ms=span / 1e3, gpu_idle_ms=idle / 1e3, gpu_idle_fraction=idle / span if span else 0.0,
                      largest_gaps_us=[(round(g, 1), n[:60]) for g, n in sorted(gaps, reverse=True)[:5]], kernels=len(kernels))
    return result


def _sources(events: Any) -> List[str]:
    """Each host sync with the innermost Python frames that led to it (with ``with_stack``,
    the profiler records Python calls as the parents of the ops they run), preferring frames
    outside torch."""
    found = []
    for event in events:
        if event.name not in SYNC_CALLS and event.name not in SCALAR_READS:
            continue
        frames, parent = [], event.cpu_parent
        while parent is not None:
            if ".py(" in parent.name:
                frames.append(parent.name)
            parent = parent.cpu_parent
        outside = [f for f in frames if "torch/" not in f] or frames
        found.append(f"{event.name} <- {' < '.join(outside[:3]) or '?'}")
    return found


def main(argv: List[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="1b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="steps under cProfile")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    init_fake_world(args.world)
    cfg = CONFIGS[args.config]
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    model = wrap("flatshard", model, device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    tokens = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1)).to(device)
    step = make_step(model, optim, tokens[:, :-1], tokens[:, 1:], plain=False)
    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    units = sum(1 for m in model.modules() if type(m).__name__ == "ShardedDataParallel")
    result = {"units": units, "flatshard_python_ms_per_step": 1e3 * python_per_step(step, args.steps)}
    result.update(sync_and_gaps(step, cuda))
    emit(result, args.json)


if __name__ == "__main__":
    main(sys.argv[1:])

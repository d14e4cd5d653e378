"""Per-rank memory of parameters, gradients and optimizer state against the world size.

    python bench/memory.py                     # the default shape, world sizes 1-4
    python bench/memory.py --shape wide --world-sizes 2,4

For flatshard (default configuration) each rank trains the benchmark model for two steps and
reports, in MiB: the bytes of its parameter shards, of their gradients and of the AdamW state
(counted from the tensors themselves after a step), the most full flat tensors it held gathered
at any moment of the second step (sampled after every aten op by a dispatch mode, so it is
exact at op granularity). The expectation is
parameters + gradients + optimizer state = 4 × total / N (AdamW: parameter, gradient and
two moments; plus padding) and gathered at most the
prefetch limit of full units (the unit computing and the one prefetched, plus the root, which
FULL_SHARD keeps between its forward and backward). The last column is the arena each rank of
two on one host allocates up front in shared memory for swapping chunks with its peer ([Note:
shared-memory exchange] in ``flatshard/_comm/_shared_memory.py``): three of the largest shard.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MIB = 2**20


class _GatheredPeak(TorchDispatchMode):
    """After every aten op: the bytes of all full flat tensors currently allocated."""

    def __init__(self, handles: List[Any]) -> None:
        super().__init__()
        self.handles = handles
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        gathered = sum(h.full_storage_bytes() for h in self.handles)
        self.peak = max(self.peak, gathered)
        return out


def _rank(rank: int, world: int, init_file: str, cfg: Dict[str, Any], out: str) -> None:
    import bench

    bench.start_rank(rank, world, init_file)
    example = bench._example()
    model = bench.build_model(example, cfg)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model = bench._wrap("flatshard", model, example.TransformerBlock, {})
    handles = [h for m in model.modules() if hasattr(m, "_unit") for h in m._unit.handles]
    largest = max(h.padded_numel * h.compute_dtype.itemsize for h in handles)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    one_step = bench.training_step(model, optim, cfg, rank)

    one_step()
    tracker = _GatheredPeak(handles)
    with tracker:
        one_step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    state = sum(t.numel() * t.element_size() for s in optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    arena = sum(c.capacity for c in bench.shared_memory_channels(model) if c.state.name == "READY")
    row = torch.tensor([params, grads, state, tracker.peak, arena], dtype=torch.float64)
    dist.all_reduce(row, op=dist.ReduceOp.MAX)
    if rank == 0:
        torch.save({"total": total, "largest": largest, "row": row.tolist()}, out)
    del model, optim, one_step, tracker, handles
    bench.end_rank()


def main() -> None:
    import bench

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(bench.SHAPES), default="default")
    p.add_argument("--world-sizes", default="1,2,3,4")
    args = p.parse_args()
    cfg = dict(layers=8, dim=256, heads=4, batch=8, seq=128, vocab=4096, untied=False)
    cfg.update(bench.SHAPES[args.shape])
    print(f"shape {args.shape}: {cfg}")
    print(
        "| world size | params | grads | AdamW state | sum | 4 × total / N | gathered at most (in largest units) "
        "| shared-memory arena (in largest units) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for world in [int(w) for w in args.world_sizes.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            out = f"{tmp}/out.pt"
            mp.spawn(_rank, args=(world, f"{tmp}/init", cfg, out), nprocs=world)
            res = torch.load(out)
        params, grads, state, gathered, arena = res["row"]
        total, largest = res["total"], res["largest"]
        held = params + grads + state
        print(
            f"| {world} | {params / MIB:.1f} | {grads / MIB:.1f} | {state / MIB:.1f} | {held / MIB:.1f} | "
            f"{4 * total / world / MIB:.1f} | {gathered / MIB:.1f} MiB ({gathered / largest:.2f}) | "
            f"{arena / MIB:.1f} MiB ({arena / largest:.2f}) |"
        )


if __name__ == "__main__":
    main()

"""Per-rank memory at scale, flatshard against torch FSDP1 and FSDP2, on torch's fake process group.

    python bench/scale_memory.py                                   # 1b at N = 8, 512, 4096
    python bench/scale_memory.py --model 7b --world-sizes 1024 --seq 32
    python bench/scale_memory.py --impls "flatshard,flatshard no overlap,fsdp1,fsdp2"

One process per (implementation, N) runs as one rank of N (the last by default) on torch's fake
process group: collectives return at once and exchange nothing, memory is real. The model (a
Llama, ``bench/llama.py``) is built on the meta device and materialised one unit at a time by
``param_init_fn`` (FSDP2: ``fully_shard`` on the meta model, then ``to_empty`` and the same
initialisation), one unit per decoder layer, fp32, AdamW, two training steps. "flatshard no
overlap" is flatshard after ``set_communication_overlap(False)``. Bytes are the
CPU allocator's, phase by phase (``flatshard._base._memory_timeline``, [Note: measuring memory]):
the peak of the second step's forward, backward and optimizer step, and what stays allocated
between steps (after ``zero_grad(set_to_none=True)``). The last columns are flatshard's
planner: its estimate of the parameters and gradients and its per-rank shard and optimizer
state, against which "between steps" is compared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def _child(impl: str, model: str, world: int, rank: int, batch: int, seq: int) -> Dict[str, Any]:
    import torch

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from llama import CONFIGS, DecoderLayer, Llama, loss_of

    import flatshard
    from flatshard._comm._collectives import init_fake_world
    from flatshard._base._memory_timeline import MemoryTimeline
    from flatshard.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    cfg = CONFIGS[model]
    init_fake_world(rank, world)

    def init(module: torch.nn.Module) -> None:
        module.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            for p in module.parameters(recurse=False):
                p.normal_(0.0, 0.02)

    tokens = torch.randint(0, cfg.vocab, (batch, seq))
    with torch.device("meta"):
        meta = Llama(cfg)
    planned = flatshard.plan(meta, ModuleWrapPolicy({DecoderLayer}), world_size=world, print_table=False)
    with MemoryTimeline(torch.device("cpu")) as timeline:
        with timeline.phase("construct"):
            policy = ModuleWrapPolicy({DecoderLayer})
            if impl.startswith("flatshard"):
                wrapped = flatshard.ShardedDataParallel(meta, auto_wrap_policy=policy, param_init_fn=init)
                wrapped.set_communication_overlap(impl == "flatshard")
            elif impl == "fsdp2":
                wrapped = _fsdp2(meta)
            else:
                from torch.distributed.fsdp import FullyShardedDataParallel

                wrapped = FullyShardedDataParallel(meta, auto_wrap_policy=policy, param_init_fn=init, device_id=torch.device("cpu"))
            optim = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
        with timeline.phase("first step"):
            loss_of(wrapped(tokens), tokens).backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
        with timeline.phase("forward"):
            loss = loss_of(wrapped(tokens), tokens)
        with timeline.phase("backward"):
            loss.backward()
            del loss
        with timeline.phase("optimizer step"):
            optim.step()
        with timeline.phase("zero_grad"):
            optim.zero_grad(set_to_none=True)
    def local(t: Any) -> Any:  # (FSDP2's are DTensors: this rank's part)
        return t.to_local() if hasattr(t, "to_local") else t

    shards = sum(local(p).numel() * p.element_size() for p in wrapped.parameters())
    state = sum(local(t).numel() * t.element_size() for s in optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    phases = {name: vars(m) for name, m in timeline.phases.items()}
    return {"phases": phases, "shards": shards, "optimizer_state": state, "planned": dict(planned.memory())}


def _fsdp2(meta: Any) -> Any:
    """FSDP2 over the meta model: one group per decoder layer and the root, then materialised
    on the CPU, initialised as ``_child``'s ``init`` does."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from llama import DecoderLayer

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for module in meta.modules():
        if isinstance(module, DecoderLayer):
            fully_shard(module, mesh=mesh)
    fully_shard(meta, mesh=mesh)
    meta.to_empty(device="cpu")
    with torch.no_grad():
        for p in meta.parameters():
            p.normal_(0.0, 0.02)
    return meta


def _run(impl: str, args: argparse.Namespace, world: int) -> Dict[str, Any]:
    rank = world - 1 if args.rank == "last" else int(args.rank)
    env = dict(os.environ, OMP_NUM_THREADS="1", FLATSHARD_SHARED_MEMORY="0")
    cmd = [sys.executable, __file__, "--child", impl, "--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq), "--world-sizes", str(world), "--rank", str(rank)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    line = next((l for l in out.stdout.splitlines() if l.startswith("{")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"{impl} at N={world} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(line)


def _mib(n: float) -> str:
    return f"{n / MIB:,.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b")
    p.add_argument("--world-sizes", default="8,512,4096")
    p.add_argument("--rank", default="last", help="'last' or a rank number")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--impls", default="flatshard,flatshard no overlap,fsdp1,fsdp2")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.model, int(args.world_sizes), int(args.rank), args.batch, args.seq)))
        return
    impls = args.impls.split(",")
    print(f"model {args.model}, batch {args.batch} x {args.seq} tokens, rank {args.rank}, fp32, AdamW; MiB per rank")
    print("| N | implementation | construction peak | forward peak | backward peak | optimizer-step peak | between steps | shards + AdamW state | planner: parameters + gradients peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for world in [int(w) for w in args.world_sizes.split(",")]:
        results: List[Dict[str, Any]] = [_run(impl, args, world) for impl in impls]
        for impl, res in zip(impls, results):
            ph = res["phases"]
            planned = sum(res["planned"].values())
            print(
                f"| {world} | {impl} | {_mib(ph['construct']['peak'])} | {_mib(ph['forward']['peak'])} | "
                f"{_mib(ph['backward']['peak'])} | {_mib(ph['optimizer step']['peak'])} | {_mib(ph['zero_grad']['end'])} | "
                f"{_mib(res['shards'] + res['optimizer_state'])} | {_mib(planned)} |"
            )
        if "fsdp1" in impls:
            base = results[impls.index("fsdp1")]["phases"]
            for impl, res in zip(impls, results):
                if impl == "fsdp1":
                    continue
                a = res["phases"]
                ratios = ", ".join(f"{k} {a[k]['peak'] / max(base[k]['peak'], 1):.2f}x" for k in ("forward", "backward", "optimizer step"))
                print(f"| {world} | {impl} / fsdp1 | | | | | {a['zero_grad']['end'] / max(base['zero_grad']['end'], 1):.2f}x between steps; peaks: {ratios} | | |")

if __name__ == "__main__":
    main()

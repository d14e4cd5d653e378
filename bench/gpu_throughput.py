"""One implementation's training throughput and memory as rank 0 of N on the fake backend.

    python bench/gpu_throughput.py --impl flatshard --json out/flatshard.json
    python bench/gpu_throughput.py --impl fsdp1 --config tiny --device cpu --steps 2   # dry run

A Llama-style model (``bench/llama.py``) in bf16 mixed precision (parameters bf16 for compute,
gradients reduced in fp32, fp32 master weights), one unit per decoder layer, trained with AdamW.
The fake process group returns every collective at once without moving data, so this rank does
its real compute, holds its real memory and runs its real stream logic: what it measures is the
cost of everything but the network. ``plain`` is the unwrapped model (no process group).

Each implementation runs in its own process (``gpu_check.py`` starts them), so peak memory is its
own. The JSON holds the median step time over the measured steps, tokens/s of this rank, MFU
against the card's dense bf16 peak, peak allocated and reserved memory, and the allocator's
``num_alloc_retries`` (each one a synchronising cudaFree-and-retry).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from llama import CONFIGS, DecoderLayer, Llama, loss_of  # noqa: E402

IMPLS = ("flatshard", "fsdp1", "fsdp2", "plain")
# dense bf16 tensor-core peak of an H100 SXM (the MFU denominator)
H100_BF16_PEAK = 989e12


def init_fake_world(world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())


def wrap(impl: str, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` wrapped by ``impl`` with the same options: FULL_SHARD, one unit per decoder
    layer plus the root, bf16 compute, fp32 gradient reduction, BACKWARD_PRE prefetch,
    limit_all_gathers."""
    bf16, fp32 = torch.bfloat16, torch.float32
    device_id = device if device.type == "cuda" else None
    if impl == "plain":
        return model.to(device)
    if impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy)
        return fully_shard(model, mp_policy=policy)
    if impl == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({DecoderLayer}), device_id=device,  # (FSDP1 on CPU needs it too)
                    mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=fp32, buffer_dtype=bf16),
                    limit_all_gathers=True)
    if impl == "flatshard":
        from flatshard import MixedPrecision, ModuleWrapPolicy, ShardedDataParallel

        return ShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({DecoderLayer}), device_id=device_id,
                                   mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=fp32, buffer_dtype=bf16),
                                   limit_all_gathers=True)
    raise ValueError(f"--impl must be one of {IMPLS}, got {impl!r}")


def make_step(model: torch.nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor, plain: bool) -> Callable[[], None]:
    def step() -> None:
        optim.zero_grad(set_to_none=True)
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=plain):
            loss = loss_of(model(tokens), targets)
        loss.backward()
        optim.step()

    return step


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    if args.impl != "plain":
        init_fake_world(args.world)
    cfg = CONFIGS[args.config]
    torch.manual_seed(0)
    # built on the device (the unwrapped fp32 model fits); the wrappers shard it in place
    with torch.device(device):
        model = Llama(cfg)
    model = wrap(args.impl, model, device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
    step = make_step(model, optim, tokens[:, :-1], tokens[:, 1:], args.impl == "plain")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times: List[float] = []
    host: List[float] = []  # until step() returns: above the step time, the host is the bottleneck
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        host.append(time.perf_counter() - start)
        sync()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    tokens_per_step = args.batch * args.seq
    result: Dict[str, Any] = {
        "impl": args.impl, "config": args.config, "params": cfg.parameters(), "world": args.world if args.impl != "plain" else 1,
        "batch": args.batch, "seq": args.seq, "steps": args.steps, "step_s": median, "step_times_s": times, "host_s": statistics.median(host),
        "tokens_per_s": tokens_per_step / median,
        "mfu": cfg.flops_per_token(args.seq) * tokens_per_step / median / H100_BF16_PEAK,
        "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
    }
    if cuda:
        stats = torch.cuda.memory_stats(device)
        result.update(peak_allocated_gib=stats["allocated_bytes.all.peak"] / 2**30,
                      peak_reserved_gib=stats["reserved_bytes.all.peak"] / 2**30,
                      alloc_retries=stats["num_alloc_retries"])
    return result


def parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=IMPLS, required=True)
    p.add_argument("--config", choices=sorted(CONFIGS), default="1b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--world", type=int, default=8, help="fake world size (this process is rank 0)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args(argv)
    if args.world < 1 or args.batch < 1 or args.seq < 1 or args.steps < 1 or args.warmup < 0:
        p.error(f"--world, --batch, --seq, --steps must be >= 1 and --warmup >= 0; got {vars(args)}")
    return args


def emit(result: Dict[str, Any], path: Optional[Path]) -> None:
    """Print ``result`` as JSON, and write it to ``path`` when given."""
    text = json.dumps(result, indent=1)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(text)


def main(argv: List[str]) -> None:
    args = parse(argv)
    emit(measure(args), args.json)


if __name__ == "__main__":
    main(sys.argv[1:])

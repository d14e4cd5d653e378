"""One implementation's training step on a simulated network (``bench/simnet.py``) and on none.

    python bench/gpu_network.py --impl flatshard --networks nvlink --json-dir out/
    python bench/gpu_network.py --impl flatshard,fsdp1,fsdp2 --networks none,nvlink,ib --config tiny \\
        --device cpu --batch 2 --seq 32 --warmup 1 --steps 2 --json-dir out/               # dry run

The model, options and optimizer are ``gpu_throughput``'s (Llama-style, bf16 compute, fp32
gradient reduction and master weights, one unit per decoder layer, AdamW), as rank 0 of
``--world`` ranks, at batch 8 x 2048 by default, where the GPU and not the host sets the pace.
``none`` is torch's plain fake process group (every collective returns at once); the others are
``"fake_simnet"`` groups over ``simnet.NETWORKS``. Each network writes
``<json-dir>/network_<impl>_<network>.json``: the median step time and its phases (forward,
backward, optimizer, timed with CUDA events on the compute stream), tokens/s and MFU, the
collectives' modelled time per step and, on CUDA, their kernels' measured time, and the peak
allocated and reserved memory. ``gpu_check.py`` subtracts the ``none`` phases to get the exposed
communication.

Several implementations and networks in one process run one after another, each with a model,
optimizer and process group of its own (the dry run does so to stay fast; the GPU check runs one
implementation on one network per process, so each one's peak memory is its own, from a fresh
allocator).
"""

from __future__ import annotations

import argparse
import gc
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

import simnet  # noqa: E402
from gpu_throughput import H100_BF16_PEAK, emit, init_fake_world, wrap  # noqa: E402
from llama import CONFIGS, Llama, loss_of  # noqa: E402

IMPLS = ("flatshard", "fsdp1", "fsdp2")
NETWORKS = ("none",) + tuple(simnet.NETWORKS)
PHASES = ("forward", "backward", "optimizer")


class Clock:
    """Marks on the compute stream: CUDA events on a GPU, the host's clock on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        """Between two marks (on CUDA, once both are done)."""
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


def phased_step(model: torch.nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor, clock: Clock) -> Callable[[], List[Any]]:
    """A training step that returns a mark before the forward and after each phase."""

    def step() -> List[Any]:
        optim.zero_grad(set_to_none=True)
        marks = [clock.mark()]
        loss = loss_of(model(tokens), targets)
        marks.append(clock.mark())
        loss.backward()
        marks.append(clock.mark())
        optim.step()
        marks.append(clock.mark())
        return marks

    return step


def run_network(args: argparse.Namespace, impl: str, network: str) -> Dict[str, Any]:
    """Build, wrap and train ``impl``'s model over ``network``; its measurements."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    config: Optional[simnet.Config] = None
    if network == "none":
        init_fake_world(args.world)
    else:
        config = simnet.init_world(args.world, simnet.NETWORKS[network], device)
    cfg = CONFIGS[args.config]
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    model = wrap(impl, model, device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    tokens = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1)).to(device)
    clock = Clock(cuda)
    step = phased_step(model, optim, tokens[:, :-1], tokens[:, 1:], clock)
    for _ in range(args.warmup):
        step()
    _sync(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    if config is not None:
        config.ledger.take()
    phases: Dict[str, List[float]] = {name: [] for name in ("step",) + PHASES}
    modelled, measured, entries = [], [], {}
    for _ in range(args.steps):
        marks = step()
        _sync(cuda)
        phases["step"].append(clock.seconds(marks[0], marks[-1]))
        for name, start, end in zip(PHASES, marks, marks[1:]):
            phases[name].append(clock.seconds(start, end))
        if config is not None:
            ledger = config.ledger.take()
            modelled.append(ledger.total(device.type))
            measured.append(ledger.measured_seconds())
            entries = ledger.entries
    result = _result(args, impl, network, cfg, phases, modelled, measured, device)
    result["collectives"] = entries  # (the last step's: "device:kind" -> [count, bytes, modelled seconds])
    del step, optim, model
    dist.destroy_process_group()
    if cuda:  # (the next network's peak memory starts from an empty cache)
        gc.collect()
        torch.cuda.empty_cache()
    return result


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _result(args: argparse.Namespace, impl: str, network: str, cfg: Any, phases: Dict[str, List[float]], modelled: List[float],
            measured: List[float], device: torch.device) -> Dict[str, Any]:
    median = {name: statistics.median(values) for name, values in phases.items()}
    tokens_per_step = args.batch * args.seq
    spec = simnet.NETWORKS.get(network)
    result: Dict[str, Any] = {
        "impl": impl, "network": network, "config": args.config, "params": cfg.parameters(), "world": args.world,
        "batch": args.batch, "seq": args.seq, "steps": args.steps, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "bus_bandwidth_gbps": spec.bus_bandwidth / 1e9 if spec else None, "alpha_us": 1e6 * spec.alpha_s if spec else None,
        "step_s": median["step"], "phase_s": {name: median[name] for name in PHASES}, "step_times_s": phases["step"],
        "tokens_per_s": tokens_per_step / median["step"],
        "mfu": cfg.flops_per_token(args.seq) * tokens_per_step / median["step"] / H100_BF16_PEAK,
        # the collectives on the model's device, per step (CPU collectives on a GPU run are the host's checks)
        "comm_modelled_s": statistics.median(modelled) if modelled else 0.0,
        "comm_measured_s": statistics.median(measured) if measured and device.type == "cuda" else None,
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        result.update(peak_allocated_gib=stats["allocated_bytes.all.peak"] / 2**30, peak_reserved_gib=stats["reserved_bytes.all.peak"] / 2**30)
    return result


def parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", required=True, help=f"comma-separated, of {IMPLS} (each over every network, in order)")
    p.add_argument("--networks", default=",".join(NETWORKS), help=f"comma-separated, of {NETWORKS} (default: all, in that order)")
    p.add_argument("--config", choices=sorted(CONFIGS), default="1b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--world", type=int, default=8, help="fake world size (this process is rank 0)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json-dir", type=Path, required=True, help="one network_<impl>_<network>.json per network here")
    args = p.parse_args(argv)
    args.impls, args.networks = args.impl.split(","), args.networks.split(",")
    unknown = [n for n in args.networks if n not in NETWORKS] + [i for i in args.impls if i not in IMPLS]
    if unknown or args.world < 2 or args.batch < 1 or args.seq < 1 or args.steps < 1 or args.warmup < 1:
        p.error(f"--impl must be of {IMPLS} and --networks of {NETWORKS} (got {unknown}); --world >= 2, --batch, --seq, --steps, --warmup >= 1; got {vars(args)}")
    return args


def main(argv: List[str]) -> None:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    for impl in args.impls:
        for network in args.networks:
            emit(run_network(args, impl, network), args.json_dir / f"network_{impl}_{network}.json")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Side-by-side training benchmark: flatshard vs torch FSDP1, FSDP2 and DDP, on CPU with gloo.

    python bench/bench.py                      # the default config, all implementations
    python bench/bench.py --layers 2 --steps 3 --rounds 1      # a quick look

A GPT-style model (token + position embedding, N transformer blocks, tied head) is trained
with AdamW at world size 2. Every implementation runs in fresh rank processes (so peak memory
is its own), in an order that alternates between rounds; per implementation the script prints
the median step time (slowest rank per step), the peak resident memory of the largest rank, and
the bytes each rank sends per step (loopback traffic during the measured steps, plus what
flatshard's ranks swap through shared memory, divided by steps and ranks), the page faults per rank and step, where the CPU time went (per rank and
step: the thread that runs the step, and all other threads, which are gloo's communication
threads), how busy the machine's cores were, then the ratios of flatshard to the others.
A second table splits each phase of a step (forward with the loss, backward, optimizer step)
into the step thread's time on a core, runnable but waiting for a core, and asleep (see
[Note: where the wall time goes]).

The CPU columns show what a step costs when the ranks share the cores: a step cannot take
less than all ranks' CPU time divided by the cores, so with the cores close to fully busy,
any CPU a collective spends (copying bytes through loopback) is time the step takes, even
when the collective overlaps with compute.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _example():
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _wrap(impl: str, model: torch.nn.Module, block_cls: type, options: Dict[str, Any]) -> torch.nn.Module:
    import functools

    if impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if impl == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if impl == "fsdp1":
        from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    else:
        from flatshard import BackwardPrefetch, ShardedDataParallel as FullyShardedDataParallel, ShardingStrategy
        from flatshard import transformer_auto_wrap_policy
    prefetch = options.get("backward_prefetch", "BACKWARD_PRE")
    extra = {}
    if options.get("mixed_precision") == "bf16":
        if impl == "fsdp1":
            from torch.distributed.fsdp import MixedPrecision
        else:
            from flatshard import MixedPrecision
        bf16 = torch.bfloat16
        extra["mixed_precision"] = MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16)
    wrapped = FullyShardedDataParallel(
        model,
        **extra,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block_cls}),
        sharding_strategy=ShardingStrategy[options.get("sharding_strategy", "FULL_SHARD")],
        backward_prefetch=None if prefetch == "None" else BackwardPrefetch[prefetch],
        forward_prefetch=options.get("forward_prefetch", False),
        use_orig_params=options.get("use_orig_params", False),
        device_id=torch.device("cpu"),
    )
    if options.get("activation_checkpointing"):
        # as FSDP1 training recipes do it: after wrapping, each block's forward is recomputed in backward
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, block_cls))
    return wrapped


def build_model(example: Any, cfg: Dict[str, Any]) -> torch.nn.Module:
    """The benchmark's GPT of shape ``cfg``, unwrapped, with the same weights on every rank."""
    torch.manual_seed(0)
    model = example.GPT(cfg["vocab"], cfg["dim"], cfg["layers"], cfg["heads"], cfg["seq"])
    if cfg["untied"]:
        model.head.weight = torch.nn.Parameter(model.head.weight.detach().clone())
    return model


def _deepspeed(model: torch.nn.Module, cfg: Dict[str, Any], rank: int) -> Any:
    """``model`` under DeepSpeed ZeRO stage 3 on its CPU accelerator, over the gloo group
    already set up, with torch's AdamW (the other rows' optimizer) and DeepSpeed's defaults
    otherwise; returns the engine, which runs the backward and the optimizer step."""
    import logging
    import warnings

    world = dist.get_world_size()
    # DeepSpeed reads the launcher's variables even when torch.distributed is initialised.
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    # (DeepSpeed calls collectives by names torch deprecated)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    config = {
        "train_micro_batch_size_per_gpu": cfg["batch"], "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30,
    }
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optim, config=config)
    return engine


def add_trace_arguments(p: argparse.ArgumentParser, shape: str, warmup: int, steps: int) -> None:
    """The options of the scripts that trace one implementation's steps (heap_trace.py,
    own_cpu.py, gather_waits.py): the model shape and batch, warm-up and traced steps."""
    p.add_argument("--shape", choices=sorted(SHAPES), default=shape)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--steps", type=int, default=steps)


def trace_config(args: argparse.Namespace) -> Dict[str, Any]:
    """The model and batch configuration ``add_trace_arguments`` options describe."""
    return {**SHAPES[args.shape], "vocab": args.vocab, "batch": args.batch, "seq": args.seq}


def start_rank(rank: int, world: int, init_file: str, threads: int = 1) -> None:
    """Join the gloo group of ``world`` ranks that rendezvous at ``init_file``, computing on ``threads`` threads."""
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def end_rank() -> None:
    """Wait for the other ranks, then leave the process group (once the caller dropped its
    model and optimizer)."""
    dist.barrier()
    gc.collect()  # before the process group goes (gloo can abort at exit otherwise)
    dist.destroy_process_group()


def make_trainee(impl: str, options: Dict[str, Any], cfg: Dict[str, Any], rank: int) -> Tuple[torch.nn.Module, Any]:
    """(model, optimizer) of the benchmark's GPT under ``impl`` (a DeepSpeed engine is both)."""
    example = _example()
    if impl == "deepspeed":
        engine = _deepspeed(build_model(example, cfg), cfg, rank)
        return engine, engine
    model = _wrap(impl, build_model(example, cfg), example.TransformerBlock, options)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def training_step(
    model: torch.nn.Module, optim: Any, cfg: Dict[str, Any], rank: int,
    mark: Callable[[str], None] = lambda phase: None,
) -> Callable[[], None]:
    """One training step on a new random batch of this rank's own stream; ``mark`` is told
    where each phase (PHASES, then "end") begins. A DeepSpeed engine is both ``model`` and
    ``optim`` (it zeroes the gradients in its own step)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    if optim is model:
        backward = model.backward
    else:
        def backward(loss: torch.Tensor) -> None:
            optim.zero_grad(set_to_none=True)
            loss.backward()

    def one_step() -> None:
        mark("forward")
        tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        mark("backward")
        backward(loss)
        mark("optimizer")
        optim.step()
        mark("end")

    return one_step


PHASES = ("forward", "backward", "optimizer")
# Per phase, where the thread running the step spent its wall time (all per rank and step).
SPLIT = ("wall", "cpu", "runnable", "asleep")


def _schedstat(tid: int) -> Optional[Tuple[int, int]]:
    """(nanoseconds thread ``tid`` of this process has run on a core, nanoseconds it was
    runnable but waited for one), from Linux's schedstat; None elsewhere or once it ended."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            ran, waited = f.read().split()[:2]
        return int(ran), int(waited)
    except (OSError, ValueError):
        return None


def _thread_clocks() -> List[float]:
    """[wall seconds, seconds this thread has run on a core, seconds it was runnable but
    waited for one, wall seconds again]. The CPU time is the thread's CPU clock, current when
    read (schedstat's run time lags by up to a tick for the running thread); the waiting time
    is schedstat's, which changes only while the thread waits. The wall clock is read before
    and after the others: see [Note: where the wall time goes]."""
    wall, cpu = time.perf_counter(), time.thread_time()
    stat = _schedstat(threading.get_native_id())
    return [wall, cpu, stat[1] / 1e9 if stat is not None else 0.0, time.perf_counter()]


class PhaseClock:
    """[Note: where the wall time goes] Splits each phase of a step into the time the step's
    thread ran on a core, the time it was runnable while other threads had the cores (with
    the ranks sharing the cores, gloo's threads of any rank, or another rank's step), and the
    rest, the time it slept: blocked in a collective's wait (or DDP's end-of-backward sync).
    Comparing implementations phase by phase shows whether a difference is work (CPU),
    competition for the cores, or communication waited on.

    A phase's wall time runs from the wall clock read before its first reading of the other
    clocks to the one read after its last. Were one wall reading used for both, a thread
    preempted between the wall and schedstat reads at a phase's end would have that wait
    counted as runnable in the phase but not in its wall time (seen under load: 2 ms of wall,
    6 ms runnable). This way the wall time always contains what the other clocks measured;
    the reading itself (microseconds, or the wait of a thread preempted during it) counts in
    the wall time of both phases around it."""

    def __init__(self, read: Callable[[], List[float]] = _thread_clocks) -> None:
        self.on = False
        self.totals = {phase: [0.0] * len(SPLIT) for phase in PHASES}
        self._read = read
        self._phase = ""
        self._since = [0.0, 0.0, 0.0]

    def mark(self, phase: str) -> None:
        """``phase`` begins now (and the one before ends): its time is added to ``totals``
        when the clock is ``on`` and the phase is one of ``PHASES`` (not "end")."""
        now = self._read()  # (wall, cpu, runnable[, wall after]: see the note)
        if self.on and self._phase in self.totals:
            wall = (now[3] if len(now) > 3 else now[0]) - self._since[0]
            cpu, runnable = now[1] - self._since[1], now[2] - self._since[2]
            for i, value in enumerate((wall, cpu, runnable, max(wall - cpu - runnable, 0.0))):
                self.totals[self._phase][i] += value
        self._phase, self._since = phase, now


def _loopback_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])  # transmitted bytes
    return 0


def shared_memory_channels(model: Any) -> List[Any]:
    """The shared-memory channels of a flatshard model's handles ([Note: shared-memory
    exchange] in ``flatshard/_comm/_shared_memory.py``), each once; none for anything else."""
    channels = {}
    for module in model.modules():
        for handle in getattr(getattr(module, "_unit", None), "handles", ()):
            channel = getattr(handle.comm, "channel", None)
            if channel is not None:
                channels[id(channel)] = channel
    return list(channels.values())


def _shared_memory_bytes(model: Any) -> int:
    """What this rank has given its peer through shared memory so far."""
    return sum(getattr(channel, "published_bytes", 0) for channel in shared_memory_channels(model))


def _thread_cpu() -> Dict[int, int]:
    """CPU nanoseconds each thread of this process has run (Linux; empty elsewhere)."""
    try:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return {}
    stats = {tid: _schedstat(tid) for tid in tids}
    return {tid: stat[0] for tid, stat in stats.items() if stat is not None}  # (ended ones left out)


def _cpu_split(before: Dict[int, int], after: Dict[int, int], steps: int) -> List[float]:
    """[seconds per step of the thread running the steps, of all other threads]."""
    me = threading.get_native_id()
    main = (after.get(me, 0) - before.get(me, 0)) / 1e9
    others = sum(ns - before.get(tid, 0) for tid, ns in after.items() if tid != me) / 1e9
    return [main / steps, others / steps]


def _rank(rank: int, world: int, init_file: str, label: str, impl: str, options: Dict[str, Any], cfg: Dict[str, Any], out: str) -> None:
    if options.get("flatshard_path"):  # another checkout's flatshard (--baseline)
        sys.path.insert(0, options["flatshard_path"])
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # (read when deepspeed is imported)
    start_rank(rank, world, init_file, cfg["threads"])
    model, optim = make_trainee(impl, options, cfg, rank)
    clock = PhaseClock()
    one_step = training_step(model, optim, cfg, rank, clock.mark)
    times: List[float] = []
    sent = faults = shared = 0
    cpu_before: Dict[int, int] = {}
    started = 0.0

    for step in range(cfg["warmup"] + cfg["steps"]):
        if step == cfg["warmup"]:
            dist.barrier()
            sent = _loopback_bytes()
            shared = _shared_memory_bytes(model)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            cpu_before, started = _thread_cpu(), time.perf_counter()
            clock.on = True
        dist.barrier()
        start = time.perf_counter()
        one_step()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= cfg["warmup"]:
            times.append(elapsed.item())
    dist.barrier()
    wall = time.perf_counter() - started
    clock.on = False
    phases = torch.tensor([clock.totals[phase] for phase in PHASES], dtype=torch.float64)
    dist.all_reduce(phases)  # summed over ranks
    phases /= world * cfg["steps"]
    cpu = torch.tensor(_cpu_split(cpu_before, _thread_cpu(), cfg["steps"]))
    dist.all_reduce(cpu)  # summed over ranks
    # (loopback counts every rank's traffic on the machine; shared memory, this rank's)
    shared = torch.tensor([float(_shared_memory_bytes(model) - shared)])
    dist.all_reduce(shared)
    sent = _loopback_bytes() - sent + shared.item()
    faults = torch.tensor([float(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)])
    dist.all_reduce(faults, op=dist.ReduceOp.MAX)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    result = {
        "label": label, "times": times, "peak_rss": peak.item(), "bytes_per_step": sent / cfg["steps"] / world,
        "faults_per_step": faults.item() / cfg["steps"],
        # per rank and step, averaged over the ranks; and the share of the cores' time in use
        "cpu_main": cpu[0].item() / world, "cpu_other": cpu[1].item() / world,
        "busy": cpu.sum().item() * cfg["steps"] / ((os.cpu_count() or 1) * wall) if wall > 0 else 0.0,
        "phases": {phase: dict(zip(SPLIT, row)) for phase, row in zip(PHASES, phases.tolist())},
    }
    if cfg["profile"] and impl == "flatshard":
        result["profile"] = _profile(rank, one_step, cfg, statistics.median(times), result["bytes_per_step"])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    del model, optim
    end_rank()


def _profile(rank: int, one_step: Any, cfg: Dict[str, Any], median: float, sent: float) -> str:
    """Rank 0 profiles ``cfg['profile']`` more steps (the others run them unprofiled, so the
    collectives pair up); see ``profile_step``."""
    import profile_step

    bandwidth = profile_step.loopback_bandwidth()
    latency = profile_step.collective_latency()
    dist.barrier()
    if rank != 0:
        for _ in range(cfg["profile"]):
            one_step()
        return ""
    profiled, parts = profile_step.profile_steps(one_step, cfg["profile"])
    return profile_step.report(median, profiled, parts, sent, bandwidth, latency)


def run(label: str, impl: str, options: Dict[str, Any], cfg: Dict[str, Any]) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(cfg["world_size"], os.path.join(tmp, "rdv"), label, impl, options, cfg, out), nprocs=cfg["world_size"])
        with open(out) as f:
            return json.load(f)


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def table(results: Dict[str, Dict[str, Any]], reference: str = "flatshard") -> str:
    lines = [
        f"| implementation | median step (s) | peak RSS / rank | sent / rank / step | page faults / rank / step "
        f"| CPU / rank / step: step thread + gloo threads | cores busy | {reference} / it: step | memory | bytes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ref = results[reference]
    for label, r in results.items():
        lines.append(
            f"| {label} | {r['median']:.3f} | {_size(r['peak_rss'])} | {_size(r['bytes_per_step'])} | {r['faults_per_step']:,.0f} | "
            f"{r['cpu_main'] * 1e3:.0f} + {r['cpu_other'] * 1e3:.0f} ms | {r['busy']:.0%} | "
            f"{ref['median'] / r['median']:.2f} | {ref['peak_rss'] / r['peak_rss']:.2f} | "
            f"{ref['bytes_per_step'] / max(r['bytes_per_step'], 1):.2f} |"
        )
    return "\n".join(lines)


def phase_table(results: Dict[str, Dict[str, Any]]) -> str:
    """Per phase and implementation: wall = CPU + runnable + asleep, in ms per rank and step
    (see [Note: where the wall time goes])."""
    head = " | ".join(f"{phase}: wall = CPU + runnable + asleep" for phase in (*PHASES, "step"))
    lines = [f"| implementation | {head} |", "|---|" + "---|" * (len(PHASES) + 1)]
    for label, r in results.items():
        rows = [[r["phases"][phase][key] for key in SPLIT] for phase in PHASES]
        rows.append([sum(column) for column in zip(*rows)])
        cells = (f"{w * 1e3:.0f} = {c * 1e3:.0f} + {q * 1e3:.0f} + {s * 1e3:.0f}" for w, c, q, s in rows)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The model shapes of RESULTS.md.
SHAPES: Dict[str, Dict[str, Any]] = {
    "default": {"layers": 8, "dim": 256, "heads": 4, "untied": False},
    "untied8": {"layers": 8, "dim": 256, "heads": 8, "untied": True},
    "wide": {"layers": 12, "dim": 512, "heads": 8, "untied": False},
    "deep": {"layers": 24, "dim": 128, "heads": 4, "untied": False},  # many small units
}

VARIANTS = {
    "flatshard": ("flatshard", {}),
    "fsdp1": ("fsdp1", {}),
    "fsdp2": ("fsdp2", {}),
    "ddp": ("ddp", {}),
    "deepspeed": ("deepspeed", {}),  # ZeRO-3; needs the deepspeed extra
    "flatshard SHARD_GRAD_OP": ("flatshard", {"sharding_strategy": "SHARD_GRAD_OP"}),
    "fsdp1 SHARD_GRAD_OP": ("fsdp1", {"sharding_strategy": "SHARD_GRAD_OP"}),
    "flatshard NO_SHARD": ("flatshard", {"sharding_strategy": "NO_SHARD"}),
    "fsdp1 NO_SHARD": ("fsdp1", {"sharding_strategy": "NO_SHARD"}),
    "flatshard BACKWARD_POST": ("flatshard", {"backward_prefetch": "BACKWARD_POST"}),
    "fsdp1 BACKWARD_POST": ("fsdp1", {"backward_prefetch": "BACKWARD_POST"}),
    "flatshard no prefetch": ("flatshard", {"backward_prefetch": "None"}),
    "fsdp1 no prefetch": ("fsdp1", {"backward_prefetch": "None"}),
    "flatshard forward_prefetch": ("flatshard", {"forward_prefetch": True}),
    "fsdp1 forward_prefetch": ("fsdp1", {"forward_prefetch": True}),
    "flatshard bf16": ("flatshard", {"mixed_precision": "bf16"}),
    "fsdp1 bf16": ("fsdp1", {"mixed_precision": "bf16"}),
    "flatshard use_orig_params": ("flatshard", {"use_orig_params": True}),
    "fsdp1 use_orig_params": ("fsdp1", {"use_orig_params": True}),
    "flatshard activation_checkpointing": ("flatshard", {"activation_checkpointing": True}),
    "fsdp1 activation_checkpointing": ("fsdp1", {"activation_checkpointing": True}),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), help="a preset model shape (overrides --layers/--dim/--heads/--untied)")
    p.add_argument("--untied", action="store_true", help="no tied embedding/head")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS", help="profile STEPS more steps of each flatshard variant (rank 0)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2, help="each implementation runs once per round, order alternating")
    p.add_argument("--variants", default="flatshard,fsdp1,fsdp2,ddp", help=f"comma-separated, from: {', '.join(VARIANTS)}")
    p.add_argument(
        "--baseline", metavar="DIR",
        help="also run 'flatshard (baseline)': the flatshard package of another checkout (e.g. a git worktree "
        "of an earlier commit), side by side with this one",
    )
    args = p.parse_args()
    if args.baseline:
        VARIANTS["flatshard (baseline)"] = ("flatshard", {"flatshard_path": os.path.abspath(args.baseline)})
        args.variants += ",flatshard (baseline)"
    if args.shape:
        for key, value in SHAPES[args.shape].items():
            setattr(args, key, value)
    keys = ("layers", "dim", "heads", "untied", "batch", "seq", "vocab", "world_size", "threads", "warmup", "steps", "profile")
    cfg = {k: getattr(args, k) for k in keys}
    labels = [v.strip() for v in args.variants.split(",")]
    unknown = [label for label in labels if label not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from: {', '.join(VARIANTS)}")
    if "deepspeed" in labels and importlib.util.find_spec("deepspeed") is None:
        p.error('the deepspeed variant needs DeepSpeed in this environment: pip install -e ".[deepspeed]"')
    collected: Dict[str, List[Dict[str, Any]]] = {label: [] for label in labels}
    for round_index in range(args.rounds):
        order = labels if round_index % 2 == 0 else list(reversed(labels))
        for label in order:
            impl, options = VARIANTS[label]
            collected[label].append(run(label, impl, options, cfg))
            print(f"round {round_index + 1}: {label}: {statistics.median(collected[label][-1]['times']):.3f} s/step", flush=True)
    results = {
        label: {
            "median": statistics.median(t for r in runs for t in r["times"]),
            "peak_rss": max(r["peak_rss"] for r in runs),
            "bytes_per_step": statistics.median(r["bytes_per_step"] for r in runs),
            "faults_per_step": statistics.median(r.get("faults_per_step", 0.0) for r in runs),
            **{key: statistics.median(r[key] for r in runs) for key in ("cpu_main", "cpu_other", "busy")},
            # means, so that each run's wall = CPU + runnable + asleep still holds
            "phases": {
                phase: {key: statistics.fmean(r["phases"][phase][key] for r in runs) for key in SPLIT}
                for phase in PHASES
            },
        }
        for label, runs in collected.items()
    }
    command = "python bench/bench.py " + " ".join(sys.argv[1:])
    print(f"\n{command}\n{platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__}, config {cfg}\n")
    print(table(results, labels[0]))
    print("\nWhere the step's thread spends each phase (ms per rank and step, means over the runs):\n")
    print(phase_table(results))
    for label, runs in collected.items():
        for r in runs[-1:]:
            if r.get("profile"):
                print(f"\n### {label}: where a step goes\n\n{r['profile']}")
                if "ddp" in results:  # the physical limit: same compute, one all-reduce
                    print(f"DDP's step in this run: {results['ddp']['median'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()

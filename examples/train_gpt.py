"""Train a small GPT-style model with flatshard.

    python examples/train_gpt.py                 # starts 2 local CPU ranks (gloo) by itself
    torchrun --nproc-per-node 4 examples/train_gpt.py --steps 50   # the launcher's ranks
    python examples/train_gpt.py --steps 30 --save ckpt          # sharded checkpoint at the end
    python examples/train_gpt.py --steps 60 --resume ckpt        # continues from step 30
    python examples/train_gpt.py --full-checkpoint model.pt      # one file a plain model loads
    torchrun --nproc-per-node 2 --max-restarts 5 examples/train_gpt.py --steps 1000 \
        --resume ckpt --save-every 50 --keep 3                   # survives killed ranks
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 2 --nproc-per-node 2 \
        --rdzv-backend c10d --rdzv-endpoint HOST:29500 --max-restarts 3 examples/train_gpt.py \
        --strategy HYBRID_SHARD --resume ckpt --save-every 50          # on each node

Checkpoints are ``flatshard.RunCheckpoints``: ``ckpt/step-00000050/`` and so on, each published
atomically (complete or invisible); ``--resume`` loads the newest complete one (model,
optimizer, step, data position and each rank's RNG state), or starts at step 1 if there is none,
so the same command line starts a run and restarts it.

``transformer_auto_wrap_policy`` makes each transformer block its own sharded unit; the
embedding (tied to the output head) and the final norm live in the root unit. The corpus is generated deterministically (a random
Markov chain), so nothing is downloaded and the loss visibly falls.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import resource
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from typing import Any, Dict, Optional

# torch warns at import when NumPy is missing, but training needs no NumPy (only --save/--resume
# do, through torch.distributed.checkpoint: setup.py's `checkpoint` extra installs it). So exactly
# that warning is silenced, before torch is imported; mp.spawn's ranks run this line again.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy: No module named 'numpy'", category=UserWarning)

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import flatshard
from flatshard import (
    BackwardPrefetch,
    FullStateDictConfig,
    MixedPrecision,
    RunCheckpoints,
    ShardedDataParallel,
    ShardingStrategy,
    StateDictType,
    transformer_auto_wrap_policy,
)

DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied input/output embedding

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def markov_batch(step: int, rank: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """Sequences from a fixed random Markov chain where each token has 3 likely successors."""
    chain = torch.Generator().manual_seed(0)
    successors = torch.randint(0, vocab, (vocab, 3), generator=chain)
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    for t in range(seq):
        pick = torch.randint(0, 3, (batch,), generator=gen)
        tokens[:, t + 1] = successors[tokens[:, t], pick]
    return tokens


def build(args: argparse.Namespace, device: torch.device) -> ShardedDataParallel:
    torch.manual_seed(args.seed)  # every rank builds the same initial model
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq)
    dtype = DTYPES[args.mixed_precision]
    prefetch = None if args.backward_prefetch == "None" else BackwardPrefetch[args.backward_prefetch]
    return ShardedDataParallel(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock}),
        sharding_strategy=ShardingStrategy[args.strategy],
        backward_prefetch=prefetch,
        forward_prefetch=args.forward_prefetch,
        mixed_precision=MixedPrecision(param_dtype=dtype, buffer_dtype=dtype) if dtype else None,
        device_id=device,
    )


class MarkovData:
    """This rank's batches, one per step, with a position that checkpoints save and restore (a
    resumed run sees exactly the batches the uninterrupted run would have seen)."""

    def __init__(self, rank: int, args: argparse.Namespace) -> None:
        self.rank, self.args = rank, args
        self.next_step = 1

    def next_batch(self) -> torch.Tensor:
        tokens = markov_batch(self.next_step, self.rank, self.args.batch, self.args.seq, self.args.vocab)
        self.next_step += 1
        return tokens

    def state_dict(self) -> Dict[str, Any]:
        return {"next_step": self.next_step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.next_step = int(state["next_step"])


def checkpoints(args: argparse.Namespace, model: ShardedDataParallel, optim: torch.optim.Optimizer) -> Optional[RunCheckpoints]:
    """The run's checkpoints: in --save (else the --resume directory), every --save-every steps."""
    directory = args.save or args.resume
    if directory is None:
        return None
    return RunCheckpoints(directory, model, optim, save_every=args.save_every, keep=args.keep)


def resume(run: RunCheckpoints, directory: str, data: MarkovData) -> int:
    """Load the newest complete checkpoint in ``directory`` (at any world size) into the model,
    optimizer and data; returns the first step to run (1 if there is none)."""
    source = run if os.path.abspath(directory) == os.path.abspath(run.directory) else RunCheckpoints(directory, run.model, run.optimizer)
    resumed = source.resume()
    if resumed is None:
        return 1
    data.load_state_dict(resumed.state["data"])
    if resumed.rank_state is not None:  # saved at this world size: this rank's RNG state
        torch.set_rng_state(resumed.rank_state["torch_rng"])
    return resumed.step + 1


def run_state(data: MarkovData) -> Dict[str, Any]:
    """What a checkpoint keeps besides model and optimizer: the data position (the same on every
    rank) ..."""
    return {"data": data.state_dict()}


def rank_state() -> Dict[str, Any]:
    """... and this rank's RNG state (unused by this model, kept as a template for dropout)."""
    return {"torch_rng": torch.get_rng_state()}


def save_full(model: ShardedDataParallel, path: str) -> None:
    """The unwrapped model's state dict in one file, gathered unit by unit onto rank 0."""
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with ShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        state = model.state_dict()
    if dist.get_rank() == 0:
        torch.save(state, path)


def memory_per_rank() -> str:
    """Peak resident memory of every rank, in MiB."""
    mine = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    everyone = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return "/".join(f"{m.item():.0f}" for m in everyone) + " MiB"


def report(step: int, args: argparse.Namespace, loss: float, tokens_per_s: float, memory: str) -> None:
    """Rank 0's progress: a live bar on a terminal, one line per logged step otherwise."""
    line = f"step {step:4d}  loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s  mem {memory}"
    if sys.stdout.isatty():
        done = int(30 * step / args.steps)
        print(f"\r[{'#' * done}{'.' * (30 - done)}] {line}", end="\n" if step == args.steps else "", flush=True)
    else:
        print(line, flush=True)


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    model = build(args, device)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = MarkovData(rank, args)
    run = checkpoints(args, model, optim)
    first = resume(run, args.resume, data) if run is not None and args.resume else 1
    if rank == 0:
        total = sum(h.numel for m in ShardedDataParallel.fsdp_modules(model) for h in m.handles)
        where = "" if not args.resume else f", resumed at step {first}" if first > 1 else f", no checkpoint in {args.resume}: starting at step 1"
        print(f"{world} ranks, {total:,} parameters, {args.strategy}, device {device}{where}", flush=True)
    start = time.perf_counter()
    saved = first - 1 if first > 1 else None
    for step in range(first, args.steps + 1):
        tokens = data.next_batch().to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if step % args.log_every == 0 or step == args.steps:
            mean_loss = loss.detach().float().clone()
            dist.all_reduce(mean_loss)
            memory = memory_per_rank()
            tokens_per_s = (step - first + 1) * world * args.batch * args.seq / (time.perf_counter() - start)
            if rank == 0:
                report(step, args, mean_loss.item() / world, tokens_per_s, memory)
        if run is not None and run.maybe_save(step, run_state(data), rank_state()):
            saved = step
    if run is not None and (saved is None or saved < args.steps):  # (a resumed later step stays as it is)
        run.save(args.steps, run_state(data), rank_state())
    if args.full_checkpoint:
        save_full(model, args.full_checkpoint)
    if rank == 0:
        print(f"done: {args.steps} steps; the best possible loss here is ln 3 = {math.log(3):.4f}", flush=True)


def _spawned(rank: int, world: int, init_file: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timeout)
    try:
        train(args)
    finally:
        _shutdown()


def _shutdown() -> None:
    # flatshard's destroy_process_group frees the groups while Python still runs; torch's alone can
    # leave a gloo group to die at interpreter exit, which can abort the finished process
    # (docs/training.md, "Ending a job").
    flatshard.destroy_process_group()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--strategy", choices=[s.name for s in ShardingStrategy], default="FULL_SHARD",
        help="HYBRID_SHARD / _HYBRID_SHARD_ZERO2: shard within each node, replicate across nodes (the node size is "
        "the launcher's LOCAL_WORLD_SIZE; started without torchrun, the ranks of each host, here all --nproc ranks)",
    )
    p.add_argument("--nproc", type=int, default=2, help="local CPU ranks to start when not under torchrun")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--backward-prefetch", choices=["BACKWARD_PRE", "BACKWARD_POST", "None"], default="BACKWARD_PRE")
    p.add_argument("--forward-prefetch", action="store_true")
    p.add_argument("--mixed-precision", choices=list(DTYPES), default="none", help="compute dtype (this CPU: slow)")
    p.add_argument("--save", metavar="DIR", help="checkpoint directory: a checkpoint (model, optimizer, step, data position) at the end")
    p.add_argument("--save-every", type=int, default=0, metavar="N", help="also a checkpoint every N steps (into --save, else --resume)")
    p.add_argument("--keep", type=int, default=None, metavar="K", help="keep only the newest K checkpoints (default: all)")
    p.add_argument("--resume", metavar="DIR", help="continue from the newest complete checkpoint in DIR (any world size); none yet: start at step 1")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="process-group timeout: ranks waiting for a dead peer fail within it")
    p.add_argument("--full-checkpoint", metavar="FILE", help="write the unwrapped model's state dict (rank 0)")
    args = p.parse_args()
    if args.save_every and not (args.save or args.resume):
        p.error("--save-every needs a checkpoint directory: --save DIR or --resume DIR")
    return args


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
        try:
            train(args)
        finally:
            _shutdown()
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(args.nproc, os.path.join(tmp, "rendezvous"), args), nprocs=args.nproc)


if __name__ == "__main__":
    main()

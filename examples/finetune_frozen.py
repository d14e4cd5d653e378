"""Fine-tune small adapters inside a frozen model with flatshard (the LoRA / adapter case).

    python examples/finetune_frozen.py                   # starts 2 local CPU ranks (gloo) by itself
    torchrun --nproc-per-node 4 examples/finetune_frozen.py --steps 50 --out adapters.pt

The "pretrained" base is a small GPT-style model whose weights come from ``--seed`` (nothing is
downloaded). Every transformer block also holds a low-rank adapter ``Linear(dim, rank) ->
Linear(rank, dim)``, added residually and zero-initialised, so training starts from the base model
exactly. All base weights have ``requires_grad=False``; only the adapters train.

``transformer_auto_wrap_policy`` makes each block one unit, so every unit mixes frozen and
trainable parameters: flatshard gives such a unit two ``FlatParameter``s, one per ``requires_grad``
group. The frozen one gets no gradient and no reduce-scatter, and the optimizer is built over the
trainable parameters only. The task is next-token prediction on a deterministic Markov-chain corpus.

At the end, a FULL state dict (gathered unit by unit onto rank 0's CPU) is filtered down to the
adapter parameters and saved with ``torch.save``; it loads into the plain model with
``load_state_dict(adapters, strict=False)``. ``--check`` also verifies, through
``summon_full_params``, that the frozen weights are bit-for-bit the pretrained ones.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import flatshard
from flatshard import FullStateDictConfig, ShardedDataParallel, StateDictType, transformer_auto_wrap_policy


class Adapter(nn.Module):
    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim, bias=False)
        nn.init.zeros_(self.up.weight)  # x + adapter(x) starts as x: training begins at the base model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class Block(nn.Module):
    """A pre-norm transformer block (frozen) with a trainable adapter inside it."""

    def __init__(self, dim: int, heads: int, rank: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.adapter = Adapter(dim, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(self.ln1(x)).split(d, -1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        x = x + self.mlp(self.ln2(x))
        return x + self.adapter(x)


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int, rank: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, rank) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def build_model(args: argparse.Namespace) -> GPT:
    """The pretrained base (weights from ``args.seed``) with fresh adapters; only adapters train."""
    torch.manual_seed(args.seed)  # every rank (and the test) builds the same model
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq, args.rank)
    for name, p in model.named_parameters():
        p.requires_grad_(".adapter." in name)
    return model


def markov_batch(step: int, rank: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """Sequences from a fixed random Markov chain where each token has 2 likely successors."""
    successors = torch.randint(0, vocab, (vocab, 2), generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    for t in range(seq):
        tokens[:, t + 1] = successors[tokens[:, t], torch.randint(0, 2, (batch,), generator=gen)]
    return tokens


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    model = build_model(args)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    pretrained = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    model = ShardedDataParallel(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        device_id=device,
    )
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    if rank == 0:
        handles = [h for m in ShardedDataParallel.fsdp_modules(model) for h in m.handles]
        n_train = sum(h.numel for h in handles if h.requires_grad)
        print(f"{world} ranks, {len(handles)} flat parameters, {n_train:,} of "
              f"{sum(h.numel for h in handles):,} parameters trainable", flush=True)
    for step in range(1, args.steps + 1):
        tokens = markov_batch(step, rank, args.batch, args.seq, args.vocab).to(device)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            print(f"step {step:4d}  loss {mean_loss.item() / world:.4f}", flush=True)

    if args.check:  # every rank compares its full copy of the frozen weights with the pretrained ones
        with ShardedDataParallel.summon_full_params(model, writeback=False):
            full = {n: p.detach().cpu() for n, p in model.named_parameters() if n in pretrained}
            same = full.keys() == pretrained.keys() and all(torch.equal(full[n], pretrained[n]) for n in full)
        ok = torch.tensor([float(same)], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not ok.item():
            raise RuntimeError("frozen weights changed during fine-tuning")
        if rank == 0:
            print("frozen weights unchanged", flush=True)

    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with ShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()  # collective; {} on ranks other than 0
    if rank == 0:
        adapters = {k: v for k, v in state.items() if k in trainable}
        if args.out is None:
            fd, args.out = tempfile.mkstemp(prefix="adapters-", suffix=".pt")
            os.close(fd)
        torch.save(adapters, args.out)
        print(f"saved {len(adapters)} adapter tensors to {args.out}", flush=True)


def _spawned(rank: int, world: int, init_file: str, args: argparse.Namespace) -> None:  # as in train_gpt.py
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        train(args)
    finally:
        _shutdown()


def _shutdown() -> None:
    flatshard.destroy_process_group()  # as in train_gpt.py: the groups are freed before exit


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--rank", type=int, default=8, help="adapter rank")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-2)
    p.add_argument("--nproc", type=int, default=2, help="local CPU ranks to start when not under torchrun")
    p.add_argument("--seed", type=int, default=0, help="seed of the pretrained base weights")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--out", help="where to save the adapter state dict (default: a temporary file)")
    p.add_argument("--check", action="store_true", help="verify the frozen weights are unchanged after training")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        try:
            train(args)
        finally:
            _shutdown()
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(args.nproc, os.path.join(tmp, "rendezvous"), args), nprocs=args.nproc)


if __name__ == "__main__":
    main()

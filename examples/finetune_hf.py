"""Fine-tune a Hugging Face causal LM with flatshard, save it in Hugging Face's format, generate.

    python examples/finetune_hf.py                          # 2 local CPU ranks, a tiny Llama from a config
    python examples/finetune_hf.py --arch gpt2 --steps 40   # a tiny GPT-2 instead
    python examples/finetune_hf.py --model PATH_OR_NAME     # a pretrained model (from_pretrained)
    python examples/finetune_hf.py --steps 20 --save ckpt   # sharded checkpoint at the end
    python examples/finetune_hf.py --steps 40 --resume ckpt # continues from step 20
    python examples/finetune_hf.py --steps 400 --resume ckpt --save-every 50 --keep 2  # survives killed ranks
    torchrun --nproc-per-node 4 examples/finetune_hf.py     # the launcher's ranks

Each decoder layer is a unit (``transformer_auto_wrap_policy`` on the model's decoder layer
class); computation in bfloat16 (``--mixed-precision none`` for float32), activation
checkpointing per layer (Hugging Face's own), a generated corpus (nothing to download unless
``--model`` names a hub model). At the end the model is written with ``save_pretrained`` (on every
rank, rank 0 writing: the wrapped model's state dict is the full one, gathered unit by unit),
loaded back with ``from_pretrained`` and both generate the same tokens. Checkpoints are
``flatshard.RunCheckpoints`` (``ckpt/step-00000050/``, each published atomically; ``--resume``
loads the newest complete one, at any world size; the batches follow from the step, so a resumed
run sees the batches an uninterrupted one would). Needs the ``hf`` extra.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from torch import nn

import flatshard
from flatshard import MixedPrecision, RunCheckpoints, ShardedDataParallel, transformer_auto_wrap_policy

TINY = {
    "llama": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128),
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, n_positions=128),
}


def load_model(args: argparse.Namespace) -> nn.Module:
    """The model: ``--model`` through ``from_pretrained``, else a tiny one from a config (seeded,
    so every rank builds the same weights)."""
    torch.manual_seed(args.seed)
    if args.model:
        return transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = transformers.AutoConfig.for_model(args.arch, vocab_size=args.vocab, bos_token_id=0, eos_token_id=1,
                                               pad_token_id=1, **TINY[args.arch])
    return transformers.AutoModelForCausalLM.from_config(config)


def decoder_layer_class(model: nn.Module) -> type:
    """The class Hugging Face keeps whole (``_no_split_modules``): the decoder layer."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in names:
            return type(module)
    raise ValueError(f"{type(model).__name__} names no decoder layer class in _no_split_modules ({sorted(names)})")


def build(args: argparse.Namespace) -> ShardedDataParallel:
    model = load_model(args)
    model.activation_checkpointing_enable({"use_reentrant": False})  # per decoder layer, inside its unit
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={decoder_layer_class(model)})
    precision = MixedPrecision(param_dtype=torch.bfloat16) if args.mixed_precision == "bf16" else None
    return ShardedDataParallel(model, auto_wrap_policy=policy, mixed_precision=precision, use_orig_params=True)


def batch(step: int, rank: int, args: argparse.Namespace, vocab: int) -> torch.Tensor:
    """A deterministic corpus to fine-tune on: token t is followed by t + 1 or t + 2."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(2, vocab, (args.batch, 1), generator=gen)
    steps = torch.randint(1, 3, (args.batch, args.seq - 1), generator=gen)
    return 2 + (start - 2 + torch.cat([torch.zeros_like(start), steps.cumsum(1)], 1)) % (vocab - 2)


def checkpoints(args: argparse.Namespace, model: ShardedDataParallel, optim: torch.optim.Optimizer) -> Optional[RunCheckpoints]:
    """Where this run's checkpoints go (``--save``, else the ``--resume`` directory)."""
    directory = args.save or args.resume
    if directory is None:
        return None
    return RunCheckpoints(directory, model, optim, save_every=args.save_every, keep=args.keep)


def resume(run: RunCheckpoints, directory: str) -> int:
    """The first step to run after loading the newest complete checkpoint in ``directory``
    (1 if it has none); the batches follow from the step."""
    source = run if os.path.abspath(directory) == os.path.abspath(run.directory) else RunCheckpoints(directory, run.model, run.optimizer)
    resumed = source.resume()
    return 1 if resumed is None else resumed.step + 1


def progress(step: int, total: int, loss: float, tokens_per_s: float) -> None:
    """Rank 0's progress: a live bar on a terminal, a line per logged step otherwise."""
    line = f"step {step:4d}  loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s"
    if sys.stdout.isatty():
        done = int(30 * step / total)
        print(f"\r[{'#' * done}{'.' * (30 - done)}] {line}", end="\n" if step == total else "", flush=True)
    else:
        print(line, flush=True)


def finetune(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args)
    vocab = model.config.vocab_size
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    run = checkpoints(args, model, optim)
    first = resume(run, args.resume) if run is not None and args.resume else 1
    if rank == 0:
        where = f", resumed at step {first}" if args.resume else ""
        print(f"{world} ranks, {type(model.module).__name__}, {args.mixed_precision}{where}", flush=True)
    start = time.perf_counter()
    saved = first - 1 if first > 1 else None
    model.train()
    for step in range(first, args.steps + 1):
        tokens = batch(step, rank, args, vocab)
        loss = model(input_ids=tokens, labels=tokens).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if step % args.log_every == 0 or step == args.steps:
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            if rank == 0:
                progress(step, args.steps, mean.item() / world, (step - first + 1) * world * tokens.numel() / (time.perf_counter() - start))
        if run is not None and run.maybe_save(step):
            saved = step
    if run is not None and saved != args.steps:
        run.save(args.steps)
    with tempfile.TemporaryDirectory() as scratch:
        export(model, args.output or os.path.join(scratch, "model"), rank)


def export(model: ShardedDataParallel, directory: str, rank: int) -> None:
    """Hugging Face's format through the wrapper (every rank calls; rank 0 writes), loaded back
    with ``from_pretrained``; the wrapped and the loaded model generate the same tokens."""
    model.eval()
    model.save_pretrained(directory, is_main_process=rank == 0)
    dist.barrier()
    prompt = torch.tensor([[2, 3, 4, 5]])
    tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)
    if rank == 0:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(directory)
        again = loaded.generate(prompt, max_new_tokens=8, do_sample=False)
        same = "the same" if torch.equal(tokens, again) else "DIFFERENT"
        print(f"saved to {directory}; generate: {tokens[0].tolist()} ({same} after from_pretrained)", flush=True)
    dist.barrier()


def _spawned(rank: int, world: int, init_file: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timeout)
    try:
        finetune(args)
    finally:
        flatshard.destroy_process_group()  # as in train_gpt.py: the groups are freed before exit


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model path or hub name for from_pretrained (default: a tiny model from a config)")
    p.add_argument("--arch", choices=sorted(TINY), default="llama", help="the tiny model's architecture")
    p.add_argument("--vocab", type=int, default=64, help="the tiny model's vocabulary")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--mixed-precision", choices=["bf16", "none"], default="bf16")
    p.add_argument("--nproc", type=int, default=2, help="local CPU ranks to start when not under torchrun")
    p.add_argument("--save", metavar="DIR", help="write sharded checkpoints (model, optimizer, step) here, at the end and every --save-every steps")
    p.add_argument("--resume", metavar="DIR", help="continue from the newest complete checkpoint in DIR (any world size; step 1 if none)")
    p.add_argument("--save-every", type=int, default=0, metavar="N", help="also save every N steps")
    p.add_argument("--keep", type=int, default=None, metavar="K", help="keep only the newest K checkpoints (default: all)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="process-group timeout: ranks waiting for a dead peer fail within it")
    p.add_argument("--output", metavar="DIR", help="keep the Hugging Face model directory here (default: a temporary one)")
    args = p.parse_args()
    if args.save_every and not (args.save or args.resume):
        p.error("--save-every needs a checkpoint directory: --save DIR or --resume DIR")
    return args


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        try:
            finetune(args)
        finally:
            flatshard.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(args.nproc, os.path.join(tmp, "rendezvous"), args), nprocs=args.nproc)


if __name__ == "__main__":
    main()

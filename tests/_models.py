"""Models, data and training loops shared by the tests (importable by the rank processes).

Truth is single-process training: ``train_reference`` trains the unwrapped model on the
global batch (every rank's batch, concatenated); ``train_wrapped`` trains the wrapped model
with each rank on its slice. Both start from the same seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn

from flatshard import ShardedDataParallel, ShardingStrategy
from flatshard._common import clean_name, join_name

VOCAB = 13
DIM = 8
SEQ = 5
PER_RANK = 2
RTOL = 1e-5
ATOL = 1e-6


@dataclasses.dataclass
class Out:
    """A dataclass forward output, for nested-output tests."""

    logits: torch.Tensor
    extra: Dict[str, Any]


class Block(nn.Module):
    def __init__(self, dim: int = DIM, checkpoint: bool = False, nested_output: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.checkpoint = checkpoint
        self.nested_output = nested_output

    def _residual(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.norm(x))))

    def forward(self, x: torch.Tensor) -> Any:
        if self.checkpoint:
            h = x + torch.utils.checkpoint.checkpoint(self._residual, x, use_reentrant=False)
        else:
            h = x + self._residual(x)
        # the tensor backward needs, buried in a dict of a list of a tuple
        return {"out": [(h, "tag")], "count": 1} if self.nested_output else h


class TinyLM(nn.Module):
    """Embedding tied to the output head, a positional buffer, residual blocks.

    Options for runtime tests: ``reuse_first_block`` applies block 0 twice; ``unused`` adds a
    parameter and a block that never run; ``nested_output`` makes blocks return nested
    containers and the model a dataclass; ``checkpoint`` is ``"inner"`` (blocks checkpoint
    their own computation) or ``"outer"`` (the model checkpoints each block call).
    """

    def __init__(
        self,
        n_blocks: int = 3,
        vocab: int = VOCAB,
        dim: int = DIM,
        reuse_first_block: bool = False,
        unused: bool = False,
        nested_output: bool = False,
        checkpoint: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.register_buffer("pos", torch.linspace(-1.0, 1.0, SEQ * dim).reshape(SEQ, dim))
        self.blocks = nn.ModuleList(
            Block(dim, checkpoint=checkpoint == "inner", nested_output=nested_output) for _ in range(n_blocks)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.reuse_first_block = reuse_first_block
        self.nested_output = nested_output
        self.outer_checkpoint = checkpoint == "outer"
        if unused:
            self.unused_param = nn.Parameter(torch.ones(3))
            self.blocks.append(Block(dim))  # never called: forward runs n_blocks blocks

    def forward(self, tokens: torch.Tensor) -> Any:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        n_blocks = len(self.blocks) - (1 if hasattr(self, "unused_param") else 0)
        order = ([0] if self.reuse_first_block else []) + list(range(n_blocks))
        for index in order:
            block = self.blocks[index]
            if self.outer_checkpoint:
                out = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            else:
                out = block(h)
            h = out["out"][0][0] if self.nested_output else out
        logits = self.head(self.norm(h))
        return Out(logits, {"hidden": (h,)}) if self.nested_output else logits


def build(seed: int = 0, **kwargs: Any) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs)


def wrap(model: nn.Module, mode: str, **options: Any) -> ShardedDataParallel:
    """``single``: one unit; ``nested``: each block its own unit inside the root unit."""
    if mode == "nested":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = ShardedDataParallel(block, **options)
    elif mode != "single":
        raise ValueError(mode)
    return ShardedDataParallel(model, **options)


def batch(step: int, world_size: int, per_rank: int = PER_RANK) -> Tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same on every rank (each rank has its own generator)."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (world_size * per_rank, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (world_size * per_rank, SEQ), generator=gen)
    return tokens, targets


def local(t: torch.Tensor, rank: int, per_rank: int = PER_RANK) -> torch.Tensor:
    return t[rank * per_rank : (rank + 1) * per_rank]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.to(logits.device).flatten())


def make_optim(params: Any, weight_decay: float = 0.01) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=weight_decay)


def train_reference(world_size: int, steps: int = 5, micro_batches: int = 1, **model_kwargs: Any) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """Single-process training on the global batches: (losses, parameters by name)."""
    model = build(**model_kwargs)
    optim = make_optim(model.parameters())
    losses = []
    for step in range(steps):
        optim.zero_grad()
        total = 0.0
        for micro in range(micro_batches):
            tokens, targets = batch(step * micro_batches + micro, world_size)
            loss = lm_loss(model(tokens), targets) / micro_batches
            loss.backward()
            total += loss.item()
        optim.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def global_mean(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def train_wrapped(
    rank: int,
    world_size: int,
    mode: str = "nested",
    steps: int = 5,
    micro_batches: int = 1,
    model_kwargs: Optional[Dict[str, Any]] = None,
    **options: Any,
) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """The same training, sharded: (global losses, full parameters by name).

    With ``micro_batches > 1`` all but the last micro-batch run under ``no_sync``.
    """
    model = wrap(build(**(model_kwargs or {})), mode, **options)
    optim = make_optim(model.parameters())
    losses = []
    for step in range(steps):
        optim.zero_grad()
        total = 0.0
        for micro in range(micro_batches):
            tokens, targets = batch(step * micro_batches + micro, world_size)
            context = model.no_sync() if micro < micro_batches - 1 else contextlib.nullcontext()
            with context:
                loss = lm_loss(model(local(tokens, rank)), local(targets, rank)) / micro_batches
                loss.backward()
            total += global_mean(loss)
        optim.step()
        losses.append(total)
    return losses, full_params(model)


def full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every original parameter (tied ones under each name) gathered from the shards."""
    out: Dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, ShardedDataParallel) and module.handle is not None:
            handle = module.handle
            handle.unshard()
            for param_name, tensor in handle.named_full_views():
                out[join_name(clean_name(name), param_name)] = tensor.clone()
            handle.reshard()
    return out


def assert_same_training(reference: Tuple[List[float], Dict[str, torch.Tensor]], actual: Tuple[List[float], Dict[str, torch.Tensor]]) -> None:
    ref_losses, ref_params = reference
    losses, params = actual
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(ref_losses, dtype=torch.float64), rtol=RTOL, atol=ATOL)
    if sorted(params) != sorted(ref_params):
        raise AssertionError(f"parameter names differ: {sorted(params)} vs {sorted(ref_params)}")
    for name, expected in ref_params.items():
        torch.testing.assert_close(params[name].cpu(), expected.cpu(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def handles(model: nn.Module) -> List[Any]:
    return [m.handle for m in ShardedDataParallel.fsdp_modules(model) if m.handle is not None]


def strategy(name: str) -> ShardingStrategy:
    return ShardingStrategy[name]


def run_parity(rank: int, world_size: int, mode: str, steps: int = 5, micro_batches: int = 1, **options: Any) -> None:
    """Rank function: train sharded and compare with the single-process reference in place."""
    reference = train_reference(world_size, steps=steps, micro_batches=micro_batches)
    assert_same_training(reference, train_wrapped(rank, world_size, mode, steps=steps, micro_batches=micro_batches, **options))


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
from flatshard._base._common import HandleState, clean_name, join_name
from flatshard._checkpoint._checkpointing import guarded_call
from flatshard._comm._collectives import Communicator
from flatshard._comm._guard import make_guard

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


class Box:
    """A container the wrapper cannot look into (for the hidden-output case)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class Block(nn.Module):
    """A residual block. ``output``: ``tensor``; ``nested`` (the tensor in a dict of a list
    of a tuple); ``passthrough`` (also returns its input); ``hidden`` (in a ``Box``)."""

    def __init__(self, dim: int = DIM, checkpoint: bool = False, output: str = "tensor", reentrant: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.checkpoint = checkpoint
        self.reentrant = reentrant
        self.output = output

    def _residual(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.norm(x))))

    def forward(self, x: torch.Tensor) -> Any:
        if self.checkpoint:
            h = x + torch.utils.checkpoint.checkpoint(self._residual, x, use_reentrant=self.reentrant)
        else:
            h = x + self._residual(x)
        if self.output == "nested":
            return {"out": [(h, "tag")], "count": 1}
        if self.output == "passthrough":
            return h, x
        return Box(h) if self.output == "hidden" else h


def unpack(out: Any) -> torch.Tensor:
    """A block's output as one tensor, whatever its ``output`` mode."""
    if isinstance(out, dict):
        return out["out"][0][0]
    if isinstance(out, tuple):
        return out[0] + 0.5 * out[1]
    return out.value if isinstance(out, Box) else out


class WeightOut(nn.Module):
    """Returns its weight itself: an output that aliases the unit's parameters."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim) * 0.1)

    def forward(self) -> torch.Tensor:
        return self.weight


class TinyLM(nn.Module):
    """Embedding tied to the output head, a positional buffer, residual blocks.

    Options for runtime tests: ``reuse_first_block`` applies block 0 twice; ``unused`` adds a
    parameter and a block that never run; ``output`` is the blocks' output mode (``nested``
    also makes the model return a dataclass); ``checkpoint`` is ``"inner"`` (blocks checkpoint
    their own computation) or ``"outer"`` (the model checkpoints each block call), non-reentrant,
    or ``"inner-reentrant"`` / ``"outer-reentrant"``;
    ``frozen_blocks`` freezes those blocks; ``untied_head`` replaces the tied head by a
    ``WeightOut`` module; ``frozen_embed`` freezes the embedding (needs ``untied_head``).
    """

    def __init__(
        self,
        n_blocks: int = 3,
        vocab: int = VOCAB,
        dim: int = DIM,
        reuse_first_block: bool = False,
        unused: bool = False,
        output: str = "tensor",
        checkpoint: Optional[str] = None,
        frozen_blocks: Tuple[int, ...] = (),
        untied_head: bool = False,
        frozen_embed: bool = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.register_buffer("pos", torch.linspace(-1.0, 1.0, SEQ * dim).reshape(SEQ, dim))
        inner = checkpoint is not None and checkpoint.startswith("inner")
        self.reentrant = checkpoint is not None and checkpoint.endswith("reentrant")
        self.blocks = nn.ModuleList(Block(dim, inner, output, self.reentrant) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head: nn.Module = WeightOut(vocab, dim) if untied_head else nn.Linear(dim, vocab, bias=False)
        if not untied_head:
            self.head.weight = self.embed.weight
        for index in frozen_blocks:
            self.blocks[index].requires_grad_(False)
        self.embed.requires_grad_(not frozen_embed)
        self.reuse_first_block = reuse_first_block
        self.untied_head = untied_head
        self.output = output
        self.outer_checkpoint = checkpoint is not None and checkpoint.startswith("outer")
        self.n_used = n_blocks
        if unused:
            self.unused_param = nn.Parameter(torch.ones(3))
            self.blocks.append(Block(dim))  # never called

    def forward(self, tokens: torch.Tensor) -> Any:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        order = ([0] if self.reuse_first_block else []) + list(range(self.n_used))
        for index in order:
            block = self.blocks[index]
            if self.outer_checkpoint:
                h = unpack(torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.reentrant))
            else:
                h = unpack(block(h))
        h = self.norm(h)
        logits = h @ self.head().t() if self.untied_head else self.head(h)
        return Out(logits, {"hidden": (h,)}) if self.output == "nested" else logits


class Outer(nn.Module):
    """A module with no parameters of its own around a model (a root that owns nothing)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, tokens: torch.Tensor) -> Any:
        return self.inner(tokens)


def build(seed: int = 0, **kwargs: Any) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs)


def wrap(model: nn.Module, mode: str, **options: Any) -> ShardedDataParallel:
    """``single``: one unit; ``nested``: each block its own unit inside the root unit;
    ``nested+embed`` / ``nested+head``: the embedding / head too; ``empty_root``: ``nested``
    inside a root that owns no parameters."""
    if mode == "single":
        return ShardedDataParallel(model, **options)
    units = {"nested": [], "nested+embed": ["embed"], "nested+head": ["head"], "empty_root": []}[mode]
    for i, block in enumerate(model.blocks):
        model.blocks[i] = ShardedDataParallel(block, **options)
    for name in units:
        setattr(model, name, ShardedDataParallel(getattr(model, name), **options))
    if mode == "empty_root":
        return ShardedDataParallel(Outer(ShardedDataParallel(model, **options)), **options)
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


def step_on_global_batch(model: nn.Module, optim: torch.optim.Optimizer, step: int, rank: Optional[int] = None, world_size: int = 1, rows: int = 12) -> None:
    """One optimizer step on ``step``'s global batch of ``rows`` rows (the same on every rank);
    with ``rank``, on its even slice of them only (``rows`` divisible by ``world_size``)."""
    tokens, targets = batch(step, 1, per_rank=rows)
    if rank is not None:
        mine = rows // world_size
        tokens, targets = tokens[rank * mine : (rank + 1) * mine], targets[rank * mine : (rank + 1) * mine]
    lm_loss(model(tokens), targets).backward()
    optim.step()
    optim.zero_grad()


def dcp_save_in_one_process(state: Dict[str, Any], path: str) -> None:
    """``torch.distributed.checkpoint.save`` from a process without a process group (which it
    does as one process, saying so in a warning that is expected here)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=path)


def make_optim(params: Any, weight_decay: float = 0.01) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=weight_decay)


def _train(model: nn.Module, world_size: int, steps: int, micro_batches: int, rank: Optional[int], create_graph: bool = False, device: Optional[torch.device] = None) -> List[float]:
    """AdamW training; ``rank is None``: the plain model on global batches, else the wrapped
    model on this rank's slices, all micro-batches but the last under ``no_sync``;
    ``create_graph``: backwards build a graph of the gradients (dropped before the step);
    ``device``: where the batches go (else they stay on the CPU)."""
    optim = make_optim(model.parameters())
    losses = []
    for step in range(steps):
        optim.zero_grad()
        total = 0.0
        for micro in range(micro_batches):
            tokens, targets = batch(step * micro_batches + micro, world_size)
            if rank is not None:
                tokens, targets = local(tokens, rank), local(targets, rank)
            if device is not None:
                tokens, targets = tokens.to(device), targets.to(device)
            syncing = rank is None or micro == micro_batches - 1
            with contextlib.nullcontext() if syncing else model.no_sync():
                loss = lm_loss(model(tokens), targets) / micro_batches
                loss.backward(create_graph=create_graph)
            total += loss.item() if rank is None else global_mean(loss)
        if create_graph:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad = p.grad.detach()
        optim.step()
        losses.append(total)
    return losses


def train_reference(world_size: int, steps: int = 5, micro_batches: int = 1, create_graph: bool = False, **model_kwargs: Any) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """Single-process training on the global batches: (losses, parameters by name)."""
    model = build(**model_kwargs)
    losses = _train(model, world_size, steps, micro_batches, None, create_graph)
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
    create_graph: bool = False,
    **options: Any,
) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """The same training, sharded: (global losses, full parameters by name)."""
    model = wrap(build(**(model_kwargs or {})), mode, **options)
    losses = _train(model, world_size, steps, micro_batches, rank, create_graph)
    return losses, full_params(model)


@contextlib.contextmanager
def inside_call(model: Any, what: str = "a test's own collectives") -> Any:
    """A test that drives handles or communicators directly makes their collectives inside a
    guarded call of the model's roots ([Note: one guarded path] in flatshard/_comm/_guard.py)."""
    with guarded_call(model, what):
        yield


def guarded_comm(group: Optional[Any] = None) -> Communicator:
    """A communicator of ``group`` (default: the default group) for a test of the
    communication layer: its collectives run in one guarded call, left open."""
    comm = Communicator(group if group is not None else dist.group.WORLD)
    make_guard([comm], torch.device("cpu")).open("a test's own collectives", eager=True)
    return comm


def full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every original parameter (tied ones under each name) gathered from the shards."""
    with inside_call(model, "full_params() (a test's gather)"):
        return _full_params(model)


def _full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, ShardedDataParallel):
            for handle in module.handles:
                if handle.state is HandleState.SHARDED:
                    handle.unshard()
                else:
                    handle.refresh()  # kept from a forward whose backward never ran
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


def error_text(call: Any, error: Any) -> str:
    """The text of the ``error`` ``call()`` raises (an AssertionError if it raises none)."""
    try:
        call()
    except error as exc:
        return str(exc)
    raise AssertionError(f"no {getattr(error, '__name__', error)} raised")


def handles(model: nn.Module) -> List[Any]:
    return [h for m in ShardedDataParallel.fsdp_modules(model) for h in m.handles]


def strategy(name: str) -> ShardingStrategy:
    return ShardingStrategy[name]


def run_parity(rank: int, world_size: int, mode: str, steps: int = 5, micro_batches: int = 1, create_graph: bool = False, **options: Any) -> None:
    """Rank function: train sharded and compare with the single-process reference in place."""
    reference = train_reference(world_size, steps=steps, micro_batches=micro_batches, create_graph=create_graph)
    actual = train_wrapped(rank, world_size, mode, steps=steps, micro_batches=micro_batches, create_graph=create_graph, **options)
    assert_same_training(reference, actual)



class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim, bias=False)  # a key bias gets an exactly-zero gradient (softmax
        self.v = nn.Linear(dim, dim)  # ignores it) that AdamW would turn into noise-driven steps
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class Layer(nn.Module):
    """A transformer layer. ``frozen_attention`` freezes its attention (the fine-tuning case:
    frozen and trainable parameters in one unit); ``float64_gain`` adds a float64 parameter
    (two dtypes in one unit)."""

    def __init__(self, dim: int, heads: int, frozen_attention: bool = False, float64_gain: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.attn.requires_grad_(not frozen_attention)
        self.gain = nn.Parameter(torch.ones(dim, dtype=torch.float64)) if float64_gain else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x * self.gain.to(x.dtype) if self.gain is not None else x


class SampleTransformer(nn.Module):
    """Tied embedding/head, a positional buffer, a ModuleList of layers, a final norm;
    ``reuse_first_layer`` runs layer 0 twice."""

    def __init__(self, n_layers: int = 2, dim: int = DIM, heads: int = 2, reuse_first_layer: bool = False, **layer_options: Any) -> None:
        super().__init__()
        self.reuse_first_layer = reuse_first_layer
        self.embed = nn.Embedding(VOCAB, dim)
        self.register_buffer("pos", torch.linspace(-0.5, 0.5, SEQ * dim).reshape(SEQ, dim))
        self.layers = nn.ModuleList(Layer(dim, heads, **layer_options) for _ in range(n_layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in ([self.layers[0]] if self.reuse_first_layer else []) + list(self.layers):
            h = layer(h)
        return self.head(self.ln(h))


def sample_transformer(seed: int = 0, **options: Any) -> SampleTransformer:
    torch.manual_seed(seed)
    return SampleTransformer(**options)


def unit_tree(model: nn.Module) -> str:
    """One line per unit: its name, module class, and per FlatParameter dtype/requires_grad/
    parameter count/elements."""
    lines = []
    for m in ShardedDataParallel.fsdp_modules(model):
        groups = ", ".join(
            f"{str(h.dtype).replace('torch.', '')}{'' if h.requires_grad else ' frozen'} "
            f"{len(h.param_infos)}p/{h.numel}" for h in m.handles
        )
        strategy = "" if m.sharding_strategy is ShardingStrategy.FULL_SHARD else f" {m.sharding_strategy.name}"
        lines.append(f"{m._unit.name or '<root>'}: {type(m.module).__name__} [{groups or 'no parameters'}]{strategy}")
    return "\n".join(lines)

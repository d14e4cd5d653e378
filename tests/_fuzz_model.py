"""The module kinds of the differential fuzzer and the builder of a model from a tree spec.

A tree spec is plain data (dicts and lists, see ``tests/_fuzz.py``), so a case pickles to the
rank processes and prints readably. Every parameter and buffer is initialised from a key (a
seeded ``torch.Generator`` per tensor) in ``reset_parameters``: a model built on the ``meta``
device and materialised by the wrapper gets exactly the values of one built on the CPU, and
two modules sharing a weight share its key, so whichever resets it last writes the same values.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

VOCAB = 11
PLANNED_FAILURE = "fuzz: planned backward failure"


class PlannedFailure(RuntimeError):
    """Raised by a tensor hook in the backward the schedule chose to fail."""


@dataclasses.dataclass
class Hidden:
    """A dataclass output of a block (or of the model)."""

    h: torch.Tensor
    extra: Dict[str, Any]


def fill(t: torch.Tensor, key: int, role: str) -> None:
    """Deterministic initial values for one tensor; a no-op on the meta device."""
    if t.is_meta:
        return
    gen = torch.Generator().manual_seed(1_000_003 * key + 7)
    with torch.no_grad():
        if role == "matrix":
            t.copy_(torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[-1]))
        elif role == "gain":
            t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=gen))
        elif role == "small":
            t.copy_(0.1 * torch.randn(t.shape, generator=gen))
        elif role == "perm":
            t.copy_(torch.randperm(t.numel(), generator=gen).view(t.shape))
        elif role == "zero":
            t.zero_()
        else:
            raise ValueError(role)


def pack(h: torch.Tensor, x: torch.Tensor, kind: str) -> Any:
    """A block's output in the container ``kind`` (``unpack`` reverses it)."""
    if kind == "tuple":
        return (h, x)
    if kind == "dict":
        return {"h": [h], "n": 1}
    if kind == "data":
        return Hidden(h, {"input": (x,)})
    return h


def unpack(out: Any) -> torch.Tensor:
    if isinstance(out, tuple):
        return out[0] + 0.5 * out[1]
    if isinstance(out, dict):
        return out["h"][0]
    if isinstance(out, Hidden):
        return out.h
    return out


class Lin(nn.Linear):
    # ``clamp``: a bound the forward clamps the weight to, in place, when autograd is off
    # (no_grad, inference_mode): a constraint applied when the model is evaluated.
    clamp: Optional[float] = None

    def __init__(self, fan_in: int, fan_out: int, bias: bool, key: int) -> None:
        self.wkey, self.bkey = key, key + 1  # plain ints may be set before nn.Module.__init__;
        super().__init__(fan_in, fan_out, bias=bias)  # a tie copies wkey, never bkey

    def reset_parameters(self) -> None:
        fill(self.weight, self.wkey, "matrix")
        if self.bias is not None:
            fill(self.bias, self.bkey, "small")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clamp is not None and not torch.is_grad_enabled():
            with torch.no_grad():
                self.weight.clamp_(-self.clamp, self.clamp)
        return super().forward(x)


class Norm(nn.LayerNorm):
    def __init__(self, dim: int, key: int) -> None:
        self.wkey = key
        super().__init__(dim)

    def reset_parameters(self) -> None:
        fill(self.weight, self.wkey, "gain")
        fill(self.bias, self.wkey + 1, "small")


class Emb(nn.Embedding):
    def __init__(self, vocab: int, dim: int, key: int) -> None:
        self.wkey = key
        super().__init__(vocab, dim)

    def reset_parameters(self) -> None:
        fill(self.weight, self.wkey, "matrix")


class Block(nn.Module):
    """Base of the fuzzer's blocks: output container kind, skip/eval switches."""

    def __init__(self, opts: Dict[str, Any]) -> None:
        super().__init__()
        self.out_kind = opts.get("out", "tensor")
        self.skip_name: Optional[str] = opts.get("skip_name")
        self.skipped = False
        self.eval_bypass = bool(opts.get("eval_bypass", False))
        self.wrap_tag = bool(opts.get("wrap_tag", False))
        self.act_ckpt = bool(opts.get("act_ckpt", False))

    def forward(self, x: torch.Tensor) -> Any:
        if self.eval_bypass and not self.training:
            return pack(x, x, self.out_kind)
        if self.act_ckpt and torch.is_grad_enabled():
            h = torch.utils.checkpoint.checkpoint(self.compute, x, use_reentrant=False)
        else:
            h = self.compute(x)
        return pack(h, x, self.out_kind)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class MLP(Block):
    def __init__(self, dim: int, hidden: int, key: int, opts: Dict[str, Any]) -> None:
        super().__init__(opts)
        self.fc1 = Lin(dim, hidden, True, key)
        self.fc2 = Lin(hidden, dim, bool(opts.get("bias", True)), key + 2)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Residual(Block):
    """``x + inner(x)`` (the inner module's output unpacked)."""

    def __init__(self, inner: nn.Module, opts: Dict[str, Any]) -> None:
        super().__init__(opts)
        self.inner = inner

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return x + unpack(self.inner(x))


class Twice(Block):
    """One module called twice in a forward."""

    def __init__(self, inner: nn.Module, opts: Dict[str, Any]) -> None:
        super().__init__(opts)
        self.inner = inner

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return unpack(self.inner(torch.tanh(unpack(self.inner(x)))))


class AuxBlock(Block):
    """MoE-style side channel: after computing its output, stores ``self.aux`` (a term of
    its own parameters) that the training loss adds."""

    def __init__(self, dim: int, key: int, opts: Dict[str, Any]) -> None:
        super().__init__(opts)
        self.w = nn.Parameter(torch.empty(dim, dim))
        self.fc = Lin(dim, dim, True, key + 1)
        self.key = key
        self.aux: Optional[torch.Tensor] = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        fill(self.w, self.key, "matrix")

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(torch.tanh(x @ self.w))
        self.aux = self.w.pow(2).sum() * 1e-2
        return y


class ScaleBlock(Block):
    """A direct parameter, a float buffer and (optionally) a parameter never used."""

    def __init__(self, dim: int, key: int, opts: Dict[str, Any]) -> None:
        super().__init__(opts)
        self.gain = nn.Parameter(torch.empty(dim))
        self.register_buffer("scale", torch.empty(dim))
        self.spare = nn.Parameter(torch.empty(3)) if opts.get("spare") else None
        self.key = key
        self.reset_parameters()

    def reset_parameters(self) -> None:
        fill(self.gain, self.key, "gain")
        fill(self.scale, self.key + 1, "gain")
        if self.spare is not None:
            fill(self.spare, self.key + 2, "small")

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.gain * self.scale)


class PermBlock(Block):
    """An integer buffer (a feature permutation) and a non-persistent float buffer."""

    def __init__(self, dim: int, key: int, opts: Dict[str, Any]) -> None:
        super().__init__(opts)
        self.register_buffer("perm", torch.empty(dim, dtype=torch.long))
        self.register_buffer("shift", torch.empty(dim), persistent=False)
        self.fc = Lin(dim, dim, False, key + 1)
        self.key = key
        self.reset_parameters()

    def reset_parameters(self) -> None:
        fill(self.perm, self.key, "perm")
        fill(self.shift, self.key + 2, "small")

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x[..., self.perm] + self.shift)


class CountBlock(Block):
    """An integer buffer changed by every forward (its value reaches the output)."""

    def __init__(self, dim: int, key: int, opts: Dict[str, Any]) -> None:
        super().__init__(opts)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.norm = Norm(dim, key)

    def reset_parameters(self) -> None:
        fill(self.count, 0, "zero")

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.norm(x) + 0.01 * self.count.to(x.dtype)


class FailPoint(nn.Module):
    """No parameters; when armed, its input's gradient hook raises ``PlannedFailure``."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and x.requires_grad:
            x.register_hook(_raise_planned)
        return x


def _raise_planned(grad: torch.Tensor) -> None:
    raise PlannedFailure(PLANNED_FAILURE)


class Stack(Block):
    """A ``ModuleList`` (or ``ModuleDict``) run in order; registered-only members are skipped,
    as are members whose branch the schedule switched off."""

    def __init__(self, members: List[nn.Module], names: List[str], unused: List[bool], as_dict: bool, opts: Dict[str, Any]) -> None:
        super().__init__(opts)
        self.as_dict = as_dict
        self.members: nn.Module = nn.ModuleDict(dict(zip(names, members))) if as_dict else nn.ModuleList(members)
        self.unused = list(unused)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        members = list(self.members.values()) if self.as_dict else list(self.members)
        for member, unused in zip(members, self.unused):
            if unused or getattr(member, "skipped", False):
                continue
            x = unpack(member(x))
        return x


class FuzzNet(nn.Module):
    """Embedding (+ float position buffer) -> body -> norm -> head, output in a container."""

    def __init__(self, dim: int, seq: int, body: nn.Module, tie_head: bool, head_bias: bool, out: str, key: int) -> None:
        super().__init__()
        self.embed = Emb(VOCAB, dim, key)
        self.register_buffer("pos", torch.empty(seq, dim))
        self.body = body
        self.norm = Norm(dim, key + 2)
        self.head = Lin(dim, VOCAB, head_bias, key + 4)
        if tie_head:
            self.head.weight = self.embed.weight
            self.head.wkey = self.embed.wkey
        self.out_kind = out
        self.key = key
        self.reset_parameters()

    def reset_parameters(self) -> None:
        fill(self.pos, self.key + 6, "small")

    def forward(self, tokens: torch.Tensor, skip: Tuple[str, ...] = (), fail: bool = False) -> Any:
        for m in self.modules():
            if isinstance(m, Block):
                m.skipped = m.skip_name is not None and m.skip_name in skip
            elif isinstance(m, FailPoint):
                m.armed = fail
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        h = unpack(self.body(h))
        logits = self.head(self.norm(h))
        if self.out_kind == "tuple":
            return (logits, h)
        if self.out_kind == "dict":
            return {"logits": logits, "hidden": [h]}
        if self.out_kind == "data":
            return Hidden(logits, {"hidden": h})
        return logits


def logits_of(out: Any) -> torch.Tensor:
    if isinstance(out, tuple):
        return out[0]
    if isinstance(out, dict):
        return out["logits"]
    return out.h if isinstance(out, Hidden) else out


def loss_of(model: nn.Module, out: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy plus every side-channel term the forward stored (then cleared)."""
    logits = logits_of(out)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    for m in model.modules():
        if isinstance(m, AuxBlock) and m.aux is not None:
            loss = loss + m.aux
            m.aux = None
    return loss


# -- building a model from a spec ---------------------------------------------------------


def build_model(spec: Dict[str, Any], device: Optional[str] = None, with_nodes: bool = False) -> Any:
    """The model of ``spec`` (see ``tests/_fuzz.py``), on ``device`` (``"meta"`` or the CPU);
    with ``with_nodes``, also the module of each node id."""
    with torch.device(device or "cpu"):
        built: Dict[int, nn.Module] = {}
        body = _build_node(spec["body"], spec["dim"], built)
        model = FuzzNet(spec["dim"], spec["seq"], body, spec["tie_head"], spec["head_bias"], spec["out"], 9000)
    for a, b in spec["ties"]:  # between two ``lin`` nodes
        src, dst = built[a], built[b]
        dst.weight = src.weight
        dst.wkey = src.wkey
    for node_id in spec["frozen"]:
        built[node_id].requires_grad_(False)
    clamp = spec.get("clamp")
    if clamp:
        for node_id in clamp["nodes"]:
            built[node_id].clamp = clamp["bound"]
        if clamp["head"]:
            model.head.clamp = clamp["bound"]
    return (model, built) if with_nodes else model


def _build_node(node: Dict[str, Any], dim: int, built: Dict[int, nn.Module]) -> nn.Module:
    kind, opts, key = node["kind"], node.get("opts", {}), 100 * node["id"]
    if kind == "share":  # the module of an earlier node, registered here too
        return built[node["ref"]]
    children = [_build_node(child, dim, built) for child in node.get("children", [])]
    module = _make(kind, dim, key, opts, children, node)
    built[node["id"]] = module
    return module


def _make(kind: str, dim: int, key: int, opts: Dict[str, Any], children: List[nn.Module], node: Dict[str, Any]) -> nn.Module:
    if kind == "lin":
        return Lin(dim, dim, bool(opts.get("bias", True)), key)
    if kind == "norm":
        return Norm(dim, key)
    if kind == "seq":
        layers: List[nn.Module] = []
        for i, leaf in enumerate(opts["leaves"]):
            layers.append({"lin": lambda: Lin(dim, dim, True, key + 10 * i), "norm": lambda: Norm(dim, key + 10 * i), "tanh": nn.Tanh}[leaf]())
        return nn.Sequential(*layers)
    if kind == "mlp":
        return MLP(dim, opts.get("hidden", 2 * dim), key, opts)
    if kind == "aux":
        return AuxBlock(dim, key, opts)
    if kind == "scale":
        return ScaleBlock(dim, key, opts)
    if kind == "perm":
        return PermBlock(dim, key, opts)
    if kind == "count":
        return CountBlock(dim, key, opts)
    if kind == "fail":
        return FailPoint()
    if kind == "res":
        return Residual(children[0], opts)
    if kind == "twice":
        return Twice(children[0], opts)
    if kind in ("list", "dict"):
        names = [f"m{c['id']}" for c in node["children"]]
        unused = [bool(c.get("opts", {}).get("unused", False)) for c in node["children"]]
        return Stack(children, names, unused, kind == "dict", opts)
    raise ValueError(f"unknown node kind {kind!r}")


POLICY_CLASSES = {
    "Lin": Lin,
    "Norm": Norm,
    "Emb": Emb,
    "MLP": MLP,
    "Residual": Residual,
    "Twice": Twice,
    "AuxBlock": AuxBlock,
    "ScaleBlock": ScaleBlock,
    "PermBlock": PermBlock,
    "CountBlock": CountBlock,
    "Stack": Stack,
    "Sequential": nn.Sequential,
}

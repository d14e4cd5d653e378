"""A Llama-style decoder (RMSNorm, rotary attention with grouped key/value heads, SwiGLU MLP,
untied head) for the GPU throughput benchmark. ``CONFIGS`` names its sizes; ``tiny`` is for
the CPU dry run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int

    def parameters(self) -> int:
        head_dim = self.dim // self.heads
        attention = 2 * self.dim * self.dim + 2 * self.dim * self.kv_heads * head_dim
        per_layer = attention + 3 * self.dim * self.ffn + 2 * self.dim
        return self.layers * per_layer + 2 * self.vocab * self.dim + self.dim

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token: 6 per parameter-token of the matrix products, plus the
        attention scores and their weighted sum (forward 4·L·d·T per token, ×3 with backward;
        causal halves it, which the usual MFU convention does not count)."""
        return 6.0 * self.parameters() + 12.0 * self.layers * self.dim * seq


CONFIGS: Dict[str, LlamaConfig] = {
    # about 1.1B parameters: Llama-3.2-1B's shape with a 32k vocabulary
    "1b": LlamaConfig(dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=32000),
    # about 6.7B parameters: Llama-2-7B's shape
    "7b": LlamaConfig(dim=4096, layers=32, heads=32, kv_heads=32, ffn=11008, vocab=32000),
    # about 310M parameters (1.2 GB in fp32): bench/load_memory.py's model
    "300m": LlamaConfig(dim=1024, layers=16, heads=16, kv_heads=4, ffn=4096, vocab=32000),
    "tiny": LlamaConfig(dim=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=256),
    # 1b's structure (16 layers) at tiny size: its step time on CPU is mostly per-unit overhead
    "overhead": LlamaConfig(dim=64, layers=16, heads=4, kv_heads=2, ffn=128, vocab=256),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + 1e-5)).to(x.dtype) * self.weight


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` (batch, heads, seq, head_dim), computed on the fly."""
    seq, half = x.shape[-2], x.shape[-1] // 2
    freq = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = torch.arange(seq, device=x.device, dtype=torch.float32)[:, None] * freq[None, :]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# For ``python -m flatshard.plan llama:llama_1b --measure --input llama:tokens --loss llama:lm_loss``
# (with ``PYTHONPATH=bench``): the shapes of ``bench/scale_memory.py``, one batch of 64 tokens.
def llama_1b() -> Llama:
    return Llama(CONFIGS["1b"])


def llama_7b() -> Llama:
    return Llama(CONFIGS["7b"])


def tokens() -> torch.Tensor:
    return torch.randint(0, 32000, (1, 64), generator=torch.Generator().manual_seed(0))


def lm_loss(logits: torch.Tensor) -> torch.Tensor:
    return loss_of(logits, tokens())

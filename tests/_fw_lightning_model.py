"""The model, data and single-process reference of the Lightning flows (tests/_fw_lightning.py).

Plain torch only (no Lightning, no process group), so the test process computes the truth the
flows are compared with: the same model, AdamW and schedule, one process, the combined batch.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn

DIM, IN, OUT = 16, 8, 4
WORLD = 2
LOCAL_BATCH = 4
STEPS_PER_EPOCH = 2
LR, WEIGHT_DECAY = 1e-2, 0.01


class Block(nn.Module):
    """One residual MLP block: the unit the auto-wrap policy asks for."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(blocks))
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_net() -> Net:
    """The same weights in every process."""
    torch.manual_seed(0)
    return Net()


def data() -> Tuple[torch.Tensor, torch.Tensor]:
    """One epoch: ``STEPS_PER_EPOCH`` combined batches of ``WORLD * LOCAL_BATCH`` rows, in order."""
    gen = torch.Generator().manual_seed(1)
    rows = STEPS_PER_EPOCH * WORLD * LOCAL_BATCH
    return torch.randn(rows, IN, generator=gen), torch.randn(rows, OUT, generator=gen)


def rank_rows(rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows, in the order its loader yields them: step s's combined batch is
    rows [s*B, (s+1)*B) (B = ``WORLD * LOCAL_BATCH``), of which rank r takes the r-th
    ``LOCAL_BATCH`` rows."""
    x, y = data()
    combined = WORLD * LOCAL_BATCH
    keep = [s * combined + rank * LOCAL_BATCH + i for s in range(STEPS_PER_EPOCH) for i in range(LOCAL_BATCH)]
    return x[keep], y[keep]


def schedule(step: int) -> float:
    return 1.0 / (1.0 + step)


def make_optimizer(params) -> Tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def reference(steps: int) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """(the loss at each step, the final parameters by name) of one process training ``Net`` on
    the combined batches, epoch after epoch, with the flows' optimizer and schedule."""
    net = build_net()
    optimizer, scheduler = make_optimizer(net.parameters())
    x, y = data()
    combined = WORLD * LOCAL_BATCH
    losses = []
    for step in range(steps):
        s = step % STEPS_PER_EPOCH
        loss = nn.functional.mse_loss(net(x[s * combined:(s + 1) * combined]), y[s * combined:(s + 1) * combined])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in net.named_parameters()}

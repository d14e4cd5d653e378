"""Which compute each collective of a training step hides behind, as one rank of a large world
on torch's fake process group, for ``tests/test_overlap_trace.py``.

    python -m tests._overlap_trace [CONFIG ...]     # CONFIGS' names; all by default

trains, per configuration, three steps of a six-unit model (the root: an input projection, or an embedding, and
the head; five blocks) as rank 0 of 8 and prints one JSON line: for every data collective of
the third step (agreement checks aside), in issue order, its kind, the phase it was issued in
and the matrix products dispatched between its issue and the first wait for it.

[Note: dispatch-order trace] On a GPU everything one stream does runs in the order the host
issued it, and an asynchronous NCCL collective starts only after what was queued on the
current stream before its issue. So a collective can run behind the compute dispatched
between its issue and its wait, and behind nothing else: zero matrix products between the two
is a collective fully exposed. The fake process group completes every collective at once and
exchanges nothing, so the dispatch order is all that is measured, and it is the order a GPU
would see. The waits counted are flatshard's (``Pending.wait``) on the host path: under hybrid
sharding on CUDA the reduce-scatter's first wait is on the side stream of the chain, which a CPU
trace does not have ([Note: chained all-reduce]).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

DIM, BLOCKS, WORLD, LOCAL = 32, 5, 8, 4
_MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Model(nn.Module):
    def __init__(self, embedding: bool) -> None:
        super().__init__()
        self.embedding = embedding
        self.entry = nn.Embedding(64, DIM) if embedding else nn.Linear(DIM, DIM)
        self.blocks = nn.Sequential(*[Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.entry(x)))


class _Matmuls(TorchDispatchMode):
    """Counts the matrix products dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ in _MATMULS:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _Issued:
    """The model's tracer (``Unit.set_trace``): the kind of each collective issued, ``None``
    for an agreement check, until the ``Pending`` made for it takes it."""

    def __init__(self) -> None:
        self.kinds: List[Optional[str]] = []

    def event(self, kind: str, label: str) -> None:
        pass

    def collective(self, event: Any) -> None:
        self.kinds.append(None if event.check else event.kind)


def _record(model: Any, log: List[Dict[str, Any]], matmuls: _Matmuls, phase: List[str]) -> Callable[[], None]:
    """Log every data collective of ``model``'s root: its issue (the model's tracer) and its
    first wait (patches ``Pending`` of this process); returns what undoes the patches."""
    from flatshard._comm import _collectives
    from flatshard._comm._collectives import Pending

    init, drain = Pending.__init__, Pending.drain
    issued = _Issued()
    model._unit.set_trace(issued)

    def made(pending: Pending, work: Any, *args: Any, **kwargs: Any) -> None:
        init(pending, work, *args, **kwargs)
        kind = issued.kinds.pop() if issued.kinds else None
        issued.kinds.clear()
        if work is not None and kind is not None:
            entry = {"kind": kind, "phase": phase[0], "issued": matmuls.count, "waited": None}
            log.append(entry)
            pending._trace_entry = entry  # type: ignore[attr-defined]

    def drained(pending: Pending) -> None:
        entry = getattr(pending, "_trace_entry", None)
        if entry is not None and entry["waited"] is None:
            entry["waited"] = matmuls.count
        drain(pending)

    _collectives.Pending.__init__ = made  # type: ignore[method-assign]
    _collectives.Pending.drain = drained  # type: ignore[method-assign]

    def undo() -> None:
        model._unit.set_trace(None)
        _collectives.Pending.__init__ = init  # type: ignore[method-assign]
        _collectives.Pending.drain = drain  # type: ignore[method-assign]

    return undo


def trace(strategy: str, overlap: bool = True, embedding: bool = False) -> str:
    """The third step's data collectives, one per entry: phase (f/b), kind and the matrix
    products dispatched between its issue and its first wait ("-" if never waited)."""
    import flatshard
    from flatshard.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = flatshard.ShardedDataParallel(
        Model(embedding), auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=flatshard.ShardingStrategy[strategy],
    )
    model.set_communication_overlap(overlap)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (4, 8)) if embedding else torch.randn(4, 8, DIM)
    log: List[Dict[str, Any]] = []
    phase = ["forward"]
    matmuls = _Matmuls()
    undo = _record(model, log, matmuls, phase)
    try:
        for _ in range(3):
            del log[:]
            with matmuls:
                phase[0] = "f"
                loss = model(x).square().mean()
                phase[0] = "b"
                loss.backward()
            optim.step()
            optim.zero_grad()
    finally:
        undo()
    names = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
    return " ".join(f"{e['phase']}{names[e['kind']]}{'-' if e['waited'] is None else e['waited'] - e['issued']}" for e in log)


CONFIGS = {
    "FULL_SHARD": ("FULL_SHARD", True, False),
    "SHARD_GRAD_OP": ("SHARD_GRAD_OP", True, False),
    "NO_SHARD": ("NO_SHARD", True, False),
    "HYBRID_SHARD": ("HYBRID_SHARD", True, False),
    "FULL_SHARD embedding": ("FULL_SHARD", True, True),
    "FULL_SHARD without overlap": ("FULL_SHARD", False, False),
    "HYBRID_SHARD without overlap": ("HYBRID_SHARD", False, False),
}


def main(names: List[str]) -> Dict[str, str]:
    from flatshard._comm._collectives import init_fake_world

    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)  # (hybrid sharding: two nodes of four)
    os.environ["LOCAL_RANK"] = "0"
    init_fake_world(0, WORLD)
    return {name: trace(*CONFIGS[name]) for name in (names or list(CONFIGS))}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))

"""Recording what the runtime does, from inside a rank process.

``recording()`` gives a ``Recorder``; ``rec.attach(model)`` hands it to the model's root as its
trace hook (``Unit.set_trace``): the runtime then reports its events (a unit's forward,
pre-backward and post-backward, a handle gathered, freed, its gradient reduction issued and
completed) and every collective of the model's units and handles. Leaving the ``with`` block
detaches it. Nothing is patched.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Dict, Iterator, List

from torch import nn

from flatshard import ShardedDataParallel
from flatshard._comm._collectives import CollectiveEvent
from flatshard._base._common import HandleState

_REDUCTIONS = ("reduce", "reduced")


class Recorder:
    """Events as strings, e.g. ``"gather blocks.1"``, ``"pre-backward root"``."""

    def __init__(self, reductions: bool = False) -> None:
        self.reductions = reductions
        self.events: List[str] = []
        self.collectives: Dict[str, int] = collections.Counter()  # data collectives by kind
        self.sent: Dict[str, int] = collections.Counter()  # bytes sent by torch.distributed function (data only)
        self.max_gathered = 0  # most sharded units gathered at once
        self.checks = 0  # order checks: small all-gathers of one integer (not in ``collectives``)
        self._handles: List[Any] = []
        self._roots: List[Any] = []

    def attach(self, model: nn.Module) -> None:
        wrappers = ShardedDataParallel.fsdp_modules(model)
        self._handles = [h for m in wrappers for h in m.handles if h.sharded]
        for root in ShardedDataParallel.fsdp_modules(model, root_only=True):
            root._unit.set_trace(self)
            self._roots.append(root._unit)

    def detach(self) -> None:
        for unit in self._roots:
            unit.set_trace(None)
        self._roots = []

    def clear(self) -> None:
        self.events.clear()
        self.collectives.clear()
        self.sent.clear()
        self.checks = 0
        self.max_gathered = 0

    # -- the trace hook (flatshard._engine._unit.Tracer) ----------------------------------------------

    def event(self, kind: str, label: str) -> None:
        if kind in _REDUCTIONS and not self.reductions:
            return
        self.events.append(f"{kind} {label}")
        if kind in ("gather", "free"):
            count = sum(h.state is not HandleState.SHARDED for h in self._handles)
            self.max_gathered = max(self.max_gathered, count)

    def collective(self, event: CollectiveEvent) -> None:
        if event.check:
            self.checks += 1
            return
        self.collectives[event.kind] += 1
        self.sent[event.op] += event.nbytes


@contextlib.contextmanager
def recording(reductions: bool = False) -> Iterator[Recorder]:
    """A recorder for the ``with`` block; with ``reductions`` it also records when gradient
    reductions are issued ("reduce X") and completed ("reduced X")."""
    rec = Recorder(reductions)
    try:
        yield rec
    finally:
        rec.detach()

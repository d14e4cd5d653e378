"""Recording what the runtime does, from inside a rank process.

``recording()`` patches the runtime's hooks and the handle's gather/free/reduce methods for
the duration of a ``with`` block (the worker processes are reused, so everything is undone
on exit). Enter it before building the model: hooks bind their functions when registered.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable, Dict, Iterator, List

from torch import nn

import flatshard._runtime as runtime
import flatshard.flat_param as flat_param
from flatshard._collectives import Communicator
from flatshard import ShardedDataParallel
from flatshard._common import HandleState


class Recorder:
    """Events as strings, e.g. ``"gather blocks.1"``, ``"pre-backward root"``."""

    def __init__(self) -> None:
        self.events: List[str] = []
        self.collectives: Dict[str, int] = collections.Counter()
        self.max_gathered = 0  # most sharded units gathered at once
        self.in_check = False
        self.checks = 0  # order checks: small all-gathers of one integer (not in ``collectives``)
        self._handles: Dict[int, str] = {}
        self._all: List[Any] = []

    def attach(self, model: nn.Module) -> None:
        self._handles = {}
        for m in ShardedDataParallel.fsdp_modules(model):
            for i, handle in enumerate(m.handles):
                self._handles[id(handle)] = (m._unit.name or "root") + (f"#{i}" if i else "")
                if handle.sharded:
                    self._all.append(handle)

    def clear(self) -> None:
        self.events.clear()
        self.collectives.clear()
        self.checks = 0
        self.max_gathered = 0

    def handle_name(self, handle: Any) -> str:
        return self._handles.get(id(handle), "?")

    def note_gathered(self) -> None:
        count = sum(h.state is not HandleState.SHARDED for h in self._all)
        self.max_gathered = max(self.max_gathered, count)


def _wrap_handle_method(rec: Recorder, name: str, label: str) -> Callable[..., Any]:
    original = getattr(flat_param.FlatParamHandle, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        done = original(self, *args, **kwargs)
        if done:
            rec.events.append(f"{label} {rec.handle_name(self)}")
            rec.note_gathered()
        return done

    return method


def _wrap_hook(rec: Recorder, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    def hook(unit: Any, *args: Any) -> Any:
        rec.events.append(f"{label} {unit.name or 'root'}")
        return fn(unit, *args)

    return hook


def _count(rec: Recorder, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
    def collective(*args: Any, **kwargs: Any) -> Any:
        if not rec.in_check:
            rec.collectives[kind] += 1
        return fn(*args, **kwargs)

    return collective


def _count_check(rec: Recorder, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Order checks (small all-gathers of one integer) are counted apart from data collectives."""

    def check(*args: Any, **kwargs: Any) -> Any:
        rec.checks += 1
        rec.in_check = True
        try:
            return fn(*args, **kwargs)
        finally:
            rec.in_check = False

    return check


def _wrap_reduction(rec: Recorder) -> List[Any]:
    reduce_grad, finish = flat_param.FlatParamHandle.reduce_grad, flat_param.FlatParamHandle.finish_reduction

    def issue(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = reduce_grad(self, *args, **kwargs)
        if started and self._reduction is not None:
            rec.events.append(f"reduce {rec.handle_name(self)}")
        return started

    def complete(self: Any) -> None:
        if self._reduction is not None:
            rec.events.append(f"reduced {rec.handle_name(self)}")
        finish(self)

    return [(flat_param.FlatParamHandle, "reduce_grad", issue), (flat_param.FlatParamHandle, "finish_reduction", complete)]


@contextlib.contextmanager
def recording(reductions: bool = False) -> Iterator[Recorder]:
    """Record events; with ``reductions`` also when gradient reductions are issued
    ("reduce X") and completed ("reduced X")."""
    rec = Recorder()
    patches = [
        (flat_param.FlatParamHandle, "unshard", _wrap_handle_method(rec, "unshard", "gather")),
        (flat_param.FlatParamHandle, "reshard", _wrap_handle_method(rec, "reshard", "free")),
        (runtime, "_pre_forward", _wrap_hook(rec, runtime._pre_forward, "forward")),
        (runtime, "_pre_backward", _wrap_hook(rec, runtime._pre_backward, "pre-backward")),
        (runtime, "_post_backward", _wrap_hook(rec, runtime._post_backward, "post-backward")),
        (runtime, "_post_backward_frozen", _wrap_hook(rec, runtime._post_backward_frozen, "post-backward")),
        (Communicator, "all_gather", _count(rec, Communicator.all_gather, "all_gather")),
        (Communicator, "reduce_scatter_mean", _count(rec, Communicator.reduce_scatter_mean, "reduce_scatter")),
        (Communicator, "all_reduce_mean", _count(rec, Communicator.all_reduce_mean, "all_reduce")),
        (Communicator, "gather_ints", _count_check(rec, Communicator.gather_ints)),
    ]
    if reductions:
        patches += _wrap_reduction(rec)
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, replacement in patches:
            setattr(owner, name, replacement)
        yield rec
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)

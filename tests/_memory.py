"""Peak bytes held by tensor storages allocated inside a ``with`` block.

    with track_allocations() as tracker:
        model = build_sharded_model()
    assert tracker.peak_bytes <= limit

How it works: a ``TorchDispatchMode`` sees every aten op run while the block is active. After
each op it looks at the op's output tensors and starts tracking, through a weak reference, every
storage that the op *allocated* (see the counting rule below). It then samples: live bytes are
the sum of the *current* ``nbytes()`` of the tracked storages that are still alive, and
``peak_bytes`` is the largest sample so far. Only weak references are held, so the tracker never
keeps memory alive; a storage is freed when its last owner (a tensor, a view, an autograd
saved tensor, ...) goes away, and PyTorch keeps a storage's Python object alive exactly as long as
the storage itself, so the weak reference dies exactly then.

Counting rule
-------------
A storage counts iff, while the block is active, it first shows up in the output of an aten op
that *allocated* it, meaning the output is

* not declared by the op's schema as an alias of an input (``Tensor(a)`` / ``Tensor(a!)``:
  views, in-place and ``out=`` ops), and
* not sharing its storage with any tensor (or storage) among the op's inputs.

So factory ops (``empty``, ``zeros``, ...) and out-of-place ops (``add``, ``clone``, ``_to_copy``,
backward ops, ...) allocate; views, in-place ops and ``out=`` ops never do, whether the storage
they touch is pre-existing (ignored) or was allocated inside the block (already tracked once,
never double counted). One exception: ``aten.lift_fresh``, which ``torch.tensor(data)`` /
``torch.as_tensor(data)`` call on a tensor built outside the dispatcher, counts when its storage
is resizable (i.e. owned by a PyTorch allocator; ``from_numpy``/DLPack memory is not).

Storages are identified by their ``StorageImpl`` address plus a weak reference to the storage
object (an address is only trusted while that reference is alive and points at the same object),
not by data pointer: ``resize_`` moves the data, zero-size storages all have data pointer 0, and
freed data pointers get reused. Meta storages count 0 (and are not tracked); zero-size storages
are tracked, since they can be grown later by ``untyped_storage().resize_(n)``.

Sampling happens after every op, on ``sample()`` and on exit. Growing/shrinking a tracked storage
with ``untyped_storage().resize_(n)`` does not go through the dispatcher: it is seen at the next
sample, so call ``tracker.sample()`` right after such a resize if the peak must include it.

Known blind spots
-----------------
* Memory allocated outside the dispatcher: ``torch.UntypedStorage(n)``, ``torch.frombuffer``,
  ``torch.from_numpy``, C++-side buffers (e.g. process-group internals), and temporaries a kernel
  allocates and frees inside one op (workspaces). Only op *outputs* are seen.
* Pre-existing storages are ignored even when they grow (``resize_`` on a storage allocated before
  the block, e.g. re-allocating a freed unsharded flat parameter); use ``tracker.watch(t)`` to
  opt such a storage in, counted at its full current size from then on.
* A resize that grows and shrinks a storage between two samples is missed.
* Ops returning a pre-existing tensor that is neither an input nor declared as an alias would be
  miscounted as an allocation (no aten op does this; custom ops could).
* Tensors without an accessible storage (sparse, nested, opaque wrapper subclasses) are skipped;
  traceable wrapper subclasses (``__tensor_flatten__``) are counted through their inner tensors.
* Bytes are logical storage sizes, not what an allocator reserves (CUDA caching/rounding).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Dict, Iterable, Iterator, List, Optional, Set, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["AllocationTracker", "track_allocations"]

_LIFT_FRESH = {torch.ops.aten.lift_fresh.default}


def _storages(obj: Any) -> Iterator[torch.UntypedStorage]:
    """The storages behind a tensor (recursing into traceable wrapper subclasses) or storage."""
    if isinstance(obj, torch.UntypedStorage):
        yield obj
    elif isinstance(obj, torch.TypedStorage):
        yield obj.untyped()
    elif isinstance(obj, torch.Tensor):
        if is_traceable_wrapper_subclass(obj):
            attrs, _ = obj.__tensor_flatten__()
            for attr in attrs:
                yield from _storages(getattr(obj, attr))
            return
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return  # sparse / nested / opaque subclass: no plain storage to look at
        yield storage


def _matches(device: torch.device, want: Optional[torch.device]) -> bool:
    if device.type == "meta":
        return False
    if want is None:
        return True
    return device.type == want.type and (want.index is None or device.index == want.index)


class AllocationTracker:
    """Live / peak bytes of the storages allocated while its ``track_allocations`` block ran."""

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.peak_bytes: int = 0
        self._device = device
        # StorageImpl address -> weak reference to that storage's (preserved) Python object
        self._tracked: Dict[int, "weakref.ReferenceType[torch.UntypedStorage]"] = {}
        # backward may run ops on autograd device threads; re-entrant because a ``__del__`` run
        # by the garbage collector in the middle of a sample may itself run (tracked) ops
        self._lock = threading.RLock()

    # -- tracking ---------------------------------------------------------------------------
    def _is_tracked(self, storage: torch.UntypedStorage) -> bool:
        ref = self._tracked.get(storage._cdata)
        return ref is not None and ref() is storage

    def _add(self, storage: torch.UntypedStorage) -> None:
        if _matches(storage.device, self._device) and not self._is_tracked(storage):
            self._tracked[storage._cdata] = weakref.ref(storage)

    def watch(self, *objs: Union[torch.Tensor, torch.UntypedStorage]) -> None:
        """Opt storages in (e.g. pre-existing ones that get resized), at their full size."""
        with self._lock:
            for obj in objs:
                for storage in _storages(obj):
                    self._add(storage)
        self.sample()

    def _after_op(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        with self._lock:
            candidates = self._new_outputs(func, args, kwargs, out)
            for storage in candidates:
                self._add(storage)
            self._sample_locked()

    def _new_outputs(self, func: Any, args: Any, kwargs: Any, out: Any) -> List[torch.UntypedStorage]:
        if func in _LIFT_FRESH:
            # ``torch.tensor(data)``: the input is a tensor created outside the dispatcher just
            # now; its storage is ours unless it wraps foreign memory (numpy, DLPack).
            return [s for s in _storages(out) if s.resizable()]
        returns = getattr(getattr(func, "_schema", None), "returns", None)
        if returns is not None and len(returns) > 1 and isinstance(out, (tuple, list)) and len(out) == len(returns):
            values: Iterable[Any] = [o for o, r in zip(out, returns) if r.alias_info is None]
        elif returns is not None and len(returns) == 1:
            values = [out] if returns[0].alias_info is None else []
        else:
            values = [out]
        candidates = [
            s
            for leaf in tree_leaves(values)
            for s in _storages(leaf)
            if _matches(s.device, self._device) and not self._is_tracked(s)
        ]
        if not candidates:
            return []
        inputs: Set[int] = {s._cdata for leaf in tree_leaves((args, kwargs)) for s in _storages(leaf)}
        return [s for s in candidates if s._cdata not in inputs]

    # -- sampling ---------------------------------------------------------------------------
    def _live_locked(self) -> int:
        total = 0
        dead: List[int] = []
        for key, ref in list(self._tracked.items()):  # snapshot: see the lock comment
            storage = ref()
            if storage is None:
                dead.append(key)
            else:
                total += storage.nbytes()
        for key in dead:
            if self._tracked.get(key) is not None and self._tracked[key]() is None:
                del self._tracked[key]
        return total

    def _sample_locked(self) -> int:
        live = self._live_locked()
        if live > self.peak_bytes:
            self.peak_bytes = live
        return live

    def live_bytes(self) -> int:
        """Bytes currently held by tracked storages that are still alive (current sizes)."""
        with self._lock:
            return self._live_locked()

    def sample(self) -> int:
        """Take a sample now (e.g. after a ``storage.resize_``); returns the live bytes."""
        with self._lock:
            return self._sample_locked()

    def reset_peak(self) -> None:
        """Start a new measurement phase: the peak becomes the current live bytes."""
        with self._lock:
            self.peak_bytes = self._live_locked()

    def __repr__(self) -> str:
        return f"AllocationTracker(peak_bytes={self.peak_bytes}, live_bytes={self.live_bytes()})"


class _AllocationMode(TorchDispatchMode):
    def __init__(self, tracker: AllocationTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.tracker._after_op(func, args, kwargs, out)
        return out


@contextlib.contextmanager
def track_allocations(device: Union[str, torch.device, None] = None) -> Iterator[AllocationTracker]:
    """Track storages allocated inside the block (all non-meta devices, or only ``device``:
    ``"cuda"`` for every CUDA device, ``"cuda:1"`` for one). Nested blocks each count their own
    allocations (an outer block also counts the inner block's)."""
    tracker = AllocationTracker(torch.device(device) if device is not None else None)
    try:
        with _AllocationMode(tracker):
            yield tracker
    finally:
        tracker.sample()

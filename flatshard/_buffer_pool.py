"""Reusing the memory of a root's large per-step CPU buffers.

[Note: buffer pool] Every step, a sharded unit allocates its full flat tensor twice (forward
and backward gather) and frees it twice, autograd assembles a full gradient for it, and its
reduction needs a receive buffer as large as the unit. On the CPU these are allocations of
megabytes: the C allocator serves them with fresh pages from the kernel and returns them on
free, so every step first-touches (page-faults) each byte again -- tens of thousands of faults
a step on a small model, a measurable share of the step on a machine whose cores also do the
communication (see bench/RESULTS.md). The root's pool keeps memory just given up (a freed
gather, a reduced full gradient, a used receive buffer) for the next request of the same size,
holding at most two of the root's largest units idle: forwards after the first gather into
memory the step before gave up, and a backward allocates only what it needs beyond that.

A full flat tensor must keep its storage *object* across a free (autograd saved views of it,
see [Note: storage freeing] in ``_common``); the pool moves only the memory in and out of
that object (``UntypedStorage._swap_data_ptr_``). Where that is unavailable (older torch)
or the device has its own caching allocator (CUDA), the pool does nothing but allocate and
free.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

_Key = Tuple[torch.device, int]  # (device, bytes)

_CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class BufferPool:
    """Idle CPU memory blocks by (device, size), at most ``limit_bytes`` in all: keeping a
    block when there is no room evicts (frees) the least recently kept ones.

    Args:
        limit_bytes: how much idle memory the pool may hold (0: none, every request allocates).
    """

    def __init__(self, limit_bytes: int = 0) -> None:
        self.limit_bytes = limit_bytes
        self.held_bytes = 0
        # Idle blocks, the least recently kept first (evicted first when room is needed).
        self._idle: List[Tuple[_Key, torch.UntypedStorage]] = []
        # Requests (fill, new) served from idle memory / by allocating.
        self.reused = 0
        self.allocated = 0

    def _pooling(self, device: torch.device) -> bool:
        return _CAN_SWAP and device.type == "cpu" and self.limit_bytes > 0

    def _take(self, device: torch.device, nbytes: int) -> Optional[torch.UntypedStorage]:
        key = (device, nbytes)
        for i in range(len(self._idle) - 1, -1, -1):
            if self._idle[i][0] == key:
                self.held_bytes -= nbytes
                self.reused += 1
                return self._idle.pop(i)[1]
        self.allocated += 1
        return None

    def _keep(self, storage: torch.UntypedStorage) -> bool:
        nbytes = storage.nbytes()
        if nbytes > self.limit_bytes:
            return False
        while self.held_bytes + nbytes > self.limit_bytes:
            _, evicted = self._idle.pop(0)
            self.held_bytes -= evicted.nbytes()
        self._idle.append(((storage.device, nbytes), storage))
        self.held_bytes += nbytes
        return True

    def fill(self, tensor: torch.Tensor, nbytes: int) -> None:
        """Give ``tensor``'s empty storage ``nbytes`` of memory (idle memory if there is some)."""
        storage = tensor.untyped_storage()
        if self._pooling(tensor.device):
            block = self._take(tensor.device, nbytes)
            if block is not None:
                storage._swap_data_ptr_(block)  # (the block object, now empty, is dropped)
                return
        storage.resize_(nbytes)

    def empty(self, tensor: torch.Tensor) -> None:
        """Take the memory away from ``tensor``'s storage (keeping the storage object), into
        the pool if it has room (else it is freed)."""
        storage = tensor.untyped_storage()
        if not self._pooling(tensor.device):
            storage.resize_(0)
            return
        block = torch.UntypedStorage(0, device=tensor.device)
        block._swap_data_ptr_(storage)
        self._keep(block)  # (a block not kept is freed with its last reference, here)

    def new(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised 1-D tensor, on idle memory if there is some of exactly its size.
        Give it back with ``give`` once nothing else references it."""
        nbytes = numel * dtype.itemsize
        if self._pooling(device):
            block = self._take(device, nbytes)
            if block is not None:
                return torch.empty(0, dtype=dtype, device=device).set_(block, 0, (numel,))
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, tensor: torch.Tensor) -> None:
        """Keep the memory of ``tensor`` (from ``new``, referenced by nothing else once the
        caller drops it) for a later request."""
        storage = tensor.untyped_storage()
        whole = tensor.storage_offset() == 0 and storage.nbytes() == tensor.numel() * tensor.element_size()
        if self._pooling(tensor.device) and whole and tensor.is_contiguous():
            self._keep(storage)

    def clear(self) -> None:
        """Release all idle memory."""
        self._idle.clear()
        self.held_bytes = 0

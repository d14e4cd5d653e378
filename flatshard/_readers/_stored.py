"""What the checkpoint readers of ``load_pretrained`` share: a stored tensor's description, and
a piece of one to read (a range of its elements in row-major order) with where it goes.

[Note: pieces of stored tensors] A rank's shard of a flat parameter holds, of each original
parameter, one contiguous range of its elements in row-major order (``_layout``). So the
one request a reader has to serve is "elements [start, start + n) of the stored tensor
``key``, into this 1-D tensor" -- a ``Piece``. A buffer, or a parameter no unit flattened, is
the piece from 0 to its numel. Readers convert the dtype and move to the destination's device
as they copy, the way ``load_state_dict``'s ``copy_`` does.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence, Tuple

import torch

__all__ = ["CheckpointReader", "Piece", "StoredTensor", "sampled_digest"]

# What ``sampled_digest`` reads of a file: this many bytes at its start and at its end.
_SAMPLE_BYTES = 64 * 1024


@dataclass(frozen=True)
class StoredTensor:
    """A tensor as a checkpoint describes it."""

    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + dest.numel())`` of stored tensor ``key`` (flattened,
    row-major), to be copied into ``dest``: a contiguous 1-D tensor of any dtype and device."""

    key: str
    start: int
    dest: torch.Tensor

    @property
    def stop(self) -> int:
        return self.start + self.dest.numel()


class CheckpointReader(Protocol):
    """A checkpoint opened for reading pieces of its tensors."""

    path: str
    tensors: Mapping[str, StoredTensor]  # every stored tensor, by key
    unreadable: Mapping[str, str]  # stored tensors this torch cannot hold: key -> why

    def read(self, pieces: Sequence[Piece]) -> None:
        """Fill every piece's ``dest`` (keys are in ``tensors``, ranges within them)."""
        ...

    def identity(self) -> str:
        """What tells this checkpoint's content from another's, the same for every copy of it
        wherever it lies (file names, sizes, sampled digests; no paths)."""
        ...


def sampled_digest(file: str) -> str:
    """``name:size:digest`` of a file from its size and its first and last 64 KiB: two
    saves of the same model at different steps differ there, identical copies do not."""
    size = os.path.getsize(file)
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        digest.update(f.read(_SAMPLE_BYTES))
        if size > 2 * _SAMPLE_BYTES:
            f.seek(size - _SAMPLE_BYTES)
        digest.update(f.read(_SAMPLE_BYTES))
    return f"{os.path.basename(file)}:{size}:{digest.hexdigest()[:16]}"

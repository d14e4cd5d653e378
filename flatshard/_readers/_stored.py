"""What the checkpoint readers of ``load_pretrained`` share: a stored tensor's description, and
a piece of one to read (a range of its elements in row-major order) with where it goes.

[Note: pieces of stored tensors] A rank's shard of a flat parameter holds, of each original
parameter, one contiguous range of its elements in row-major order (``_layout``). So the
one request a reader has to serve is "elements [start, start + n) of the stored tensor
``key``, into this 1-D tensor" -- a ``Piece``. A buffer, or a parameter no unit flattened, is
the piece from 0 to its numel. Readers convert the dtype and move to the destination's device
as they copy, the way ``load_state_dict``'s ``copy_`` does.

[Note: checking files] A checkpoint may be malformed (a broken or hostile writer, a truncated
copy) or differ between the ranks (each rank reads its own copy, or the file changed between
their reads). Opening a reader checks all that can be checked without reading tensor data: a
safetensors header whole (see [Note: safetensors byte ranges]), a DCP directory's metadata
(each saved chunk inside its tensor, at a place inside the directory, in a file long enough
to hold it). Every rank opens every file, so a malformed one raises the same error, naming
the file and the key, on every rank before anything is read. Whether the tensors' bytes are
the same on every rank cannot be known without reading them all: every load compares the
cheap ``identity`` (sizes, whole headers, the first and last 64 KiB of files), and only a
verified load (``load_pretrained(..., verify=True)``) compares ``digests`` of every byte the
load reads from, which costs reading the checkpoint once more on every rank.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Dict, List, Mapping, Protocol, Sequence, Tuple

import torch

__all__ = ["CheckpointReader", "Piece", "StoredTensor", "range_digests", "sampled_digest"]

# What ``sampled_digest`` reads of a file: (at least) this many bytes at its start, and this
# many at its end.
_SAMPLE_BYTES = 64 * 1024
# ``range_digests`` reads this many bytes at a time.
_BLOCK_BYTES = 8 * 1024 * 1024


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
    """A checkpoint opened for reading pieces of its tensors. Opening it checks everything
    that can be checked without reading the tensors' data (see [Note: checking files])."""

    path: str
    tensors: Mapping[str, StoredTensor]  # every stored tensor, by key
    unreadable: Mapping[str, str]  # stored tensors this torch cannot hold: key -> why

    def read(self, pieces: Sequence[Piece]) -> None:
        """Fill every piece's ``dest`` (keys are in ``tensors``, ranges within them)."""
        ...

    def identity(self) -> str:
        """What tells this checkpoint's content from another's, cheaply, the same for every
        copy of it wherever it lies (file names, sizes, digests of headers and of each file's
        first and last 64 KiB; no paths)."""
        ...

    def digests(self, keys: Sequence[str]) -> List[str]:
        """A SHA-256 digest of every stored byte of each of ``keys``, each line naming the key
        and its file (no paths): reads every byte of those tensors."""
        ...


def sampled_digest(file: str, head: int = 0) -> str:
    """``name:size:digest`` of a file from its size, its first ``max(head, 64 KiB)`` bytes
    (``head``: its header's length, so a header is covered whole) and its last 64 KiB: two
    saves of the same model at different steps differ there, identical copies do not."""
    size = os.path.getsize(file)
    first = max(head, _SAMPLE_BYTES)
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        digest.update(f.read(first))
        if size > first + _SAMPLE_BYTES:
            f.seek(size - _SAMPLE_BYTES)
        digest.update(f.read(_SAMPLE_BYTES))
    return f"{os.path.basename(file)}:{size}:{digest.hexdigest()[:16]}"


def range_digests(file: str, ranges: Sequence[Tuple[int, int]]) -> List[str]:
    """The SHA-256 digest (its first 16 hex digits) of each ``[begin, end)`` byte range of
    ``file``, in the order given; the file is read in offset order, a block at a time."""
    found: Dict[int, str] = {}
    block = bytearray(_BLOCK_BYTES)
    with open(file, "rb", buffering=0) as f:
        for index in sorted(range(len(ranges)), key=lambda i: ranges[i]):
            begin, end = ranges[index]
            digest = hashlib.sha256()
            f.seek(begin)
            while begin < end:
                got = f.readinto(memoryview(block)[: min(_BLOCK_BYTES, end - begin)])
                if not got:
                    raise ValueError(f"{file!r} ends at byte {begin}, before byte {end}, where the checkpoint's data does (truncated file)")
                digest.update(memoryview(block)[:got])
                begin += got
            found[index] = digest.hexdigest()[:16]
    return [found[i] for i in range(len(ranges))]

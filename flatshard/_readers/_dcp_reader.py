"""Reading element ranges of tensors from a ``torch.distributed.checkpoint`` (DCP) checkpoint
directory, straight into the destination tensors, with no collective.

[Note: a flat range as boxes] DCP addresses parts of a tensor as boxes (an offset and a size
per dimension), and reads a box from whichever saved chunks overlap it. A range of elements
in row-major order -- what a shard holds of a parameter -- splits into at most ``2d - 1``
boxes of a ``d``-dimensional tensor: the tail of the first row it starts in (recursively, a
box of the rows below), the whole rows in between, and the head of the last row. Each box is
contiguous in row-major order too, so it is a view of the destination with the box's shape,
and DCP copies into it directly (``_IntoViews.resolve_tensor``): no state dict, no copy of
the shard, which is what makes a sharded state dict plus ``dcp.load`` cost about two and a
half times the shards.

The storage reader is driven through its public protocol (metadata, local plan, global plan
of one, read) as ``dcp.load`` does with ``no_dist``: each rank plans only its own reads, so
loading needs no collective and works at any world size. The reader deserialises every saved
chunk that overlaps a box (``torch.load`` of the chunk), so the transient memory is one saved
chunk -- for a checkpoint saved by one process, one whole parameter.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Sequence, Tuple

import torch

from .._comm._collectives import fingerprint
from ._stored import Piece, StoredTensor, sampled_digest

__all__ = ["DcpReader", "is_dcp_checkpoint", "flat_range_boxes"]

# (offsets, sizes) of a box, and where in the range it starts (counted from the range's start)
Box = Tuple[Tuple[int, ...], Tuple[int, ...], int]


def is_dcp_checkpoint(path: str) -> bool:
    """Whether ``path`` is a directory DCP saved (it holds DCP's ``.metadata``)."""
    return os.path.isfile(os.path.join(path, ".metadata"))


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> List[Box]:
    """The boxes covering elements ``[start, stop)`` of a tensor of ``shape`` in row-major
    order, in that order, with each box's position in the range (see [Note: a flat range as
    boxes])."""
    shape = tuple(int(n) for n in shape)
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    if len(shape) == 1:
        return [((start,), (stop - start,), 0)]
    row = math.prod(shape[1:])
    first_full = -(-start // row)  # the first row the range holds whole
    end_full = stop // row  # the row after the last one it holds whole
    zeros = (0,) * (len(shape) - 1)
    if first_full > end_full:  # inside one row
        return _in_row(shape, start // row, start % row, stop % row or row, 0)
    out: List[Box] = []
    if start < first_full * row:
        out += _in_row(shape, first_full - 1, start % row, row, 0)
    if first_full < end_full:
        out.append(((first_full,) + zeros, (end_full - first_full,) + shape[1:], first_full * row - start))
    if stop > end_full * row:
        out += _in_row(shape, end_full, 0, stop - end_full * row, end_full * row - start)
    return out


def _in_row(shape: Tuple[int, ...], row: int, lo: int, hi: int, at: int) -> List[Box]:
    return [((row,) + offsets, (1,) + sizes, at + where) for offsets, sizes, where in flat_range_boxes(shape[1:], lo, hi)]


class DcpReader:
    """The tensors of the DCP checkpoint directory at ``path`` (see [Note: a flat range as
    boxes]).

    Args:
        path: a directory written by ``torch.distributed.checkpoint.save``.
    """

    def __init__(self, path: str) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        self._reader = FileSystemReader(path)
        self._metadata = self._reader.read_metadata()
        entries = self._metadata.state_dict_metadata.items()
        self._stored = {key: md for key, md in entries if isinstance(md, TensorStorageMetadata)}
        self.tensors: Dict[str, StoredTensor] = {
            key: StoredTensor(tuple(md.size), md.properties.dtype) for key, md in self._stored.items()
        }
        self.unreadable: Dict[str, str] = {}

    def identity(self) -> str:
        # (not the metadata: two saves of the same values differ there, in ids DCP writes)
        data = sorted(n for n in os.listdir(self.path) if n.endswith(".distcp"))
        sizes = fingerprint(" ".join(f"{n}:{os.path.getsize(os.path.join(self.path, n))}" for n in data))
        sampled = [sampled_digest(os.path.join(self.path, n)) for n in dict.fromkeys(data[:1] + data[-1:])]
        return " ".join([f"{len(data)} files, sizes {sizes:x}"] + sampled)

    def read(self, pieces: Sequence[Piece]) -> None:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        chunks: Dict[str, List[Any]] = {}
        views: Dict[Tuple[str, int], torch.Tensor] = {}
        for piece in pieces:
            shape = self.tensors[piece.key].shape
            for offsets, sizes, at in flat_range_boxes(shape, piece.start, piece.stop):
                listed = chunks.setdefault(piece.key, [])
                views[(piece.key, len(listed))] = piece.dest[at : at + math.prod(sizes)].view(sizes)
                listed.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        items = [item for key, listed in chunks.items() for item in create_read_items_for_chunk_list(key, self._stored[key], listed)]
        _check_covered(items, views)
        if not items:
            return
        self._reader.set_up_storage_reader(self._metadata, True)
        plan = self._reader.prepare_local_plan(LoadPlan(items))
        plan = self._reader.prepare_global_plan([plan])[0]
        self._reader.read_data(plan, _into_views(views)).wait()


def _check_covered(items: Sequence[Any], views: Dict[Tuple[str, int], torch.Tensor]) -> None:
    """Raise unless the saved chunks cover every box (else some elements would keep whatever
    the destination held)."""
    covered: Dict[Tuple[str, int], int] = {}
    for item in items:
        where = (item.dest_index.fqn, item.dest_index.index)
        covered[where] = covered.get(where, 0) + math.prod(item.lengths)
    for (key, index), view in views.items():
        if covered.get((key, index), 0) != view.numel():
            raise ValueError(
                f"the checkpoint's saved chunks of '{key}' cover {covered.get((key, index), 0)} of the {view.numel()} "
                f"elements of the box of shape {tuple(view.shape)} this rank reads (an incomplete checkpoint?)"
            )


def _into_views(views: Dict[Tuple[str, int], torch.Tensor]) -> Any:
    """A DCP ``LoadPlanner`` that hands the storage reader views of the destinations."""
    from torch.distributed.checkpoint.planner import LoadPlanner

    class _IntoViews(LoadPlanner):
        # (the planning steps are done by DcpReader.read; a storage reader only resolves and
        # commits tensors)
        def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("_IntoViews only serves a storage reader's read_data")

        create_local_plan = create_global_plan = finish_plan = set_up_planner

        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise AssertionError(f"_IntoViews was asked for the non-tensor entry '{read_item.dest_index.fqn}'")

        def resolve_tensor(self, read_item: Any) -> torch.Tensor:
            view = views[(read_item.dest_index.fqn, read_item.dest_index.index)]
            for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                view = view.narrow(dim, offset, length)
            return view

        def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
            pass  # (it was written in place)

    return _IntoViews()

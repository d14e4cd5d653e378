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
chunk -- for a checkpoint saved by one process, one whole parameter. Chunks are read one at a
time, so a chunk that fails to deserialise is named with its file and key.

Opening the directory checks its metadata (see [Note: checking files]): every saved chunk of a
tensor lies inside the tensor and has a place in a file inside the directory, long enough to
hold it (a truncated or missing file is named at once, with the key). Whether the chunks of a
tensor cover what a rank reads, each element once, is checked per box when reading (checking
every pair of chunks when opening would cost the square of the saving world size).
The metadata file is a pickle, as torch's own reader loads it: a hostile one runs code.
"""

from __future__ import annotations

import math
import os
import pickle
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .._comm._collectives import fingerprint
from ._stored import Piece, StoredTensor, range_digests, sampled_digest

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
        self._metadata = _read_metadata(path)
        entries = self._metadata.state_dict_metadata.items()
        self._stored = {key: md for key, md in entries if isinstance(md, TensorStorageMetadata)}
        # (key, a saved chunk's offsets) -> (its file, relative to path; offset; length)
        self._places = _checked_places(path, self._metadata.storage_data, self._stored)
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

    def digests(self, keys: Sequence[str]) -> List[str]:
        chunks = [
            (key, offsets) for key in dict.fromkeys(keys) for offsets in sorted(tuple(int(n) for n in c.offsets) for c in self._stored[key].chunks)
        ]
        by_file: Dict[str, List[Tuple[str, Tuple[int, ...]]]] = {}
        for chunk in chunks:
            by_file.setdefault(self._places[chunk][0], []).append(chunk)
        found: Dict[Tuple[str, Tuple[int, ...]], str] = {}
        for name, group in by_file.items():
            ranges = [(self._places[c][1], self._places[c][1] + self._places[c][2]) for c in group]
            for (key, offsets), digest in zip(group, range_digests(os.path.join(self.path, name), ranges)):
                found[(key, offsets)] = f"sha256 of '{key}' saved chunk at offsets {offsets} in {name}: {digest}"
        return [found[chunk] for chunk in chunks]

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
        _check_covered(self.path, items, views)
        if not items:
            return
        self._reader.set_up_storage_reader(self._metadata, True)
        planner = _into_views(views)
        by_chunk: Dict[Tuple[str, Tuple[int, ...]], List[Any]] = {}
        for item in items:
            by_chunk.setdefault((item.storage_index.fqn, tuple(int(n) for n in item.storage_index.offset)), []).append(item)
        for (key, offsets), group in by_chunk.items():
            plan = self._reader.prepare_global_plan([self._reader.prepare_local_plan(LoadPlan(group))])[0]
            try:
                self._reader.read_data(plan, planner).wait()
            except Exception as exc:  # noqa: BLE001 - named with its file and key (torch.load of broken bytes raises anything, OSError too)
                name, offset, length = self._places[(key, offsets)]
                raise ValueError(
                    f"{os.path.join(self.path, name)!r}: the saved chunk of '{key}' at offsets {offsets} (bytes "
                    f"[{offset}, {offset + length})) cannot be read: {type(exc).__name__}: {exc}"
                ) from exc


def _read_metadata(path: str) -> Any:
    """The checkpoint's metadata, loaded as torch's ``FileSystemReader`` loads it."""
    from torch.distributed.checkpoint.metadata import Metadata

    file = os.path.join(path, ".metadata")
    try:
        with open(file, "rb") as f:
            metadata = pickle.load(f)
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever unpickling raises: named with the file
        raise ValueError(f"{file!r} is not a torch.distributed.checkpoint metadata file: {type(exc).__name__}: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{file!r} is not a torch.distributed.checkpoint metadata file: it holds a {type(metadata).__name__}")
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise ValueError(f"{file!r} is not a torch.distributed.checkpoint metadata file: its state_dict_metadata or storage_data is not a dict")
    return metadata


def _checked_places(path: str, storage: Dict[Any, Any], stored: Dict[str, Any]) -> Dict[Tuple[str, Tuple[int, ...]], Tuple[str, int, int]]:
    """Where each saved chunk of each tensor lies: its file (relative to ``path``), offset and
    length, checked against the tensor, the directory and the file's size."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    meta = os.path.join(path, ".metadata")
    sizes: Dict[str, int] = {}
    places: Dict[Tuple[str, Tuple[int, ...]], Tuple[str, int, int]] = {}
    for key, md in stored.items():
        shape = _described_shape(meta, key, md)
        for chunk in md.chunks:
            raw = (getattr(chunk, "offsets", None), getattr(chunk, "sizes", None))
            offsets, extent = _ints(raw[0]), _ints(raw[1])
            if offsets is None or extent is None or not _fits(offsets, extent, shape):
                shown = [given if given is not None else value for given, value in zip((offsets, extent), raw)]
                raise ValueError(f"{meta!r}: '{key}' of shape {shape} has a saved chunk at offsets {shown[0]} of sizes {shown[1]}, which do not fit in it")
            info = storage.get(MetadataIndex(key, chunk.offsets))
            if info is None:
                raise ValueError(f"{meta!r} names no stored bytes for the saved chunk of '{key}' at offsets {offsets}")
            where = f"the saved chunk of '{key}' at offsets {offsets}"
            name, offset, length = getattr(info, "relative_path", None), getattr(info, "offset", None), getattr(info, "length", None)
            if not isinstance(name, str) or os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == os.pardir:
                raise ValueError(f"{meta!r} places {where} in {name!r}, outside the checkpoint directory")
            if not (_is_int(offset) and _is_int(length) and offset >= 0 and length >= 0):
                raise ValueError(f"{meta!r} places {where} at offset {offset!r}, length {length!r} (expected non-negative integers)")
            file = os.path.join(path, name)
            if name not in sizes:
                if not os.path.isfile(file):
                    raise FileNotFoundError(f"{file!r}, where {meta!r} places {where}, does not exist")
                sizes[name] = os.path.getsize(file)
            if offset + length > sizes[name]:
                raise ValueError(
                    f"{file!r} holds {sizes[name]} bytes, but {meta!r} places {where} in its bytes [{offset}, "
                    f"{offset + length}) (a truncated or replaced file)"
                )
            places[(key, offsets)] = (name, offset, length)
    return places


def _fits(offsets: Tuple[int, ...], sizes: Tuple[int, ...], shape: Tuple[int, ...]) -> bool:
    return len(offsets) == len(sizes) == len(shape) and all(0 <= o and 0 <= n and o + n <= d for o, n, d in zip(offsets, sizes, shape))


def _described_shape(meta: str, key: str, md: Any) -> Tuple[int, ...]:
    size, dtype, chunks = getattr(md, "size", None), getattr(getattr(md, "properties", None), "dtype", None), getattr(md, "chunks", None)
    if not (isinstance(size, tuple) and all(_is_int(n) and n >= 0 for n in size) and isinstance(dtype, torch.dtype) and isinstance(chunks, list)):
        raise ValueError(f"{meta!r}: the entry of '{key}' is not a tensor's description (a size, a dtype and a list of saved chunks)")
    return tuple(size)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(value: object) -> Optional[Tuple[int, ...]]:
    """``value`` as a tuple if it is a tuple of integers (a ``torch.Size``), else ``None``."""
    return tuple(value) if isinstance(value, tuple) and all(_is_int(n) for n in value) else None


def _check_covered(path: str, items: Sequence[Any], views: Dict[Tuple[str, int], torch.Tensor]) -> None:
    """Raise unless the saved chunks cover every box, each element once (else some elements
    would keep whatever the destination held, or hold what no save wrote there)."""
    per_box: Dict[Tuple[str, int], List[Any]] = {}
    for item in items:
        per_box.setdefault((item.dest_index.fqn, item.dest_index.index), []).append(item)
    for (key, index), view in views.items():
        found = per_box.get((key, index), [])
        clash = _first_overlap(found)
        if clash is not None:
            first, second = (tuple(int(n) for n in item.storage_index.offset) for item in clash)
            raise ValueError(
                f"{path!r}: the checkpoint's saved chunks of '{key}' at offsets {first} and {second} overlap in the box of "
                f"shape {tuple(view.shape)} this rank reads (a malformed checkpoint)"
            )
        covered = sum(math.prod(item.lengths) for item in found)
        if covered != view.numel():
            raise ValueError(
                f"{path!r}: the checkpoint's saved chunks of '{key}' cover {covered} of the {view.numel()} "
                f"elements of the box of shape {tuple(view.shape)} this rank reads (an incomplete checkpoint?)"
            )


def _first_overlap(items: Sequence[Any]) -> Optional[Tuple[Any, Any]]:
    """Two read items whose regions of the box overlap, or ``None``: a sweep along the first
    dimension, comparing only items whose first-dimension ranges meet (for chunks cut along
    the rows, as sharded saves cut them, each item meets one other)."""
    order = sorted((item for item in items if math.prod(item.lengths)), key=lambda item: tuple(item.dest_offsets))
    active: List[Any] = []
    for item in order:
        start = item.dest_offsets[0] if len(item.lengths) else 0
        active = [a for a in active if not len(a.lengths) or a.dest_offsets[0] + a.lengths[0] > start]
        for other in active:
            if all(o1 < o2 + n2 and o2 < o1 + n1 for o1, n1, o2, n2 in zip(other.dest_offsets, other.lengths, item.dest_offsets, item.lengths)):
                return other, item
        active.append(item)
    return None


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

"""Reading element ranges of tensors from Hugging Face safetensors files, without loading the
tensors and without the ``safetensors`` package.

[Note: safetensors byte ranges] A safetensors file is an 8-byte little-endian header length,
a JSON header naming each tensor's dtype, shape and ``[begin, end)`` byte offsets (counted
from the end of the header), then the tensors' bytes, each row-major and little-endian. A
range of a tensor's elements in row-major order -- what a rank's shard holds of a parameter
(see [Note: pieces of stored tensors]) -- is therefore one contiguous range of bytes in the
file: it is read with one ``readinto``, straight into the destination when that is a CPU tensor
of the stored dtype, else through a bounded staging buffer that is converted as it is copied.
Plain reads, not a memory map: what a rank reads is its shard's bytes, and nothing of the file
stays mapped into the process afterwards. A model split over several files names them in a
``model.safetensors.index.json`` (``weight_map``: key -> file), as Hugging Face saves them.

The header is checked whole when a file is opened, before any data is read (see [Note:
checking files]): a JSON object naming nothing twice (a JSON parser would silently keep the
last of two entries of one key), ``__metadata__`` strings to strings, each tensor exactly a
dtype the format defines, a shape of non-negative integers and ``[begin, end]`` offsets whose
length fits the dtype and shape, inside the data section, no two tensors' bytes overlapping
(else writing one would change the other, and reading gives values no save produced). Gaps
between tensors, and bytes after the last one, are allowed: nothing reads them.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import sys
from typing import Any, BinaryIO, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from ._stored import Piece, StoredTensor, range_digests, sampled_digest

__all__ = ["INDEX_NAME", "SafetensorsReader", "safetensors_files", "write_safetensors"]

INDEX_NAME = "model.safetensors.index.json"

# The header's largest sensible size (the format's own readers refuse more than 100 MB).
_MAX_HEADER = 100 * 1024 * 1024
# Converting or moving reads go through a staging buffer of at most this many bytes.
_STAGING_BYTES = 64 * 1024 * 1024


# Every dtype the format defines, with its bits per element (a file may hold ones this torch
# cannot: see ``_dtypes``).
_FORMAT_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}  # fmt: skip
_FIELDS = frozenset({"dtype", "shape", "data_offsets"})


def _dtypes() -> Dict[str, torch.dtype]:
    names = {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
        "U16": "uint16", "U32": "uint32", "U64": "uint64", "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
        "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    }
    # (only those this torch has: the unsigned and float8 types came in later versions)
    return {code: getattr(torch, name) for code, name in names.items() if isinstance(getattr(torch, name, None), torch.dtype)}


def safetensors_files(path: str) -> List[str]:
    """The safetensors files of the checkpoint at ``path``: a ``.safetensors`` file; an index
    file (``*.safetensors.index.json``); or a directory holding an index or, without one, its
    ``*.safetensors`` files. Raises ``FileNotFoundError`` if there are none."""
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_NAME)
        if os.path.isfile(index):
            return _indexed_files(index)
        found = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
        if not found:
            raise FileNotFoundError(f"{path!r} holds no {INDEX_NAME} and no *.safetensors file")
        return found
    if path.endswith(".json"):
        return _indexed_files(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path!r}")
    return [path]


def _indexed_files(index: str) -> List[str]:
    with open(index, encoding="utf-8") as f:
        try:
            weight_map = json.load(f, object_pairs_hook=_unique_names(repr(index))).get("weight_map")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ValueError(f"{index!r} is not a safetensors index (a JSON object with a 'weight_map')") from exc
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index!r} is not a safetensors index: its 'weight_map' must map keys to file names")
    folder = os.path.dirname(index)
    return [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]


class SafetensorsReader:
    """The tensors of one or more safetensors files (see [Note: safetensors byte ranges]).

    Args:
        path: what ``safetensors_files`` accepts.
    """

    def __init__(self, path: str) -> None:
        if sys.byteorder != "little":
            raise NotImplementedError("reading safetensors files on a big-endian machine")
        self.path = path
        self.tensors: Dict[str, StoredTensor] = {}
        self.unreadable: Dict[str, str] = {}
        # key -> (file, file offsets of its first byte and past its last)
        self._where: Dict[str, Tuple[str, int, int]] = {}
        self._data_start: Dict[str, int] = {}  # file -> where its data section starts
        self._files = safetensors_files(path)
        for file in self._files:
            header = _read_header(file)
            self._data_start[file] = header.data_start
            for entry in header.entries:
                if entry.key in self._where or entry.key in self.unreadable:
                    where = self._where[entry.key][0] if entry.key in self._where else "an earlier file"
                    raise ValueError(f"key '{entry.key}' is stored twice: in {where!r} and in {file!r}")
                if entry.stored is None:
                    self.unreadable[entry.key] = entry.why
                    continue
                self.tensors[entry.key] = entry.stored
                self._where[entry.key] = (file, header.data_start + entry.begin, header.data_start + entry.end)

    def identity(self) -> str:
        return " ".join(sampled_digest(file, head=self._data_start[file]) for file in self._files)

    def digests(self, keys: Sequence[str]) -> List[str]:
        by_file: Dict[str, List[str]] = {}
        for key in dict.fromkeys(keys):
            by_file.setdefault(self._where[key][0], []).append(key)
        found: Dict[str, str] = {}
        for file, group in by_file.items():
            for key, digest in zip(group, range_digests(file, [self._where[key][1:] for key in group])):
                found[key] = f"sha256 of '{key}' in {os.path.basename(file)}: {digest}"
        return [found[key] for key in dict.fromkeys(keys)]

    def read(self, pieces: Sequence[Piece]) -> None:
        by_file: Dict[str, List[Piece]] = {}
        for piece in pieces:
            by_file.setdefault(self._where[piece.key][0], []).append(piece)
        for file, group in by_file.items():
            with open(file, "rb", buffering=0) as stream:
                for piece in sorted(group, key=lambda p: (self._where[p.key][1], p.start)):
                    self._read_piece(stream, piece)

    def _read_piece(self, stream: BinaryIO, piece: Piece) -> None:
        stored = self.tensors[piece.key]
        size = stored.dtype.itemsize
        offset = self._where[piece.key][1] + piece.start * size
        dest = piece.dest
        if dest.device.type == "cpu" and dest.dtype == stored.dtype and dest.is_contiguous():
            _fill(stream, offset, dest.view(torch.uint8) if dest.numel() else dest, piece.key)
            # (written behind autograd's back: a graph that saved the old values must see the
            # change, as it would after copy_)
            torch.autograd.graph.increment_version(dest)
            return
        step = max(1, _STAGING_BYTES // size)
        staging = torch.empty(min(step, dest.numel()) * size, dtype=torch.uint8)
        for first in range(0, dest.numel(), step):
            count = min(step, dest.numel() - first)
            part = staging[: count * size]
            _fill(stream, offset + first * size, part, piece.key)
            dest[first : first + count].copy_(part.view(stored.dtype))


def write_safetensors(file: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``tensors`` (CPU or not, any layout) to the safetensors ``file``, in key order,
    one tensor in memory at a time (for tests and benchmarks; flatshard only reads them)."""
    if sys.byteorder != "little":
        raise NotImplementedError("writing safetensors files on a big-endian machine")
    codes = {dtype: code for code, dtype in _dtypes().items()}
    header: Dict[str, object] = {}
    begin = 0
    for key, tensor in tensors.items():
        if tensor.dtype not in codes:
            raise NotImplementedError(f"write_safetensors: '{key}' has dtype {tensor.dtype}, which safetensors cannot hold")
        end = begin + tensor.numel() * tensor.element_size()
        header[key] = {"dtype": codes[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [begin, end]}
        begin = end
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # (the data starts 8-byte aligned, as the format's writers align it)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for tensor in tensors.values():
            data = tensor.detach().to("cpu").contiguous()
            if data.numel():
                f.write(_bytes_of(data))


def _fill(stream: BinaryIO, offset: int, dest: torch.Tensor, key: str) -> None:
    """Read ``dest.numel()`` bytes at ``offset`` into ``dest``, a contiguous CPU uint8 tensor."""
    nbytes = dest.numel()
    if nbytes == 0:
        return
    window = _bytes_of(dest)
    stream.seek(offset)
    done = 0
    while done < nbytes:
        got = stream.readinto(window[done:])
        if not got:
            raise ValueError(f"{stream.name!r} ends before the data of key '{key}' does (truncated file)")
        done += got


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous, non-empty CPU tensor, writable in place (no NumPy needed)."""
    return memoryview((ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())).cast("B")


class _Entry(NamedTuple):
    """A tensor of a file's header: its bytes ``[begin, end)`` of the data section, and what
    it holds, or (``stored`` None) why this torch cannot hold it."""

    key: str
    begin: int
    end: int
    stored: Optional[StoredTensor]
    why: str


class _Header(NamedTuple):
    data_start: int  # the file offset of the data section
    entries: List[_Entry]


def _read_header(file: str) -> _Header:
    """The checked header of ``file`` (see [Note: safetensors byte ranges])."""
    file_size = os.path.getsize(file)
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{file!r} is not a safetensors file: it has {len(prefix)} bytes")
        (length,) = struct.unpack("<Q", prefix)
        if length > file_size - 8:
            raise ValueError(f"{file!r} is not a safetensors file: its header length {length} exceeds the file ({file_size} bytes)")
        if length > _MAX_HEADER:
            raise ValueError(f"{file!r} is not a safetensors file: its header length {length} exceeds the format's limit ({_MAX_HEADER} bytes)")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_names(f"{file!r}: its header"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file!r} is not a safetensors file: its header is not JSON") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{file!r} is not a safetensors file: its header is not a JSON object")
    metadata = header.get("__metadata__", {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise ValueError(f"{file!r}: its __metadata__ is {_shown(metadata)}; expected an object mapping strings to strings")
    dtypes = _dtypes()
    data_size = file_size - 8 - length
    entries = [_entry(file, key, entry, data_size, dtypes) for key, entry in header.items() if key != "__metadata__"]
    _check_apart(file, entries)
    return _Header(8 + length, entries)


def _entry(file: str, key: str, entry: object, data_size: int, dtypes: Mapping[str, torch.dtype]) -> _Entry:
    where = f"{file!r}: key '{key}'"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is {_shown(entry)} ({_a(entry)}); expected an object with dtype, shape and data_offsets")
    lacking, extra = sorted(_FIELDS - set(entry)), sorted(set(entry) - _FIELDS)
    if lacking:
        raise ValueError(f"{where} lacks {', '.join(map(repr, lacking))} (every tensor has dtype, shape and data_offsets)")
    if extra:
        raise ValueError(f"{where} has {', '.join(map(repr, extra))} besides dtype, shape and data_offsets")
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(code, str) or code not in _FORMAT_BITS:
        kind = "" if isinstance(code, str) else f" ({_a(code)})"
        raise ValueError(f"{where} has dtype {_shown(code)}{kind}; expected one of the safetensors dtypes ({', '.join(sorted(_FORMAT_BITS))})")
    if not (isinstance(shape, list) and all(_is_int(n) and n >= 0 for n in shape)):
        raise ValueError(f"{where} has shape {_shown(shape)}; expected a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(n) for n in offsets) and 0 <= offsets[0] <= offsets[1]):
        raise ValueError(f"{where} has data_offsets {_shown(offsets)}; expected [begin, end], integers with 0 <= begin <= end")
    begin, end = offsets
    bits = math.prod(shape) * _FORMAT_BITS[code]
    if bits != 8 * (end - begin):
        need = f"{bits // 8} bytes" if bits % 8 == 0 else f"{bits} bits ({bits / 8:g} bytes)"
        raise ValueError(f"{where} ({code}, shape {tuple(shape)}) needs {need}; its data_offsets {offsets} give {end - begin}")
    if end > data_size:
        raise ValueError(f"{file!r}: the data of key '{key}' ends at byte {end} of the data section, past its end ({data_size})")
    if code not in dtypes:
        return _Entry(key, begin, end, None, f"{where} has dtype {code!r}, which this torch cannot hold (known: {sorted(dtypes)})")
    return _Entry(key, begin, end, StoredTensor(tuple(shape), dtypes[code]), "")


def _check_apart(file: str, entries: Sequence[_Entry]) -> None:
    """Raise if two tensors' bytes overlap (empty tensors hold none)."""
    previous = None
    for entry in sorted((e for e in entries if e.end > e.begin), key=lambda e: (e.begin, e.end)):
        if previous is not None and entry.begin < previous.end:
            raise ValueError(
                f"{file!r}: the data of keys '{previous.key}' (bytes [{previous.begin}, {previous.end}) of the data section) "
                f"and '{entry.key}' (bytes [{entry.begin}, {entry.end})) overlap; every tensor needs bytes of its own"
            )
        previous = entry


def _unique_names(where: str) -> Callable[[List[Tuple[str, Any]]], Dict[str, Any]]:
    """A JSON ``object_pairs_hook`` refusing an object that names a key twice (``json`` would
    keep the last value silently)."""

    def pairs(items: List[Tuple[str, Any]]) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise ValueError(f"{where} names {key!r} twice in one JSON object (a JSON parser would keep only the last)")
            out[key] = value
        return out

    return pairs


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _a(value: object) -> str:
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _shown(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

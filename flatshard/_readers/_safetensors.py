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
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
from typing import BinaryIO, Dict, List, Mapping, Sequence, Tuple, Union

import torch

from ._stored import Piece, StoredTensor, sampled_digest

__all__ = ["INDEX_NAME", "SafetensorsReader", "safetensors_files", "write_safetensors"]

INDEX_NAME = "model.safetensors.index.json"

# The header's largest sensible size (the format's own readers refuse more than 100 MB).
_MAX_HEADER = 100 * 1024 * 1024
# Converting or moving reads go through a staging buffer of at most this many bytes.
_STAGING_BYTES = 64 * 1024 * 1024


def _dtypes() -> Dict[str, torch.dtype]:
    names = {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
        "U16": "uint16", "U32": "uint32", "U64": "uint64", "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
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
            weight_map = json.load(f).get("weight_map")
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
        # key -> (file, offset of its first byte in the file)
        self._where: Dict[str, Tuple[str, int]] = {}
        self._files = safetensors_files(path)
        for file in self._files:
            for key, entry in _read_header(file).items():
                if key in self._where or key in self.unreadable:
                    where = self._where[key][0] if key in self._where else "an earlier file"
                    raise ValueError(f"key '{key}' is stored twice: in {where!r} and in {file!r}")
                if isinstance(entry, str):
                    self.unreadable[key] = entry
                    continue
                self.tensors[key], offset = entry
                self._where[key] = (file, offset)

    def identity(self) -> str:
        return " ".join(sampled_digest(file) for file in self._files)

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


def _read_header(file: str) -> Mapping[str, Union[Tuple[StoredTensor, int], str]]:
    """Every tensor of ``file``: its description and the file offset of its first byte,
    checked for what reading it needs (entries complete, sizes consistent, data within the
    file); or, for a dtype this torch cannot hold, why not (an error only if it is read)."""
    dtypes = _dtypes()
    file_size = os.path.getsize(file)
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{file!r} is not a safetensors file: it has {len(prefix)} bytes")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(_MAX_HEADER, file_size - 8):
            raise ValueError(f"{file!r} is not a safetensors file: its header length {length} exceeds the file ({file_size} bytes)")
        try:
            header = json.loads(f.read(length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{file!r} is not a safetensors file: its header is not JSON") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{file!r} is not a safetensors file: its header is not a JSON object")
    data_start = 8 + length
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        described = _entry(file, key, entry, dtypes)
        if isinstance(described, str):
            out[key] = described
            continue
        stored, begin = described
        end = begin + stored.numel * stored.dtype.itemsize
        if data_start + end > file_size:
            raise ValueError(f"{file!r}: the data of key '{key}' ends at byte {data_start + end}, past the file's end ({file_size})")
        out[key] = (stored, data_start + begin)
    return out


def _entry(file: str, key: str, entry: object, dtypes: Mapping[str, torch.dtype]) -> Union[Tuple[StoredTensor, int], str]:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise ValueError(f"{file!r}: key '{key}' lacks a dtype, shape or data_offsets entry")
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if code not in dtypes:
        return f"{file!r}: key '{key}' has dtype {code!r}, which this torch cannot hold (known: {sorted(dtypes)})"
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise ValueError(f"{file!r}: key '{key}' has shape {shape!r}; expected a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)):
        raise ValueError(f"{file!r}: key '{key}' has data_offsets {offsets!r}; expected [begin, end]")
    stored = StoredTensor(tuple(shape), dtypes[code])
    begin, end = offsets
    if end - begin != stored.numel * stored.dtype.itemsize or begin < 0:
        raise ValueError(
            f"{file!r}: key '{key}' ({code}, shape {tuple(shape)}) needs {stored.numel * stored.dtype.itemsize} bytes; "
            f"its data_offsets {offsets} give {end - begin}"
        )
    return stored, begin

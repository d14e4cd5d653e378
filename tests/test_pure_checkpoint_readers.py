"""The checkpoint readers behind ``load_pretrained``, without ranks: a flat element range as
DCP boxes, element ranges of safetensors files (against the ``safetensors`` package where it
is installed) and of DCP directories, dtype conversion through the staging buffer, and every
malformed safetensors file named."""

import itertools
import json
import math
import os
import struct

import pytest
import torch
from torch import nn

import flatshard._readers._safetensors as safetensors_module
from flatshard._readers._dcp_reader import DcpReader, flat_range_boxes
from flatshard._readers._safetensors import SafetensorsReader, write_safetensors
from flatshard._readers._stored import Piece, StoredTensor
from flatshard.pretrained import empty_init, open_checkpoint
from tests._models import dcp_save_in_one_process

SHAPES = [(), (5,), (3, 4), (2, 3, 4), (2, 1, 3, 2), (0, 3)]


def _tensors():
    gen = torch.Generator().manual_seed(0)
    return {
        "matrix": torch.randn(3, 5, generator=gen),
        "cube": torch.randn(2, 3, 4, generator=gen),
        "low": torch.randn(7, generator=gen).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "ints": torch.arange(10, dtype=torch.int64).reshape(2, 5),
        "empty": torch.zeros(0, 3),
    }


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_boxes_cover_exactly_the_range_in_order(shape):
    numel = math.prod(shape)
    source = torch.arange(numel).reshape(shape)
    for start, stop in itertools.combinations_with_replacement(range(numel + 1), 2):
        values, position = [], 0
        boxes = flat_range_boxes(shape, start, stop)
        for offsets, sizes, at in boxes:
            assert at == position, (shape, start, stop, boxes)
            box = source[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
            assert tuple(box.shape) == tuple(sizes)
            values += box.reshape(-1).tolist()
            position += box.numel()
        assert values == source.reshape(-1)[start:stop].tolist(), (shape, start, stop, boxes)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)


def _every_range(reader, tensors, dtypes=(None, torch.float64)):
    for key, tensor in tensors.items():
        numel = tensor.numel()
        for start, stop in itertools.combinations_with_replacement(range(numel + 1), 2):
            for dtype in dtypes:
                dest = torch.full((stop - start,), -7, dtype=dtype or tensor.dtype)
                reader.read([Piece(key, start, dest)])
                assert torch.equal(dest, tensor.reshape(-1)[start:stop].to(dest.dtype)), (key, start, stop, dtype)


def test_safetensors_ranges_and_descriptions(tmp_path):
    tensors = _tensors()
    write_safetensors(str(tmp_path / "t.safetensors"), tensors)
    reader = SafetensorsReader(str(tmp_path / "t.safetensors"))
    assert reader.tensors == {k: StoredTensor(tuple(v.shape), v.dtype) for k, v in tensors.items()}
    _every_range(reader, tensors)


def test_safetensors_staging_in_small_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_module, "_STAGING_BYTES", 8)  # (two float32 elements a step)
    tensors = _tensors()
    write_safetensors(str(tmp_path / "t.safetensors"), tensors)
    _every_range(SafetensorsReader(str(tmp_path / "t.safetensors")), tensors, dtypes=(torch.float64,))


def test_files_of_the_safetensors_package_and_ours_read_by_each_other(tmp_path):
    st = pytest.importorskip("safetensors.torch", reason="the safetensors package is not installed (the hf extra: pip install -e '.[hf]')")
    tensors = _tensors()
    st.save_file(tensors, str(tmp_path / "theirs.safetensors"))
    _every_range(SafetensorsReader(str(tmp_path / "theirs.safetensors")), tensors)
    write_safetensors(str(tmp_path / "ours.safetensors"), tensors)
    back = st.load_file(str(tmp_path / "ours.safetensors"))
    assert list(back) == list(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())


def test_several_files_through_an_index_or_a_directory(tmp_path):
    tensors = _tensors()
    keys = list(tensors)
    write_safetensors(str(tmp_path / "a.safetensors"), {k: tensors[k] for k in keys[:3]})
    write_safetensors(str(tmp_path / "b.safetensors"), {k: tensors[k] for k in keys[3:]})
    for path in (tmp_path, tmp_path / "a.safetensors"):
        reader = open_checkpoint(str(path))
        assert isinstance(reader, SafetensorsReader)
    assert sorted(open_checkpoint(str(tmp_path)).tensors) == sorted(keys)
    index = {"weight_map": {k: "a.safetensors" if i < 3 else "b.safetensors" for i, k in enumerate(keys)}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    _every_range(open_checkpoint(str(tmp_path)), tensors, dtypes=(None,))
    write_safetensors(str(tmp_path / "c.safetensors"), {"matrix": tensors["matrix"]})
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match=r"key 'matrix' is stored twice: in '.*a.safetensors' and in '.*c.safetensors'"):
        open_checkpoint(str(tmp_path))


def _raw(path, header, data=b""):
    encoded = json.dumps(header).encode() if isinstance(header, dict) else header
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return str(path)


def test_malformed_safetensors_files_are_named(tmp_path):
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    cases = [
        (str(tmp_path / "short.safetensors"), "is not a safetensors file: it has 3 bytes"),
        (_raw(tmp_path / "nothing.safetensors", b"{}", b""), None),
        (_raw(tmp_path / "json.safetensors", b"{nope"), "is not a safetensors file: its header is not JSON"),
        (_raw(tmp_path / "list.safetensors", b"[1]"), "is not a safetensors file: its header is not a JSON object"),
        (_raw(tmp_path / "past.safetensors", {"w": entry}, b"1234"), r"the data of key 'w' ends at byte 8 of the data section, past its end \(4\)"),
        (_raw(tmp_path / "sizes.safetensors", {"w": {**entry, "data_offsets": [0, 4]}}, b"1234"), r"key 'w' \(F32, shape \(2,\)\) needs 8 bytes; its data_offsets \[0, 4\] give 4"),
        (_raw(tmp_path / "shape.safetensors", {"w": {**entry, "shape": "2"}}), r"key 'w' has shape '2'; expected a list of non-negative integers"),
        (_raw(tmp_path / "lacks.safetensors", {"w": {"dtype": "F32"}}), r"key 'w' lacks 'data_offsets', 'shape' \(every tensor has dtype, shape and data_offsets\)"),
    ]
    (tmp_path / "short.safetensors").write_bytes(b"abc")
    for path, message in cases:
        if message is None:
            assert SafetensorsReader(path).tensors == {}
            continue
        with pytest.raises(ValueError, match=message):
            SafetensorsReader(path)
    length = tmp_path / "length.safetensors"
    length.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match=r"its header length 1099511627776 exceeds the file \(10 bytes\)"):
        SafetensorsReader(str(length))
    truncated = _raw(tmp_path / "truncated.safetensors", {"w": entry}, b"12345678")
    reader = SafetensorsReader(truncated)
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) - 2)
    with pytest.raises(ValueError, match=r"ends before the data of key 'w' does \(truncated file\)"):
        reader.read([Piece("w", 0, torch.empty(2))])


def test_dcp_ranges_and_descriptions(tmp_path):
    tensors = _tensors()
    dcp_save_in_one_process(dict(tensors), str(tmp_path / "one"))
    reader = open_checkpoint(str(tmp_path / "one"))
    assert isinstance(reader, DcpReader)
    assert reader.tensors == {k: StoredTensor(tuple(v.shape), v.dtype) for k, v in tensors.items()}
    _every_range(reader, tensors)


def test_empty_init_materialises_only_what_is_on_the_meta_device():
    class Rotary(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(3, 3, device="meta")
            self.register_buffer("inv_freq", torch.arange(3.0), persistent=False)  # real: kept
            self.register_buffer("scale", torch.empty(2, device="meta"))  # persistent: loaded later

    module = Rotary()
    frozen = module.proj.bias
    frozen.requires_grad_(False)
    for m in module.modules():
        empty_init("cpu")(m)
    assert module.proj.weight.device.type == "cpu" and module.proj.weight.requires_grad
    assert module.proj.bias.device.type == "cpu" and not module.proj.bias.requires_grad
    assert module.scale.device.type == "cpu" and module.scale.shape == (2,)
    assert torch.equal(module.inv_freq, torch.arange(3.0))  # (Module.to_empty would have emptied it)


def test_a_direct_read_counts_as_an_in_place_write_for_autograd(tmp_path):
    # (bytes read straight into a shard bypass copy_: autograd must still see the change)
    write_safetensors(str(tmp_path / "t.safetensors"), {"w": torch.ones(4)})
    dest = torch.zeros(4)
    before = dest._version
    SafetensorsReader(str(tmp_path / "t.safetensors")).read([Piece("w", 0, dest)])
    assert torch.equal(dest, torch.ones(4)) and dest._version > before


def test_a_dtype_this_torch_cannot_hold_is_an_error_only_where_it_is_read(tmp_path):
    entry = {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}
    good = {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}
    reader = SafetensorsReader(_raw(tmp_path / "mixed.safetensors", {"odd": entry, "w": good}, b"\0" + struct.pack("<2f", 1.0, 2.0)))
    assert list(reader.tensors) == ["w"]
    assert reader.unreadable == {"odd": f"{str(tmp_path / 'mixed.safetensors')!r}: key 'odd' has dtype 'F4', which this torch cannot hold (known: {sorted(safetensors_module._dtypes())})"}
    dest = torch.empty(2)
    reader.read([Piece("w", 0, dest)])
    assert dest.tolist() == [1.0, 2.0]


def test_dcp_saved_chunks_that_do_not_cover_a_read_are_an_error(tmp_path):
    dcp_save_in_one_process({"w": torch.arange(12.0).reshape(3, 4)}, str(tmp_path / "one"))
    reader = DcpReader(str(tmp_path / "one"))
    reader._stored["w"].chunks.clear()  # (an incomplete checkpoint: its one chunk lost)
    with pytest.raises(ValueError, match=r"the checkpoint's saved chunks of 'w' cover 0 of the 4 elements of the box of shape \(1, 4\)"):
        reader.read([Piece("w", 4, torch.empty(4))])


def test_identities_tell_other_content_apart_and_not_other_places(tmp_path):
    for place in ("a", "b", "c"):
        (tmp_path / place).mkdir()
        value = torch.zeros(100_000) if place != "c" else torch.ones(100_000)
        write_safetensors(str(tmp_path / place / "m.safetensors"), {"w": value})
        dcp_save_in_one_process({"w": value}, str(tmp_path / place / "dcp"))
    for form in ("m.safetensors", "dcp"):
        a, b, c = (open_checkpoint(str(tmp_path / p / form)).identity() for p in ("a", "b", "c"))
        assert a == b and a != c, (form, a, b, c)


# -- every header checked whole before any data is read --------------------------------------------


def _opened(path):
    """The error text of opening ``path`` (the file's path shown as <file>), or "ok"."""
    try:
        open_checkpoint(path)
    except (ValueError, FileNotFoundError) as exc:
        return f"{type(exc).__name__}: {str(exc).replace(path, '<file>')}"
    return "ok"


def test_safetensors_headers_are_checked_whole(tmp_path):
    good = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    data = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    known = ", ".join(sorted(safetensors_module._FORMAT_BITS))
    cases = {
        "overlapping data": (
            {"a": good, "b": {**good, "data_offsets": [4, 12]}},
            "'<file>': the data of keys 'a' (bytes [0, 8) of the data section) and 'b' (bytes [4, 12)) overlap; every "
            "tensor needs bytes of its own",
        ),
        "overlap after a gap and an empty tensor": (
            {"a": {**good, "shape": [1], "data_offsets": [0, 4]}, "e": {**good, "shape": [0], "data_offsets": [6, 6]}, "b": {**good, "shape": [1], "data_offsets": [12, 16]}, "c": {**good, "shape": [3], "data_offsets": [4, 16]}},
            "'<file>': the data of keys 'c' (bytes [4, 16) of the data section) and 'b' (bytes [12, 16)) overlap; every "
            "tensor needs bytes of its own",
        ),
        "a key twice": (
            b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}',
            "'<file>': its header names 'a' twice in one JSON object (a JSON parser would keep only the last)",
        ),
        "a field twice": (
            b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"shape":[1]}}',
            "'<file>': its header names 'shape' twice in one JSON object (a JSON parser would keep only the last)",
        ),
        "dtype not a string": (
            {"a": {**good, "dtype": ["F32"]}},
            f"'<file>': key 'a' has dtype ['F32'] (a list); expected one of the safetensors dtypes ({known})",
        ),
        "dtype unknown": (
            {"a": {**good, "dtype": "F33"}},
            f"'<file>': key 'a' has dtype 'F33'; expected one of the safetensors dtypes ({known})",
        ),
        "entry not an object": ({"a": 3}, "'<file>': key 'a' is 3 (an int); expected an object with dtype, shape and data_offsets"),
        "a field lacking": ({"a": {"dtype": "F32"}}, "'<file>': key 'a' lacks 'data_offsets', 'shape' (every tensor has dtype, shape and data_offsets)"),
        "a field more": ({"a": {**good, "strides": [1]}}, "'<file>': key 'a' has 'strides' besides dtype, shape and data_offsets"),
        "negative size": ({"a": {**good, "shape": [2, -1]}}, "'<file>': key 'a' has shape [2, -1]; expected a list of non-negative integers"),
        "size a bool": ({"a": {**good, "shape": [True]}}, "'<file>': key 'a' has shape [True]; expected a list of non-negative integers"),
        "size a float": ({"a": {**good, "shape": [2.0]}}, "'<file>': key 'a' has shape [2.0]; expected a list of non-negative integers"),
        "offsets reversed": ({"a": {**good, "data_offsets": [8, 0]}}, "'<file>': key 'a' has data_offsets [8, 0]; expected [begin, end], integers with 0 <= begin <= end"),
        "negative offset": ({"a": {**good, "data_offsets": [-8, 0]}}, "'<file>': key 'a' has data_offsets [-8, 0]; expected [begin, end], integers with 0 <= begin <= end"),
        "three offsets": ({"a": {**good, "data_offsets": [0, 8, 16]}}, "'<file>': key 'a' has data_offsets [0, 8, 16]; expected [begin, end], integers with 0 <= begin <= end"),
        "offsets floats": ({"a": {**good, "data_offsets": [0.0, 8.0]}}, "'<file>': key 'a' has data_offsets [0.0, 8.0]; expected [begin, end], integers with 0 <= begin <= end"),
        "size and offsets disagree": ({"a": {**good, "data_offsets": [0, 12]}}, "'<file>': key 'a' (F32, shape (2,)) needs 8 bytes; its data_offsets [0, 12] give 12"),
        "sub-byte size": ({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}, "'<file>': key 'a' (F4, shape (3,)) needs 12 bits (1.5 bytes); its data_offsets [0, 1] give 1"),
        "past the end": ({"a": {**good, "data_offsets": [16, 24]}}, "'<file>': the data of key 'a' ends at byte 24 of the data section, past its end (16)"),
        "metadata not an object": ({"__metadata__": [1]}, "'<file>': its __metadata__ is [1]; expected an object mapping strings to strings"),
        "metadata not strings": ({"__metadata__": {"format": 1}}, "'<file>': its __metadata__ is {'format': 1}; expected an object mapping strings to strings"),
        "not an object": (b"[1]", "'<file>' is not a safetensors file: its header is not a JSON object"),
    }
    got = {}
    for name, (header, _) in cases.items():
        got[name] = _opened(_raw(tmp_path / f"{name}.safetensors", header, data))
    assert got == {name: f"ValueError: {message}" for name, (_, message) in cases.items()}


def test_a_header_beyond_the_format_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_module, "_MAX_HEADER", 16)
    path = _raw(tmp_path / "long.safetensors", {"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}})
    assert _opened(path) == "ValueError: '<file>' is not a safetensors file: its header length 61 exceeds the format's limit (16 bytes)"


def test_an_index_naming_a_key_twice(tmp_path):
    write_safetensors(str(tmp_path / "a.safetensors"), {"w": torch.ones(2)})
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}}')
    assert _opened(str(tmp_path)) == (
        "ValueError: '<file>/model.safetensors.index.json' names 'w' twice in one JSON object (a JSON parser would keep only the last)"
    )


# -- DCP directories checked before any data is read -----------------------------------------------


def _dcp_with_one_file(path):
    """A DCP directory of one tensor 'w' in one file; its data file's name and storage info
    (offset, length), as torch's own reader gives them."""
    from torch.distributed.checkpoint import FileSystemReader

    dcp_save_in_one_process({"w": torch.arange(1000.0)}, str(path))
    (info,) = FileSystemReader(str(path)).read_metadata().storage_data.values()
    return info.relative_path, info.offset, info.length


def test_a_truncated_dcp_file_is_named_with_the_key(tmp_path):
    name, offset, length = _dcp_with_one_file(tmp_path / "dcp")
    data = tmp_path / "dcp" / name
    os.truncate(data, length - 100)
    assert _opened(str(tmp_path / "dcp")) == (
        f"ValueError: '<file>/{name}' holds {length - 100} bytes, but '<file>/.metadata' places the saved chunk of 'w' "
        f"at offsets (0,) in its bytes [{offset}, {offset + length}) (a truncated or replaced file)"
    )
    data.unlink()
    assert _opened(str(tmp_path / "dcp")) == (
        f"FileNotFoundError: '<file>/{name}', where '<file>/.metadata' places the saved chunk of 'w' at offsets (0,), "
        f"does not exist"
    )


def test_a_bad_dcp_metadata_file_is_named(tmp_path):
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    _dcp_with_one_file(tmp_path / "dcp")
    meta = tmp_path / "dcp" / ".metadata"
    metadata = FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    meta.write_bytes(b"not a pickle")
    assert _opened(str(tmp_path / "dcp")) == (
        "ValueError: '<file>/.metadata' is not a torch.distributed.checkpoint metadata file: UnpicklingError: invalid load key, 'n'."
    )
    meta.write_bytes(pickle.dumps({"w": 1}))
    assert _opened(str(tmp_path / "dcp")) == "ValueError: '<file>/.metadata' is not a torch.distributed.checkpoint metadata file: it holds a dict"
    (index,) = metadata.storage_data
    for change, message in [
        ({"relative_path": "../elsewhere.distcp"}, "places the saved chunk of 'w' at offsets (0,) in '../elsewhere.distcp', outside the checkpoint directory"),
        ({"offset": -1}, f"places the saved chunk of 'w' at offsets (0,) at offset -1, length {metadata.storage_data[index].length} (expected non-negative integers)"),
    ]:
        info = metadata.storage_data[index]
        broken = type(info)(**{**vars(info), **change})
        meta.write_bytes(pickle.dumps(type(metadata)(**{**vars(metadata), "storage_data": {index: broken}})))
        assert _opened(str(tmp_path / "dcp")) == f"ValueError: '<file>/.metadata' {message}"
    meta.write_bytes(pickle.dumps(type(metadata)(**{**vars(metadata), "storage_data": {}})))
    assert _opened(str(tmp_path / "dcp")) == "ValueError: '<file>/.metadata' names no stored bytes for the saved chunk of 'w' at offsets (0,)"
    w = metadata.state_dict_metadata["w"]
    for chunks, message in [
        ([type(w.chunks[0])(offsets=torch.Size([500]), sizes=torch.Size([1000]))], "'w' of shape (1000,) has a saved chunk at offsets (500,) of sizes (1000,), which do not fit in it"),
        ([type(w.chunks[0])(offsets=torch.Size([0, 0]), sizes=torch.Size([1000, 1]))], "'w' of shape (1000,) has a saved chunk at offsets (0, 0) of sizes (1000, 1), which do not fit in it"),
    ]:
        tensors = {"w": type(w)(properties=w.properties, size=w.size, chunks=chunks)}
        meta.write_bytes(pickle.dumps(type(metadata)(**{**vars(metadata), "state_dict_metadata": tensors})))
        assert _opened(str(tmp_path / "dcp")) == f"ValueError: '<file>/.metadata': {message}"


def test_a_dcp_chunk_that_fails_to_deserialise_is_named(tmp_path):
    name, offset, length = _dcp_with_one_file(tmp_path / "dcp")
    reader = open_checkpoint(str(tmp_path / "dcp"))
    with open(tmp_path / "dcp" / name, "r+b") as f:
        f.seek(offset + length - 80)
        f.write(b"\xff" * 64)  # (the zip archive torch.save wrote: its directory broken, its size kept)
    with pytest.raises(ValueError) as caught:
        reader.read([Piece("w", 0, torch.empty(1000))])
    text = str(caught.value).replace(str(tmp_path / "dcp"), "<dir>")
    prefix = f"'<dir>/{name}': the saved chunk of 'w' at offsets (0,) (bytes [{offset}, {offset + length})) cannot be read: "
    assert text.startswith(prefix), text
    assert text == prefix + f"{type(caught.value.__cause__).__name__}: {caught.value.__cause__}"


def test_overlapping_dcp_chunks_are_an_error_even_where_their_sizes_add_up(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    dcp_save_in_one_process({"w": torch.arange(16.0).reshape(4, 4)}, str(tmp_path / "one"))
    reader = DcpReader(str(tmp_path / "one"))
    # (rows 0-1 and 1-2: 16 elements together, row 1 twice, row 3 never)
    reader._stored["w"].chunks[:] = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 4])), ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([2, 4]))]
    with pytest.raises(ValueError) as caught:
        reader.read([Piece("w", 0, torch.empty(16))])
    assert str(caught.value).replace(str(tmp_path / "one"), "<dir>") == (
        "'<dir>': the checkpoint's saved chunks of 'w' at offsets (0, 0) and (1, 0) overlap in the box of shape (4, 4) this rank "
        "reads (a malformed checkpoint)"
    )


# -- what tells checkpoints apart: by default, and verified ----------------------------------------


def test_the_identity_covers_a_header_longer_than_the_sample(tmp_path):
    # (two files of the same size whose headers differ only past the first 64 KiB)
    for place, last in (("a", "x"), ("b", "y")):
        header = {"__metadata__": {"note": "n" * 70_000 + last}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
        (tmp_path / place).mkdir()
        _raw(tmp_path / place / "m.safetensors", header, b"\0" * 4 + b"\0" * 200_000)
    a, b = (open_checkpoint(str(tmp_path / p / "m.safetensors")).identity() for p in "ab")
    assert a != b


def _middle_changed(source, target, start, stop):
    data = bytearray(source.read_bytes())
    data[start:stop] = bytes(255 - byte for byte in data[start:stop])
    target.write_bytes(bytes(data))


def test_verified_digests_name_the_key_whose_bytes_differ(tmp_path):
    import hashlib

    gen = torch.Generator().manual_seed(0)
    tensors = {"first": torch.randn(40_000, generator=gen), "middle": torch.randn(40_000, generator=gen), "last": torch.randn(40_000, generator=gen)}
    for place in "ab":
        (tmp_path / place).mkdir()
    write_safetensors(str(tmp_path / "a" / "m.safetensors"), tensors)
    raw = (tmp_path / "a" / "m.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, start = json.loads(raw[8 : 8 + length]), 8 + length
    begin, end = (start + n for n in header["middle"]["data_offsets"])
    _middle_changed(tmp_path / "a" / "m.safetensors", tmp_path / "b" / "m.safetensors", begin + 100, begin + 200)
    a, b = (open_checkpoint(str(tmp_path / p / "m.safetensors")) for p in "ab")
    assert a.identity() == b.identity()  # (by default: size, header, first and last 64 KiB only)
    data = {p: (tmp_path / p / "m.safetensors").read_bytes() for p in "ab"}
    expected = {
        p: [f"sha256 of '{k}' in m.safetensors: {hashlib.sha256(data[p][start + header[k]['data_offsets'][0] : start + header[k]['data_offsets'][1]]).hexdigest()[:16]}" for k in ("last", "middle")]
        for p in "ab"
    }
    assert a.digests(["last", "middle"]) == expected["a"]
    assert b.digests(["last", "middle"]) == expected["b"]
    assert expected["a"][0] == expected["b"][0] and expected["a"][1] != expected["b"][1]


def test_verified_dcp_digests_name_the_key_whose_bytes_differ(tmp_path):
    import shutil

    gen = torch.Generator().manual_seed(0)
    dcp_save_in_one_process({"u": torch.randn(50_000, generator=gen), "w": torch.randn(50_000, generator=gen)}, str(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    from torch.distributed.checkpoint import FileSystemReader

    a = open_checkpoint(str(tmp_path / "a"))
    where = FileSystemReader(str(tmp_path / "a")).read_metadata().storage_data
    (w_index,) = [index for index in where if index.fqn == "w"]
    info = where[w_index]
    _middle_changed(tmp_path / "a" / info.relative_path, tmp_path / "b" / info.relative_path, info.offset + info.length // 2, info.offset + info.length // 2 + 8)
    b = open_checkpoint(str(tmp_path / "b"))
    assert a.identity() == b.identity()
    da, db = a.digests(["u", "w"]), b.digests(["u", "w"])
    assert [line.rsplit(": ", 1)[0] for line in da] == [
        f"sha256 of 'u' saved chunk at offsets (0,) in {where[i].relative_path}" for i in where if i.fqn == "u"
    ] + [f"sha256 of 'w' saved chunk at offsets (0,) in {info.relative_path}"]
    assert da[0] == db[0] and da[1] != db[1]

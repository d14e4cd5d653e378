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
        (_raw(tmp_path / "past.safetensors", {"w": entry}, b"1234"), r"the data of key 'w' ends at byte \d+, past the file's end"),
        (_raw(tmp_path / "sizes.safetensors", {"w": {**entry, "data_offsets": [0, 4]}}, b"1234"), r"key 'w' \(F32, shape \(2,\)\) needs 8 bytes; its data_offsets \[0, 4\] give 4"),
        (_raw(tmp_path / "shape.safetensors", {"w": {**entry, "shape": "2"}}), r"key 'w' has shape '2'; expected a list of sizes"),
        (_raw(tmp_path / "lacks.safetensors", {"w": {"dtype": "F32"}}), "key 'w' lacks a dtype, shape or data_offsets entry"),
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

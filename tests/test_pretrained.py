"""``flatshard.load_pretrained``: a model built on the meta device, wrapped with
``param_init_fn=empty_init(...)``, reads its shards from safetensors files or a
``torch.distributed.checkpoint`` directory, and then holds, and trains, exactly as the
single-process model the checkpoint came from. Also: each rank reads only its shard's
elements; a tie read from either name; ``rename``; a forward left gathered before the load;
a checkpoint torch FSDP1 saved; every error, on every rank.

Truth is single-process training of the model the checkpoint was saved from."""

import json
import os
import shutil
import struct
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp
from expecttest import TestCase
from torch import nn

import flatshard
from flatshard import (
    FullStateDictConfig,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardedDataParallel,
    ShardingStrategy,
    StateDictType,
    empty_init,
    load_pretrained,
)
from flatshard._readers._safetensors import SafetensorsReader, write_safetensors
from flatshard._readers._stored import Piece
from flatshard.pretrained import open_checkpoint
from tests._models import Block, batch, build, dcp_save_in_one_process, error_text, lm_loss, step_on_global_batch

K = 2
ROWS = 12  # global batch rows (divisible by 2 and 3)
SOURCE_SEED = 0


def _source():
    """The model the checkpoints hold (single process), trained one step so no value is an
    initialiser's."""
    model = build(SOURCE_SEED)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step_on_global_batch(model, optim, 99, rows=ROWS)
    return model


def _write_checkpoints(directory):
    """One model, saved four ways: one safetensors file; Hugging Face style (two files, an
    index, keys under "model.", the tied head left out); a DCP directory; a DCP directory in
    bfloat16 under {"model": ...} with an optimizer state next to it."""
    state = _source().state_dict()
    write_safetensors(os.path.join(directory, "one.safetensors"), state)
    hf = os.path.join(directory, "hf")
    os.makedirs(hf)
    names = [k for k in state if k != "head.weight"]
    weight_map = {}
    for part, keys in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{part + 1:05d}-of-00002.safetensors"
        write_safetensors(os.path.join(hf, file), {f"model.{k}": state[k] for k in keys})
        weight_map.update({f"model.{k}": file for k in keys})
    with open(os.path.join(hf, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    low = {k: v.to(torch.bfloat16) for k, v in state.items()}
    dcp_save_in_one_process(dict(state), os.path.join(directory, "dcp"))
    dcp_save_in_one_process({"model": low, "optim": {"lr": 0.5, "m": torch.ones(3)}}, os.path.join(directory, "dcp_bf16"))


def _hf_rename(key):
    return key[len("model.") :]


def _nested_rename(key):
    return key[len("model.") :] if key.startswith("model.") else None


_SOURCES = {
    "one": ("one.safetensors", None),
    "hf": ("hf", _hf_rename),
    "hf_index": ("hf/model.safetensors.index.json", _hf_rename),
    "dcp": ("dcp", None),
    "dcp_bf16": ("dcp_bf16", _nested_rename),
}


def _meta_wrapped(**options):
    with torch.device("meta"):
        model = build(7)  # (a different seed: nothing may survive from it)
    return ShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}), param_init_fn=empty_init("cpu"), **options)


def _full_state(model):
    with ShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        return {k: v.clone() for k, v in model.state_dict().items()}


_OPTIONS = {
    "default": {},
    "orig": {"use_orig_params": True},
    "no_shard": {"sharding_strategy": ShardingStrategy.NO_SHARD},
    "grad_op": {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP},
    "mixed": {"mixed_precision": MixedPrecision(param_dtype=torch.float16)},
}


def _load_everything(rank, world_size, directory):
    """Every checkpoint form into every option: the full state dict afterwards, per case."""
    out = {}
    for source, (path, rename) in _SOURCES.items():
        for option, kwargs in _OPTIONS.items():
            model = _meta_wrapped(**kwargs)
            result = load_pretrained(model, os.path.join(directory, path), rename=rename)
            out[(source, option)] = (result, _full_state(model))
    return out


def _load_then_train(rank, world_size, directory, option, gathered_before):
    """Load, then K steps; ``gathered_before``: a forward whose backward never runs (a metric
    with autograd on) leaves the root gathered before the load."""
    model = _meta_wrapped(**_OPTIONS[option])
    if gathered_before:
        model(batch(0, 1, per_rank=2)[0]).sum()
    load_pretrained(model, os.path.join(directory, "hf"), rename=_hf_rename)
    if gathered_before:  # (the root stayed gathered: its modules show the loaded values at once)
        shown = model.module.norm.weight.detach().clone()
        saved = torch.empty(shown.numel())
        SafetensorsReader(os.path.join(directory, "one.safetensors")).read([Piece("norm.weight", 0, saved)])
        if not torch.equal(shown, saved):
            raise AssertionError(f"the root's norm.weight after the load is {shown}, not the checkpoint's")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(K):
        tokens, targets = batch(step, 1, per_rank=ROWS)
        rows = ROWS // world_size
        loss = lm_loss(model(tokens[rank * rows : (rank + 1) * rows]), targets[rank * rows : (rank + 1) * rows])
        losses.append(loss.detach().clone())
        loss.backward()
        optim.step()
        optim.zero_grad()
    if option == "orig":
        with ShardedDataParallel.summon_full_params(model):
            params = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
        return params
    return _full_state(model)


def _reference_trained():
    model = _source()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(K):
        step_on_global_batch(model, optim, step, rows=ROWS)
    return model


def _pieces_read(rank, world_size, directory):
    """The elements each rank reads, against what its shards hold."""
    read = []
    original = SafetensorsReader.read

    def counting(self, pieces):
        read.extend((p.key, p.start, p.stop) for p in pieces)
        return original(self, pieces)

    SafetensorsReader.read = counting
    try:
        model = _meta_wrapped()
        load_pretrained(model, os.path.join(directory, "one.safetensors"))
    finally:
        SafetensorsReader.read = original
    held = sum(h.flat_param.numel() for m in model.modules() for h in getattr(getattr(m, "_unit", None), "handles", ()))
    return read, held


def _save_sharded(rank, world_size, directory):
    """A wrapped model (trained K steps) saved as flatshard's SHARDED_STATE_DICT with DCP."""
    model = ShardedDataParallel(build(3), auto_wrap_policy=ModuleWrapPolicy({Block}))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(K):
        step_on_global_batch(model, optim, step, rank, world_size, rows=ROWS)
    with ShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save(model.state_dict(), checkpoint_id=directory)
    return _full_state(model)


def _fsdp1_save(rank, world_size, directory):
    """torch FSDP1's sharded state dict (through torch's state-dict API), saved with DCP as
    {"model": ..., "optim": ...}."""
    import torch.distributed.checkpoint.state_dict as torch_sd
    import torch.distributed.fsdp as torch_fsdp

    warnings.filterwarnings("ignore")  # (FSDP1's deprecation warnings)
    model = torch_fsdp.FullyShardedDataParallel(build(4), auto_wrap_policy=torch_fsdp.wrap.ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model_state, optim_state = torch_sd.get_state_dict(model, optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    return True


def _load_fsdp1(rank, world_size, directory):
    model = _meta_wrapped()
    return load_pretrained(model, directory, rename=_nested_rename), _full_state(model)


def _hybrid(rank, world_size, directory):
    """HYBRID_SHARD on a 2 x 2 grid: the load, and a file missing on the last rank only (it
    shares neither group with rank 0: the failure must cross both)."""
    import torch.distributed as dist

    shard = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    model = _meta_wrapped(sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=(shard[rank // 2], replicate[rank % 2]))
    one = os.path.join(directory, "one.safetensors")
    result = load_pretrained(model, one)
    state = _full_state(model)
    failure = _outcome(lambda: load_pretrained(model, one if rank != 3 else one + ".gone"))
    return result, state, failure.replace(directory, "<dir>")


def _load_sharded(rank, world_size, directory):
    model = _meta_wrapped(use_orig_params=True)
    return load_pretrained(model, directory), _full_state(model)


class PretrainedLoadTest(TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.directory = tempfile.mkdtemp(prefix="flatshard-pretrained-")
        _write_checkpoints(cls.directory)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.directory, True)
        super().tearDownClass()

    def _assert_loaded_exactly(self, result, state, expected, where):
        """Nothing missing or unexpected, and the full state dict is ``expected``, bit for bit."""
        self.assertEqual(result, flatshard.IncompatibleKeys([], []), where)
        self.assertEqual(list(state), list(expected), where)
        for key, value in expected.items():
            self.assertTrue(torch.equal(state[key], value), f"{where}: {key}")

    def test_every_checkpoint_form_and_option_holds_the_source_exactly(self):
        expected = _source().state_dict()
        for world_size in (2, 3):
            for (source, option), (result, state) in self.pool.run(_load_everything, world_size, self.directory)[0].items():
                low = source == "dcp_bf16"
                want = {k: v.to(torch.bfloat16).to(v.dtype) for k, v in expected.items()} if low else expected
                self._assert_loaded_exactly(result, state, want, f"{source}, {option}, {world_size} ranks")

    def test_training_after_the_load_is_single_process_training(self):
        reference = _reference_trained()
        for world_size in (2, 3):
            for option in ("default", "orig", "grad_op"):
                for gathered_before in (False, True):
                    got = self.pool.run(_load_then_train, world_size, self.directory, option, gathered_before)[0]
                    where = f"{option}, {world_size} ranks, gathered before: {gathered_before}"
                    expected = dict(reference.named_parameters()) if option == "orig" else reference.state_dict()
                    self.assertEqual(sorted(got), sorted(expected), where)
                    for key, value in expected.items():
                        torch.testing.assert_close(got[key], value.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {key}: {m}")

    def test_a_sharded_checkpoint_saved_at_another_world_size(self):
        directory = os.path.join(self.directory, "saved_sharded")
        saved = self.pool.run(_save_sharded, 2, directory)[0]
        for result, state in self.pool.run(_load_sharded, 3, directory):
            self._assert_loaded_exactly(result, state, saved, "saved sharded at 2 ranks")

    def test_a_checkpoint_torch_fsdp1_saved(self):
        directory = os.path.join(self.directory, "fsdp1")
        self.pool.run(_fsdp1_save, 2, directory)
        expected = build(4).state_dict()
        for result, state in self.pool.run(_load_fsdp1, 3, directory):
            self._assert_loaded_exactly(result, state, expected, "saved by torch FSDP1")

    def test_hybrid_sharding_and_a_failure_that_crosses_both_groups(self):
        expected = _source().state_dict()
        for rank, (result, state, failure) in enumerate(self.pool.run(_hybrid, 4, self.directory)):
            self.assertEqual(result, flatshard.IncompatibleKeys([], []))
            self.assertTrue(all(torch.equal(state[k], v) for k, v in expected.items()), rank)
            if rank == 3:
                self.assertEqual(failure, "FileNotFoundError: load_pretrained(): no such file or directory: '<dir>/one.safetensors.gone'")
            else:
                self.assertEqual(
                    failure,
                    f"RuntimeError: [rank {rank}] load_pretrained(): nothing was loaded, because rank 3 failed to plan its "
                    f"reads from '<dir>/one.safetensors' (see its error)",
                )

    def test_each_rank_reads_only_what_its_shards_hold(self):
        state = _source().state_dict()
        buffers = state["pos"].numel()
        results = self.pool.run(_pieces_read, 3, self.directory)
        covered = {}
        for rank, (read, held) in enumerate(results):
            params_read = sum(stop - start for key, start, stop in read if key != "pos")
            self.assertLessEqual(params_read, held)  # (the rest of a shard is padding)
            self.assertIn(("pos", 0, buffers), read)  # buffers: whole, on every rank
            self.assertNotIn("embed.weight", [k for k, _, _ in read])  # a tie is read once, from its last name
            for key, start, stop in read:
                if key != "pos":
                    covered.setdefault(key, []).append((start, stop))
        # together the ranks read every parameter element exactly once
        for key, ranges in covered.items():
            ranges.sort()
            self.assertEqual(ranges[0][0], 0, key)
            self.assertEqual(ranges[-1][1], state[key].numel(), key)
            self.assertTrue(all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (key, ranges))
        self.assertEqual(sorted(covered), sorted(k for k in state if k not in ("pos", "embed.weight")))


# -- tied names holding different values ------------------------------------------------------


def _load_file(rank, world_size, path):
    model = _meta_wrapped()
    return _outcome(lambda: load_pretrained(model, path) and None), _full_state(model)


def _file_content(path):
    """Every tensor of a safetensors file, whole."""
    reader = SafetensorsReader(path)
    out = {}
    for key, stored in reader.tensors.items():
        out[key] = torch.empty(stored.shape, dtype=stored.dtype)
        reader.read([Piece(key, 0, out[key].view(-1))])
    return out


class PretrainedTiesTest(TestCase):
    def test_tied_names_holding_different_values_load_as_load_state_dict_loads_them(self):
        # torch's load_state_dict copies every key into the one tied tensor, in the model's
        # state-dict order: the last name the file holds wins, whatever the file's own order
        directory = tempfile.mkdtemp(prefix="flatshard-pretrained-ties-")
        self.addCleanup(shutil.rmtree, directory, True)
        state = _source().state_dict()
        state["head.weight"] = state["embed.weight"] * 2 + 1
        orders = {"model order": list(state), "reversed": list(reversed(state))}
        for order, keys in orders.items():
            path = os.path.join(directory, f"{order}.safetensors")
            write_safetensors(path, {k: state[k] for k in keys})
            plain = build(7)
            plain.load_state_dict(_file_content(path))
            expected = plain.state_dict()
            self.assertTrue(torch.equal(expected["embed.weight"], state["head.weight"]), order)
            for rank, (outcome, loaded) in enumerate(self.pool.run(_load_file, 2, path)):
                self.assertEqual(outcome, "ok", (order, rank))
                self.assertEqual(list(loaded), list(expected), (order, rank))
                for key, value in expected.items():
                    self.assertTrue(torch.equal(loaded[key], value), (order, rank, key))


# -- a file that differs between the ranks -------------------------------------------------------

_BIG_VOCAB = 8192  # (the tied head: 256 KiB of float32, far more than the sampled 64 KiB at each end)


def _load_own_copy(rank, world_size, directory, verify):
    """Each rank loads its own copy, ``<directory>/rank<r>/one.safetensors``."""
    with torch.device("meta"):
        model = build(7, vocab=_BIG_VOCAB)
    model = ShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}), param_init_fn=empty_init("cpu"))
    path = os.path.join(directory, f"rank{rank}", "one.safetensors")
    return _outcome(lambda: load_pretrained(model, path, verify=verify) and None).replace(directory, "<dir>"), _full_state(model)


def _data_range(path, key):
    """Where the bytes of ``key`` lie in the safetensors file ``path`` (read from the file's
    own header, not through flatshard)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        begin, end = json.loads(f.read(length))[key]["data_offsets"]
    return 8 + length + begin, 8 + length + end


class PretrainedDifferentFilesTest(TestCase):
    def test_a_file_that_differs_between_ranks_past_what_is_sampled_needs_verify(self):
        import hashlib

        directory = tempfile.mkdtemp(prefix="flatshard-pretrained-copies-")
        self.addCleanup(shutil.rmtree, directory, True)
        state = build(SOURCE_SEED, vocab=_BIG_VOCAB).state_dict()
        for rank in (0, 1):
            os.makedirs(os.path.join(directory, f"rank{rank}"))
        good, bad = (os.path.join(directory, f"rank{rank}", "one.safetensors") for rank in (0, 1))
        write_safetensors(good, state)
        data = bytearray(open(good, "rb").read())
        begin, end = _data_range(good, "head.weight")  # (the last tensor of the file)
        # rank 1's copy: the same size, header, first and last 64 KiB, its middle garbage
        data[begin : end - 64 * 1024] = b"\x7e" * (end - 64 * 1024 - begin)
        with open(bad, "wb") as f:
            f.write(data)
        digests = [hashlib.sha256(open(p, "rb").read()[begin:end]).hexdigest()[:16] for p in (good, bad)]
        for shared in (False, True):  # (also: the ranks given identical copies)
            if shared:
                shutil.copyfile(good, bad)
            # by default nothing tells the copies apart (docs/checkpoints.md says so): rank 1 reads garbage
            (first, loaded), (second, _) = self.pool.run(_load_own_copy, 2, directory, False)
            self.assertEqual((first, second), ("ok", "ok"))
            self.assertEqual(torch.equal(loaded["embed.weight"], state["embed.weight"]), shared)
            verified = self.pool.run(_load_own_copy, 2, directory, True)
            if shared:
                self.assertEqual([outcome for outcome, _ in verified], ["ok", "ok"])
                self.assertTrue(all(torch.equal(verified[0][1][k], v) for k, v in state.items()))
                continue
            for rank, (outcome, _) in enumerate(verified):
                self.assertEqual(
                    outcome,
                    f"RuntimeError: [rank {rank}] load_pretrained(): the ranks read different checkpoints: rank 0 reads "
                    f"sha256 of 'head.weight' in one.safetensors: {digests[0]}, rank 1 reads sha256 of 'head.weight' "
                    f"in one.safetensors: {digests[1]}",
                )


# -- errors, on every rank -------------------------------------------------------------------


def _write_broken(directory):
    """Checkpoints that differ from the model in one way each."""
    state = _source().state_dict()
    write_safetensors(os.path.join(directory, "wrong_shape.safetensors"), {**state, "norm.weight": torch.zeros(9)})
    write_safetensors(os.path.join(directory, "missing.safetensors"), {k: v for k, v in state.items() if k != "norm.bias"})
    write_safetensors(os.path.join(directory, "extra.safetensors"), {**state, "extra.weight": torch.zeros(2)})
    write_safetensors(os.path.join(directory, "float64.safetensors"), {**state, "norm.weight": state["norm.weight"].double()})
    os.makedirs(os.path.join(directory, "empty"))
    os.makedirs(os.path.join(directory, "later"))
    write_safetensors(os.path.join(directory, "later", "one.safetensors"), {k: v + 1 for k, v in state.items()})
    overlapping = {"norm.weight": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}, "norm.bias": {"dtype": "F32", "shape": [8], "data_offsets": [16, 48]}}
    header = json.dumps(overlapping).encode()
    with open(os.path.join(directory, "overlapping.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + bytes(48))
    shutil.copytree(os.path.join(directory, "dcp"), os.path.join(directory, "dcp_truncated"))
    (data,) = [n for n in os.listdir(os.path.join(directory, "dcp_truncated")) if n.endswith(".distcp")]
    os.truncate(os.path.join(directory, "dcp_truncated", data), os.path.getsize(os.path.join(directory, "dcp_truncated", data)) - 100)


def _outcome(run):
    try:
        result = run()
    except Exception as exc:  # noqa: BLE001 - the outcome is the error
        return f"{type(exc).__name__}: {exc}"
    return result if result is not None else "ok"


class _NonPersistent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("table", torch.ones(2), persistent=False)


def _errors(rank, world_size, directory):
    one = os.path.join(directory, "one.safetensors")
    at = lambda name: os.path.join(directory, name)  # noqa: E731
    out = {}
    model = _meta_wrapped()
    out["missing on one rank"] = _outcome(lambda: load_pretrained(model, one if rank == 0 else at("nowhere.safetensors")))
    out["wrong shape"] = _outcome(lambda: load_pretrained(model, at("wrong_shape.safetensors")))
    out["missing key"] = _outcome(lambda: load_pretrained(model, at("missing.safetensors")))
    out["missing key, not strict"] = _outcome(lambda: load_pretrained(model, at("missing.safetensors"), strict=False))
    out["unexpected key"] = _outcome(lambda: load_pretrained(model, at("extra.safetensors")))
    out["unexpected key, not strict"] = _outcome(lambda: load_pretrained(model, at("extra.safetensors"), strict=False))
    out["rename collision"] = _outcome(lambda: load_pretrained(model, one, rename=lambda k: "norm.weight"))
    out["rename type"] = _outcome(lambda: load_pretrained(model, one, rename=lambda k: 3))
    out["different checkpoints"] = _outcome(lambda: load_pretrained(model, one if rank == 0 else at("float64.safetensors")))
    out["another step of the same run"] = _outcome(lambda: load_pretrained(model, one if rank == 0 else at("later/one.safetensors")))
    original = SafetensorsReader.read

    def failing(self, pieces):
        raise OSError("the disk went away")

    SafetensorsReader.read = failing if rank == 1 else original
    try:
        out["read fails on one rank"] = _outcome(lambda: load_pretrained(model, one))
    finally:
        SafetensorsReader.read = original
    out["not a checkpoint"] = _outcome(lambda: load_pretrained(model, at("empty")))
    out["overlapping data"] = _outcome(lambda: load_pretrained(model, at("overlapping.safetensors")))
    out["truncated .distcp"] = _outcome(lambda: load_pretrained(model, at("dcp_truncated")))
    out["verify type"] = _outcome(lambda: load_pretrained(model, one, verify=1))
    out["no units"] = _outcome(lambda: load_pretrained(nn.Linear(2, 2), one))
    out["checkpoint type"] = _outcome(lambda: load_pretrained(model, 3))
    with ShardedDataParallel.summon_full_params(model):
        out["inside summon"] = _outcome(lambda: load_pretrained(model, one))
    with torch.device("meta"):
        transient = _NonPersistent()
    out["non-persistent meta buffer"] = _outcome(lambda: ShardedDataParallel(transient, param_init_fn=empty_init("cpu")))
    out["loads afterwards"] = _outcome(lambda: load_pretrained(model, one) and None)
    return out


class PretrainedErrorsTest(TestCase):
    def setUp(self):
        self.directory = tempfile.mkdtemp(prefix="flatshard-pretrained-errors-")
        self.addCleanup(shutil.rmtree, self.directory, True)
        _write_checkpoints(self.directory)
        _write_broken(self.directory)

    def test_every_rank_raises_naming_the_problem(self):
        first, second = [
            {k: v.replace(self.directory, "<dir>") if isinstance(v, str) else v for k, v in out.items()}
            for out in self.pool.run(_errors, 2, self.directory)
        ]
        planned = "RuntimeError: Error(s) in load_pretrained() for ShardedDataParallel from '<dir>/{}.safetensors':\n\t{}"
        same = {
            "wrong shape": planned.format(
                "wrong_shape",
                "size mismatch for norm.weight: copying a param with shape torch.Size([9]) from checkpoint (key "
                "'norm.weight'), the shape in current model is torch.Size([8]).",
            ),
            "missing key": planned.format("missing", "Missing key(s) in checkpoint: 'norm.bias'."),
            "missing key, not strict": flatshard.IncompatibleKeys(["norm.bias"], []),
            "unexpected key": planned.format("extra", "Unexpected key(s) in checkpoint: 'extra.weight'."),
            "unexpected key, not strict": flatshard.IncompatibleKeys([], ["extra.weight"]),
            "rename collision": "ValueError: load_pretrained(): rename maps two checkpoint keys, 'pos' and 'embed.weight', to the model key 'norm.weight'",
            "rename type": "TypeError: load_pretrained(): rename must return a model key (str) or None; for 'pos' it returned int",
            "not a checkpoint": (
                "ValueError: load_pretrained(): '<dir>/empty' is neither a torch.distributed.checkpoint directory (holding "
                ".metadata) nor safetensors (a .safetensors file, a model.safetensors.index.json, or a directory holding them)"
            ),
            "overlapping data": (
                "ValueError: '<dir>/overlapping.safetensors': the data of keys 'norm.weight' (bytes [0, 32) of the data "
                "section) and 'norm.bias' (bytes [16, 48)) overlap; every tensor needs bytes of its own"
            ),
            "truncated .distcp": "ValueError: " + error_text(lambda: open_checkpoint(os.path.join(self.directory, "dcp_truncated")), ValueError).replace(self.directory, "<dir>"),
            "verify type": "TypeError: load_pretrained(): verify must be a bool; got int",
            "no units": "ValueError: load_pretrained(): Linear holds no ShardedDataParallel module; use load_state_dict() for a plain model",
            "checkpoint type": "TypeError: load_pretrained(): checkpoint must be a path (str or os.PathLike); got int",
            "non-persistent meta buffer": (
                "ValueError: empty_init: _NonPersistent holds the non-persistent buffer(s) 'table' on the meta device; no "
                "checkpoint holds them, so they would stay uninitialised: build the buffers on a real device, or wrap "
                "without param_init_fn so that the module's reset_parameters() initialises them"
            ),
            "loads afterwards": "ok",
        }
        self.assertTrue(same["truncated .distcp"].startswith("ValueError: '<dir>/dcp_truncated/__0_0.distcp' holds "), same["truncated .distcp"])
        for key, expected in same.items():
            self.assertEqual((key, first[key]), (key, expected))
            self.assertEqual((key, second[key]), (key, expected))
        self.assertEqual(
            first["missing on one rank"],
            "RuntimeError: [rank 0] load_pretrained(): nothing was loaded, because rank 1 failed to plan its reads from "
            "'<dir>/one.safetensors' (see its error)",
        )
        self.assertEqual(second["missing on one rank"], "FileNotFoundError: load_pretrained(): no such file or directory: '<dir>/nowhere.safetensors'")
        for rank, out in enumerate((first, second)):
            self.assertEqual(
                out["different checkpoints"],
                f"RuntimeError: [rank {rank}] load_pretrained(): the ranks read different checkpoints: rank 0 reads "
                f"norm.weight <- norm.weight torch.float32, rank 1 reads norm.weight <- norm.weight torch.float64",
            )
            self.assertRegex(
                out["another step of the same run"],
                rf"RuntimeError: \[rank {rank}\] load_pretrained\(\): the ranks read different checkpoints: rank 0 reads "
                rf"files one.safetensors:\d+:[0-9a-f]{{16}}, rank 1 reads files one.safetensors:\d+:[0-9a-f]{{16}}",
            )
            self.assertEqual(
                out["inside summon"],
                f"WrongStateError: [rank {rank}] unit the root module: load_pretrained() cannot be used inside "
                f"summon_full_params (the unit's full parameters are already summoned)",
            )
        self.assertEqual(
            first["read fails on one rank"],
            "RuntimeError: [rank 0] load_pretrained(): rank 1 failed while reading '<dir>/one.safetensors' (see its "
            "error); the model is partly loaded -- load it again",
        )
        self.assertEqual(second["read fails on one rank"], "OSError: the disk went away")

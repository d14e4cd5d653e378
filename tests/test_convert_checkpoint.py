"""examples/convert_checkpoint.py: a sharded checkpoint saved at world size 2 becomes one full
file equal to the full model and optimizer state dicts (and loadable by the plain model), and
converted back it resumes a wrapped model at world size 3 exactly."""

import contextlib
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from expecttest import TestCase

from flatshard import ShardedDataParallel, StateDictType
from tests._models import batch, build, lm_loss, local, make_optim, wrap

ROOT = Path(__file__).resolve().parents[1]
CONVERTER = str(ROOT / "examples" / "convert_checkpoint.py")


def assert_identical(actual, expected, where="checkpoint"):
    """The same nesting, keys in the same order, equal objects, tensors equal in dtype and value
    (any dict matches an OrderedDict: DCP gives plain dicts)."""
    if type(actual) is not type(expected) and not (isinstance(actual, dict) and isinstance(expected, dict)):
        raise AssertionError(f"{where}: {type(actual).__name__} vs {type(expected).__name__}")
    if isinstance(expected, dict):
        if list(actual) != list(expected):
            raise AssertionError(f"{where}: keys {list(actual)} vs {list(expected)}")
        for key in expected:
            assert_identical(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            raise AssertionError(f"{where}: length {len(actual)} vs {len(expected)}")
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_identical(a, e, f"{where}[{index}]")
    elif isinstance(expected, torch.Tensor):
        if actual.dtype != expected.dtype or actual.shape != expected.shape or not torch.equal(actual, expected):
            raise AssertionError(f"{where}: {actual.dtype} {tuple(actual.shape)} vs {expected.dtype} {tuple(expected.shape)}, or different values")
    elif actual != expected:
        raise AssertionError(f"{where}: {actual!r} vs {expected!r}")


def _full_state(model, optim):
    """What a plain model and optimizer would hold: full model and name-keyed optimizer state."""
    with ShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        model_state = model.state_dict()
    return {"model": model_state, "optim": ShardedDataParallel.full_optim_state_dict(model, optim, rank0_only=False)}


def _train_and_save(rank, world_size, directory):
    """Two AdamW steps, then a sharded checkpoint; rank 0 also saves the full state to compare with."""
    model = wrap(build(), "nested")
    optim = make_optim(model.parameters())
    for step in range(2):
        tokens, targets = batch(step, world_size)
        lm_loss(model(local(tokens, rank)), local(targets, rank)).backward()
        optim.step()
        optim.zero_grad()
    expected = _full_state(model, optim)
    if rank == 0:
        torch.save(expected, os.path.join(directory, "expected.pt"))
    with ShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": ShardedDataParallel.optim_state_dict(model, optim), "step": 2}
        dcp.save(state, checkpoint_id=os.path.join(directory, "sharded"))
    dist.barrier()


def _resume(rank, world_size, directory):
    """A fresh wrapped model and optimizer (other seed) resumed from the converted-back
    checkpoint with the sharded recipe, and another from the full file: both equal the original."""
    expected = torch.load(os.path.join(directory, "expected.pt"), weights_only=True)
    model = wrap(build(seed=1), "nested")
    optim = make_optim(model.parameters())
    with ShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": ShardedDataParallel.optim_state_dict(model, optim), "step": 0}
        dcp.load(state, checkpoint_id=os.path.join(directory, "back"))
        model.load_state_dict(state["model"])
        optim.load_state_dict(ShardedDataParallel.optim_state_dict_to_load(model, optim, state["optim"]))
    assert state["step"] == 2, state["step"]
    assert_identical(_full_state(model, optim), expected, f"rank {rank}, from the converted-back checkpoint")

    full = torch.load(os.path.join(directory, "full.pt"), weights_only=True)
    model = wrap(build(seed=1), "nested")
    optim = make_optim(model.parameters())
    model.load_state_dict(full["model"])
    optim.load_state_dict(ShardedDataParallel.shard_full_optim_state_dict(full["optim"], model, optim=optim))
    assert_identical(_full_state(model, optim), expected, f"rank {rank}, from the full file")


def convert(*args):
    return subprocess.run([sys.executable, CONVERTER, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


class ConvertCheckpointTest(TestCase):
    def setUp(self):
        self.directory = tempfile.mkdtemp(prefix="flatshard-convert-")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def path(self, name):
        return os.path.join(self.directory, name)

    def test_sharded_to_full_and_back_at_another_world_size(self):
        self.pool.run(_train_and_save, 2, self.directory)
        done = convert("to-full", self.path("sharded"), self.path("full.pt"))
        self.assertEqual((done.returncode, done.stdout, done.stderr), (0, "", ""))  # no warnings

        full = torch.load(self.path("full.pt"), weights_only=True)
        expected = torch.load(self.path("expected.pt"), weights_only=True)
        self.assertEqual(list(full), ["model", "optim", "step"])
        self.assertEqual(full.pop("step"), 2)
        assert_identical(full, expected)
        plain = build(seed=1)
        plain.load_state_dict(full["model"], strict=True)
        assert_identical(plain.state_dict(), expected["model"])

        done = convert("to-sharded", self.path("full.pt"), self.path("back"))
        self.assertEqual((done.returncode, done.stdout, done.stderr), (0, "", ""))
        self.pool.run(_resume, 3, self.directory)

    def test_missing_paths_are_usage_errors(self):
        spec = importlib.util.spec_from_file_location("convert_checkpoint", CONVERTER)
        converter = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(converter)
        missing = self.path("missing")
        Path(self.directory, ".metadata").touch()  # looks like a checkpoint: the output is checked next
        for args, message in (
            (("to-full", missing, self.path("out.pt")), "missing' is not a sharded checkpoint (no .metadata file in it)"),
            (("to-full", self.directory, self.path("no/out.pt")), "the directory of"),
            (("to-sharded", missing + ".pt", self.path("out")), "missing.pt' does not exist"),
        ):
            stderr = io.StringIO()
            with self.assertRaises(SystemExit) as exit, contextlib.redirect_stderr(stderr):
                converter.main(args)
            self.assertEqual(exit.exception.code, 2)
            self.assertIn(message, stderr.getvalue())
            self.assertRegex(stderr.getvalue(), rf"^usage: \S+ {args[0]} ")

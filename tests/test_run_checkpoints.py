"""``flatshard.RunCheckpoints``: periodic checkpoints published atomically, the last K kept,
the newest complete one resumed (bit-identically at the same world size, at other world sizes,
in both ``use_orig_params`` modes), partial and corrupt directories skipped with a warning
naming them, errors. The kill-anywhere test of the example is ``tests/test_kill_anywhere.py``.

Training is ``tests/_models``' TinyLM with AdamW on a global batch split over the ranks."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from unittest import mock

import torch
from expecttest import TestCase

import flatshard.run_checkpoints as run_checkpoints_module
from flatshard import ModuleWrapPolicy, RunCheckpoints, ShardedDataParallel, SkippedCheckpointWarning
from flatshard.run_checkpoints import MANIFEST, file_problem, file_record, key_mismatch, leftovers, published_steps, read_manifest, step_name, stored_keys
from tests._models import Block, batch, build, error_text, lm_loss

ROWS = 12


def _setup(seed=0, orig=False):
    model = ShardedDataParallel(build(seed), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=orig)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)


def _step(model, optim, step, rank, world_size):
    tokens, targets = batch(step, 1, per_rank=ROWS)
    rows = ROWS // world_size
    lm_loss(model(tokens[rank * rows : (rank + 1) * rows]), targets[rank * rows : (rank + 1) * rows]).backward()
    optim.step()
    optim.zero_grad()


def _final(model, optim):
    """Full parameters and full optimizer state (rank 0), to compare runs."""
    with ShardedDataParallel.summon_full_params(model):
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return params, ShardedDataParallel.full_optim_state_dict(model, optim)


def _train(rank, world_size, directory, steps, save_every=0, keep=None, orig=False, first=1, model_optim=None):
    """Train steps ``first..steps``, saving through RunCheckpoints; returns the final state."""
    model, optim = model_optim or _setup(orig=orig)
    checkpoints = RunCheckpoints(directory, model, optim, save_every=save_every, keep=keep)
    for step in range(first, steps + 1):
        _step(model, optim, step, rank, world_size)
        checkpoints.maybe_save(step, state={"next": step + 1}, rank_state={"rank": rank, "rng": torch.get_rng_state()})
    return _final(model, optim)


def _resume_and_train(rank, world_size, directory, steps, orig=False):
    """A fresh model (other seed) resumed from ``directory``, trained on to ``steps``."""
    model, optim = _setup(seed=7, orig=orig)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = RunCheckpoints(directory, model, optim).resume()
    result = _train(rank, world_size, directory + "-continued", steps, first=resumed.step + 1, model_optim=(model, optim))
    rank_state = None if resumed.rank_state is None else resumed.rank_state["rank"]
    return (resumed.step, resumed.state, rank_state, resumed.world_size, [str(w.message) for w in caught]), result


def _assert_equal(actual, expected, where, exact=True):
    if isinstance(expected, dict):
        if sorted(actual, key=str) != sorted(expected, key=str):
            raise AssertionError(f"{where}: keys {sorted(actual, key=str)} vs {sorted(expected, key=str)}")
        for key in expected:
            _assert_equal(actual[key], expected[key], f"{where}.{key}", exact)
    elif isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            raise AssertionError(f"{where}: {len(actual)} items vs {len(expected)}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_equal(a, e, f"{where}[{i}]", exact)
    elif isinstance(expected, torch.Tensor):
        if exact and not torch.equal(actual, expected):
            raise AssertionError(f"{where}: not bit-identical")
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")
    elif actual != expected:
        raise AssertionError(f"{where}: {actual!r} vs {expected!r}")


def _warnings_of(rank, world_size, fn, *args):
    """``fn(*args)``'s result and the warnings it gave, on every rank."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args)
    return result, [(w.category.__name__, str(w.message)) for w in caught]


def _resume_only(rank, world_size, directory, save_steps=(), keep=None):
    """Resume (warnings recorded); then save ``save_steps``; returns the step resumed and the warnings."""
    model, optim = _setup(seed=7)
    checkpoints = RunCheckpoints(directory, model, optim, keep=keep)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = checkpoints.resume()
    for step in save_steps:
        checkpoints.save(step)
    messages = [str(w.message).replace(directory, "<dir>") for w in caught if issubclass(w.category, SkippedCheckpointWarning)]
    return (None if resumed is None else resumed.step), messages


def _errors(rank, world_size, directory):
    model, optim = _setup()
    messages = []
    for call in (
        lambda: RunCheckpoints(directory, model, optim, save_every=-1),
        lambda: RunCheckpoints(directory, model, optim, keep=0),
        lambda: RunCheckpoints(directory, build(0), optim),
        lambda: RunCheckpoints(directory, model, optim).save(3 + rank),
        lambda: (RunCheckpoints(directory, model, None).save(1), RunCheckpoints(directory, model, optim).resume()),
    ):
        try:
            call()
            messages.append("no error")
        except (TypeError, ValueError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}".replace(directory, "<dir>"))
    return messages


def _without_numpy(rank, world_size, directory, missing_on):
    """Save and resume where the ranks in ``missing_on`` lack NumPy; the errors, per call."""
    model, optim = _setup()
    checkpoints = RunCheckpoints(directory, model, optim)
    with mock.patch.object(run_checkpoints_module, "_numpy_works", lambda: rank not in missing_on):
        return [f"ImportError: {error_text(call, ImportError)}" for call in (lambda: checkpoints.save(1), checkpoints.resume)]


def _blocks(n_blocks, seed, sgd=False):
    model = ShardedDataParallel(build(seed, n_blocks=n_blocks), auto_wrap_policy=ModuleWrapPolicy({Block}))
    if sgd:
        return model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)


def _mismatched(rank, world_size, directory, saved_blocks, resumed_blocks, sgd=False):
    """Save step 1 of a ``saved_blocks`` model with AdamW; resume it into a trained
    ``resumed_blocks`` one (with SGD if ``sgd``), without and with its optimizer (each must
    raise or load nothing but the model, and a refused one leave model and optimizer as they
    were); then into a fresh ``saved_blocks`` one with AdamW (must load the saved model and
    optimizer exactly). Returns the errors."""
    saved, saved_optim = _blocks(saved_blocks, 0)
    _step(saved, saved_optim, 1, rank, world_size)
    RunCheckpoints(directory, saved, saved_optim).save(1, state={"next": 2}, rank_state=rank)
    model, optim = _blocks(resumed_blocks, 7, sgd)
    _step(model, optim, 1, rank, world_size)
    errors = []
    for optimizer in (None, optim):
        before = _final(model, optim)
        try:
            RunCheckpoints(directory, model, optimizer).resume()
            errors.append("no error")
        except ValueError as exc:
            errors.append(f"ValueError: {exc}".replace(directory, "<dir>"))
            _assert_equal(_final(model, optim), before, "after the refused resume", exact=True)
    matching, matching_optim = _blocks(saved_blocks, 7)
    resumed = RunCheckpoints(directory, matching, matching_optim).resume()
    if (resumed.step, resumed.state, resumed.rank_state) != (1, {"next": 2}, rank):
        raise AssertionError(f"resumed {resumed}")
    _assert_equal(_final(matching, matching_optim), _final(saved, saved_optim), "resumed vs saved", exact=True)
    return errors


class RunCheckpointsTest(TestCase):
    def setUp(self):
        self.directory = tempfile.mkdtemp(prefix="flatshard-runckpt-")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def _path(self, name):
        return os.path.join(self.directory, name)

    def test_saves_every_n_steps_keeps_the_last_k_complete_and_leaves_nothing_partial(self):
        ckpt = self._path("run")
        self.pool.run(_train, 2, ckpt, 7, 2, 2)
        self.assertEqual(sorted(os.listdir(ckpt)), ["step-00000004", "step-00000006"])
        manifest, problem = read_manifest(os.path.join(ckpt, "step-00000006"), 6)
        self.assertEqual(problem, "")
        self.assertEqual(
            {k: v for k, v in manifest.items() if k != "files"},
            {"format": 1, "optimizer": True, "rank_state": True, "sequence": 3, "state": True, "step": 6, "world_size": 2},
        )
        self.assertEqual(sorted(manifest["files"]), [".metadata", "__0_0.distcp", "__1_0.distcp"])
        self.assertEqual(sorted(os.listdir(os.path.join(ckpt, "step-00000006"))), [".metadata", "__0_0.distcp", "__1_0.distcp", MANIFEST])

    def test_resume_at_the_same_world_size_is_bit_identical_in_both_modes(self):
        for orig in (False, True):
            with self.subTest(use_orig_params=orig):
                ckpt = self._path(f"same-{orig}")
                uninterrupted = self.pool.run(_train, 2, self._path(f"whole-{orig}"), 6, 0, None, orig)[0]
                self.pool.run(_train, 2, ckpt, 4, 2, None, orig)
                results = self.pool.run(_resume_and_train, 2, ckpt, 6, orig)
                self.assertEqual([r[0][:4] for r in results], [(4, {"next": 5}, 0, 2), (4, {"next": 5}, 1, 2)])
                _assert_equal(results[0][1], uninterrupted, "resumed vs uninterrupted", exact=True)

    def test_resume_at_other_world_sizes_and_across_modes(self):
        ckpt = self._path("other")
        self.pool.run(_train, 2, ckpt, 4, 4, None, True)  # saved with use_orig_params=True
        for world_size in (3, 1):
            with self.subTest(world_size=world_size):
                uninterrupted = self.pool.run(_train, world_size, self._path(f"whole-{world_size}"), 6)[0]
                results = self.pool.run(_resume_and_train, world_size, ckpt, 6, False)
                self.assertEqual([r[0][:4] for r in results], [(4, {"next": 5}, None, 2)] * world_size)
                _assert_equal(results[0][1], uninterrupted, f"resumed at {world_size} vs uninterrupted", exact=False)

    def test_partial_and_corrupt_directories_are_skipped_with_a_warning_naming_them(self):
        ckpt = self._path("corrupt")
        self.pool.run(_train, 2, ckpt, 8, 2)
        shutil.copytree(os.path.join(ckpt, "step-00000002"), os.path.join(ckpt, ".partial-step-00000010"))
        os.makedirs(os.path.join(ckpt, "step-00000009"))  # no manifest: not ours, or damaged
        with open(os.path.join(ckpt, "step-00000008", "__1_0.distcp"), "r+b") as f:  # same size, other bytes
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
        os.truncate(os.path.join(ckpt, "step-00000006", "__0_0.distcp"), 10)
        with open(os.path.join(ckpt, "step-00000004", MANIFEST), "w") as f:
            f.write("{not json")
        size = os.path.getsize(os.path.join(ckpt, "step-00000002", "__0_0.distcp"))
        step, messages = self.pool.run(_resume_only, 2, ckpt)[0]
        self.assertEqual(step, 2)
        self.assertExpectedInline(
            "\n".join(messages),
            f"""\
RunCheckpoints: skipping <dir>/.partial-step-00000010: an interrupted save or removal left it (the next save removes it)
RunCheckpoints: skipping <dir>/step-00000009: it has no flatshard-checkpoint.json (not written by RunCheckpoints, or damaged)
RunCheckpoints: skipping <dir>/step-00000004: its flatshard-checkpoint.json cannot be read: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)
RunCheckpoints: skipping <dir>/step-00000008: file __1_0.distcp has a different CRC-32 than when it was saved (expected {read_manifest(os.path.join(ckpt, "step-00000008"), 8)[0]["files"]["__1_0.distcp"]["crc32"]})
RunCheckpoints: skipping <dir>/step-00000006: file __0_0.distcp has 10 bytes, expected {size}""",
        )
        # Saving step 3 of the resumed run: the leftover and the abandoned later steps go.
        self.pool.run(_resume_only, 2, ckpt, (3,))
        self.assertEqual(sorted(os.listdir(ckpt)), ["step-00000002", "step-00000003"])

    def test_keep_never_removes_the_newest_and_an_interrupted_removal_is_invisible(self):
        ckpt = self._path("keep")
        self.pool.run(_train, 2, ckpt, 4, 2, 1)
        self.assertEqual(os.listdir(ckpt), ["step-00000004"])
        os.rename(os.path.join(ckpt, "step-00000004"), os.path.join(ckpt, ".deleting-step-00000004"))  # killed while removing
        step, messages = self.pool.run(_resume_only, 2, ckpt, (5, 6), 1)[0]
        self.assertEqual(step, None)
        self.assertEqual(messages, ["RunCheckpoints: skipping <dir>/.deleting-step-00000004: an interrupted save or removal left it (the next save removes it)"])
        self.assertEqual(os.listdir(ckpt), ["step-00000006"])
        self.assertEqual(self.pool.run(_resume_only, 2, ckpt)[0], (6, []))

    def test_errors(self):
        messages = self.pool.run(_errors, 2, self._path("errors"))
        self.assertEqual(messages[0], messages[1])
        self.assertExpectedInline(
            "\n".join(messages[0]),
            """\
ValueError: RunCheckpoints: save_every must be an int >= 0, got -1
ValueError: RunCheckpoints: keep must be an int >= 1 or None, got 0
TypeError: RunCheckpoints: model must be a ShardedDataParallel, got TinyLM
ValueError: RunCheckpoints.save: ranks disagree: rank 1 passed '4' where rank 0 passed '3' (directory and step must be the same on every rank)
ValueError: RunCheckpoints.resume: <dir>/step-00000001 has no optimizer state, but an optimizer was given (pass optimizer=None to load the model only)""",
        )

    def test_without_numpy_every_rank_raises_naming_the_extra_before_any_io(self):
        everywhere = self.pool.run(_without_numpy, 2, self._path("none"), (0, 1))
        one = self.pool.run(_without_numpy, 3, self._path("one"), (2,))
        self.assertEqual(everywhere[0], everywhere[1])
        self.assertEqual(one[0], one[1])
        self.assertEqual(one[0], one[2])
        self.assertExpectedInline(
            "\n".join(everywhere[0] + one[0]),
            """\
ImportError: RunCheckpoints.save: torch.distributed.checkpoint needs NumPy on more than one rank, and it is missing on every rank: install it with pip install "flatshard[checkpoint]" (or pip install numpy)
ImportError: RunCheckpoints.resume: torch.distributed.checkpoint needs NumPy on more than one rank, and it is missing on every rank: install it with pip install "flatshard[checkpoint]" (or pip install numpy)
ImportError: RunCheckpoints.save: torch.distributed.checkpoint needs NumPy on more than one rank, and it is missing on rank 2: install it with pip install "flatshard[checkpoint]" (or pip install numpy)
ImportError: RunCheckpoints.resume: torch.distributed.checkpoint needs NumPy on more than one rank, and it is missing on rank 2: install it with pip install "flatshard[checkpoint]" (or pip install numpy)""",
        )
        self.assertFalse(os.path.exists(self._path("none")) or os.path.exists(self._path("one")))

    def test_numpy_is_found_missing_where_torch_cannot_use_it(self):
        code = "import sys; sys.modules['numpy'] = None; import flatshard.run_checkpoints as r; print(r._numpy_works())"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        self.assertEqual(done.stdout.strip(), "False", done.stderr)
        self.assertTrue(run_checkpoints_module._numpy_works())

    def test_resume_into_a_model_with_fewer_layers_raises_naming_the_extra_keys(self):
        errors = self.pool.run(_mismatched, 2, self._path("3-into-2"), 3, 2)
        self.assertEqual(errors[0], errors[1])
        self.assertExpectedInline(
            "\n".join(errors[0]),
            """\
ValueError: RunCheckpoints.resume: <dir>/step-00000001 does not match the model (nothing was loaded): 6 of the checkpoint's 23 model keys are not in the model (blocks.2.norm.weight, blocks.2.norm.bias, blocks.2.fc1.weight and 3 more)
ValueError: RunCheckpoints.resume: <dir>/step-00000001 does not match the model and optimizer (nothing was loaded): 6 of the checkpoint's 23 model keys are not in the model (blocks.2.norm.weight, blocks.2.norm.bias, blocks.2.fc1.weight and 3 more); 18 of the checkpoint's 63 optimizer keys are not in the optimizer (state.blocks.2.norm.weight.exp_avg, state.blocks.2.norm.weight.exp_avg_sq, state.blocks.2.norm.bias.exp_avg and 15 more)""",
        )

    def test_resume_into_a_model_with_more_layers_raises_naming_the_missing_keys(self):
        errors = self.pool.run(_mismatched, 2, self._path("2-into-3"), 2, 3)
        self.assertEqual(errors[0], errors[1])
        self.assertExpectedInline(
            "\n".join(errors[0]),
            """\
ValueError: RunCheckpoints.resume: <dir>/step-00000001 does not match the model (nothing was loaded): 6 of the model's 23 keys are not in the checkpoint (blocks.2.norm.weight, blocks.2.norm.bias, blocks.2.fc1.weight and 3 more)
ValueError: RunCheckpoints.resume: <dir>/step-00000001 does not match the model and optimizer (nothing was loaded): 6 of the model's 23 keys are not in the checkpoint (blocks.2.norm.weight, blocks.2.norm.bias, blocks.2.fc1.weight and 3 more); 18 of the optimizer's 63 keys are not in the checkpoint (state.blocks.2.norm.weight.step, state.blocks.2.norm.weight.exp_avg, state.blocks.2.norm.weight.exp_avg_sq and 15 more)""",
        )

    def test_resume_with_an_optimizer_of_another_kind_raises_naming_its_keys(self):
        errors = self.pool.run(_mismatched, 2, self._path("adamw-into-sgd"), 3, 3, True)
        self.assertEqual(errors[0], errors[1])
        self.assertExpectedInline(
            "\n".join(errors[0]),
            """\
no error
ValueError: RunCheckpoints.resume: <dir>/step-00000001 does not match the optimizer (nothing was loaded): 63 of the checkpoint's 63 optimizer keys are not in the optimizer (state.embed.weight.exp_avg, state.embed.weight.exp_avg_sq, state.blocks.0.norm.weight.exp_avg and 60 more); 21 of the optimizer's 21 keys are not in the checkpoint (state.embed.weight.momentum_buffer, state.blocks.0.norm.weight.momentum_buffer, state.blocks.0.norm.bias.momentum_buffer and 18 more) (pass optimizer=None to load the model only)""",
        )


# -- names and files, without a process group -------------------------------------------------


class FilesTest(TestCase):
    def test_names_listing_and_file_checks(self):
        with tempfile.TemporaryDirectory() as root:
            for name in ("step-00000002", "step-00000010", ".partial-step-00000011", ".deleting-step-00000001", "other", "step-3"):
                os.makedirs(os.path.join(root, name))
            self.assertEqual(step_name(42), "step-00000042")
            self.assertEqual([(s, os.path.basename(p)) for s, p in published_steps(root)], [(10, "step-00000010"), (2, "step-00000002")])
            self.assertEqual([os.path.basename(p) for p in leftovers(root)], [".deleting-step-00000001", ".partial-step-00000011"])
            self.assertEqual(published_steps(os.path.join(root, "missing")), [])
            path = os.path.join(root, "step-00000010")
            with open(os.path.join(path, "data"), "wb") as f:
                f.write(b"abc")
            record = file_record(os.path.join(path, "data"))
            self.assertEqual(record, {"size": 3, "crc32": 891568578})
            with open(os.path.join(path, MANIFEST), "w") as f:
                json.dump({"step": 9, "files": {"data": record}}, f)
            self.assertExpectedInline(read_manifest(path, 10)[1], """its flatshard-checkpoint.json is for step 9, expected 10""")
            with open(os.path.join(path, MANIFEST), "w") as f:
                json.dump({"step": 10}, f)
            self.assertExpectedInline(read_manifest(path, 10)[1], """its flatshard-checkpoint.json has no file list""")
            self.assertEqual(file_problem(path, "data", record, True), "")
            self.assertExpectedInline(file_problem(path, "gone", record, True), """file gone is missing""")
            self.assertExpectedInline(file_problem(path, "data", {"size": 3, "crc32": 1}, True), """file data has a different CRC-32 than when it was saved (expected 1)""")
            self.assertEqual(file_problem(path, "data", {"size": 3, "crc32": 1}, False), "")

    def test_published_directories_are_listed_in_publish_order(self):
        with tempfile.TemporaryDirectory() as root:
            # (name, step in its manifest, sequence): a run that reached step 8, resumed from
            # step 4 and saved 4 again, then 6; a checkpoint from before sequences; a damaged one.
            for name, step, sequence in (
                ("step-00000008", 8, 2), ("step-00000004", 4, 1), ("step-00000004.1", 4, 3), ("step-00000006", 6, 4),
                ("step-00000012", 12, None), ("step-00000001", 1, "damaged"),
            ):
                os.makedirs(os.path.join(root, name))
                manifest = {"step": step, "files": {}} if sequence is None else {"step": step, "files": {}, "sequence": sequence}
                with open(os.path.join(root, name, MANIFEST), "w") as f:
                    f.write("{" if sequence == "damaged" else json.dumps(manifest))
            self.assertEqual(
                [os.path.basename(p) for _, p in published_steps(root)],
                ["step-00000001", "step-00000006", "step-00000004.1", "step-00000008", "step-00000004", "step-00000012"],
            )
            self.assertEqual([s for s, _ in published_steps(root)], [1, 6, 4, 8, 4, 12])

    def test_stored_keys_are_the_keys_dcp_flattens_a_state_dict_to(self):
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # the truth, in DCP's own words

        state = {
            "model": {"a.weight": torch.ones(2), "b._extra_state": {"x": 1, "y": [torch.ones(1), 2]}},
            "optim": {
                "state": {"a.weight": {"step": torch.tensor(1.0), "exp_avg": torch.ones(2), "none": None}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["a.weight"], "empty": []}, {"nested": [[1, 2], [torch.ones(1)]]}],
            },
            "step": 3,
        }
        self.assertEqual(stored_keys(state), list(flatten_state_dict(state)[0]))

    def test_key_mismatch_names_the_first_keys_of_each_kind(self):
        self.assertEqual(key_mismatch("model", ["a", "b"], ["b", "a"]), [])
        self.assertExpectedInline(
            "\n".join(key_mismatch("model", ["a", "b", "c", "d", "e"], ["a", "x"])),
            """\
1 of the checkpoint's 2 model keys is not in the model (x)
4 of the model's 5 keys are not in the checkpoint (b, c, d and 1 more)""",
        )

"""``RunCheckpoints.save`` interrupted before each of its filesystem operations in turn (every
rename, deletion, directory creation and fsync, DCP's own included): afterwards ``resume``
loads a complete checkpoint, bit-identically -- the one published before the save while the
new one is not yet published, the new one from the moment its rename has happened -- and no
visible ``step-`` directory is incomplete. Covered: ``keep=1`` with a re-save of the newest step
(the same directory name), with a smaller step after a larger one (a run resumed from an
older checkpoint), and ``keep=2`` with a re-save. In the same traces, nothing of an older
checkpoint is renamed away or deleted before the directory was fsynced after the new one's
publishing rename (a machine that crashes then still has the new one).

An interruption is an exception nothing catches (a ``BaseException``), raised instead of the
k-th operation; every later operation raises too, as nothing runs in a killed process. The
kill-anywhere test of the example (``tests/test_kill_anywhere.py``) does the same with SIGKILL
at random moments, two ranks, and the real launcher's way of starting them."""

import os
import shutil
import tempfile
import warnings
from typing import Any, Dict, List, Optional, Tuple
from unittest import mock

from expecttest import TestCase

from flatshard import RunCheckpoints
from flatshard.run_checkpoints import file_problem, leftovers, published_steps, read_manifest
from tests.test_run_checkpoints import _assert_equal, _final, _setup, _step

# The os functions that change what is on disk, or make it durable: each call is one point at
# which a save is interrupted.
_OPERATIONS = ("mkdir", "rename", "replace", "unlink", "remove", "rmdir", "fsync")


class Killed(BaseException):
    """A simulated SIGKILL (no ``except Exception`` in flatshard or torch stops it)."""


class Interrupter:
    """Counts the save's filesystem operations and raises ``Killed`` instead of number
    ``kill_at`` (1-based; 0: never) and every one after it; records ``(operation, paths)``
    of each operation that ran (paths resolved through the file descriptors it saw opened)."""

    def __init__(self, kill_at: int) -> None:
        self.kill_at = kill_at
        self.count = 0
        self.fired: Optional[str] = None
        self.trace: List[Tuple[str, Tuple[str, ...]]] = []
        self.fds: Dict[int, str] = {}
        self.real = {name: getattr(os, name) for name in _OPERATIONS + ("open",)}

    def _path(self, value: Any, dir_fd: Optional[int]) -> str:
        if isinstance(value, int):
            return self.fds.get(value, f"<fd {value}>")
        path = os.fspath(value)
        return os.path.join(self.fds.get(dir_fd, "?"), path) if dir_fd is not None else path

    def _wrap(self, name: str):
        def operation(*args, **kwargs):
            names = [arg for arg in args if isinstance(arg, (str, os.PathLike)) or (name == "fsync" and isinstance(arg, int))]
            paths = tuple(self._path(arg, kwargs.get("dir_fd", kwargs.get("src_dir_fd"))) for arg in names)
            self.count += 1
            if self.fired is None and self.count == self.kill_at:
                self.fired = f"{name}{paths}"
            if self.fired is not None:
                raise Killed(self.fired)
            result = self.real[name](*args, **kwargs)
            self.trace.append((name, paths))
            return result

        return operation

    def _open(self, path, *args, **kwargs):
        fd = self.real["open"](path, *args, **kwargs)
        self.fds[fd] = self._path(path, kwargs.get("dir_fd"))
        return fd

    def __enter__(self) -> "Interrupter":
        self.patches = [mock.patch.object(os, name, self._wrap(name)) for name in _OPERATIONS]
        self.patches.append(mock.patch.object(os, "open", self._open))
        for patch in self.patches:
            patch.start()
        return self

    def __exit__(self, *exc) -> None:
        for patch in reversed(self.patches):
            patch.stop()


def _visible_problems(directory: str) -> List[str]:
    """Why any visible ``step-`` directory is not a complete checkpoint."""
    problems = []
    for step, path in published_steps(directory):
        manifest, problem = read_manifest(path, step)
        problems += [problem] if manifest is None else [p for n, r in manifest["files"].items() if (p := file_problem(path, n, r, True))]
    return problems


def _published_by(trace: List[Tuple[str, Tuple[str, ...]]]) -> Optional[int]:
    """Index in ``trace`` of the rename that published the new checkpoint (``None``: none)."""
    for index, (name, paths) in enumerate(trace):
        if name in ("rename", "replace") and os.path.basename(paths[0]).startswith(".partial-"):
            return index
    return None


def _durability_problem(directory: str, trace: List[Tuple[str, Tuple[str, ...]]], older: List[str]) -> str:
    """Whether anything of the ``older`` checkpoints was renamed away or deleted before an
    fsync of ``directory`` made the publishing rename durable (``""``: nothing was)."""
    published = _published_by(trace)
    if published is None:
        return "the new checkpoint was never published"
    durable = next((i for i in range(published + 1, len(trace)) if trace[i] == ("fsync", (directory,))), len(trace))
    for index, (name, paths) in enumerate(trace[:durable]):
        touched = [p for p in paths if any(p == o or p.startswith(o + os.sep) for o in older)]
        if name != "fsync" and touched and index != published:
            return f"{name}{paths} (operation {index}) before the fsync of the directory after publishing (operation {durable})"
    return ""


def _interrupted_saves(rank, world_size, root, before, then, keep):
    """Save steps ``before`` (one training step apart), train one more step and save step
    ``then`` into a copy of that directory, interrupted at its 1st, 2nd, ... filesystem
    operation until a save runs through; after each, a fresh model resumes from the copy.
    Returns one line per interruption saying what is wrong (none: all is well), and the
    names the uninterrupted save left."""
    model, optim = _setup()
    base = os.path.join(root, "base")
    saved = {}
    for index, step in enumerate(before):
        _step(model, optim, index + 1, rank, world_size)
        RunCheckpoints(base, model, optim, keep=keep).save(step, state={"saved": f"step {step}"})
        saved[f"step {step}"] = _final(model, optim)
    _step(model, optim, len(before) + 1, rank, world_size)
    saved["new"] = _final(model, optim)
    older, last = f"step {before[-1]}", None
    wrong = []
    for kill_at in range(1, 1000):
        work = os.path.join(root, f"kill-{kill_at}")
        shutil.copytree(base, work)
        with Interrupter(kill_at) as interrupter:
            try:
                RunCheckpoints(work, model, optim, keep=keep).save(then, state={"saved": "new"})
            except BaseException as exc:  # noqa: BLE001 - Killed, or DCP's exception wrapping it
                if interrupter.fired is None:
                    raise
        published = _published_by(interrupter.trace) is not None
        expected = "new" if published else older
        where = f"keep={keep}, steps {before} then {then}, interrupted at {interrupter.fired or 'nothing'}"
        wrong += [f"{where}: visible but {p}" for p in _visible_problems(work)]
        fresh, fresh_optim = _setup(seed=7)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            resumed = RunCheckpoints(work, fresh, fresh_optim).resume()
        if resumed is None:
            wrong.append(f"{where}: no complete checkpoint left (expected the {expected} one)")
        elif resumed.state["saved"] != expected:
            wrong.append(f"{where}: resumed {resumed.state['saved']}, expected {expected} ({'' if published else 'not '}published)")
        else:
            try:
                _assert_equal(_final(fresh, fresh_optim), saved[expected], "resumed")
            except AssertionError as exc:
                wrong.append(f"{where}: {exc}")
        if interrupter.fired is None:
            older_paths = [os.path.join(work, os.path.basename(p)) for _, p in published_steps(base)]
            problem = _durability_problem(work, interrupter.trace, older_paths)
            wrong += [f"{where}: {problem}"] if problem else []
            last = sorted(os.listdir(work))
            break
        shutil.rmtree(work)
    return wrong, last, kill_at


class InterruptedSaveTest(TestCase):
    maxDiff = None

    def setUp(self):
        self.directory = tempfile.mkdtemp(prefix="flatshard-interrupted-")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def _run(self, name, before, then, keep):
        wrong, last, operations = self.pool.run(_interrupted_saves, 1, os.path.join(self.directory, name), before, then, keep)[0]
        self.assertEqual(wrong, [])
        self.assertGreater(operations, 10)  # (every interruption point was tried: DCP's and the publishing)
        return last

    def test_keep_1_resaving_the_newest_step_always_leaves_a_complete_checkpoint(self):
        self.assertEqual(self._run("resave", [4], 4, 1), ["step-00000004"])

    def test_keep_1_a_smaller_step_after_a_larger_one_is_resumed_once_published(self):
        self.assertEqual(self._run("smaller", [8], 4, 1), ["step-00000004"])

    def test_keep_2_resaving_the_newest_step_never_falls_back_to_an_older_one(self):
        self.assertEqual(self._run("keep2", [2, 4], 4, 2), ["step-00000002", "step-00000004"])

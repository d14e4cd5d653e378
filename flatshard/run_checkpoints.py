"""Periodic, atomically published checkpoints of a training run, and resuming from the latest.

``RunCheckpoints`` keeps the checkpoints of one run in one directory on a filesystem every rank
sees::

    checkpoints = RunCheckpoints("ckpt", model, optim, save_every=100, keep=3)
    resumed = checkpoints.resume()                   # None: no complete checkpoint yet
    first = resumed.step + 1 if resumed else 1
    for step in range(first, steps + 1):
        ...                                          # one training step
        checkpoints.maybe_save(step, state={"data": loader_position})

Each checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory ``step-00000100`` holding
the model's sharded state dict (``"model"``), the optimizer's (``"optim"``), the step
(``"step"``), the caller's state and a manifest. It loads at any world size.

[Note: atomic publish] A checkpoint is written into ``.partial-step-N`` (a name ``resume``
never loads). When DCP has written every rank's files and its ``.metadata``, the ranks
checksum them (each a share of the files) and rank 0 writes ``flatshard-checkpoint.json`` (the
manifest: step, world size, every file's size and CRC-32, and the publish sequence: one more
than the largest among the published ones), fsyncs it and the directory, renames the directory to a
name no directory has -- ``step-N``, or ``step-N.1`` (``.2``, ...) where a checkpoint of step N
is there already -- and fsyncs the parent directory. A rename within one filesystem is atomic,
so a process killed at any moment leaves the new checkpoint either complete under its published
name or invisible; leftovers of an interrupted save keep their ``.partial-`` name and are removed
by the next save.

[Note: reading checkpoints] ``resume`` tries the published directories newest first -- in the
order they were published ([Note: replacing checkpoints]) -- and loads the first whose manifest
lists the step and whose files all exist with the listed sizes and checksums (the ranks share
the checking). Every directory it passes over -- a newer one that does not verify, one whose
manifest cannot be read (its age unknown, so tried first), or a leftover ``.partial-`` one -- is
named in a ``SkippedCheckpointWarning`` with the reason, on every rank; nothing that does not
verify is loaded. Rank 0 decides what exists and the ranks follow it, so they always load the
same checkpoint. Loading is strict, as ``nn.Module.load_state_dict`` is: before loading
anything, every rank compares the keys the checkpoint's DCP metadata lists for the model and the
optimizer with the model's and the optimizer's own (its per-parameter state; not the options of
its parameter groups, which a newer torch may extend), and any key on one side only (another
model, an optimizer of another kind) is a ``ValueError`` naming the first keys of each kind,
raised alike on every rank with the model and optimizer left as they were.

[Note: replacing checkpoints] The promise: from the first publish on, the directory holds, at
every instant, the checkpoint ``resume`` is to load -- the newest complete one -- whole and
visible, until a newer one is published; whatever the steps, ``keep``, or the moment a process
is killed (or the machine loses power: what the promise rests on is fsynced first). "Newest" is
the last published (the manifest's sequence), not the highest step: a run resumed from an older
checkpoint saves smaller steps than the ones it abandons, and saves again steps that are there
already (then the new checkpoint of step N gets a name of its own, never the old one's). Every
save therefore goes through one protocol, ``_replace``, the only code that renames or deletes a
published directory:

1. publish the new checkpoint under a fresh name and fsync the directory: from here on
   ``resume`` prefers it to every other one, and a crash cannot undo the rename;
2. remove what it replaces: every other directory of its step (the one a re-save replaces),
   every one of a later step (a timeline the run abandoned: it resumed from before them because
   they did not verify, or an earlier run left them in the same directory), and the complete
   ones beyond ``keep`` in publish order. Each is renamed to ``.deleting-...`` (invisible at
   once), the directory fsynced (so none comes back with part of its files after a crash), and
   only then deleted;
3. a new checkpoint published as ``step-N.R`` is renamed to ``step-N`` (free since step 2),
   fsynced. Killed before that, it stays a complete checkpoint under ``step-N.R``.

Leftovers never hold the checkpoint the promise is about (a ``.partial-`` one was never
published, a ``.deleting-`` one was replaced), so the next save deletes them before it writes. Directories without a readable manifest are never counted
as complete, so ``keep`` never removes a complete checkpoint in favour of one.

[Note: keeping the last K] After publishing, the oldest complete checkpoints beyond ``keep`` are
removed (step 2 of [Note: replacing checkpoints]); the one just published is never removed
(``keep >= 1``), so there is always at least one complete checkpoint once one was saved.

[Note: caller's state] ``state`` is whatever the run needs besides model and optimizer that is
the same on every rank (data position, schedule, counters): rank 0's is saved. ``rank_state``
differs per rank (RNG states, a per-rank data cursor): each rank's is saved under its rank and
given back only when resuming at the world size it was saved at (at another world size there is
no rank it belongs to, so ``Resumed.rank_state`` is ``None``). Both are pickled, so any
picklable object works; DCP stores each as one opaque item.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ._comm._collectives import Communicator, ProcessGroup, object_device, all_gather_object, broadcast_object, default_group, first_difference, raise_on_every_rank
from ._comm._guard import make_guard
from ._comm._peer_failures import together
from .api import StateDictType
from .sharded_data_parallel import ShardedDataParallel

__all__ = ["RunCheckpoints", "Resumed", "SkippedCheckpointWarning", "MANIFEST"]

MANIFEST = "flatshard-checkpoint.json"
FORMAT_VERSION = 1
_PUBLISHED = re.compile(r"^step-(\d{8,})(?:\.\d+)?$")  # step-N, or step-N.R (a re-save: [Note: replacing checkpoints])
_PARTIAL, _DELETING = ".partial-", ".deleting-"
_READ_CHUNK = 1 << 22
_SHOWN_KEYS = 3  # keys a mismatch error names of each kind
_OWNERS = {"model": "model", "optim": "optimizer"}  # parts of a checkpoint loaded strictly: what holds them


class SkippedCheckpointWarning(UserWarning):
    """A checkpoint directory that ``RunCheckpoints.resume`` did not load (the message names it
    and says why)."""


@dataclass(frozen=True)
class Resumed:
    """What ``RunCheckpoints.resume`` loaded.

    Attributes:
        step: the step the checkpoint was saved after (continue with ``step + 1``).
        path: the checkpoint directory.
        world_size: the world size it was saved at.
        state: the ``state`` given to ``save`` (rank 0's), or ``None``.
        rank_state: this rank's ``rank_state`` given to ``save``, or ``None`` (also when resuming
            at another world size).
    """

    step: int
    path: str
    world_size: int
    state: Any
    rank_state: Any


# -- names and files (no process group needed) -----------------------------------------------


def step_name(step: int) -> str:
    """The directory name of the checkpoint of ``step``: ``step-00000042``."""
    return f"step-{step:08d}"


def published_steps(directory: str) -> List[Tuple[int, str]]:
    """``(step, path)`` of every published directory in ``directory`` (``step-N``, or
    ``step-N.R``: [Note: replacing checkpoints]), complete or not (see ``read_manifest``), newest
    first: in the order they were published (``publish_sequence``), those whose age is unknown
    (no readable manifest) first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        match = _PUBLISHED.match(name)
        if match and os.path.isdir(path):
            step = int(match.group(1))
            sequence = publish_sequence(path, step)
            found.append(((1, 0) if sequence is None else (0, sequence), step, name, path))
    return [(step, path) for _, step, _, path in sorted(found, reverse=True)]


def publish_sequence(path: str, step: int) -> Optional[int]:
    """Where the checkpoint directory ``path`` of ``step`` comes in publish order (larger:
    published later; 0: published before flatshard recorded it), or ``None`` if its manifest
    cannot be read."""
    manifest, _ = read_manifest(path, step)
    if manifest is None:
        return None
    sequence = manifest.get("sequence", 0)
    return sequence if isinstance(sequence, int) and not isinstance(sequence, bool) else None


def leftovers(directory: str) -> List[str]:
    """Paths of the directories interrupted saves and removals left in ``directory``."""
    if not os.path.isdir(directory):
        return []
    names = sorted(n for n in os.listdir(directory) if n.startswith((_PARTIAL, _DELETING)))
    return [os.path.join(directory, n) for n in names]


def file_record(path: str) -> Dict[str, int]:
    """``{"size": bytes, "crc32": checksum}`` of one file."""
    crc = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_READ_CHUNK), b""):
            crc = zlib.crc32(chunk, crc)
    return {"size": os.path.getsize(path), "crc32": crc}


def read_manifest(path: str, step: int) -> Tuple[Optional[Dict[str, Any]], str]:
    """The manifest of the checkpoint directory ``path`` named for ``step``, and ``""``; or
    ``None`` and why it is missing or not valid."""
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None, f"it has no {MANIFEST} (not written by RunCheckpoints, or damaged)"
    except (OSError, ValueError) as exc:
        return None, f"its {MANIFEST} cannot be read: {exc}"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None, f"its {MANIFEST} has no file list"
    if manifest.get("step") != step:
        return None, f"its {MANIFEST} is for step {manifest.get('step')!r}, expected {step}"
    return manifest, ""


def file_problem(path: str, name: str, expected: Dict[str, int], checksums: bool) -> str:
    """Why file ``name`` of checkpoint ``path`` does not match its manifest record (``""``: it
    does)."""
    full = os.path.join(path, name)
    if not os.path.isfile(full):
        return f"file {name} is missing"
    size = os.path.getsize(full)
    if size != expected.get("size"):
        return f"file {name} has {size} bytes, expected {expected.get('size')}"
    if checksums and file_record(full)["crc32"] != expected.get("crc32"):
        return f"file {name} has a different CRC-32 than when it was saved (expected {expected.get('crc32')})"
    return ""


def stored_keys(state: Mapping[Any, Any]) -> List[str]:
    """The keys DCP stores ``state`` under, relative to it: DCP flattens mappings key by key and
    lists that hold tensors or containers item by item, joining the names with dots, and stores
    anything else (a tuple, a list of numbers or names) as one item."""
    keys = []
    for name, value in state.items():
        if isinstance(value, list) and not _stored_whole(value):
            value = {str(index): item for index, item in enumerate(value)}
        if isinstance(value, Mapping):
            keys.extend(f"{name}.{key}" for key in stored_keys(value))
        else:
            keys.append(str(name))
    return keys


def _stored_whole(items: List[Any]) -> bool:
    """Whether DCP stores the list ``items`` as one item (nothing in it is split further)."""
    return not any(isinstance(item, (torch.Tensor, Mapping)) or (isinstance(item, list) and not _stored_whole(item)) for item in items)


def key_mismatch(owner: str, expected: Sequence[str], stored: Sequence[str]) -> List[str]:
    """What differs between the keys ``owner`` has (``expected``) and those a checkpoint stored
    for it: one clause for the stored keys ``owner`` lacks, one for its keys the checkpoint
    lacks, each naming the first few (none: the keys match)."""
    expected_set, stored_set = set(expected), set(stored)
    unexpected = [key for key in stored if key not in expected_set]
    missing = [key for key in expected if key not in stored_set]
    clauses = []
    if unexpected:
        clauses.append(f"{len(unexpected)} of the checkpoint's {len(stored)} {owner} keys {_are(unexpected)} not in the {owner} ({_first(unexpected)})")
    if missing:
        clauses.append(f"{len(missing)} of the {owner}'s {len(expected)} keys {_are(missing)} not in the checkpoint ({_first(missing)})")
    return clauses


def _are(keys: Sequence[str]) -> str:
    return "is" if len(keys) == 1 else "are"


def _first(keys: Sequence[str]) -> str:
    shown = ", ".join(keys[:_SHOWN_KEYS])
    return shown if len(keys) <= _SHOWN_KEYS else f"{shown} and {len(keys) - _SHOWN_KEYS} more"


def _fsync_directory(path: str) -> None:
    """Make a rename in ``path`` durable (where the platform can open directories)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _check_int(name: str, value: Any, least: int, allow_none: bool = False) -> None:
    """Refuse ``value`` unless it is an int >= ``least`` (or ``None`` where allowed)."""
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"RunCheckpoints: {name} must be an int >= {least}{' or None' if allow_none else ''}, got {value!r}")


# -- publishing and removing: [Note: replacing checkpoints] -----------------------------------
# (rank 0 only; nothing else renames or deletes in a checkpoint directory)


def _clear_leftovers(directory: str) -> None:
    """Delete what interrupted saves and removals left (never a published checkpoint)."""
    for path in leftovers(directory):
        shutil.rmtree(path, ignore_errors=True)


def _replace(directory: str, partial: str, step: int, manifest: Dict[str, Any], keep: Optional[int]) -> str:
    """Publish the checkpoint of ``step`` written in ``partial`` with ``manifest`` (the sequence
    added here), then remove what it replaces, in the order of [Note: replacing checkpoints];
    returns its path."""
    before = published_steps(directory)
    sequences = [publish_sequence(path, done) for done, path in before]
    _write_manifest(partial, dict(manifest, sequence=1 + max((s for s in sequences if s is not None), default=0)))
    fresh = _fresh_name(directory, step)
    os.rename(partial, fresh)
    _fsync_directory(directory)  # 1. published, durably: from here on resume prefers it
    _delete(directory, _replaced(before, step, keep))  # 2.
    final = os.path.join(directory, step_name(step))
    if fresh != final:  # 3. (the old one of this step is gone since 2.)
        os.rename(fresh, final)
        _fsync_directory(directory)
    return final


def _write_manifest(partial: str, manifest: Dict[str, Any]) -> None:
    """Write ``manifest`` into ``partial`` and make it durable."""
    with open(os.path.join(partial, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_directory(partial)


def _fresh_name(directory: str, step: int) -> str:
    """``step-N``, or where that is taken, the first free ``step-N.R``."""
    name, number = step_name(step), 0
    while os.path.lexists(os.path.join(directory, name if number == 0 else f"{name}.{number}")):
        number += 1
    return os.path.join(directory, name if number == 0 else f"{name}.{number}")


def _replaced(before: List[Tuple[int, str]], step: int, keep: Optional[int]) -> List[str]:
    """The published directories (``before`` publishing ``step``, newest first) that its
    publishing replaces: those of this or a later step, and the complete ones beyond ``keep``."""
    doomed = [path for done, path in before if done >= step]
    if keep is not None:
        complete = [path for done, path in before if done < step and read_manifest(path, done)[0] is not None]
        doomed += complete[keep - 1 :]  # (the one just published is the first kept)
    return doomed


def _delete(directory: str, paths: List[str]) -> None:
    """Delete the published directories ``paths``: all renamed to ``.deleting-...`` first
    (invisible to ``resume`` at once) and that made durable, then deleted."""
    hidden = []
    for path in paths:
        target = os.path.join(directory, _DELETING + os.path.basename(path))
        if os.path.lexists(target):  # (an earlier removal's leftover that could not be deleted)
            shutil.rmtree(target)
        os.rename(path, target)
        hidden.append(target)
    if hidden:
        _fsync_directory(directory)
    for path in hidden:
        shutil.rmtree(path, ignore_errors=True)


# -- the run's checkpoints -------------------------------------------------------------------


class RunCheckpoints:
    """Periodic checkpoints of one training run in ``directory``; see the module docstring.

    Every method that touches checkpoints is collective (call it on every rank, with the same
    arguments). ``directory`` must be on a filesystem every rank sees, and only one run may
    write to it at a time.

    Args:
        directory: where the ``step-N`` checkpoint directories go (created when needed).
        model: the ``ShardedDataParallel`` model (either ``use_orig_params`` mode).
        optimizer: its optimizer, or ``None`` to save and load the model only.
        save_every: ``maybe_save`` saves at steps that are multiples of it (0: never).
        keep: how many complete checkpoints to keep (the newest ones); ``None``: all.
        process_group: the group that saves and loads (``None``: the default group). Give it a
            short timeout (``init_process_group(timeout=...)``) so that ranks stuck waiting for
            a dead peer fail within it.
        verify_checksums: ``resume`` compares every file's CRC-32 with the manifest (each rank
            reads a share of the files); ``False`` compares sizes only.
    """

    def __init__(
        self,
        directory: str,
        model: nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        *,
        save_every: int = 0,
        keep: Optional[int] = None,
        process_group: Optional[ProcessGroup] = None,
        verify_checksums: bool = True,
    ) -> None:
        _check_int("save_every", save_every, 0)
        _check_int("keep", keep, 1, allow_none=True)
        if not isinstance(model, ShardedDataParallel):
            raise TypeError(f"RunCheckpoints: model must be a ShardedDataParallel, got {type(model).__name__}")
        self.directory = os.fspath(directory)
        self.model = model
        self.optimizer = optimizer
        self.save_every = save_every
        self.keep = keep
        self.verify_checksums = verify_checksums
        # (holds the group weakly: see [Note: ending cleanly] in ``teardown``)
        self._comm = Communicator(process_group if process_group is not None else default_group())
        self._device = object_device(self.group)
        # Its own calls' guard ([Note: one guarded path] in ``_comm/_guard``).
        self._guard = make_guard([self._comm], self._device)

    @property
    def group(self) -> ProcessGroup:
        """The process group that saves and loads together."""
        return self._comm.group

    # -- saving ------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether ``maybe_save(step)`` saves: ``step`` is a positive multiple of ``save_every``."""
        return self.save_every > 0 and step > 0 and step % self.save_every == 0

    def maybe_save(self, step: int, state: Any = None, rank_state: Any = None) -> Optional[str]:
        """``save(step, state, rank_state)`` if ``should_save(step)``; returns its path or ``None``.

        Args:
            step: the step just completed.
            state: the run's state that is the same on every rank (rank 0's is saved).
            rank_state: this rank's own state (e.g. RNG states).
        """
        return self.save(step, state, rank_state) if self.should_save(step) else None

    def save(self, step: int, state: Any = None, rank_state: Any = None) -> str:
        """Save a checkpoint of the run after ``step`` and publish it atomically ([Note: atomic
        publish]); then remove what it replaces: an earlier checkpoint of the same step, those of
        later steps, and the oldest beyond ``keep`` ([Note: replacing checkpoints]). Returns the
        published path, which every rank can load once this returns on any rank. Collective.

        Args:
            step: the step just completed (``resume`` continues after it).
            state: the run's state that is the same on every rank (rank 0's is saved).
            rank_state: this rank's own state (given back at the same world size only).
        """
        with self._guard.call("RunCheckpoints.save()"):
            return self._save(step, state, rank_state)

    def _save(self, step: int, state: Any, rank_state: Any) -> str:
        """[Note: a save stops together] Every step of a save that one rank can fail at alone --
        pickling its ``rank_state`` (or rank 0 the ``state``), rank 0 making the directory and
        clearing leftovers, a rank making the checkpoint's directory (a path that is a file on
        one node), reading back what it wrote, rank 0 publishing (a manifest whose fsync
        fails) -- is done before the collective that follows it and shared there (``_together``):
        every rank raises, naming the rank and its error, and the process group stays usable.
        ``torch.distributed.checkpoint`` shares the errors of its own steps itself."""
        _check_int("step", step, 0)
        self._check_numpy("save")
        final = os.path.join(self.directory, step_name(step))
        partial = os.path.join(self.directory, _PARTIAL + step_name(step))
        blobs: Dict[str, Any] = {}
        with self._together("could not pickle its state or prepare the directory"):
            if state is not None and self._comm.rank == 0:
                blobs["state"] = pickle.dumps(state)
            if rank_state is not None:
                blobs[f"rank_state_{self._comm.rank}"] = pickle.dumps(rank_state)
            if self._comm.rank == 0:
                os.makedirs(self.directory, exist_ok=True)
                _clear_leftovers(self.directory)
        self._agree("save", [self.directory, str(step)])  # also: nobody writes before the clean-up
        with self._together(f"could not make {partial}"):
            os.makedirs(partial, exist_ok=True)
        metadata = dcp.save({**self._state_dicts(step), **blobs}, checkpoint_id=partial, process_group=self.group)
        files = sorted({info.relative_path for info in metadata.storage_data.values()} | {".metadata"})
        mine: Dict[str, Any] = {}
        with self._together("could not read back the files it wrote"):
            mine = {name: file_record(os.path.join(partial, name)) for name in files[self._comm.rank :: self._comm.world_size]}
        records = {name: record for share in all_gather_object(mine, self._comm) for name, record in share.items()}
        with self._together("could not publish the checkpoint (nothing was published, or it was and is complete)"):
            if self._comm.rank == 0:
                self._publish(partial, step, records, has_state=state is not None, has_rank_state=rank_state is not None)
        return final  # (published, and what it replaces removed, once every rank is here)

    @contextlib.contextmanager
    def _together(self, failed: str) -> Iterator[None]:
        """Run the block on every rank, then raise on every rank if it raised on any (see [Note:
        a save stops together]): this rank its own error, the others one naming it."""
        error: Optional[Exception] = None
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank
            error = exc
        raise_on_every_rank([self._comm], error, f"RunCheckpoints.save: rank {{rank}} {failed} (see its error)", self._device)

    def _state_dicts(self, step: int) -> Dict[str, Any]:
        with ShardedDataParallel.state_dict_type(self.model, StateDictType.SHARDED_STATE_DICT):
            saved: Dict[str, Any] = {"model": self.model.state_dict(), "step": step}
            if self.optimizer is not None:
                saved["optim"] = ShardedDataParallel.optim_state_dict(self.model, self.optimizer)
        return saved

    def _publish(self, partial: str, step: int, records: Dict[str, Any], has_state: bool, has_rank_state: bool) -> None:
        """Rank 0: publish ``partial`` with its manifest and remove what it replaces ([Note:
        atomic publish], [Note: replacing checkpoints])."""
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "world_size": self._comm.world_size,
            "optimizer": self.optimizer is not None,
            "state": has_state,
            "rank_state": has_rank_state,
            "files": records,
        }
        _replace(self.directory, partial, step, manifest, self.keep)

    # -- resuming ----------------------------------------------------------------------------

    def latest(self) -> Optional[Tuple[str, Dict[str, Any]]]:
        """The newest checkpoint that verifies ([Note: reading checkpoints]) and its manifest,
        or ``None``; warns (``SkippedCheckpointWarning``) about every directory passed over.
        Collective."""
        with self._guard.call("RunCheckpoints.latest()"):
            return self._latest()

    def _latest(self) -> Optional[Tuple[str, Dict[str, Any]]]:
        found = (published_steps(self.directory), leftovers(self.directory)) if self._comm.rank == 0 else None
        candidates, left = broadcast_object(found, self._comm)
        for path in left:
            warnings.warn(f"RunCheckpoints: skipping {path}: an interrupted save or removal left it (the next save removes it)", SkippedCheckpointWarning, stacklevel=3)
        for step, path in candidates:
            manifest, problem = read_manifest(path, step)
            problems = all_gather_object(problem or self._file_problems(path, manifest), self._comm)
            problem = next((p for p in problems if p), "")
            if not problem:
                return path, manifest  # type: ignore[return-value]
            warnings.warn(f"RunCheckpoints: skipping {path}: {problem}", SkippedCheckpointWarning, stacklevel=3)
        return None

    def _file_problems(self, path: str, manifest: Optional[Dict[str, Any]]) -> str:
        """The first problem with this rank's share of the manifest's files (``""``: none)."""
        if manifest is None:
            return ""
        names = sorted(manifest["files"])
        if ".metadata" not in names:
            return f"its {MANIFEST} lists no .metadata"
        for name in names[self._comm.rank :: self._comm.world_size]:
            problem = file_problem(path, name, manifest["files"][name], self.verify_checksums)
            if problem:
                return problem
        return ""

    def resume(self) -> Optional[Resumed]:
        """Load the newest complete checkpoint into the model and optimizer (at any world size)
        and return what it held; ``None`` if there is none (the model and optimizer are left as
        they are). Collective.

        Raises:
            ValueError: (on every rank, nothing loaded) the checkpoint holds keys the model or
                optimizer lacks, or lacks some of theirs ([Note: reading checkpoints]), or has
                no optimizer state while an optimizer was given.
        """
        with self._guard.call("RunCheckpoints.resume()", clears=True):
            return self._resume()

    def _resume(self) -> Optional[Resumed]:
        self._check_numpy("resume")
        found = self.latest()
        if found is None:
            return None
        path, manifest = found
        rank, world_size = self._comm.rank, self._comm.world_size
        same_world = manifest.get("world_size") == world_size
        if self.optimizer is not None and not manifest.get("optimizer"):
            raise ValueError(f"RunCheckpoints.resume: {path} has no optimizer state, but an optimizer was given (pass optimizer=None to load the model only)")
        with ShardedDataParallel.state_dict_type(self.model, StateDictType.SHARDED_STATE_DICT):
            loaded: Dict[str, Any] = {"model": self.model.state_dict(), "step": 0}
            if self.optimizer is not None:
                loaded["optim"] = ShardedDataParallel.optim_state_dict(self.model, self.optimizer)
            if manifest.get("state"):
                loaded["state"] = b""
            if manifest.get("rank_state") and same_world:
                loaded[f"rank_state_{rank}"] = b""
            self._check_keys(path, loaded)
            dcp.load(loaded, checkpoint_id=path, process_group=self.group)
            self.model.load_state_dict(loaded["model"])
            if self.optimizer is not None:
                self.optimizer.load_state_dict(ShardedDataParallel.optim_state_dict_to_load(self.model, self.optimizer, loaded["optim"]))
        return Resumed(
            step=int(loaded["step"]),
            path=path,
            world_size=int(manifest.get("world_size", 0)),
            state=_unpickle(loaded.get("state")),
            rank_state=_unpickle(loaded.get(f"rank_state_{rank}")),
        )

    def _check_keys(self, path: str, loaded: Dict[str, Any]) -> None:
        """Raise, on every rank alike, unless the checkpoint at ``path`` holds exactly the keys of
        ``loaded``'s model and optimizer parts ([Note: reading checkpoints])."""
        # The ranks agree before DCP's first collective, so a rank whose own check failed (or
        # could not read the metadata) never leaves the others waiting inside the load.
        problems = all_gather_object(self._key_problem(path, loaded), self._comm)
        problem = next((p for p in problems if p), "")
        if problem:
            raise together(ValueError(f"RunCheckpoints.resume: {path} {problem}"))

    def _key_problem(self, path: str, loaded: Dict[str, Any]) -> str:
        """How the checkpoint at ``path`` does not match ``loaded`` by its metadata (``""``: it
        matches); reads no tensors."""
        try:
            stored = list(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        except Exception as exc:  # noqa: BLE001 - reported through the agreement, not raised alone
            return f"has a .metadata that cannot be read: {type(exc).__name__}: {exc}"
        clauses: List[str] = []
        owners: List[str] = []
        for part, owner in _OWNERS.items():
            if part not in loaded:
                continue
            prefix = part + "."
            expected = stored_keys(loaded[part])
            saved = [key[len(prefix) :] for key in stored if key.startswith(prefix)]
            if part == "optim":
                # Per-parameter state only: an option a newer torch adds to every param group
                # must not make older checkpoints unloadable.
                expected, saved = ([key for key in keys if key.startswith("state.")] for keys in (expected, saved))
            found = key_mismatch(owner, expected, saved)
            clauses.extend(found)
            owners += [owner] if found else []
        if not clauses:
            return ""
        hint = " (pass optimizer=None to load the model only)" if owners == ["optimizer"] else ""
        return f"does not match the {' and '.join(owners)} (nothing was loaded): " + "; ".join(clauses) + hint

    def _check_numpy(self, what: str) -> None:
        """Raise on every rank, before any checkpoint I/O, where some rank lacks NumPy.

        [Note: NumPy for sharded checkpoints] On more than one rank
        ``torch.distributed.checkpoint`` exchanges its plans as pickled objects, which torch
        turns back from bytes through NumPy; torch does not install NumPy, so without it a save
        or load fails inside torch ("Numpy is not available"), after the ranks have started.
        One small collective first (flatshard's own object collectives need no NumPy) turns
        that into an error that names the missing package and the extra that installs it, on
        every rank -- also where only some ranks lack it.
        """
        if self._comm.world_size == 1:
            return
        here = "available" if _numpy_works() else "missing"
        difference = first_difference([here], self._comm, self._device)
        if difference is None and here == "available":
            return
        if difference is None:
            where = "on every rank"
        else:
            where = f"on rank {0 if difference.reference == 'missing' else difference.rank}"
        raise together(ImportError(
            f"RunCheckpoints.{what}: torch.distributed.checkpoint needs NumPy on more than one rank, and it is "
            f'missing {where}: install it with pip install "flatshard[checkpoint]" (or pip install numpy)'
        ))

    def _agree(self, what: str, items: Sequence[str]) -> None:
        """Every rank passed the same ``items`` (else every rank raises, naming the first that differs)."""
        difference = first_difference(list(items), self._comm, self._device)
        if difference is not None:
            raise together(ValueError(
                f"RunCheckpoints.{what}: ranks disagree: rank {difference.rank} passed {difference.theirs!r} "
                f"where rank 0 passed {difference.reference!r} (directory and step must be the same on every rank)"
            ))


def _numpy_works() -> bool:
    """Whether torch can turn a tensor into a NumPy array here (what DCP needs of NumPy)."""
    try:
        torch.zeros(1).numpy()
    except (RuntimeError, ImportError):
        return False
    return True


def _unpickle(blob: Any) -> Any:
    return None if blob is None else pickle.loads(blob)

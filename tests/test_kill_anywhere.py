"""Kill-anywhere: ``examples/train_gpt.py`` with periodic checkpoints, one rank SIGKILLed at
random moments (also while a checkpoint is being written), restarted with ``--resume`` each
time, ends with parameters and optimizer state bit-identical to an uninterrupted run; after
every kill the surviving ranks exit within the stated bound, every visible checkpoint is
complete, and one is left once one was saved -- also with ``--keep 1`` when the killed save
replaces the only checkpoint: a ``resave`` round restarts from an older checkpoint (the
uninterrupted run's, copied: ``--resume OLD --save DIR``), so that its first save is a step
``DIR`` holds already (or, every other such round, a smaller one), and kills rank 0 (which
publishes and removes) as soon as the checkpoint it replaces is renamed away, while it writes,
or as soon as it is published.

The ranks are started the way ``torchrun`` starts its workers (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` of a store the launcher hosts: here this test, on a port the OS
picked), but without an agent that would kill the survivors: they must exit by themselves.

``FLATSHARD_KILL_ROUNDS=20 python -m pytest tests/test_kill_anywhere.py`` runs the long version
(default: 3 rounds).
"""

import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch.distributed import TCPStore

from flatshard.run_checkpoints import file_problem, leftovers, published_steps, read_manifest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "train_gpt.py")
WORLD = 2
STEPS = 48
# The example's process-group timeout in these runs (--timeout), and the bounds this test holds
# the surviving ranks to. A rank killed once the process group is formed (training,
# checkpointing, resuming) is reported by gloo as a closed connection: the survivors exit within
# PEER_DEATH_BOUND_S of the kill. One killed before the rendezvous completes leaves them waiting
# in the store: they give up after exactly the timeout once they reach it (their error says
# so), and exit within STARTUP_BOUND_S of the kill (generous: on a loaded machine a survivor may
# still be importing torch for many seconds when its peer dies).
TIMEOUT_S = 10
PEER_DEATH_BOUND_S = 12
STARTUP_BOUND_S = 120
RENDEZVOUS_TIMEOUT = f"DistStoreError: wait timeout after {TIMEOUT_S * 1000}ms"
SAVE_EVERY = 4
# The rounds cycle through these kill moments, each with its --keep (the default 3 rounds: the
# first three).
MODES = (("training", 1), ("resave", 1), ("anytime", 3), ("checkpoint", 2))
FLAGS = ["--steps", str(STEPS), "--layers", "2", "--dim", "32", "--log-every", "10", "--save-every", str(SAVE_EVERY), "--timeout", str(TIMEOUT_S)]


def _launch(directory: Path, log: Path, keep: Optional[int], source: Optional[Path] = None) -> Tuple[List[subprocess.Popen], TCPStore]:
    """The example's ranks, each its own process, as torchrun's workers, saving into
    ``directory`` and resuming from it (the first launch starts at step 1, every later one
    resumes), or from ``source`` if given."""
    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS="1",
    )
    procs = []
    for rank in range(WORLD):
        out = open(log.with_suffix(f".{rank}.log"), "w")
        procs.append(subprocess.Popen(
            [sys.executable, EXAMPLE, *FLAGS, *([] if keep is None else ["--keep", str(keep)]), "--resume", str(source or directory), "--save", str(directory)],
            cwd=ROOT, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), stdout=out, stderr=subprocess.STDOUT,
        ))
        out.close()
    return procs, store


def _wait_all(procs: List[subprocess.Popen], timeout: float) -> List[float]:
    """Seconds until each process exited (measured from now); kills and fails past ``timeout``."""
    start, exited = time.monotonic(), [None] * len(procs)
    while any(t is None for t in exited):
        for i, proc in enumerate(procs):
            if exited[i] is None and proc.poll() is not None:
                exited[i] = time.monotonic() - start
        if time.monotonic() - start > timeout:
            for proc in procs:
                proc.kill()
            raise AssertionError(f"ranks still running {timeout:.0f} s after a peer was killed: {exited}")
        time.sleep(0.005)
    return exited


def _complete_run(directory: Path, log: Path, keep: Optional[int]) -> None:
    procs, _store = _launch(directory, log, keep)
    _wait_all(procs, 300)
    texts = [log.with_suffix(f".{r}.log").read_text() for r in range(WORLD)]
    assert all(p.returncode == 0 for p in procs), "\n".join(texts)


def _partials(directory: Path) -> Set[Tuple[str, int]]:
    """The ``.partial-`` directories now in ``directory``, by name and inode (a save re-creates
    a leftover's name)."""
    found = set()
    for path in leftovers(str(directory)):
        try:
            found.add((path, os.stat(path).st_ino))
        except FileNotFoundError:
            pass
    return {(p, i) for p, i in found if os.path.basename(p).startswith(".partial-")}


def _kill_moment(directory: Path, procs: List[subprocess.Popen], mode: str, run_seconds: float, rng: random.Random) -> str:
    """Wait for the moment to kill, and say what it was. ``checkpoint``: while the k-th
    checkpoint of this launch is being written (a new ``.partial-`` directory exists; k random);
    ``training``: a random moment of the training loop (within half a second after the j-th
    checkpoint of this launch was published; j random);
    ``anytime``: a random moment after launch (also during start-up and rendezvous)."""
    start, alive = time.monotonic(), lambda: all(p.poll() is None for p in procs)
    if mode == "checkpoint":
        before, seen, wanted = _partials(directory), set(), rng.randint(1, 4)
        while alive() and time.monotonic() - start < 120:
            new = _partials(directory) - before - seen
            seen |= new
            if new and len(seen) >= wanted:
                time.sleep(rng.uniform(0, 0.02))
                state = "was being written" if _partials(directory) & new else "had just been published"
                return f"while checkpoint {len(seen)} of this launch {state}"
            time.sleep(0.001)
        return "never: the run ended first"
    if mode == "training":  # after j more checkpoints were published, within the next steps
        before, seen, wanted = {p for _, p in published_steps(str(directory))}, set(), rng.randint(1, 3)
        while alive() and len(seen) < wanted:  # (counted as they appear: with --keep 1 each replaces the last)
            seen |= {p for _, p in published_steps(str(directory))} - before
            time.sleep(0.001)
        start, delay, where = time.monotonic(), rng.uniform(0, 0.5), f"in the training loop, after checkpoint {wanted} of this launch"
    else:
        delay, where = rng.uniform(0, run_seconds * 0.8), "after launch"
    while alive() and time.monotonic() - start < delay:
        time.sleep(0.001)
    return f"{time.monotonic() - start:.2f} s {where}" + ("" if alive() else " (the run had ended)")


def _kill_in_first_save(directory: Path, procs: List[subprocess.Popen], when: str, replaced: Tuple[str, int]) -> str:
    """The ``resave`` rounds' moment, in the first save of this launch: while it is being
    ``written``; as soon as it is ``published`` (its ``.partial-`` directory renamed); as soon as
    the checkpoint it replaces (``replaced``: path and inode) is ``removing`` (renamed away)."""
    before, start, alive = _partials(directory), time.monotonic(), lambda: all(p.poll() is None for p in procs)
    while alive() and not (_partials(directory) - before) and time.monotonic() - start < 120:
        time.sleep(0.001)
    new = _partials(directory) - before
    if not new:
        return "never: the run ended first"
    waiting = lambda: (when == "published" and _partials(directory) & new) or (when == "removing" and _inode(replaced[0]) == replaced[1])
    while alive() and waiting() and time.monotonic() - start < 120:
        time.sleep(0.0002)
    state = "was being written" if _partials(directory) & new else "had just been published"
    gone = "" if _inode(replaced[0]) == replaced[1] else f", {os.path.basename(replaced[0])} renamed away"
    return f"as soon as its first checkpoint ({os.path.basename(min(new)[0])}) {state}{gone} ({when})"


def _inode(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _rewind(directory: Path, reference: Path, into: Path, intervals: int) -> Tuple[str, Tuple[str, int]]:
    """Make ``into`` the checkpoint directory of the run ``intervals`` saves before the newest
    complete checkpoint in ``directory`` (a copy of the uninterrupted run's; none: empty, the run
    starts at step 1), so that a run resumed from it saves steps ``directory`` has; says which,
    and gives the newest one's path and inode (the first save replaces it)."""
    newest = _assert_visible_checkpoints_complete(directory)
    assert newest, f"a resave round needs a complete checkpoint in {directory}"
    step = max(newest[0] - intervals * SAVE_EVERY, 0)
    into.mkdir()
    if step:
        shutil.copytree(reference / f"step-{step:08d}", into / f"step-{step:08d}")
    path = published_steps(str(directory))[0][1]
    saving = f"saving step {step + SAVE_EVERY} next to {os.path.basename(path)}"
    return f"resumed from step {step} of the uninterrupted run, {saving}", (path, os.stat(path).st_ino)


def _last_error(log: Path) -> str:
    """The last line of a rank's traceback (what stopped it), or how it ended."""
    lines = [line.strip() for line in log.read_text().splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    return errors[-1][:120] if errors else (lines[-1][:120] if lines else "no output")


def _assert_visible_checkpoints_complete(directory: Path) -> List[int]:
    """Their steps, newest (last published) first."""
    steps = []
    for step, path in published_steps(str(directory)):
        manifest, problem = read_manifest(path, step)
        assert manifest is not None, f"{path} is visible but {problem}"
        problems = [file_problem(path, name, record, True) for name, record in manifest["files"].items()]
        assert not any(problems), f"{path} is visible but {problems}"
        steps.append(step)
    return steps


def _full_checkpoint(path: str) -> Dict[str, Any]:
    """Everything a checkpoint holds, with full tensors (the caller's states unpickled)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from convert_checkpoint import to_full
    finally:
        sys.path.pop(0)
    out = path.rstrip("/") + ".pt"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        to_full(path, out)
    full = torch.load(out, weights_only=False)
    return {key: pickle.loads(value) if key.startswith(("state", "rank_state_")) else value for key, value in full.items()}


def _assert_bit_identical(actual, expected, where: str) -> None:
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected), f"{where}: keys {list(actual)} vs {list(expected)}"
        for key in expected:
            _assert_bit_identical(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: {len(actual)} items vs {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_bit_identical(a, e, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), f"{where}: not bit-identical"
    else:
        assert actual == expected, f"{where}: {actual!r} vs {expected!r}"


def test_killed_anywhere_and_resumed_the_run_ends_bit_identical(tmp_path):
    rounds = int(os.environ.get("FLATSHARD_KILL_ROUNDS", "3"))
    rng = random.Random(int(os.environ.get("FLATSHARD_KILL_SEED", "0")))
    started = time.monotonic()
    reference = tmp_path / "reference"
    _complete_run(reference, reference, keep=None)  # (every checkpoint kept: resave rounds start from them)
    run_seconds = time.monotonic() - started
    directory, report, resaves = tmp_path / "killed", [], 0
    for round_ in range(rounds):
        mode, keep = MODES[round_ % len(MODES)]
        had = _assert_visible_checkpoints_complete(directory)
        source, rewound = None, ""
        if mode == "resave":  # (in turn: a re-save of the same step or of a smaller one; each moment)
            source, resaves = tmp_path / f"rewound{round_}", resaves + 1
            rewound, replaced = _rewind(directory, reference, source, 1 if resaves % 2 else 2)
            rewound = f" ({rewound})"
        procs, _store = _launch(directory, tmp_path / f"round{round_}", keep, source)
        if mode == "resave":
            moment = _kill_in_first_save(directory, procs, ("removing", "written", "published")[(resaves - 1) % 3], replaced)
        else:
            moment = _kill_moment(directory, procs, mode, run_seconds, rng)
        victim = 0 if mode == "resave" else rng.randrange(WORLD)
        procs[victim].send_signal(signal.SIGKILL)
        exits = _wait_all(procs, STARTUP_BOUND_S)
        survivors = [t for i, t in enumerate(exits) if i != victim]
        steps = _assert_visible_checkpoints_complete(directory)
        errors = [_last_error(tmp_path / f"round{round_}.{i}.log") for i in range(WORLD) if i != victim]
        report.append(
            f"round {round_}, {mode}, keep {keep}{rewound}: rank {victim} killed {moment}; survivors exited after "
            f"{max(survivors):.2f} s ({'; '.join(errors)}); complete checkpoints {sorted(steps)} ({', '.join(sorted(os.listdir(directory)))})"
        )
        assert steps or not had, f"no complete checkpoint is left (before the round: {had}): {report[-1]}"
        in_rendezvous = [RENDEZVOUS_TIMEOUT in error for error in errors]
        assert mode == "anytime" or not any(in_rendezvous), report[-1]
        if not any(in_rendezvous):
            assert max(survivors) <= PEER_DEATH_BOUND_S, f"survivors took over {PEER_DEATH_BOUND_S} s to exit: {report[-1]}"
    _complete_run(directory, tmp_path / "final", keep=1)
    print("\n".join(report))
    final = tmp_path / "final.0.log"
    assert f"done: {STEPS} steps" in final.read_text()
    expected = _full_checkpoint(str(reference / f"step-{STEPS:08d}"))
    (step, newest), *_ = published_steps(str(directory))  # (a re-save killed late leaves it as step-N.R)
    assert step == STEPS, published_steps(str(directory))
    actual = _full_checkpoint(newest)
    assert {"model", "optim", "step", "state"} <= set(expected), list(expected)
    _assert_bit_identical(actual, expected, "checkpoint")

"""Running a fault case (``tests/_fault_fuzz.py``) in the rank pool and judging it.

Three pool tasks per case, each in a fresh process group:

1. the schedule without the fault (``rank_reference``): per operation, how many flatshard
   collectives each rank makes (``tests/_faults.py`` counts them), and after each save every
   rank's local state (its parameters and persistent buffers, its optimizer's state dict);
2. the schedule with the fault (``rank_faulted``) in a fresh checkpoint directory: the faulty
   rank's chosen collective of the faulted operation raises or kills the process instead. A rank
   stops at its first error, as a training script whose exception ends it would, and writes what
   it raised and when to a file at once (a rank the pool has to kill still tells). Then, as the
   case says (``after``), it stops ("stop": the error ended the script; the
   faulty rank's process ends at once, ``ENDED_EXIT_CODE``), or tries one more training step
   (the probe, "go_on": a loop that catches the error) and records how that went (the faulty
   rank's process then ends if its probe raised: the process group may hold a collective that
   never completes, and destroying it would wait for its timeout on every rank, unless a
   rank's connections close);
3. a fresh model and optimizer resume from that directory (``rank_resume``).

``check`` then holds the case to: the faulty rank raised its own error (or died with
``KILLED_EXIT_CODE``); every other rank raised an error that names the failure (a
``PeerFailedError``, ``CallFailedError`` or ``DivergedRanksError``, or one naming the faulty
rank) within ``BOUND_S`` of the fault, never before it; no process died but the killed one
(and the faulty rank that ended itself); the probes all trained on or all raised, within
``BOUND_S`` -- all trained on where every other rank raised ``CallFailedError`` (the group is
still usable); the resume loaded the last
checkpoint that a save completed before the fault (or the faulted save's, where the fault came
after it was published), bit-identical (``torch.equal``) on every rank to the state of the run
without the fault right after that save; and without a fault that fires, the run completed.
"""

from __future__ import annotations

import copy
import os
import pickle
import re
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

import flatshard
from flatshard import (
    FullStateDictConfig,
    PeerFailedError,
    RunCheckpoints,
    ShardedDataParallel as FSDP,
    SkippedCheckpointWarning,
    StateDictType,
)
from flatshard._base._errors import DivergedRanksError
from flatshard._comm._guard import CallFailedError
from tests._fault_fuzz import FaultCase, collective_number, describe
from tests._faults import KILLED_EXIT_CODE, fault_at
from tests._fuzz_model import loss_of
from tests._fuzz_run import ShardedRun
from tests._pool import COLLECTIVE_TIMEOUT_S

# Every rank raises within this many seconds of the fault (the pool's process-group timeout is
# 60 s: a rank that waits for it fails the bound by far).
BOUND_S = 10.0
FAULTED_TASK_S = 100.0  # (past the timeout, so that a rank that waits for it reports its error)
TASK_S = 150.0
# The faulty rank ends its process with this code after its error (``rank_faulted``).
ENDED_EXIT_CODE = 78
OWN_ERRORS = {
    "error": "Injected: injected",
    "oserror": "OSError: [Errno 5] Input/output error (injected)",
    "interrupt": "KeyboardInterrupt: injected",
}
SHARED_ERRORS = (PeerFailedError, DivergedRanksError)  # (CallFailedError is a PeerFailedError)
# What a failure is about: the run without the fault failed; the ranks' errors (who raised
# what, and when); a process died; the resume; the probe step; the pool task itself.
FAILURE_KINDS = ("reference", "raise", "death", "resume", "probe", "task")


# -- the operations (in a rank) -------------------------------------------------------------


class Runner:
    """One rank's model, optimizer and checkpoints, and the schedule's operations on them."""

    def __init__(self, case: FaultCase, rank: int, world_size: int, directory: str, scratch: str) -> None:
        torch.manual_seed(0)
        self.case = case
        # (hybrid sharding's groups get the default group's timeout: the pool's 60 s)
        self.run = ShardedRun(case.model, rank, world_size, scratch, group_timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        self.checkpoints = RunCheckpoints(directory, self.run.model, self.run.optim, keep=case.keep)
        self.steps = 0  # training steps so far (a resume sets it to the checkpoint's)

    def do(self, index: int, op: Dict[str, Any]) -> None:
        kind, model, optim = op["kind"], self.run.model, self.run.optim
        if kind == "step":
            self.train(index, op["clip"])
        elif kind == "save":
            self.checkpoints.save(self.steps, state={"op": index})
        elif kind == "resume":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", SkippedCheckpointWarning)
                resumed = self.checkpoints.resume()
            if resumed is not None:
                self.steps = resumed.step
        elif kind == "state_dict":
            config = FullStateDictConfig(offload_to_cpu=op["rank0"], rank0_only=op["rank0"])
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
                model.state_dict()
        elif kind == "optim_state_dict":
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
                FSDP.optim_state_dict(model, optim)
        elif kind == "summon":
            if op["write"] is not None:
                self.run.summon_write(*op["write"])
            else:
                with FSDP.summon_full_params(model, writeback=False):
                    sum(float(p.sum()) for p in model.parameters())
        elif op["what"] == "model":
            flatshard.state_dict.get_model_state_dict(model, options=StateDictOptions(full_state_dict=op["full"]))
        else:
            flatshard.state_dict.get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=op["full"]))

    def train(self, index: int, clip: Optional[float]) -> None:
        model, optim = self.run.model, self.run.optim
        optim.zero_grad(set_to_none=True)
        tokens, targets = self.run.data(index, 0, "train")
        loss = loss_of(model, model(tokens), targets)
        if loss.requires_grad:  # (everything it depends on may be frozen)
            loss.backward()
        if clip is not None:
            model.clip_grad_norm_(clip)
        optim.step()
        self.steps += 1


def local_state(run: ShardedRun) -> Dict[str, Any]:
    """This rank's parameters (its shards), persistent buffers and optimizer state dict."""
    model = run.model
    transient = {f"{name}.{b}" if name else b for name, m in model.named_modules() for b in m._non_persistent_buffers_set}
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers() if n not in transient},
        "optim": copy.deepcopy(run.optim.state_dict()),  # type: ignore[union-attr]
    }


# -- the rank functions ----------------------------------------------------------------------


def rank_reference(rank: int, world_size: int, case: FaultCase, scratch: str) -> Dict[str, Any]:
    """The schedule without the fault: collectives per operation, local state after each save."""
    runner = Runner(case, rank, world_size, os.path.join(scratch, "checkpoints"), scratch)
    counts: List[int] = []
    saved: Dict[int, Dict[str, Any]] = {}
    for index, op in enumerate(case.ops):
        with fault_at(10**9) as state:
            runner.do(index, op)
        counts.append(int(state["count"]))
        if op["kind"] == "save":
            saved[index] = local_state(runner.run)
    return {"counts": counts, "saved": saved}


def _write(path: str, value: Any) -> None:
    with open(path + ".tmp", "wb") as f:
        pickle.dump(value, f)
    os.replace(path + ".tmp", path)


def _error(exc: BaseException) -> Dict[str, Any]:
    return {
        "error": f"{type(exc).__name__}: {exc}",
        "shared": isinstance(exc, SHARED_ERRORS),
        "entry": isinstance(exc, CallFailedError),
        "time": time.monotonic(),
        "trace": "".join(traceback.format_exception(exc)[-12:]),
    }


def rank_faulted(rank: int, world_size: int, case: FaultCase, scratch: str, outcomes: str, collective: int) -> str:
    """The schedule with the fault (see the module docstring); the outcome goes to a file."""
    runner = Runner(case, rank, world_size, os.path.join(scratch, "checkpoints"), scratch)
    mine = os.path.join(outcomes, f"rank-{rank}")
    faulty = rank == case.fault["rank"]
    when: Dict[str, Any] = {}
    outcome: Dict[str, Any] = {"error": None, "op": None, "probe": None}

    def fired(state: Dict[str, Any]) -> None:
        _write(os.path.join(outcomes, "fault"), {"at": state["at"]})

    for index, op in enumerate(case.ops):
        armed = faulty and index == case.fault["op"]
        try:
            with fault_at(collective if armed else None, case.fault["kind"], when if armed else None, on_fire=fired):
                runner.do(index, op)
        except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt included: that is the point
            outcome.update(_error(exc), op=index)
            break
    _write(mine, outcome)
    if outcome["error"] is None:
        return "done"
    if case.after == "go_on":
        started = time.monotonic()
        try:
            runner.train(len(case.ops), None)
            outcome["probe"] = {"error": None, "seconds": time.monotonic() - started}
        except BaseException as exc:  # noqa: BLE001
            outcome["probe"] = dict(_error(exc), seconds=time.monotonic() - started)
        _write(mine, outcome)
        ended = outcome["probe"]["error"] is not None
    else:
        ended = True  # (as a script that the exception ends)
    if faulty and ended:
        # (and the ranks' process group may hold a collective that never completes:
        # destroying it would wait for the process group's timeout on every rank -- ARCHITECTURE.md,
        # "When a rank fails" -- unless a rank's connections close)
        os._exit(ENDED_EXIT_CODE)
    return "done"


def rank_resume(rank: int, world_size: int, case: FaultCase, scratch: str) -> Dict[str, Any]:
    """A fresh model and optimizer resume from the faulted run's checkpoints."""
    runner = Runner(case, rank, world_size, os.path.join(scratch, "checkpoints"), os.path.join(scratch, "resume"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SkippedCheckpointWarning)
        resumed = runner.checkpoints.resume()
    skipped = [str(w.message) for w in caught if issubclass(w.category, SkippedCheckpointWarning)]
    if resumed is None:
        return {"op": None, "state": None, "skipped": skipped}
    return {"op": resumed.state["op"], "step": resumed.step, "state": local_state(runner.run), "skipped": skipped}


# -- running and judging a case (in the test process) ----------------------------------------


class Verdict:
    """What ``check`` found: failures (the case fails), notes, and facts for the long mode's
    statistics."""

    def __init__(self, case: FaultCase, collective: Optional[int] = None, count: Optional[int] = None) -> None:
        self.case = case
        self.collective = collective
        self.count = count
        self.failures: List[str] = []
        self.notes: List[str] = []
        self.facts: Dict[str, Any] = {"fired": False, "errors": [], "seconds": [], "resumed": None, "probe": None}
        self.outcomes: Dict[int, Optional[Dict[str, Any]]] = {}

    def fail(self, kind: str, text: str) -> None:
        """A failure of ``kind`` (one of ``FAILURE_KINDS``)."""
        self.failures.append(f"[{kind}] {text}")

    def report(self) -> str:
        lines = [f"fault case seed={self.case.seed}: {len(self.failures)} problem(s)"]
        lines += [f"  - {text}" for text in self.failures]
        lines += [f"  note: {text}" for text in self.notes]
        lines += ["", describe(self.case, self.collective, self.count), "  outcomes:"]
        for rank, o in sorted(self.outcomes.items()):
            if o is None:
                lines.append(f"    rank {rank}: no outcome")
                continue
            lines.append(f"    rank {rank}: " + (f"raised in op {o['op']}: {o['error'][:400]}" if o["error"] else "completed the schedule"))
            if o["probe"] is not None:
                lines.append(f"      probe step: {o['probe']['error'] or 'trained on'} ({o['probe']['seconds']:.2f} s)")
        traces = [(r, o["trace"]) for r, o in sorted(self.outcomes.items()) if o is not None and o["error"] and not o["shared"]]
        for rank, trace in traces:
            lines += [f"  rank {rank}'s traceback (last frames):", *("    " + line for line in trace.rstrip().splitlines())]
        return "\n".join(lines)


def _pool_task(pool: Any, fn: Any, case: FaultCase, *args: Any, timeout: float) -> Tuple[Any, Dict[int, str], List[int], Optional[str]]:
    """``pool.run``'s results, or None; the ranks that died (and how), the ranks the pool killed
    because they did not finish, and any other failure's text."""
    try:
        return pool.run(fn, case.world_size, case, *args, timeout=timeout), {}, [], None
    except BaseException as exc:  # noqa: BLE001 - judged by the caller
        text = "\n".join([f"{type(exc).__name__}: {exc}", *getattr(exc, "__notes__", [])])
        deaths = {int(r): why for r, why in re.findall(r"rank (\d+) died \(([^)]*)\)", text)}
        match = re.search(r"ranks \[([\d, ]*)\](?: of \d+)? did not finish", text)
        unfinished = [int(x) for x in match.group(1).split(",") if x.strip()] if match else []
        return None, deaths, unfinished, None if deaths or unfinished else text


def check(pool: Any, case: FaultCase) -> Verdict:
    """Run ``case`` (three pool tasks) and judge it; see the module docstring."""
    f, ws = case.fault, case.world_size
    with tempfile.TemporaryDirectory(prefix="flatshard-fault-") as scratch:
        reference, deaths, unfinished, other = _pool_task(pool, rank_reference, case, os.path.join(scratch, "reference"), timeout=TASK_S)
        if reference is None:
            verdict = Verdict(case)
            verdict.fail("reference", f"the run without the fault failed: {other or deaths or unfinished}")
            return verdict
        count = reference[f["rank"]]["counts"][f["op"]]
        verdict = Verdict(case, collective_number(case, count), count)
        outcomes = os.path.join(scratch, "outcomes")
        os.makedirs(outcomes)
        _, deaths, unfinished, other = _pool_task(pool, rank_faulted, case, os.path.join(scratch, "run"), outcomes, verdict.collective, timeout=FAULTED_TASK_S)
        if other is not None:
            verdict.fail("task", f"the faulted run's pool task failed: {other}")
        verdict.outcomes = {r: _read(os.path.join(outcomes, f"rank-{r}")) for r in range(ws)}
        fault = _read(os.path.join(outcomes, "fault"))
        verdict.facts["fired"] = fault is not None
        _judge_run(verdict, fault["at"] if fault is not None else None, deaths, unfinished)
        resumed, deaths, unfinished, other = _pool_task(pool, rank_resume, case, os.path.join(scratch, "run"), timeout=TASK_S)
        if resumed is None:
            verdict.fail("resume", f"resuming after the faulted run failed: {other or deaths or unfinished}")
        else:
            _judge_resume(verdict, reference, resumed)
    return verdict


def _read(path: str) -> Optional[Dict[str, Any]]:
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _judge_run(v: Verdict, fault_time: Optional[float], deaths: Dict[int, str], unfinished: List[int]) -> None:
    f, faulty = v.case.fault, v.case.fault["rank"]
    kill = f["kind"] == "kill"
    for rank, why in sorted(deaths.items()):
        killed = kill and rank == faulty and why == f"exit code {KILLED_EXIT_CODE}"
        ended = rank == faulty and why == f"exit code {ENDED_EXIT_CODE}" and (v.outcomes.get(rank) or {}).get("error") is not None
        if not (killed or ended):
            v.fail("death", f"rank {rank} died ({why})" + (": an abort" if why == "killed by signal 6" else ""))
    expected = f["fires"] and v.collective <= v.count  # type: ignore[operator]
    if expected != (fault_time is not None):
        v.fail("raise", f"the fault {'did not fire' if expected else 'fired'}: without it, rank {faulty} made {v.count} collectives in op {f['op']}, and it was armed at #{v.collective}")
    if fault_time is None:
        for rank, o in v.outcomes.items():
            if o is None or o["error"] is not None:
                v.fail("raise", f"rank {rank} did not complete the schedule although no fault fired: {o['error'] if o else 'no outcome'}")
        return
    if kill and deaths.get(faulty) != f"exit code {KILLED_EXIT_CODE}":
        v.fail("death", f"the killed rank {faulty} was not reported dead with exit code {KILLED_EXIT_CODE} ({deaths.get(faulty)})")
    live = [r for r in range(v.case.world_size) if not (kill and r == faulty)]
    for rank in live:
        _judge_rank(v, rank, fault_time, rank in unfinished)
    if v.case.after == "go_on":
        _judge_probes(v, live, kill)


def _judge_rank(v: Verdict, rank: int, fault_time: float, unfinished: bool) -> None:
    f, faulty = v.case.fault, v.case.fault["rank"]
    o = v.outcomes.get(rank)
    if o is None:
        v.fail("raise", f"rank {rank} never reported" + (" (the pool killed it: its task did not end)" if unfinished else ""))
        return
    if o["error"] is None:
        v.fail("raise", f"rank {rank} completed the schedule although rank {faulty} failed in op {f['op']}")
        return
    seconds = o["time"] - fault_time
    v.facts["seconds"].append(seconds)
    v.facts["errors"].append(o["error"].split(":", 1)[0])
    if rank == faulty:
        if o["error"] != OWN_ERRORS[f["kind"]] or o["op"] != f["op"]:
            v.fail("raise", f"the faulty rank {rank} raised {o['error'][:300]!r} in op {o['op']}, expected {OWN_ERRORS[f['kind']]!r} in op {f['op']}")
    elif not (o["shared"] or f"rank {faulty}" in o["error"]):
        v.fail("raise", f"rank {rank} raised an error that is no PeerFailedError or DivergedRanksError and does not name rank {faulty}: {o['error'][:300]}")
    if seconds > BOUND_S:
        v.fail("raise", f"rank {rank} raised {seconds:.1f} s after the fault (bound {BOUND_S:.0f} s): {o['error'][:300]}")
    if seconds < -0.05:
        v.fail("raise", f"rank {rank} raised {-seconds:.2f} s before the fault fired: {o['error'][:300]}")
    if o["op"] != f["op"]:
        v.notes.append(f"rank {rank} raised in op {o['op']}, the fault was in op {f['op']}")
    if unfinished:
        v.notes.append(f"rank {rank} raised in time, but its pool task did not end (killed by the pool)")


def _judge_probes(v: Verdict, live: List[int], kill: bool) -> None:
    faulty = v.case.fault["rank"]
    probes = {r: v.outcomes[r]["probe"] for r in live if v.outcomes.get(r) and v.outcomes[r]["error"]}  # type: ignore[index]
    for rank, probe in sorted(probes.items()):
        if probe is None:
            v.fail("probe", f"rank {rank}'s probe step did not end")
        elif probe["seconds"] > BOUND_S:
            v.fail("probe", f"rank {rank}'s probe step took {probe['seconds']:.1f} s (bound {BOUND_S:.0f} s): {probe['error'] or 'trained on'}")
    done = {r: p for r, p in probes.items() if p is not None}
    trained = sorted(r for r, p in done.items() if p["error"] is None)
    raised = sorted(r for r, p in done.items() if p["error"] is not None)
    usable = not kill and all((v.outcomes.get(r) or {}).get("entry") for r in live if r != faulty)
    v.facts["probe"] = "mixed" if trained and raised else "raised" if raised else "trained on" if trained else "did not end"
    if usable and raised:
        v.fail("probe", f"every other rank raised CallFailedError (the group stays usable), but the probe step raised on ranks {raised}: {done[raised[0]]['error'][:300]}")
    elif trained and raised:
        v.fail("probe", f"the probe step trained on ranks {trained} and raised on ranks {raised}: {done[raised[0]]['error'][:300]}")


def _judge_resume(v: Verdict, reference: List[Dict[str, Any]], resumed: List[Dict[str, Any]]) -> None:
    f, ops = v.case.fault, v.case.ops
    fired = v.facts["fired"]
    saves = [i for i, op in enumerate(ops) if op["kind"] == "save" and (not fired or i < f["op"])]
    expected = {saves[-1] if saves else None}
    if fired and ops[f["op"]]["kind"] == "save":
        expected.add(f["op"])  # (the fault came after it was published)
    got = [r["op"] for r in resumed]
    v.facts["resumed"] = got[0]
    if len(set(got)) > 1:
        v.fail("resume", f"the ranks resumed different checkpoints (saved by ops {got})")
        return
    if got[0] not in expected:
        wanted = " or ".join("none" if e is None else f"op {e}'s" for e in sorted(expected, key=lambda e: -1 if e is None else e))
        v.fail("resume", f"resume loaded {'nothing' if got[0] is None else f'the checkpoint of op {got[0]}'}, expected {wanted}; skipped: {resumed[0]['skipped']}")
        return
    if got[0] is None:
        return
    for rank, r in enumerate(resumed):
        want = reference[rank]["saved"][got[0]]
        diffs = differences(want, _unstepped_sgd_dropped(want, r["state"]))
        if diffs:
            v.fail("resume", f"rank {rank}: the state resumed from op {got[0]}'s checkpoint differs from the run without the fault after that save: {'; '.join(diffs[:4])}")


def _unstepped_sgd_dropped(want: Dict[str, Any], got: Dict[str, Any]) -> Dict[str, Any]:
    """``got`` without the state of parameters that ``want`` has none for and that only hold a
    zero SGD momentum buffer: what resuming gives a parameter never stepped (docs/checkpoints.md,
    "Optimizer state": SGD's first step treats a zero buffer as none, with ``dampening=0``)."""
    state = got["optim"]["state"]
    kept = {
        k: v for k, v in state.items()
        if k in want["optim"]["state"] or set(v) != {"momentum_buffer"} or bool(v["momentum_buffer"].any())
    }
    return dict(got, optim=dict(got["optim"], state=kept))


def differences(want: Any, got: Any, path: str = "") -> List[str]:
    """Where ``got`` is not bit-identical to ``want`` (nested dicts, lists, tensors, values)."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{path}: a tensor, got {type(got).__name__}"]
        if want.dtype != got.dtype or want.shape != got.shape:
            return [f"{path}: {want.dtype}{tuple(want.shape)}, got {got.dtype}{tuple(got.shape)}"]
        if not torch.equal(want, got):
            return [f"{path}: values differ (largest {(want.double() - got.double()).abs().max().item():.3g})"]
        return []
    if isinstance(want, dict) and isinstance(got, dict):
        found = [f"{path}: key {k!r} missing" for k in want if k not in got] + [f"{path}: unexpected key {k!r}" for k in got if k not in want]
        for key in want:
            if key in got:
                found += differences(want[key], got[key], f"{path}.{key}" if path else str(key))
        return found
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)) and len(want) == len(got):
        return [d for i, (a, b) in enumerate(zip(want, got)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if want == got else [f"{path}: {want!r}, got {got!r}"]

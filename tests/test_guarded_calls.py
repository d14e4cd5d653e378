"""Every flatshard call that communicates stops together ([Note: one guarded path] in
flatshard/_comm/_guard.py).

One rank raises inside a flatshard call -- a bad argument (before the call's first collective),
an error or a ``KeyboardInterrupt`` or an ``OSError`` after it (injected before one of its
collectives: tests/_faults.py) -- or leaves a forward before its backward, while the others go
on. Every rank must raise within ``BOUND_S`` of the failure, naming the rank and what it raised,
against the pool's 60 s process-group timeout; nothing aborts the process. A failure before the
first collective leaves the process group usable: the ranks train on together afterwards.
"""

from __future__ import annotations

import ast
import contextlib
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional
from unittest import mock

import torch
import torch.distributed as dist
from expecttest import TestCase
from torch import nn

import flatshard
from flatshard import PeerFailedError, ShardedDataParallel, StateDictType
from flatshard._comm._shared_memory import ENV_SWITCH
from tests._faults import fault_at
from tests._models import batch, build, lm_loss, local, make_optim

BOUND_S = 10.0
ROOT = Path(__file__).resolve().parents[1]


def _model() -> ShardedDataParallel:
    return _model_of(build(n_blocks=2))


def _trained(rank: int, world_size: int) -> Any:
    model = _model()
    optim = make_optim(model.parameters())
    tokens, targets = (local(t, rank) for t in batch(0, world_size))
    lm_loss(model(tokens), targets).backward()
    optim.step()
    lm_loss(model(tokens), targets).backward()  # (gradients for clip and with_grads)
    return model, optim


def _bad(failing: bool, good: Any, bad: Any) -> Any:
    return bad if failing else good


# Each operation: (model, optimizer, whether this rank gets a bad argument) -> anything.
def _clip(model: Any, optim: Any, failing: bool) -> Any:
    return model.clip_grad_norm_(_bad(failing, 1.0, "one"))


def _optim_state_dict(model: Any, optim: Any, failing: bool) -> Any:
    return ShardedDataParallel.optim_state_dict(model, _bad(failing, optim, "not an optimizer"))


def _optim_state_dict_to_load(model: Any, optim: Any, failing: bool) -> Any:
    osd = ShardedDataParallel.optim_state_dict(model, optim)
    return ShardedDataParallel.optim_state_dict_to_load(model, _bad(failing, optim, "not an optimizer"), osd)


def _state_dict(model: Any, optim: Any, failing: bool) -> Any:
    with ShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return model.state_dict()


def _load_state_dict(model: Any, optim: Any, failing: bool) -> Any:
    state = model.state_dict()
    return model.load_state_dict(state, strict=_bad(failing, True, "yes"))


def _summon(model: Any, optim: Any, failing: bool) -> Any:
    with ShardedDataParallel.summon_full_params(model, writeback=_bad(failing, True, "yes")):
        pass


def _apply(model: Any, optim: Any, failing: bool) -> Any:
    def fn(module: nn.Module) -> None:
        if failing:
            raise ValueError("fn failed")

    return model.apply(fn)


def _full_optim_state_dict(model: Any, optim: Any, failing: bool) -> Any:
    return ShardedDataParallel.full_optim_state_dict(model, optim, optim_input=_bad(failing, None, [1]))


def _get_model_state_dict(model: Any, optim: Any, failing: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return flatshard.state_dict.get_model_state_dict(model, options=_bad(failing, StateDictOptions(full_state_dict=True), "full"))


def _set_optimizer_state_dict(model: Any, optim: Any, failing: bool) -> Any:
    osd = flatshard.state_dict.get_optimizer_state_dict(model, optim)
    return flatshard.state_dict.set_optimizer_state_dict(model, optim, _bad(failing, osd, "not a dict"))


OPERATIONS: Dict[str, Callable[[Any, Any, bool], Any]] = {
    "clip_grad_norm_": _clip,
    "optim_state_dict": _optim_state_dict,
    "optim_state_dict_to_load": _optim_state_dict_to_load,
    "state_dict": _state_dict,
    "load_state_dict": _load_state_dict,
    "summon_full_params": _summon,
    "apply": _apply,
    "full_optim_state_dict": _full_optim_state_dict,
    "get_model_state_dict": _get_model_state_dict,
    "set_optimizer_state_dict": _set_optimizer_state_dict,
}


def _one_rank_fails(rank: int, world_size: int, operation: str, fault: Optional[str], collective: int) -> Dict[str, Any]:
    """The last rank fails in ``operation``: with a bad argument (``fault`` None) or with
    ``fault`` injected before its ``collective``-th collective; the others call it as they
    should. Then every rank tries a training step: after a failure before the first
    collective they go on together."""
    model, optim = _trained(rank, world_size)
    failing = rank == world_size - 1
    run = OPERATIONS[operation]
    dist.barrier()
    started = time.monotonic()
    outcome: Dict[str, Any] = {"error": None}
    when: Dict[str, Any] = {}
    try:
        with fault_at(collective if failing and fault else None, fault or "error", when):
            run(model, optim, failing and fault is None)
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt included: that is the point
        outcome = {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - (when.get("at") or started)}
    try:
        tokens, targets = (local(t, rank) for t in batch(1, world_size))
        lm_loss(model(tokens), targets).backward()
        outcome["after"] = "trained on"
    except PeerFailedError as exc:
        outcome["after"] = f"{type(exc).__name__}"
    return outcome


class OneRankFailsTest(TestCase):
    def _run(self, world_size: int, operation: str, fault: Optional[str] = None, collective: int = 2) -> List[Dict[str, Any]]:
        outcomes = self.pool.run(_one_rank_fails, world_size, operation, fault, collective, timeout=120)
        for rank, outcome in enumerate(outcomes):
            self.assertIsNotNone(outcome["error"], f"{operation}: rank {rank} did not raise")
            self.assertLessEqual(outcome["seconds"], BOUND_S, f"{operation}: rank {rank}: {outcome}")
        return outcomes

    def test_a_bad_argument_on_one_rank_raises_on_every_rank_and_the_ranks_go_on(self) -> None:
        for operation in sorted(set(OPERATIONS) - {"state_dict"}):  # (state_dict() takes nothing to get wrong)
            with self.subTest(operation=operation):
                outcomes = self._run(2, operation)
                if operation == "set_optimizer_state_dict":  # (it checks the dict itself, and says so)
                    self.assertEqual(outcomes[0]["error"], "TypeError: set_optimizer_state_dict (on rank 1): optim_state_dict must be a dict; got str")
                elif operation == "apply":  # (the user's fn raised: on one rank, after the gather)
                    self.assertIn("PeerFailedError: [rank 0] rank 1 raised ValueError('fn failed') in apply() (call #", outcomes[0]["error"])
                else:
                    self.assertIn("CallFailedError: [rank 0] rank 1 raised ", outcomes[0]["error"])
                    self.assertIn("before its first collective: nothing was done, on any rank", outcomes[0]["error"])
                    self.assertEqual([o["after"] for o in outcomes], ["trained on", "trained on"])
                self.assertNotIn("CallFailedError", outcomes[1]["error"])  # (its own error)

    def test_the_message_names_the_rank_the_call_and_the_error(self) -> None:
        outcomes = self._run(3, "clip_grad_norm_")
        self.assertExpectedInline(
            "\n".join(o["error"] for o in outcomes),
            """\
CallFailedError: [rank 0] rank 2 raised TypeError("clip_grad_norm_: max_norm must be a real number; got 'one'") in clip_grad_norm_() before its first collective: nothing was done, on any rank
CallFailedError: [rank 1] rank 2 raised TypeError("clip_grad_norm_: max_norm must be a real number; got 'one'") in clip_grad_norm_() before its first collective: nothing was done, on any rank
TypeError: clip_grad_norm_: max_norm must be a real number; got 'one'""",
        )

    def test_an_error_after_the_first_collective_raises_on_every_rank_within_seconds(self) -> None:
        for operation in OPERATIONS:
            with self.subTest(operation=operation):
                outcomes = self._run(2, operation, "error")
                self.assertIn("PeerFailedError: [rank 0] rank 1 raised Injected('injected') in ", outcomes[0]["error"])
                self.assertEqual(outcomes[1]["error"], "Injected: injected")

    def test_a_keyboard_interrupt_or_an_os_error_on_one_rank_at_world_sizes_3_and_4(self) -> None:
        for world_size, fault in ((3, "interrupt"), (4, "oserror")):
            with self.subTest(world_size=world_size, fault=fault):
                outcomes = self._run(world_size, "optim_state_dict", fault)
                raised = "KeyboardInterrupt('injected')" if fault == "interrupt" else "OSError('[Errno 5] Input/output error (injected)')"
                for rank in range(world_size - 1):
                    self.assertIn(f"rank {world_size - 1} raised {raised} in optim_state_dict()", outcomes[rank]["error"])

    def test_a_failure_at_each_collective_of_a_call(self) -> None:
        # (clip's collectives: the entry check, taking the writes, the norm, the exit check)
        for collective in (1, 2, 3, 4):
            with self.subTest(collective=collective):
                outcomes = self._run(2, "clip_grad_norm_", "error", collective)
                self.assertIn("rank 1 raised Injected('injected') in clip_grad_norm_()", outcomes[0]["error"])


def _skips_backward(rank: int, world_size: int, inside_no_sync: bool, shared: bool) -> Dict[str, Any]:
    """A loss check raises on the last rank between forward and backward of step 2; it skips
    the batch. The others call backward."""
    with mock.patch.dict(os.environ, {ENV_SWITCH: "1" if shared else "0"}):
        model = _model()
        optim = make_optim(model.parameters())
        started = time.monotonic()
        try:
            for step in range(3):
                tokens, targets = (local(t, rank) for t in batch(step, world_size))
                with model.no_sync() if inside_no_sync else contextlib.nullcontext():
                    loss = lm_loss(model(tokens), targets)
                    if step == 1 and rank == world_size - 1:
                        started = time.monotonic()
                        continue  # (the loss was not finite: skip the batch)
                    if step == 1:
                        started = time.monotonic()
                    loss.backward()
                if not inside_no_sync:
                    optim.step()
                    optim.zero_grad()
            return {"error": None}
        except RuntimeError as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started}


class SkippedBackwardTest(TestCase):
    def test_a_rank_that_skips_a_backward_meets_the_others_in_a_check(self) -> None:
        cases = [(2, False, False), (2, False, True), (3, False, False), (4, False, False), (2, True, False), (3, True, False)]
        for world_size, inside_no_sync, shared in cases:
            with self.subTest(world_size=world_size, no_sync=inside_no_sync, shared=shared):
                outcomes = self.pool.run(_skips_backward, world_size, inside_no_sync, shared, timeout=120)
                for rank, outcome in enumerate(outcomes):
                    self.assertIsNotNone(outcome["error"], f"rank {rank} trained on")
                    self.assertLessEqual(outcome["seconds"], BOUND_S)
                    text = outcome["error"].replace(f"[rank {rank}]", "[rank r]")
                    self.assertIn("DivergedRanksError: [rank r] the ranks are at different places: rank 0 is at the start of its backward (call #", text)
                    self.assertIn(f"rank {world_size - 1} is at the start of its forward (call #", text)


def _step_fails(rank: int, world_size: int, where: str) -> Dict[str, Any]:
    """The last rank's optimizer step raises at step 2 (in a step pre-hook, or partway through
    the step after some parameters were updated); it catches the error and goes on."""
    model = _model()
    optim = make_optim(model.parameters())
    failing = rank == world_size - 1
    armed = {"on": False}

    def pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        if armed["on"] and where == "pre-hook":
            raise RuntimeError("pre-hook failed")

    optim.register_step_pre_hook(pre_hook)
    started = time.monotonic()
    try:
        for step in range(3):
            tokens, targets = (local(t, rank) for t in batch(step, world_size))
            lm_loss(model(tokens), targets).backward()
            armed["on"] = failing and step == 1
            try:
                if armed["on"] and where == "partway":
                    _step_partway(optim)
                else:
                    optim.step()
            except RuntimeError:
                pass  # "skip the bad step"
            armed["on"] = False
            optim.zero_grad()
            started = time.monotonic()
        return {"error": None}
    except RuntimeError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "step": step, "seconds": time.monotonic() - started}


def _step_partway(optim: torch.optim.Optimizer) -> None:
    """``optim.step()`` that runs out of memory after updating the first parameter (the step's
    pre-hooks have run, its post-hooks do not)."""
    first = optim.param_groups[0]["params"][0]
    real = torch.Tensor.addcdiv_
    calls = {"n": 0}

    def addcdiv_(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("out of memory (injected)")
        return real(self, *args, **kwargs)

    with mock.patch.object(torch.Tensor, "addcdiv_", addcdiv_):
        optim.step()
    del first


def _lbfgs(rank: int, world_size: int) -> List[float]:
    """LBFGS runs forward and backward inside its step (a closure): a step under way, not one
    that raised. (Its curvature estimates are dot products over each rank's shard, not the
    model, so it does not match one process: only that it runs is checked.)"""
    torch.manual_seed(0)
    model = _model()
    optim = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    losses = []
    for step in range(3):
        tokens, targets = (local(t, rank) for t in batch(step, world_size))

        def closure() -> torch.Tensor:
            optim.zero_grad()
            loss = lm_loss(model(tokens), targets)
            loss.backward()
            return loss

        losses.append(float(optim.step(closure).detach()))
    return losses


def _model_of(net: nn.Module) -> ShardedDataParallel:
    for i, block in enumerate(net.blocks):
        net.blocks[i] = ShardedDataParallel(block)
    return ShardedDataParallel(net)


class FailedStepTest(TestCase):
    def test_a_closure_inside_a_step_is_not_a_failed_step(self) -> None:
        for losses in self.pool.run(_lbfgs, 2, timeout=120):
            self.assertEqual(len(losses), 3)
            self.assertTrue(all(loss == loss for loss in losses), losses)

    def test_a_rank_whose_optimizer_step_failed_raises_on_every_rank_at_the_next_call(self) -> None:
        for where in ("pre-hook", "partway"):
            with self.subTest(where=where):
                outcomes = self.pool.run(_step_fails, 2, where, timeout=120)
                for rank, outcome in enumerate(outcomes):
                    self.assertEqual(outcome["step"], 2, outcome)
                    self.assertLessEqual(outcome["seconds"], BOUND_S)
                    self.assertExpectedInline(
                        outcome["error"].replace(f"[rank {rank}]", "[rank r]"),
                        """CallFailedError: [rank r] rank 1 failed an optimizer step on this model (optimizer.step() raised after flatshard's step pre-hook ran, before the step completed): its parameters or optimizer state may differ from the other ranks' from then on, so the ranks cannot go on together; load the model's and the optimizer's state from a checkpoint on every rank""",
                    )


def test_no_collective_bypasses_the_guard() -> None:
    """Only flatshard/_comm/_collectives.py calls torch.distributed's collectives, and a
    communicator that belongs to no guard refuses to issue one: a new call site either goes
    through a guarded call or fails the first test that reaches it."""
    collectives = {
        "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all", "all_to_all_single",
        "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter",
        "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "recv", "monitored_barrier",
    }
    offenders = []
    for path in sorted((ROOT / "flatshard").rglob("*.py")):
        if path.name == "_collectives.py" and path.parent.name == "_comm":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in collectives and isinstance(node.value, ast.Name) and node.value.id == "dist":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} dist.{node.attr}")
    assert offenders == [], offenders


def _unguarded(rank: int, world_size: int) -> List[str]:
    from flatshard._comm._collectives import Communicator

    model = _model()
    texts = []
    try:
        Communicator(dist.group.WORLD).all_reduce(torch.zeros(1))
    except AssertionError as exc:
        texts.append(str(exc))
    try:
        model.handles[0].unshard()
    except AssertionError as exc:
        texts.append(str(exc))
    return texts


class UnguardedTest(TestCase):
    def test_a_collective_outside_a_guarded_call_is_refused(self) -> None:
        texts = self.pool.run(_unguarded, 2)[0]
        self.assertExpectedInline(
            "\n".join(texts),
            """\
[rank 0] flatshard issued a collective (all_reduce (the root)) through a communicator that belongs to no guard: every flatshard operation that communicates must run as a call of its Guard ([Note: one guarded path])
[rank 0] flatshard issued a collective (all_gather (the root unit)) outside any guarded call: every flatshard operation that communicates must run as a call of its Guard ([Note: one guarded path])""",
        )


def _checkpoint_fails(rank: int, world_size: int, directory: str, case: str) -> Dict[str, Any]:
    """A ``RunCheckpoints.save`` that fails on one rank: a ``rank_state`` that cannot be pickled
    (last rank), the checkpoint's directory a file there (last rank), the manifest's fsync failing
    with EIO (rank 0). Then every rank saves again and resumes: the process group is usable and
    the newest complete checkpoint loads."""
    from flatshard import RunCheckpoints

    model, optim = _trained(rank, world_size)
    runs = RunCheckpoints(directory, model, optim)
    runs.save(1, rank_state={"rank": rank})
    failing = rank == (0 if case == "eio" else world_size - 1)
    rank_state: Any = {"rank": rank}
    patches: Any = contextlib.nullcontext()
    if failing and case == "unpicklable":
        rank_state = {"rng": lambda: rank}
    elif failing and case == "file":
        real = os.makedirs

        def makedirs(path: str, *args: Any, **kwargs: Any) -> None:
            if os.path.basename(path).startswith(".partial-"):
                raise NotADirectoryError(20, "Not a directory", path)
            real(path, *args, **kwargs)

        patches = mock.patch("flatshard.run_checkpoints.os.makedirs", makedirs)
    elif failing and case == "eio":
        real_fsync = os.fsync

        def fsync(fd: int) -> None:  # (the manifest's only: torch.distributed.checkpoint's own succeed)
            if os.readlink(f"/proc/self/fd/{fd}").endswith("flatshard-checkpoint.json"):
                raise OSError(5, "Input/output error")
            real_fsync(fd)

        patches = mock.patch("os.fsync", fsync)
    dist.barrier()
    started = time.monotonic()
    outcome: Dict[str, Any] = {}
    try:
        with patches:
            runs.save(2, rank_state=rank_state)
        outcome["error"] = None
    except Exception as exc:  # noqa: BLE001
        outcome.update(error=f"{type(exc).__name__}: {exc}".replace(directory, "<dir>"), seconds=time.monotonic() - started)
    resumed = runs.resume()
    outcome["resumed"] = resumed.step if resumed is not None else None
    runs.save(3)
    outcome["after"] = runs.resume().step  # type: ignore[union-attr]
    return outcome


def _pretrained_interrupted(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """``load_pretrained`` interrupted (``KeyboardInterrupt``) on the last rank while it reads."""
    from flatshard import load_pretrained
    from flatshard._readers._safetensors import SafetensorsReader

    model, _ = _trained(rank, world_size)
    real = SafetensorsReader.read
    when: Dict[str, float] = {}

    def read(self: Any, pieces: Any) -> None:
        if rank == world_size - 1:
            when["at"] = time.monotonic()
            raise KeyboardInterrupt("interrupted")
        real(self, pieces)

    started = time.monotonic()
    try:
        with mock.patch.object(SafetensorsReader, "read", read):
            load_pretrained(model, path)
        return {"error": None}
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt included
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - when.get("at", started)}


class CheckpointFailsTest(TestCase):
    def test_a_save_that_fails_on_one_rank_raises_on_every_rank_and_the_run_goes_on(self) -> None:
        import tempfile

        expected = {
            "unpicklable": "RunCheckpoints.save: rank 1 could not pickle its state or prepare the directory (see its error)",
            "file": "RunCheckpoints.save: rank 1 could not make <dir>/.partial-step-00000002 (see its error)",
            "eio": "RunCheckpoints.save: rank 0 could not publish the checkpoint (nothing was published, or it was and is complete) (see its error)",
        }
        for case, text in expected.items():
            with self.subTest(case=case), tempfile.TemporaryDirectory() as directory:
                outcomes = self.pool.run(_checkpoint_fails, 2, directory, case, timeout=120)
                failing = 0 if case == "eio" else 1
                for rank, outcome in enumerate(outcomes):
                    self.assertLessEqual(outcome["seconds"], BOUND_S)
                    if rank != failing:
                        self.assertEqual(outcome["error"], f"RuntimeError: [rank {rank}] {text}")
                    self.assertEqual((outcome["resumed"], outcome["after"]), (1, 3), outcome)
                own = {"unpicklable": "Can't pickle local object", "file": "NotADirectoryError: [Errno 20] Not a directory", "eio": "OSError: [Errno 5] Input/output error"}
                self.assertIn(own[case], outcomes[failing]["error"])

    def test_a_keyboard_interrupt_in_load_pretrained_on_one_rank(self) -> None:
        import tempfile

        from flatshard._readers._safetensors import write_safetensors

        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "model.safetensors")
            write_safetensors(path, {k: v.contiguous() for k, v in build(n_blocks=2).state_dict().items()})
            outcomes = self.pool.run(_pretrained_interrupted, 3, path, timeout=120)
        self.assertEqual(outcomes[2]["error"], "KeyboardInterrupt: interrupted")
        for rank in (0, 1):
            self.assertLessEqual(outcomes[rank]["seconds"], BOUND_S)
            self.assertIn(f"PeerFailedError: [rank {rank}] rank 2 raised KeyboardInterrupt('interrupted') in load_pretrained() (call #", outcomes[rank]["error"])


def _every_call_closes(rank: int, world_size: int) -> List[Any]:
    """Operations nested in others (apply's summon) and failed ones leave no call open behind
    them (a call left open would take every later one for part of it: no checks, no records)."""
    from flatshard._engine._unit import root_guard

    model, optim = _trained(rank, world_size)
    guard = root_guard(model._unit)
    seen = []
    steps: List[Callable[[], Any]] = [
        lambda: model.apply(lambda m: None),
        lambda: ShardedDataParallel.optim_state_dict(model, optim),
        lambda: model.clip_grad_norm_(1.0),
        lambda: OPERATIONS["summon_full_params"](model, optim, False),
        lambda: model.clip_grad_norm_("bad"),  # (raised together)
    ]
    for step in steps:
        try:
            step()
        except TypeError:
            pass
        seen.append((guard.depth, guard.entry.name))
    return seen


class EveryCallClosesTest(TestCase):
    def test_no_call_stays_open(self) -> None:
        for seen in self.pool.run(_every_call_closes, 2, timeout=120):
            self.assertEqual(seen, [(0, "CLOSED")] * 5)


def test_a_call_inside_a_call_of_the_same_guard_closes_with_it() -> None:
    """A call made inside another call of the same guard is part of it, and leaves the guard
    closed once the outer one ends -- also when it raises (``RunCheckpoints.resume`` calls
    ``latest``: a guard left open would take every later call for part of that one, with no
    entry check and no record when it fails)."""
    from flatshard._comm._guard import EntryState, Guard

    guard = Guard(None, [], torch.device("cpu"), live=False)
    with guard.call("outer()"):
        with guard.call("inner()"):
            pass
        assert (guard.depth, guard.name) == (1, "outer()")
    assert (guard.depth, guard.name, guard.entry) == (0, None, EntryState.CLOSED)
    try:
        with guard.call("outer()"):
            with guard.call("inner()"):
                raise ValueError("inner failed")
    except ValueError:
        pass
    assert (guard.depth, guard.name, guard.entry) == (0, None, EntryState.CLOSED)

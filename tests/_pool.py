"""A pool of long-lived rank processes for multi-rank tests.

Spawning a process and importing torch costs seconds, so the pool starts its workers once per
test session. Each task runs ``fn(rank, world_size, *args)`` on workers ``0..world_size-1``
inside a fresh process group (gloo unless asked otherwise) (file:// rendezvous: no ports to race for), which is
destroyed afterwards. A rank's exception is re-raised in the test process with the rank's
traceback attached; ranks that do not answer in time are killed and replaced, and the test
fails instead of hanging.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional

MAX_WORLD_SIZE = 4
COLLECTIVE_TIMEOUT_S = 60
# For tests that leave a rank with a collective that never completes (a peer raised): a failure
# is heard within about a second, so HEARD_WITHIN_S bounds it, and the groups' timeout stays
# above that bound, so that a failure heard only at the timeout fails it. The timeout is short
# because the pool's destroy of such a group waits it out (19 s of each such test with 20 s).
HEARD_WITHIN_S = 6.0
STUCK_GROUP_TIMEOUT = timedelta(seconds=8)

# [Note: a group made is a group every rank has finished making] A gloo group is connected
# pair by pair while it is made, and one side of a pair can be done before the other has read
# its last handshake. Unless ``TORCH_DIST_INIT_BARRIER=1``, neither ``init_process_group`` nor
# ``new_group`` waits for the other ranks afterwards, so a rank whose task ends
# just after making a group (``new_group([0, 1])`` on ranks 0 and 1, then ``return`` on rank 0)
# destroys its side while rank 1 is still connecting, and rank 1 raises "Gloo connectFullMesh
# failed ... Connection closed by peer" (about 3 tasks in 100 on a 2-core machine). The workers
# turn that barrier on, so every group of every task, and the task's own world, is made by all
# ranks before any of them goes on.
INIT_BARRIER = ("TORCH_DIST_INIT_BARRIER", "1")


class RankFailure(AssertionError):
    """A rank raised an exception that could not be re-raised as itself."""


def _worker(index: int, tasks: "mp.Queue[Any]", results: "mp.Queue[Any]") -> None:
    os.environ[INIT_BARRIER[0]] = INIT_BARRIER[1]  # (before torch reads it; see the Note above)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    while True:
        task = tasks.get()
        if task is None:
            gc.collect()  # finished models go before interpreter exit (gloo can abort there)
            return
        task_id, fn, world_size, backend, init_file, args, kwargs = task
        try:
            if backend == "nccl":
                torch.cuda.set_device(index)
            dist.init_process_group(
                backend,
                init_method=f"file://{init_file}",
                rank=index,
                world_size=world_size,
                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
            )
        except Exception:  # noqa: BLE001 - a peer process is gone: the pool restarts and retries
            results.put((task_id, index, (None, traceback.format_exc())))
            continue
        try:
            torch.manual_seed(1234 + index)  # tests seed what they compare; this only decorrelates
            outcome = (True, fn(index, world_size, *args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the test
            text = traceback.format_exc()
            try:
                pickle.dumps(exc)
                outcome = (False, (exc, text))
            except Exception:  # noqa: BLE001
                outcome = (False, (RankFailure(f"{type(exc).__name__}: {exc}"), text))
        finally:
            broken = False
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - e.g. a group left with a collective that never completed
                    broken = True
        results.put((task_id, index, outcome))
        if broken:
            return  # (this process's gloo state is suspect: the pool starts a fresh worker)


def _as_failure(value: Any) -> Any:
    """(exception, traceback text) of a failed outcome; a failed rendezvous gives a text only."""
    if isinstance(value, str):
        return RankFailure("the process group could not be formed"), value
    return value


class RankPool:
    """Runs a function on ``world_size`` ranks at a time; see the module docstring."""

    def __init__(self, size: int = MAX_WORLD_SIZE) -> None:
        self._ctx = mp.get_context("spawn")
        self._size = size
        self._results: "mp.Queue[Any]" = self._ctx.Queue()
        self._workers: List[Optional[Any]] = [None] * size
        self._tasks: List[Optional["mp.Queue[Any]"]] = [None] * size
        self._dir = tempfile.mkdtemp(prefix="flatshard-pool-")
        self._next_task = 0

    def _ensure(self, index: int) -> None:
        worker = self._workers[index]
        if worker is not None and worker.is_alive():
            return
        tasks = self._ctx.Queue()
        worker = self._ctx.Process(target=_worker, args=(index, tasks, self._results), daemon=True)
        worker.start()
        self._workers[index], self._tasks[index] = worker, tasks

    def _replace(self, index: int) -> None:
        worker = self._workers[index]
        if worker is not None:
            worker.kill()
            worker.join()
        self._workers[index] = None
        self._ensure(index)

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *args: Any,
        timeout: float = 180.0,
        backend: str = "gloo",
        **kwargs: Any,
    ) -> List[Any]:
        """``[fn(rank, world_size, *args, **kwargs) for each rank]``, computed by the ranks
        (rank ``r`` uses CUDA device ``r`` when ``backend`` is nccl).

        If the process group cannot even be formed (a worker died after its previous task,
        e.g. torch's gloo aborting while tearing down old objects), the workers are replaced
        and the task runs once more; failures inside the task are never retried.
        """
        if not 1 <= world_size <= self._size:
            raise ValueError(f"world_size must be in 1..{self._size}; got {world_size}")
        outcomes = self._attempt(fn, world_size, backend, args, kwargs, timeout)
        if any(ok is None for ok, _ in outcomes.values()):
            for index in range(world_size):
                self._replace(index)
            outcomes = self._attempt(fn, world_size, backend, args, kwargs, timeout)
        failures = [(rank, _as_failure(outcomes[rank][1])) for rank in range(world_size) if rank in outcomes and not outcomes[rank][0]]
        missing = [rank for rank in range(world_size) if rank not in outcomes]
        if failures:
            rank, (exc, text) = failures[0]
            others = "".join(f"\n--- rank {r} also failed:\n{t}" for r, (_, t) in failures[1:])
            note = f"--- raised on rank {rank} of {world_size}:\n{text}{others}"
            if missing:
                note += f"\n--- ranks {missing} did not finish (killed)"
            exc.add_note(note)
            raise exc
        if missing:
            raise TimeoutError(f"{getattr(fn, '__name__', fn)}: ranks {missing} of {world_size} did not finish within {timeout}s (killed)")
        return [outcomes[rank][1] for rank in range(world_size)]

    def _attempt(self, fn: Callable[..., Any], world_size: int, backend: str, args: Any, kwargs: Any, timeout: float) -> dict:
        for index in range(world_size):
            self._ensure(index)
        self._next_task += 1
        task_id = self._next_task
        init_file = os.path.join(self._dir, f"rendezvous-{task_id}")
        for index in range(world_size):
            self._tasks[index].put((task_id, fn, world_size, backend, init_file, args, kwargs))  # type: ignore[union-attr]
        return self._collect(task_id, world_size, timeout)

    def _collect(self, task_id: int, world_size: int, timeout: float) -> dict:
        outcomes: dict = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < world_size and time.monotonic() < deadline:
            # Once a rank failed, the others may be stuck in a collective it skipped.
            if any(not ok for ok, _ in outcomes.values()):
                deadline = min(deadline, time.monotonic() + 10.0)
            try:
                got_id, index, outcome = self._results.get(timeout=1.0)
            except queue.Empty:
                self._note_dead(outcomes, world_size)
                continue
            if got_id == task_id:
                outcomes[index] = outcome
        for index in range(world_size):
            if index not in outcomes or not self._workers[index].is_alive():  # type: ignore[union-attr]
                self._replace(index)
        return outcomes

    def _note_dead(self, outcomes: dict, world_size: int) -> None:
        """A rank process that died (e.g. a segfault) reports as a failure at once."""
        for index in range(world_size):
            worker = self._workers[index]
            if index not in outcomes and worker is not None and not worker.is_alive():
                code = worker.exitcode
                why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                outcomes[index] = (False, (RankFailure(f"rank {index} died ({why})"), f"rank {index} died ({why})\n"))

    def close(self) -> None:
        for index, worker in enumerate(self._workers):
            if worker is not None and worker.is_alive():
                self._tasks[index].put(None)  # type: ignore[union-attr]
        for worker in self._workers:
            if worker is not None:
                worker.join(timeout=10)
                if worker.is_alive():
                    worker.kill()

"""A job that did all its work exits 0: a DCP save at 2 ranks and a load at 3 ranks
(``tests/_exit_flow.py``), each rank ending with ``flatshard.destroy_process_group()`` (which
must free the default group), run while other processes keep the cores busy.

``FLATSHARD_EXIT_RUNS=200 python -m pytest tests/test_clean_exit.py`` runs the stress version
(default: 1 run); ``FLATSHARD_EXIT_BURNERS`` sets how many busy processes run beside it
(default 2; 0 when something else loads the machine, e.g. the test suite). Every run's two jobs must exit 0; a rank killed by a signal at teardown (for
example, gloo's "terminate called without an active exception") fails the test and shows the
job's output.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = int(os.environ.get("FLATSHARD_EXIT_RUNS", "1"))
BURNERS = int(os.environ.get("FLATSHARD_EXIT_BURNERS", "2"))  # (0: the load comes from elsewhere)


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_save_at_two_ranks_load_at_three_exits_cleanly_under_load(tmp_path):
    burners = [multiprocessing.get_context("spawn").Process(target=_burn, args=(30.0 * RUNS + 60,), daemon=True) for _ in range(BURNERS)]
    for burner in burners:
        burner.start()
    abnormal = []
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        for run in range(RUNS):
            checkpoint = tmp_path / f"run{run}"
            for world, mode in ((2, "save"), (3, "load")):
                done = subprocess.run([sys.executable, "-m", "tests._exit_flow", str(world), mode, str(checkpoint)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
                if done.returncode != 0:
                    abnormal.append(f"run {run}, {mode} at {world} ranks: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
            if RUNS > 1:  # (the stress version's progress, with -s)
                print(f"clean exit: run {run + 1}/{RUNS}, abnormal exits so far: {len(abnormal)}", file=sys.stderr, flush=True)
    finally:
        for burner in burners:
            burner.terminate()
            burner.join()
    assert not abnormal, f"{len(abnormal)} abnormal exits in {RUNS} runs:\n" + "\n".join(abnormal)

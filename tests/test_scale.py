"""Thousands of ranks, simulated: one process runs as rank 0 or the last rank of a world of up to
4096 on torch's fake process group ([Note: the fake process group] in ``flatshard/_comm/_collectives``),
through ``tests/_scale_run.py`` (construction on the meta device, training, every state dict and
optimizer state dict saved and loaded back; each phase's peak memory against torch FSDP1's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest

ROOT = Path(__file__).resolve().parents[1]
_RUNS = [(8, 7), (4096, 4095), (4096, 0)]


def _rank_of_a_large_world(world: int, rank: int, *mode: str) -> Dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "tests._scale_run", str(world), str(rank), *mode],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    line = next((l for l in out.stdout.splitlines() if l.startswith("{")), None)
    assert out.returncode == 0 and line is not None, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(line)


@pytest.fixture(scope="module")
def runs() -> Dict[Any, Dict[str, Any]]:
    return {run: _rank_of_a_large_world(*run) for run in _RUNS}


def test_every_state_dict_saves_and_loads_back_at_any_world_size(runs):
    for (world, rank), result in runs.items():
        outcomes = result["outcomes"]
        for name, outcome in outcomes.items():
            if name.endswith("keys") or name in ("rank0_only optimizer load", "broadcast_from_rank0"):
                continue
            assert outcome == "ok", (world, rank, name, outcome)
        assert (outcomes["FULL_STATE_DICT keys"], outcomes["SHARDED_STATE_DICT keys"]) == ("26", "26"), outcomes


def test_what_needs_the_first_ranks_data_works_there_and_says_why_not_elsewhere(runs):
    # a fake group exchanges nothing: a rank that would receive rank 0's broadcast raises
    for (world, rank), result in runs.items():
        outcomes = result["outcomes"]
        for name in ("rank0_only optimizer load", "broadcast_from_rank0"):
            if rank == 0:
                assert outcomes[name] == "ok", (world, name, outcomes[name])
            else:
                assert outcomes[name] == (
                    f"RuntimeError: [rank {rank}] this step needs data that only the group's first rank has (an "
                    f"object it broadcasts), and torch's fake process group exchanges no data: it runs one process "
                    f"as one rank of {world}. Measure this step on rank 0, or on a real process group"
                ), outcomes[name]


def test_every_step_does_the_same_work_at_every_world_size(runs):
    # flatshard's own Python calls per training step, the first (lazy initialisation, the
    # construction check) and a later one: no check, list or loop grows with N
    for key in ("first_step_calls", "calls_per_step"):
        calls = {run: result[key] for run, result in runs.items()}
        assert len(set(calls.values())) == 1, (key, calls)


def test_between_steps_a_rank_holds_its_shards_and_optimizer_state_only(runs):
    # every byte still allocated after training (zero_grad(set_to_none=True)) counted from
    # before construction: the shards and AdamW's moments, plus AdamW's 4-byte step counts
    for (world, rank), result in runs.items():
        extra = result["resting"] - result["shards_and_state"]
        assert 0 <= extra <= 4 * 32, (world, rank, result["resting"], result["shards_and_state"])


@pytest.mark.parametrize("world", [8, 512])
def test_a_ranks_peak_memory_is_at_most_fsdp1s(world):
    # each phase of a training step, flatshard's peak against torch FSDP1's on the same rank
    # (the fake process group: FSDP1's streams keep nothing in flight there)
    out = subprocess.run(
        [sys.executable, "-m", "tests._scale_run", str(world), str(world - 1), "--peaks"],
        cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300, check=False,
    )
    line = next((l for l in out.stdout.splitlines() if l.startswith("{")), None)
    assert out.returncode == 0 and line is not None, out.stdout[-2000:] + out.stderr[-4000:]
    peaks = json.loads(line)
    block = peaks["block"]["bytes"]
    for phase, fsdp1 in peaks["fsdp1"].items():
        # without overlap: FSDP1's peak in every phase
        assert peaks["flatshard without overlap"][phase] <= 1.02 * fsdp1, (phase, peaks)
        # with overlap (the default): at most one block more, gathered ahead in the forward or
        # a full gradient in flight in the backward ([Note: overlap]); no more in the step
        extra = block if phase in ("forward", "backward") else 0
        assert peaks["flatshard"][phase] <= 1.02 * fsdp1 + extra, (phase, peaks)
    assert peaks["flatshard"]["backward"] > peaks["flatshard without overlap"]["backward"], peaks  # (one in flight)


@pytest.mark.parametrize("form", ["safetensors", "dcp"])
def test_loading_a_pretrained_checkpoint_holds_the_shards_and_one_saved_chunk(form, tmp_path):
    # load_pretrained into a meta-built model at up to 4096 ranks: every shard right, and the
    # bytes allocated while loading, beyond the shards: safetensors of the shards' dtype
    # nothing (but the rank-agreement check's N integers); DCP about two saved chunks (one
    # whole parameter each here: the checkpoint was saved by one process)
    from flatshard._readers._safetensors import write_safetensors
    from tests._models import dcp_save_in_one_process
    from tests._scale_run import source

    values = source().state_dict()
    path = str(tmp_path / "model.safetensors") if form == "safetensors" else str(tmp_path / "dcp")
    if form == "safetensors":
        write_safetensors(path, values)
    else:
        dcp_save_in_one_process(dict(values), path)
    for world, rank in [(8, 7), (4096, 0), (4096, 4095)]:
        result = _rank_of_a_large_world(world, rank, "--load", path)
        assert result["wrong"] == [], (world, rank, result)
        bookkeeping = 8 * world + 4096
        allowed = bookkeeping if form == "safetensors" else bookkeeping + 2 * result["largest_parameter"]
        assert result["peak_above_start"] <= allowed, (form, world, rank, result)

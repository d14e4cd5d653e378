"""``bench/gpu_check.sh --dry-run``: the GPU check's script runs its steps on CPU at tiny size
(tests collected, not run), so it cannot rot between the times a GPU is available. Its network
part runs the simulated network's self-check in its CPU form (accounting only) and trains
flatshard, FSDP1 and FSDP2 over ``bench/simnet.py``'s group, world size 8 as rank 0, on every
network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NETWORK_IMPLS = ("flatshard", "fsdp1", "fsdp2")


def test_gpu_check_dry_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # (python3 is this one)
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (tmp_path / "summary.md").read_text()
    for impl in ("flatshard", "fsdp1", "fsdp2", "plain"):
        assert f"| {impl} |" in summary, summary  # (the median of its two rounds, both listed)
    assert "tests collected" in summary, summary
    assert "Profile of one flatshard step: units = 3" in summary, summary
    parts = ["tests", "profile", "network_check", "network"] + [f"throughput_{impl}_r{r}" for impl in ("flatshard", "fsdp1", "fsdp2", "plain") for r in (0, 1)]
    for part in parts:
        assert f"| {part} | ok |" in summary, summary
    assert "Simulated network: simulated network self-check on cpu (accounting only, no kernels): ok" in summary, summary
    for network in ("none", "nvlink", "ib"):
        for impl in NETWORK_IMPLS:
            assert f"| {network} | {impl} |" in summary, summary
    _check_network_runs(tmp_path)


def _check_network_runs(out: Path) -> None:
    """Each implementation's last step over each simulated network: all-gathers and
    reduce-scatters, counted on the CPU (the model's device) at the model's time, and the same
    collectives on both networks (only their time differs)."""
    for impl in NETWORK_IMPLS:
        runs = {net: json.loads((out / f"network_{impl}_{net}.json").read_text()) for net in ("none", "nvlink", "ib")}
        assert runs["none"]["collectives"] == {} and runs["none"]["comm_modelled_s"] == 0.0, runs["none"]
        counted = {net: {kind: entry[:2] for kind, entry in runs[net]["collectives"].items()} for net in ("nvlink", "ib")}
        assert counted["nvlink"] == counted["ib"], counted
        assert {"cpu:all_gather", "cpu:reduce_scatter"} <= set(counted["ib"]), (impl, counted)
        for net, bandwidth in (("nvlink", 360e9), ("ib", 45e9)):
            run = runs[net]
            assert run["world"] == 8 and run["bus_bandwidth_gbps"] == bandwidth / 1e9, run
            assert run["comm_modelled_s"] > 0, run
            for kind, (count, nbytes, seconds) in run["collectives"].items():
                factor = {"cpu:all_gather": 1, "cpu:reduce_scatter": 1, "cpu:all_reduce": 2}[kind]  # (the all-reduce: 2x)
                assert abs(seconds - factor * (count * 20e-6 + nbytes * 7 / 8 / bandwidth)) < 1e-12, (impl, net, kind, run["collectives"])

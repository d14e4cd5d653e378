"""``bench/gpu_check.sh --dry-run``: the GPU check's script runs its steps on CPU at tiny size
(tests collected, not run), so it cannot rot between the times a GPU is available."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    parts = ["tests", "profile"] + [f"throughput_{impl}_r{r}" for impl in ("flatshard", "fsdp1", "fsdp2", "plain") for r in (0, 1)]
    for part in parts:
        assert f"| {part} | ok |" in summary, summary

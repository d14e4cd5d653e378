"""Two "nodes" on one host, as users run many: two ``torchrun`` launchers, ``--nnodes 2
--nproc-per-node 2``, meeting through a c10d rendezvous on 127.0.0.1, run
``examples/train_gpt.py`` unchanged. With ``--strategy HYBRID_SHARD`` each unit shards within a
"node" (the launcher's ``LOCAL_WORLD_SIZE``) and replicates across them; the trained model, which
rank 0 writes as one plain state dict, equals single-process training on the four ranks'
concatenated batches; so does ``_HYBRID_SHARD_ZERO2``, and ``FULL_SHARD`` across the four ranks
(about ten seconds each on two cores). The suite runs ``HYBRID_SHARD``, the one whose groups
follow the launchers; ``FLATSHARD_MULTINODE_ALL=1`` runs all three."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "train_gpt.py")
NODES, PER_NODE, STEPS = 2, 2, 3
SHAPE = {"layers": 2, "dim": 32, "heads": 4, "seq": 16, "batch": 2, "vocab": 64}
STRATEGIES = ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "FULL_SHARD"]
ALL = bool(os.environ.get("FLATSHARD_MULTINODE_ALL"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_launchers(strategy: str, full: Path) -> List[str]:
    """Run the example on two launchers of two ranks each; their outputs."""
    port = free_port()
    flags = [f"--{k}={v}" for k, v in SHAPE.items()]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [
        subprocess.Popen(
            [
                sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--nproc-per-node={PER_NODE}",
                f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=flatshard-two-nodes",
                EXAMPLE, f"--steps={STEPS}", "--log-every=1", f"--strategy={strategy}", f"--full-checkpoint={full}", "--timeout=60", *flags,
            ],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in range(NODES)
    ]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()  # (torchrun stops its workers, which run in sessions of their own)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    assert all(p.returncode == 0 for p in procs), "\n\n".join(outs)[-6000:]
    return outs


def single_process(steps: int, ranks_at: Callable[[int], int]) -> Dict[str, torch.Tensor]:
    """The example's model and loss in one process, each step on the batches of the ranks that
    ran it (``ranks_at(step)`` of them, concatenated)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_gpt as example
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    model = example.GPT(SHAPE["vocab"], SHAPE["dim"], SHAPE["layers"], SHAPE["heads"], SHAPE["seq"])
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(1, steps + 1):
        tokens = torch.cat([example.markov_batch(step, r, SHAPE["batch"], SHAPE["seq"], SHAPE["vocab"]) for r in range(ranks_at(step))])
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def assert_trained_as(trained: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], steps: int, where: str) -> None:
    """``trained`` holds ``expected``'s values, up to the reduction order."""
    dim = SHAPE["dim"]
    for key, value in expected.items():
        got = trained[key]
        if key.endswith("attn.qkv.bias"):
            # The key bias's gradient is exactly zero in exact arithmetic (softmax ignores a
            # shift of all scores), so AdamW turns rounding noise into steps of up to lr in
            # either direction: it is held to lr × steps; the query and value biases as the rest.
            torch.testing.assert_close(got[dim : 2 * dim], value[dim : 2 * dim], rtol=0, atol=3e-3 * steps)
            got, value = torch.cat([got[:dim], got[2 * dim :]]), torch.cat([value[:dim], value[2 * dim :]])
        torch.testing.assert_close(got, value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{where}: {key}: {m}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_nodes_under_torchrun_train_as_one_process(strategy: str, tmp_path: Path) -> None:
    if strategy != "HYBRID_SHARD" and not ALL:
        pytest.skip(f"{strategy} over two launchers runs with FLATSHARD_MULTINODE_ALL=1 (the suite's time)")
    full = tmp_path / "model.pt"
    outs = _two_launchers(strategy, full)
    header = next(line for out in outs for line in out.splitlines() if " ranks, " in line)
    assert header.startswith("4 ranks, ") and strategy in header, header
    trained = torch.load(full, weights_only=True)
    expected = single_process(STEPS, lambda step: NODES * PER_NODE)
    assert list(trained) == list(expected)
    assert_trained_as(trained, expected, STEPS, strategy)

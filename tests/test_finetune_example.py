"""examples/finetune_frozen.py: adapters train inside frozen units, the base stays put, and the
saved file holds exactly the adapters, loadable into the plain model."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "finetune_frozen.py"
SMALL = ["--steps", "8", "--log-every", "1", "--layers", "2", "--dim", "32", "--rank", "4", "--seq", "16", "--check"]


def _load_example():
    spec = importlib.util.spec_from_file_location("finetune_frozen", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_finetune_trains_only_the_adapters_and_saves_them(tmp_path):
    out_file = tmp_path / "adapters.pt"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, str(EXAMPLE), *SMALL, "--out", str(out_file)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.startswith("2 ranks, "), out
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 8 and losses[-1] < losses[0] and sum(losses[-3:]) < sum(losses[:3]), out
    assert "frozen weights unchanged" in out

    example = _load_example()
    model = example.build_model(example.parse_args(SMALL))
    adapters = torch.load(out_file)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".adapter." in n for n in trainable)
    assert set(adapters) == trainable

    tokens = example.markov_batch(99, 0, 8, 16, 64)
    with torch.no_grad():
        before = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    result = model.load_state_dict(adapters, strict=False)
    assert result.unexpected_keys == []
    assert set(result.missing_keys) == set(model.state_dict()) - trainable
    for name, p in model.named_parameters():
        if name in adapters:
            assert torch.equal(p.detach(), adapters[name])
    with torch.no_grad():  # the saved adapters are the trained ones: the plain model improves too
        after = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    assert after < before

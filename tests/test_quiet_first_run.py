"""On a machine without NumPy the main example and ``python -m flatshard.plan`` print
no warnings.

torch warns at import when NumPy is missing ("Failed to initialize NumPy: No module named
'numpy'"), though neither flatshard nor the example needs NumPy. These tests hide NumPy even where
it is installed (the test extra installs it): a directory put first on PYTHONPATH holds a ``numpy``
package whose import fails exactly as a missing one does, in the process and in every rank it
starts.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "train_gpt.py")
SMALL = ["--steps", "2", "--log-every", "1", "--layers", "1", "--dim", "32"]
NUMPY_WARNING = "Failed to initialize NumPy: No module named 'numpy'"


@pytest.fixture
def no_numpy_env(tmp_path):
    fake = tmp_path / "no_numpy" / "numpy"
    fake.mkdir(parents=True)
    # torch catches ModuleNotFoundError where it imports NumPy optionally, as for a missing one.
    (fake / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'numpy\'", name="numpy")\n')
    path = os.pathsep.join([str(fake.parent), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path)


def _run(cmd, env):
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _warning_lines(stderr):
    return [line for line in stderr.splitlines() if "warning" in line.lower()]


def test_without_numpy_torch_itself_warns(no_numpy_env):
    """The premise of the tests below: hiding NumPy makes torch's import warn. (If a torch
    release stops warning, this test fails and the filters for that warning can go.)"""
    done = _run([sys.executable, "-c", "import torch"], no_numpy_env)
    assert NUMPY_WARNING in done.stderr, done.stderr


def test_example_is_quiet_without_numpy(no_numpy_env):
    done = _run([sys.executable, EXAMPLE, *SMALL], no_numpy_env)
    assert "done: 2 steps" in done.stdout
    assert _warning_lines(done.stderr) == [], done.stderr


def test_example_under_torchrun_is_quiet_without_numpy(no_numpy_env):
    # The launcher is torch's own process and imports torch before the example exists; only its
    # warning is silenced (-W does not reach the ranks it starts), so any warning left is a rank's.
    # (-W cannot hold the message's colon; its message is a prefix.)
    launcher = [sys.executable, "-W", "ignore:Failed to initialize NumPy:UserWarning", "-m", "torch.distributed.run"]
    env = dict(no_numpy_env, OMP_NUM_THREADS="1")
    done = _run([*launcher, "--standalone", "--nproc-per-node", "2", EXAMPLE, *SMALL], env)
    assert "done: 2 steps" in done.stdout
    assert _warning_lines(done.stderr) == [], done.stderr


def test_python_m_flatshard_plan_is_quiet_without_numpy(no_numpy_env):
    cmd = [sys.executable, "-m", "flatshard.plan", "tests._models:sample_transformer", "--world-size", "3"]
    done = _run(cmd, no_numpy_env)
    assert done.stdout.startswith("flatshard plan: ")
    assert done.stderr == ""


def test_flatshards_filter_ends_with_its_import_of_torch(no_numpy_env):
    code = (
        "import warnings, flatshard\n"
        "left = [f for f in warnings.filters if f[1] is not None and 'NumPy' in f[1].pattern]\n"
        "assert left == [], left\n"
    )
    _run([sys.executable, "-c", code], no_numpy_env)

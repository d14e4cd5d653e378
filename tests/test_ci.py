"""CI runs exactly the README's two set-up commands, in a fresh virtual environment."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_section_bash_blocks():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^## Set-up\n(.*?)(?=^## )", readme, re.S | re.M).group(1)
    return [line for block in re.findall(r"^```bash\n(.*?)^```", section, re.S | re.M) for line in block.splitlines() if line]


def test_ci_runs_the_readme_commands_verbatim():
    done = subprocess.run(["bash", ".ci/run", "--print-commands"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    commands = done.stdout.splitlines()
    assert commands == _setup_section_bash_blocks()
    example, suite = commands
    assert example.endswith("python examples/train_gpt.py")
    assert suite.endswith("python -m pytest tests")
    # the Hugging Face tests (tests/test_hf.py) and the framework flows (tests/test_framework_*.py) run in CI too
    assert '".[test,hf,frameworks]"' in suite
    assert "torch==2.13.0" in suite  # on the same pip command: the hf extra keeps the CPU build


def test_ci_uses_a_fresh_environment_without_system_packages():
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^python3 -m venv ", script, re.M)
    assert "--system-site-packages" not in script


def test_the_changelog_has_each_kind_of_change_once_per_release():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    for release in re.split(r"^## ", text, flags=re.M)[1:]:
        kinds = re.findall(r"^### (\w+)$", release, re.M)
        assert len(kinds) == len(set(kinds)), (release.splitlines()[0], kinds)
        order = ["Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"]
        assert kinds == sorted(kinds, key=order.index), (release.splitlines()[0], kinds)

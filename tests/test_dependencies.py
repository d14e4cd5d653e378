"""Everything the library, tests, examples and benchmark import is declared in setup.py.

A module that only the developer's machine happens to have (numpy, once) must fail here, not on a
user's fresh machine. Every ``import`` / ``from ... import`` statement (also inside functions and
``try`` blocks) is read with ``ast`` and its top-level module must be the standard library, this
project, or a declared distribution:

- ``flatshard/``: ``INSTALL_REQUIRES`` only (the library depends on torch alone);
- ``tests/``: ``INSTALL_REQUIRES`` and the ``test`` extra; an import guarded by
  ``try: ... except ImportError`` (or ``pytest.importorskip``) may also come from another extra;
- ``examples/`` and ``bench/``: ``INSTALL_REQUIRES`` and any extra.

setup.py keeps its lists as literal module-level constants, read here without running setup.py.
"""

import ast
import re
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("flatshard", "tests", "examples", "bench")

# Distributions whose import names differ from their normalized distribution name.
IMPORT_NAMES: Dict[str, Set[str]] = {
    "pytest": {"pytest", "_pytest"},
    "pyyaml": {"yaml"},
    "pillow": {"PIL"},
    "scikit-learn": {"sklearn"},
}
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError"}


def declared() -> Tuple[List[str], Dict[str, List[str]]]:
    """``INSTALL_REQUIRES`` and ``EXTRAS_REQUIRE`` from setup.py, read as literals."""
    values = {}
    for node in ast.parse((ROOT / "setup.py").read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("INSTALL_REQUIRES", "EXTRAS_REQUIRE"):
                values[node.targets[0].id] = ast.literal_eval(node.value)
    return values["INSTALL_REQUIRES"], values["EXTRAS_REQUIRE"]


def import_names(requirements: List[str]) -> Set[str]:
    """The top-level modules the distributions of ``requirements`` provide."""
    names = set()
    for requirement in requirements:
        distribution = re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower()
        names |= IMPORT_NAMES.get(distribution, {re.sub(r"[-.]", "_", distribution)})
    return names


def project_modules() -> Set[str]:
    """This repository's own top-level modules (the examples import each other by file name)."""
    scripts = {p.stem for folder in ("examples", "bench") for p in (ROOT / folder).glob("*.py")}
    return {"flatshard", "tests"} | scripts


def _catches_import_error(node: ast.Try) -> bool:
    for handler in node.handlers:
        caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if any(isinstance(c, ast.Name) and c.id in IMPORT_ERRORS for c in caught):
            return True
    return False


def imports(source: str) -> Iterator[Tuple[str, int, bool]]:
    """(top-level module, line, guarded) for every absolute import in ``source``; ``guarded``
    means inside the body of a ``try`` that catches ImportError, or ``pytest.importorskip``."""

    def visit(node: ast.AST, guarded: bool) -> Iterator[Tuple[str, int, bool]]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], node.lineno, guarded
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module.split(".")[0], node.lineno, guarded
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip":
            if node.args and isinstance(node.args[0], ast.Constant):
                yield node.args[0].value.split(".")[0], node.lineno, True
        if isinstance(node, ast.Try) and _catches_import_error(node):
            for child in node.body:
                yield from visit(child, True)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                yield from visit(child, guarded)
            return
        for child in ast.iter_child_nodes(node):
            yield from visit(child, guarded)

    yield from visit(ast.parse(source), False)


def undeclared(folder: str, source: str) -> List[Tuple[str, int]]:
    """The imports of ``source`` (a file of ``folder``) that nothing declares."""
    install, extras = declared()
    every_extra = import_names([r for reqs in extras.values() for r in reqs])
    base = set(sys.stdlib_module_names) | project_modules() | import_names(install)
    if folder == "flatshard":
        allowed = unguarded = base - project_modules() | {"flatshard"}
    elif folder == "tests":
        unguarded = base | import_names(extras.get("test", []))
        allowed = unguarded | every_extra
    else:
        allowed = unguarded = base | every_extra
    return [
        (module, line)
        for module, line, guarded in imports(source)
        if module not in (allowed if guarded else unguarded)
    ]


def test_every_import_is_declared():
    problems = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for module, line in undeclared(folder, path.read_text(encoding="utf-8")):
                problems.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert problems == [], "imports that setup.py does not declare:\n" + "\n".join(problems)


def test_the_library_depends_on_torch_alone():
    install, _ = declared()
    assert import_names(install) == {"torch"}


def test_sharded_checkpoints_and_tests_get_numpy():
    # torch.distributed.checkpoint needs NumPy on more than one rank; torch does not install it.
    _, extras = declared()
    assert "numpy" in import_names(extras["checkpoint"])
    assert "numpy" in import_names(extras["test"])


def test_the_scan_finds_undeclared_imports():
    source = (
        "import os, numpy.linalg\n"
        "from yaml import safe_load\n"
        "def f():\n"
        "    import torch.nn\n"
        "    from . import sibling\n"
        "try:\n"
        "    import numpy\n"
        "except ImportError:\n"
        "    import not_declared_anywhere\n"
    )
    assert undeclared("flatshard", source) == [("numpy", 1), ("yaml", 2), ("numpy", 7), ("not_declared_anywhere", 9)]
    # tests get the test extra (numpy); a guarded import must still be declared somewhere
    assert undeclared("tests", source) == [("yaml", 2), ("not_declared_anywhere", 9)]
    assert undeclared("tests", "import pytest\npytest.importorskip('not_declared_anywhere')\n") == [("not_declared_anywhere", 2)]
    assert undeclared("tests", "import pytest\npytest.importorskip('transformers')\n") == []  # the hf extra
    assert undeclared("flatshard", "import tests._models\nimport train_gpt\n") == [("tests", 1), ("train_gpt", 2)]
    assert undeclared("examples", "import train_gpt, flatshard.wrap\n") == []


def test_hugging_face_tests_skip_with_a_reason_without_transformers(tmp_path):
    """Without transformers (the ``hf`` extra) tests/test_hf.py is skipped, saying what to install."""
    import os
    import subprocess

    blocker = tmp_path / "transformers"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'transformers'\", name='transformers')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_hf.py")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 5), done.stdout + done.stderr  # (5: the module's tests are skipped at collection)
    assert "1 skipped" in done.stdout and "the Hugging Face tests need the hf extra" in done.stdout, done.stdout

"""README.md's claims cite their tests.

Every bullet of the "What is better" and "What differs" lists (section "Migrating from torch
FSDP1") names at least one test by its pytest node id (`tests/test_x.py::Class::test_y`,
`tests/test_x.py::test_z` or `tests/test_x.py::Class`), and every test file or node id the
README names anywhere exists: the file, and the class / function / method in it. The files of
the "Layout" table exist too.
"""

import ast
import pathlib
import re
from typing import Dict, List, Set

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
REFERENCE = re.compile(r"`(tests/[\w/]+\.py)((?:::\w+)*)`")


def _section(text: str, heading: str) -> List[str]:
    lines = text.splitlines()
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def _bullets(lines: List[str], label: str) -> List[str]:
    """The bullets of the list introduced by the line that starts with ``label`` (a bullet
    goes on over the lines indented under it)."""
    start = next(i for i, line in enumerate(lines) if line.startswith(label)) + 1
    bullets: List[str] = []
    for line in lines[start:]:
        if line.startswith("- "):
            bullets.append(line)
        elif line.startswith("  ") and bullets:
            bullets[-1] += " " + line.strip()
        elif line.strip() or bullets:
            break
    return bullets


def _defined(path: pathlib.Path) -> Dict[str, Set[str]]:
    """Top-level functions (no members) and classes (their methods) of a Python file."""
    tree = ast.parse(path.read_text())
    names: Dict[str, Set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            names[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


def _missing(path: str, node: str) -> str:
    """Why the reference does not resolve ("" if it does)."""
    file = ROOT / path
    if not file.is_file():
        return f"{path}: no such file"
    parts = [p for p in node.split("::") if p]
    names = _defined(file)
    if parts and parts[0] not in names:
        return f"{path}: no function or class {parts[0]!r}"
    if len(parts) == 2 and parts[1] not in names[parts[0]]:
        return f"{path}: class {parts[0]!r} has no method {parts[1]!r}"
    if len(parts) > 2:
        return f"{path}{node}: too deep"
    return ""


def _migrating_lists() -> Dict[str, List[str]]:
    section = _section(README.read_text(), "## Migrating from torch FSDP1")
    return {label: _bullets(section, label) for label in ("What is better", "What differs")}


def test_every_bullet_of_what_is_better_and_what_differs_names_a_test():
    for label, bullets in _migrating_lists().items():
        assert bullets, f"README: no bullets found under {label!r}"
        for bullet in bullets:
            nodes = [(path, node) for path, node in REFERENCE.findall(bullet) if node]
            assert nodes, f"README, {label} this bullet names no test (`tests/test_x.py::name`): {bullet[:100]}..."


def test_every_test_the_readme_names_exists():
    references = REFERENCE.findall(README.read_text())
    assert len(references) > 20
    problems = sorted({_missing(path, node) for path, node in references} - {""})
    assert not problems, "README names tests that do not exist:\n" + "\n".join(problems)


def test_every_file_of_the_layout_table_exists():
    rows = [line for line in _section(README.read_text(), "## Layout") if line.startswith("| `")]
    paths = [re.match(r"\| `([^`]+)`", row).group(1) for row in rows]
    assert len(paths) > 20
    assert [p for p in paths if not (ROOT / p).exists()] == []


def test_the_check_finds_what_does_not_exist():
    assert _missing("tests/test_readme.py", "::test_every_test_the_readme_names_exists") == ""
    assert _missing("tests/test_readme.py", "::NoSuchTest") == "tests/test_readme.py: no function or class 'NoSuchTest'"
    assert _missing("tests/test_parity.py", "::test_parity_with_single_process::x") != ""
    assert _missing("tests/test_errors.py", "::ErrorTest::test_no_such_thing") != ""
    assert _missing("tests/no_such_file.py", "") == "tests/no_such_file.py: no such file"

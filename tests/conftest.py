"""Test-session fixtures and the test tiers.

[Note: test tiers] Tests that need other processes carry the ``multirank`` marker: those that
use the session's pool of gloo rank processes (the ``rank_pool`` fixture, or ``self.pool`` in a
unittest-style class), and those that start a Python subprocess (examples, ``python -m
flatshard.plan``, fresh-interpreter checks, ``multiprocessing`` processes), which also carry ``subprocess``. Everything else is
the pure tier, ``python -m pytest -m "not multirank"``: in-process logic that runs in seconds.

The markers are put on at collection by reading the test's source: a unittest-style class as a
whole (its methods share one ``self.pool``), else the test function, together with the
module-level functions and fixtures they name (transitively), so a helper that starts the
subprocess counts. Only ``multirank`` classes are given ``self.pool``; a pure test reaching for
it, or starting a subprocess, fails saying so, and ``-m "not multirank"`` never creates a
``RankPool`` (the summary line at the end says whether one was started).
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set

import pytest

from tests._pool import RankPool

MULTIRANK = "multirank"
SUBPROCESS = "subprocess"
_POOL_WORDS = ("self.pool", "rank_pool", "pool.run(")
_SUBPROCESS_WORDS = ("subprocess.", "sys.executable", "Popen(", "multiprocessing")
_POOLS_STARTED = pytest.StashKey[List[RankPool]]()


# -- classification -----------------------------------------------------------------------


def _module_defs(path: Path) -> Dict[str, str]:
    """The source of each module-level function and class of a test file, by name."""
    text = path.read_text(encoding="utf-8")
    defs = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = ast.get_source_segment(text, node) or ""
    return defs


def _names_in(source: str) -> Set[str]:
    return {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)}


def _reachable_source(defs: Dict[str, str], roots: List[str]) -> str:
    """The source of the module-level definitions ``roots`` and of every module-level
    definition they name, transitively (``defs``: a file's, from ``_module_defs``)."""
    seen: Set[str] = set()
    todo = [name for name in roots if name in defs]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(n for n in _names_in(defs[name]) if n in defs and n not in seen)
    return "\n".join(defs[name] for name in sorted(seen))


def _test_roots(item: pytest.Item) -> List[str]:
    """The module-level names a test starts from: its class (and the classes it derives
    from, in this file) or its function, and the fixtures it uses."""
    cls = getattr(item, "cls", None)
    if cls is not None:
        roots = [c.__name__ for c in cls.__mro__ if c.__module__ == cls.__module__]
    else:
        roots = [getattr(item, "originalname", item.name)]
    return roots + list(getattr(item, "fixturenames", ()))


def _classify(item: pytest.Item, defs: Dict[str, str]) -> Optional[str]:
    """``SUBPROCESS``, ``MULTIRANK`` (the rank pool) or ``None`` (pure)."""
    source = _reachable_source(defs, _test_roots(item))
    if any(word in source for word in _SUBPROCESS_WORDS):
        return SUBPROCESS
    if "rank_pool" in getattr(item, "fixturenames", ()) or any(word in source for word in _POOL_WORDS):
        return MULTIRANK
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    defs_by_file: Dict[Path, Dict[str, str]] = {}
    for item in items:
        path = getattr(item, "path", None)
        if path is None or path.suffix != ".py":
            continue
        if path not in defs_by_file:
            defs_by_file[path] = _module_defs(path)
        kind = _classify(item, defs_by_file[path])
        if kind is not None:
            item.add_marker(MULTIRANK)
        if kind == SUBPROCESS:
            item.add_marker(SUBPROCESS)


def _is_multirank(node: pytest.Item) -> bool:
    return node.get_closest_marker(MULTIRANK) is not None


# -- the rank pool --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def rank_pool(pytestconfig: pytest.Config) -> Iterator[RankPool]:
    pool = RankPool()
    pytestconfig.stash.setdefault(_POOLS_STARTED, []).append(pool)
    yield pool
    pool.close()


class _NoPool:
    """What a pure test class gets as ``self.pool``: any use says the test is misclassified."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(
            f"{self.nodeid} is in the pure tier (not marked {MULTIRANK!r}) but uses self.pool.{name}; "
            f"tests/conftest.py marks a class that mentions self.pool in its own source"
        )


@pytest.fixture(autouse=True)
def _attach_rank_pool(request: pytest.FixtureRequest) -> None:
    """unittest-style test classes (for assertRaisesRegex / expecttest) get ``self.pool``;
    only multirank ones get the real pool (see [Note: test tiers])."""
    if request.instance is None or "rank_pool" in request.fixturenames:
        return
    if _is_multirank(request.node):
        request.instance.pool = request.getfixturevalue("rank_pool")
    else:
        request.instance.pool = _NoPool(request.node.nodeid)


@pytest.fixture(autouse=True)
def _pure_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pure test that starts a subprocess fails instead of slowing the pure tier down."""
    if _is_multirank(request.node):
        return
    nodeid = request.node.nodeid

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(
            f"{nodeid} is in the pure tier (not marked {MULTIRANK!r}) but starts a subprocess; "
            f"tests/conftest.py marks tests whose source (or a helper it calls) mentions subprocess"
        )

    monkeypatch.setattr(subprocess, "Popen", refuse)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    pools = config.stash.get(_POOLS_STARTED, [])
    terminalreporter.write_line(f"flatshard rank pool: {'started' if pools else 'not started'}")

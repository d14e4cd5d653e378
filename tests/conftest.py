"""Test-session fixtures: one pool of gloo rank processes shared by every multi-rank test."""

from typing import Iterator

import pytest

from tests._pool import RankPool


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[RankPool]:
    pool = RankPool()
    yield pool
    pool.close()


@pytest.fixture(autouse=True)
def _attach_rank_pool(request: pytest.FixtureRequest) -> None:
    """unittest-style test classes (for assertRaisesRegex / expecttest) get ``self.pool``."""
    if request.instance is not None and "rank_pool" not in request.fixturenames:
        request.instance.pool = request.getfixturevalue("rank_pool")

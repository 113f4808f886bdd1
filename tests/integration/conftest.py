"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.redis_servers import RedisServer, running_server

# the TieredStore bench's arena and client mapping (tests/support/store.py), as in the
# unit tests; a module with an arena of its own size defines ``arena`` itself
from tests.support.store import arena, client  # noqa: F401


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh, empty redis-server of its own for the test (a file may override it)."""
    with running_server(tmp_path / "redis") as server:
        yield server

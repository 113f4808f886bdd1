"""Test arenas in a private temp directory under /dev/shm (or the temp dir without it)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvtier.tiers.arena import Arena


def shm_root() -> Path:
    """Where test arenas live: /dev/shm when usable (the real thing), else the temp dir."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


@contextlib.contextmanager
def temp_arena(capacity_bytes: int, slab_bytes: int) -> Iterator[Arena]:
    """An un-prefaulted arena, closed and unlinked with its directory afterwards."""
    with tempfile.TemporaryDirectory(prefix="kvtier-test-", dir=shm_root()) as d:
        arena = Arena(capacity_bytes, shm_dir=Path(d), slab_bytes=slab_bytes, prefault=False)
        try:
            yield arena
        finally:
            arena.close()

"""Test arenas in a private temp directory under /dev/shm (or the temp dir without it)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kvtier.tiers.arena import Arena


def shm_root() -> Path:
    """Where test arenas live: /dev/shm when usable (the real thing), else the temp dir."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


@contextlib.contextmanager
def temp_arena(capacity_bytes: int, slab_bytes: int) -> Iterator[Arena]:
    """An un-prefaulted arena, closed and unlinked with its directory afterwards."""
    with shm_tempdir() as d:
        arena = Arena(capacity_bytes, shm_dir=d, slab_bytes=slab_bytes, prefault=False)
        try:
            yield arena
        finally:
            arena.close()


@contextlib.contextmanager
def shm_tempdir() -> Iterator[Path]:
    """A private directory under ``shm_root()``, removed with its files afterwards."""
    with tempfile.TemporaryDirectory(prefix="kvtier-test-", dir=shm_root()) as d:
        yield Path(d)


def kill_arena(arena: Arena) -> None:
    """What kill -9 does to an arena's daemon: the journal's mapping, the arena's mapping,
    descriptor and lock go (the mapping's duplicate shares the lock); the arena file and
    its journal stay for the next start to adopt."""
    if arena.journal is not None:
        arena.journal.close(unlink=False)
        arena.journal = None
    arena.buf = np.empty(0, np.uint8)
    with contextlib.suppress(BufferError):
        arena._mm.close()
    fcntl.flock(arena._fd, fcntl.LOCK_UN)
    os.close(arena._fd)
    arena._fd = -1

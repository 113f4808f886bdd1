"""The client's process-wide mapping tables across fork().

A thread of the parent may hold ``arena_mapping._LOCK`` (mapping an arena in ``connect()``)
or ``hbm_mapping._MAPPINGS_LOCK`` (opening the HBM pool) when another thread forks: the
child got a lock that nobody would ever release, and hung at its own ``connect()``. The
child now starts with fresh locks; it keeps the parent's arena mappings (MAP_SHARED, valid
there) but none of its CUDA IPC mappings (pointers of the parent's CUDA context).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvtier.tiers import arena_mapping, hbm_mapping
from kvtier.tiers.arena_mapping import ArenaMapping, shared_mappings
from kvtier.tiers.hbm_mapping import IPC_HANDLE_BYTES, HbmMapping
from tests.support.arena import temp_arena
from tests.support.forking import run_in_child


@contextmanager
def held_by_a_thread(get_lock: Callable[[], threading.Lock]) -> Iterator[None]:
    """The lock held by another thread for the duration (as across an mmap)."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with get_lock():
            holding.set()
            release.wait(30)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert holding.wait(10)
    try:
        yield
    finally:
        release.set()
        t.join(10)


def test_a_child_maps_arenas_while_its_parent_was_mapping_one() -> None:
    with temp_arena(1 << 20, 1 << 20) as arena, temp_arena(1 << 20, 1 << 20) as other:
        parents = ArenaMapping(str(arena.path), arena.size)
        before = shared_mappings()

        def child() -> bool:
            mine = ArenaMapping(str(other.path), other.size)   # a new file: mapped
            same = ArenaMapping(str(arena.path), arena.size)   # the parent's: shared
            ok = shared_mappings() == before + 1 and same.buf.ctypes.data == \
                parents.buf.ctypes.data
            mine.close()
            same.close()
            return ok

        with held_by_a_thread(lambda: arena_mapping._LOCK):
            assert run_in_child(child, 10.0) == 0
        parents.close()


def test_a_child_forgets_its_parents_hbm_mappings_and_their_lock() -> None:
    closed: list[int] = []
    handle = b"\x01" * IPC_HANDLE_BYTES
    parents = HbmMapping(1 << 20, 4096, 0, handle=handle, closer=lambda: closed.append(1))
    hbm_mapping._MAPPINGS[(handle, 4096)] = parents
    try:
        def child() -> bool:
            got = hbm_mapping._MAPPINGS_LOCK.acquire(timeout=2)
            parents.close()   # an inherited client's close: no CUDA call in the child
            return got and not hbm_mapping._MAPPINGS and parents._closed and not closed

        with held_by_a_thread(lambda: hbm_mapping._MAPPINGS_LOCK):
            assert run_in_child(child, 10.0) == 0
        assert hbm_mapping._MAPPINGS[(handle, 4096)] is parents   # the parent's, intact
    finally:
        hbm_mapping._MAPPINGS.pop((handle, 4096), None)

"""The slab layout of a pool (kvtier.tiers.slab.slab_layout): all of the configured size is
used. Whole ``slab_bytes`` slabs used to drop the rest silently (cpu.bytes = 127MiB served
64 MiB, 1GB 6% less)."""

from __future__ import annotations

import pytest

from kvtier.tiers.aligned import PAGE
from kvtier.tiers.slab import SlabAllocator, slab_layout

MiB = 2**20


@pytest.mark.parametrize("capacity", [127 * MiB, 10**9, 190 * MiB, 65 * MiB, 2 * 2**30,
                                      64 * MiB, 96 * MiB + 123, 10_000, PAGE])
def test_the_slabs_hold_the_whole_size(capacity: int) -> None:
    slab, n = slab_layout(capacity, 64 * MiB)
    whole = capacity // PAGE * PAGE
    assert slab % PAGE == 0 and n >= 1
    assert whole - n * PAGE < n * slab <= whole      # less at most a page per slab
    a = SlabAllocator(capacity, 64 * MiB)
    assert (a.slab_bytes, a.size) == (slab, n * slab)
    assert a.alloc(a.size) == 0                       # one slot can take all of it


def test_a_size_that_is_whole_slabs_keeps_the_slab_size() -> None:
    assert slab_layout(2 * 2**30, 64 * MiB) == (64 * MiB, 32)
    assert slab_layout(8 * PAGE, 2 * PAGE) == (2 * PAGE, 4)


def test_slabs_stay_near_the_asked_size() -> None:
    slab, n = slab_layout(127 * MiB, 64 * MiB)
    assert (slab, n) == (127 * MiB // 2, 2)
    slab, n = slab_layout(10**9, 64 * MiB)
    assert n == 15 and 60 * MiB < slab < 68 * MiB

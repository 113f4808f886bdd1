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


def test_slabs_only_grow() -> None:
    """As many slabs as whole ``slab_bytes`` fit, each grown by a share of the rest: a
    block near ``slab_bytes`` still takes one slab (rounding the count to the nearest made
    slabs smaller, and such blocks took two: half as many held; found by review)."""
    assert slab_layout(127 * MiB, 64 * MiB) == (127 * MiB, 1)
    slab, n = slab_layout(10**9, 64 * MiB)
    assert n == 14 and 64 * MiB <= slab < 72 * MiB
    for capacity in (170 * MiB, 1000 * MiB, 12 * 10**9):
        for block in (60 * MiB, 64 * MiB, 16 * MiB):
            new = SlabAllocator(capacity, 64 * MiB)
            held = len(new.alloc_many(block, 10**6))
            assert held >= (capacity // (64 * MiB)) * (64 * MiB // block), (capacity, block)

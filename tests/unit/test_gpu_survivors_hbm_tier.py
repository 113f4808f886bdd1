"""The HBM tier's lifecycle on a host-memory pool (``kvtier.tiers.hbm.HbmTier``; mutation
review survivors): a closed tier must not touch its freed device pool, and the pool must
be on the configured GPU, as the handshake tells the engines."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.errors import KVTierError
from kvtier.tiers.hbm import HbmTier
from tests.unit.test_hbm import HostPool, MiB


class ClosedPool(HostPool):
    """A pool that fails any use after ``close`` (a freed ``cudaMalloc``)."""

    def describe(self) -> dict[str, Any]:
        assert not self.closed, "a freed device pool was asked for its details"
        return super().describe()


def test_a_closed_tier_leaves_its_freed_pool_alone() -> None:
    """After ``close`` the stats no longer ask the freed pool (on a GPU: a call on a freed
    allocation) and a slot can no longer be given back into it (mutants: the pool kept
    after close; ``free`` not checked for an open tier)."""
    t = HbmTier(4 * MiB, slab_bytes=MiB, pool_factory=ClosedPool, device=0)
    t.open()
    off = t.alloc(MiB)
    assert off is not None
    t.close()
    assert t.stats_extra()["device"] == 0 and not t.up
    with pytest.raises(KVTierError, match="not open"):
        t.free(off)


def test_the_pool_is_made_on_the_configured_gpu_and_announced_there() -> None:
    """``hbm.device = 1``: the pool is allocated on GPU 1 and the handshake tells engines
    device 1 (mutants: the factory given device 0; the handshake saying 0, so engines map
    the handle on the wrong GPU)."""
    t = HbmTier(4 * MiB, slab_bytes=MiB, pool_factory=HostPool, device=1)
    t.open()
    try:
        assert HostPool.instances[-1].device == 1
        assert t.handshake_info()["device"] == 1
        assert t.device_ptr(2 * MiB) == HostPool.instances[-1].ptr + 2 * MiB
    finally:
        t.close()

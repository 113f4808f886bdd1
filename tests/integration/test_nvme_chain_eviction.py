"""A full nvme tier shortens chains from their tail (review of 2026-12-06): a chain reaches
nvme tail first (the arena demotes its leaves first), so the cost policy took every block
there for a leaf and evicted the head, and lookups, which touched a chain head first,
made the head the least recent block for LRU. Evicting a head drops its whole chain (its
descendants cannot be reached without it): one capacity eviction lost 2-7 blocks."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16",
                  tokens_per_block=64)
BLOCK = LAYOUT.block_bytes   # 64 KiB
SHARES = {"KVTIER_DAEMON_CLIENT_PUT_SHARE": "1", "KVTIER_DAEMON_CLIENT_GET_SHARE": "1"}


def payload(key: bytes) -> np.ndarray:
    return np.frombuffer((key * (BLOCK // len(key) + 1))[:BLOCK], np.uint8).copy()


@pytest.mark.parametrize("used", [False, True], ids=["stored", "stored-and-used"])
# lru is prefix-aware only through the order the store touches chains in: a block whose
# nvme write ends after its parent's re-enters the order after it (kvtier.policy.lru), so
# which one goes first there depends on write timing; cost counts children
@pytest.mark.parametrize("policy", ["cost", "default"])
def test_a_full_nvme_tier_evicts_leaves_not_heads(
        daemon_factory: Callable[..., DaemonProcess], policy: str, used: bool) -> None:
    args = [] if policy == "default" else ["--eviction", policy]
    d = daemon_factory("d", cpu_bytes=str(16 * BLOCK), nvme_bytes=str(24 * (BLOCK + 4096)),
                       extra_args=args, env=SHARES).start()
    with connect(d.socket, timeout=60) as c:
        ns = c.register_layout(LAYOUT, "m")
        chains = [block_keys(ns, np.arange(n * 64) + 10_000_000 * (i + 1))
                  for i, n in enumerate([8] + [4] * 9)]   # 44 blocks: 16 + 24 fit
        for keys in chains:
            c.put(ns, keys, [payload(k) for k in keys])
            if used:
                c.lookup(ns, keys, prefetch=False)        # a use, as an engine's
        evictions = d.stats()["tiers"]["nvme"]["evictions"]
        assert evictions["capacity"] >= 1
        assert evictions["orphan"] == 0, evictions       # no chain lost with its head
        held = sum(c.lookup(ns, keys, prefetch=False).hits for keys in chains)
        assert held == 44 - evictions["capacity"]
        outs = [np.zeros(BLOCK, np.uint8) for _ in chains[0]]
        got = c.get(ns, chains[0], outs)
        assert all(np.array_equal(outs[i], payload(chains[0][i])) for i in range(got))

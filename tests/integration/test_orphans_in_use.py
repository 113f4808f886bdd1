"""Orphans that were in use when their parent went are dropped once that use is over
(review of 2026-12-06: a get promoting a chain from nvme whose middle frame failed its
checksum left the blocks after it, loading at that moment, in the index and on nvme for
good, where no lookup could reach them: 114 blocks held, 70 reachable)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16",
                  tokens_per_block=64)
BLOCK = LAYOUT.block_bytes
SHARES = {"KVTIER_DAEMON_CLIENT_PUT_SHARE": "1", "KVTIER_DAEMON_CLIENT_GET_SHARE": "1",
          "KVTIER_DAEMON_LEASE_SWEEP_S": "0.2"}


def payload(key: bytes) -> np.ndarray:
    return np.frombuffer((key * (BLOCK // len(key) + 1))[:BLOCK], np.uint8).copy()


def test_orphans_loading_when_their_parent_went_are_dropped_after(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("d", cpu_bytes=str(16 * BLOCK), nvme_bytes="32MiB", env=SHARES).start()
    with connect(d.socket, timeout=60) as c:
        ns = c.register_layout(LAYOUT, "m")
        chain = block_keys(ns, np.arange(6 * 64) + 1)
        c.put(ns, chain, [payload(k) for k in chain], durable=True)   # on nvme
        for j in range(2, 32):                           # out of the arena, nvme only
            keys = block_keys(ns, np.arange(4 * 64) + 100_000 * j)
            c.put(ns, keys, [payload(k) for k in keys])
        assert c.lookup(ns, chain, prefetch=False).tiers == ["nvme"] * 6
        slots = next(Path(d.data_dir).rglob("slots-*.dat"))
        stride = 4096 + BLOCK
        data = slots.read_bytes()
        at = next(i for i in range(len(data) // stride)
                  if chain[1] in data[i * stride: i * stride + 4096])
        with open(slots, "r+b") as f:                   # block 1's payload corrupted
            f.seek(at * stride + 4096 + 100)
            f.write(b"\x5a\xa5")
        outs = [np.zeros(BLOCK, np.uint8) for _ in chain]
        got = c.get(ns, chain, outs)                     # 1: block 1 fails its checksum
        assert got == 1 and np.array_equal(outs[0], payload(chain[0]))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if d.stats()["tiers"]["nvme"]["evictions"]["orphan"] == 4:
                break
            time.sleep(0.1)
        assert d.stats()["tiers"]["nvme"]["evictions"]["orphan"] == 4   # blocks 2-5
        assert all(c.lookup(ns, [k], prefetch=False).hits == 0 for k in chain[1:])
        assert c.lookup(ns, chain, prefetch=False).hits == 1


def test_an_orphan_never_rejoins_under_a_parent_that_is_itself_going(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """Two engines hold get leases on blocks X and Y (the suffix each lacks) when X's
    parent is deleted: both wait to be dropped. Y's use ends first; it must not be taken
    for reachable under X, which is still waiting itself (found by review: Y rejoined
    under X and outlived it for good, unreachable)."""
    d = daemon_factory("d", cpu_bytes=str(64 * BLOCK), nvme_bytes="32MiB", env=SHARES).start()
    with connect(d.socket, timeout=60) as c, connect(d.socket, timeout=60) as cx, \
            connect(d.socket, timeout=60) as cy:
        ns = c.register_layout(LAYOUT, "m")
        nsx, nsy = cx.register_layout(LAYOUT, "m"), cy.register_layout(LAYOUT, "m")
        _head, middle, x, y = chain = block_keys(ns, np.arange(4 * 64) + 1)
        c.put(ns, chain, [payload(k) for k in chain])
        lx, ly = cx.prepare_get(nsx, [x]), cy.prepare_get(nsy, [y])
        assert c.delete(ns, [middle]) == 1
        ly.release()
        time.sleep(1.0)                                   # sweeps: X still in use
        lx.release()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (
                c.lookup(ns, [x], prefetch=False).hits or c.lookup(ns, [y], prefetch=False).hits):
            time.sleep(0.1)
        assert [c.lookup(ns, [k], prefetch=False).hits for k in chain] == [1, 0, 0, 0]
        assert d.stats()["tiers"]["cpu"]["evictions"]["orphan"] == 2

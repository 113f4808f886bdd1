"""The HBM tier on a real device: the cupy pool, and CUDA IPC into a second process.

Skipped (by tests/gpu/conftest.py, with the reason) where no GPU is usable. These are the only
checks of the CUDA paths in kvtier/tiers/hbm.py; they were written without a GPU.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
from typing import Any

import pytest

from kvtier.tiers.hbm import IPC_HANDLE_BYTES, HbmMapping, HbmTier, hbm_available

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def _engine(handle: bytes, size: int, device: int, bus_id: str, read_off: int, nbytes: int,
            write_off: int) -> dict[str, Any]:
    """Runs in a spawned process (an 'engine'): map the pool, read one slot, write another."""
    import cupy

    m = HbmMapping.open(handle, size, device, pci_bus_id=bus_id)
    again = HbmMapping.open(handle, size, device, pci_bus_id=bus_id)
    got = cupy.asnumpy(m.cupy_view(read_off, nbytes)).tobytes()
    out = m.cupy_view(write_off, nbytes)
    out[:] = cupy.arange(nbytes, dtype=cupy.uint32).astype(cupy.uint8)
    cupy.cuda.runtime.deviceSynchronize()
    torch_ok = None
    if importlib.util.find_spec("torch") is not None:
        t = m.torch_view(read_off, nbytes)
        torch_ok = bool(t.device.type == "cuda" and t.cpu().numpy().tobytes() == got)
        del t
    del out
    m.close()
    return {"got": got, "same_mapping": again is m, "torch_ok": torch_ok}


def test_this_host_can_run_the_hbm_tier() -> None:
    ok, why = hbm_available(0)
    assert ok, why


def test_pool_slots_views_and_capacity() -> None:
    import cupy

    tier = HbmTier(16 * MiB, device=0, slab_bytes=4 * MiB)
    tier.open()
    try:
        assert tier.up and tier.capacity_bytes == 16 * MiB
        offs = [tier.alloc(MiB) for _ in range(16)]
        assert None not in offs and tier.alloc(1) is None
        assert tier.counters.allocation_failures == 0   # an attempt: the store counts
        for i, off in enumerate(offs):
            assert off is not None
            tier.view(off, MiB).fill(i)
        cupy.cuda.runtime.deviceSynchronize()
        for i, off in enumerate(offs):
            assert off is not None
            v = tier.view(off, MiB)
            assert int(v.min()) == int(v.max()) == i
            assert int(v.data.ptr) == tier.device_ptr(off)
        handle = tier.export_handle()
        assert isinstance(handle, bytes) and len(handle) == IPC_HANDLE_BYTES
        assert tier.export_handle() == handle
        info = tier.stats_extra()
        assert info["pci_bus_id"] and info["device_name"]
    finally:
        tier.close()
    assert not tier.up


def test_ipc_round_trip_with_a_second_process() -> None:
    import cupy

    tier = HbmTier(32 * MiB, device=0, slab_bytes=8 * MiB)
    tier.open()
    try:
        a, b = tier.alloc(3 * MiB + 123), tier.alloc(3 * MiB + 123)
        assert a is not None and b is not None
        n = 3 * MiB + 123
        pattern = cupy.random.randint(0, 256, n, dtype=cupy.int32).astype(cupy.uint8)
        tier.view(a, n)[:] = pattern
        tier.view(b, n).fill(0)
        cupy.cuda.runtime.deviceSynchronize()
        info = tier.handshake_info()
        ctx = mp.get_context("spawn")   # never fork a process that has a CUDA context
        with ctx.Pool(1) as pool:
            res = pool.apply(_engine, (info["handle"], info["size"], info["device"],
                                       info["pci_bus_id"], a, n, b))
        assert res["got"] == cupy.asnumpy(pattern).tobytes()
        assert res["same_mapping"] is True
        assert res["torch_ok"] in (True, None)
        expect = (cupy.arange(n, dtype=cupy.uint32).astype(cupy.uint8))
        assert bool((tier.view(b, n) == expect).all())
    finally:
        tier.close()

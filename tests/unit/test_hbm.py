"""HBM tier on the CPU: availability checks, the slab allocator, the tier's bookkeeping over a
host-memory fake pool, client-side argument checks and the daemon wiring.

The real device pool and CUDA IPC are tested in tests/gpu/test_hbm.py (GPU hosts only).
"""

from __future__ import annotations

import random
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.config import load_config
from kvtier.errors import BufferSizeError, CapacityError, ConfigError, KVTierError
from kvtier.tiers import hbm as hbm_mod
from kvtier.tiers.base import Tier, TierName, tier_stats
from kvtier.tiers.hbm import (
    IPC_HANDLE_BYTES,
    PAGE,
    HbmMapping,
    HbmTier,
    SlabAllocator,
    hbm_available,
)
from kvtier.tiers.nvme import backends as nb
from tests.support.fake_gpu_libs import FakeDriver, no_libcuda, with_driver

MiB = 1 << 20


class HostPool:
    """A DevicePool over host memory, so the tier's logic runs without a GPU."""

    instances: list[HostPool] = []

    def __init__(self, size: int, device: int = 0) -> None:
        self.buf = np.zeros(size, dtype=np.uint8)
        self.size = size
        self.device = device
        self.ptr = int(self.buf.ctypes.data)
        self.closed = False
        HostPool.instances.append(self)

    def export_handle(self) -> bytes:
        return bytes(range(IPC_HANDLE_BYTES))

    def view(self, offset: int, nbytes: int) -> Any:
        hbm_mod._check_range(offset, nbytes, self.size)
        return self.buf[offset: offset + nbytes]

    def describe(self) -> dict[str, Any]:
        return {"device": self.device, "device_name": "host fake", "pci_bus_id": "0000:C1:00.0"}

    def close(self) -> None:
        self.closed = True


def fake_cupy(devices: int = 1) -> types.ModuleType:
    mod = types.ModuleType("cupy")
    mod.__version__ = "14.2.0"  # type: ignore[attr-defined]
    runtime = types.SimpleNamespace(getDeviceCount=lambda: devices)
    mod.cuda = types.SimpleNamespace(runtime=runtime)  # type: ignore[attr-defined]
    return mod


# ---------------------------------------------------------------------- availability
def test_unavailable_without_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    no_libcuda(monkeypatch)
    ok, why = hbm_available(0)
    assert not ok and "libcuda.so.1 cannot be loaded" in why


def test_unavailable_when_device_index_is_out_of_range(monkeypatch: pytest.MonkeyPatch) -> None:
    with_driver(monkeypatch, FakeDriver(count=1))
    ok, why = hbm_available(1)
    assert not ok and why == "hbm.device = 1 but only 1 CUDA device(s) are visible"
    assert hbm_available(-1) == (False, "hbm.device must be >= 0, got -1")


def test_unavailable_without_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    with_driver(monkeypatch, FakeDriver(count=2))
    monkeypatch.setitem(sys.modules, "cupy", None)
    ok, why = hbm_available(0)
    assert not ok and why == "cupy not installed (pip install 'kvtier[gpu]')"


def test_unavailable_when_cupy_disagrees(monkeypatch: pytest.MonkeyPatch) -> None:
    with_driver(monkeypatch, FakeDriver(count=2))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(devices=1))
    ok, why = hbm_available(1)
    assert not ok and "cupy sees 1 CUDA device(s)" in why

    def broken() -> int:
        raise RuntimeError("cudaErrorInsufficientDriver")

    cupy = fake_cupy()
    cupy.cuda.runtime.getDeviceCount = broken
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    ok, why = hbm_available(0)
    assert not ok and "cudaErrorInsufficientDriver" in why


def test_available_with_driver_and_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    with_driver(monkeypatch, FakeDriver(count=2))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(devices=2))
    assert hbm_available(1) == (True, "cupy 14.2.0, device 1 of 2")


def test_unavailable_off_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hbm_mod.sys, "platform", "darwin")
    ok, why = hbm_available(0)
    assert not ok and "need Linux" in why


def test_this_host_reports_a_reason() -> None:
    ok, why = hbm_available(0)
    assert why   # True on a GPU host, a reason why not elsewhere; never raises
    if not ok:
        assert nb.cuda_driver_status().reason in why or "cupy" in why


# ---------------------------------------------------------------------- allocator
def test_allocator_random_calls_keep_slots_disjoint_and_counts_exact() -> None:
    """The pool allocator (shared by the arena and hbm) under random alloc/free: slots never
    overlap, could_fit predicts alloc, counts are exact and capacity is never exceeded."""
    for seed in range(6):
        rng = random.Random(seed)
        capacity = rng.choice([1, 3, 8, 17]) * 64 * 1024 + rng.choice([0, 4095])
        alloc = SlabAllocator(capacity, rng.choice([PAGE, 3 * PAGE, 64 * 1024, 10**9]))
        live: dict[int, int] = {}  # offset -> slot bytes
        for _ in range(400):
            if live and rng.random() < 0.45:
                freed = rng.choice(list(live))
                del live[freed]
                alloc.free(freed)
            else:
                n = rng.choice([0, 1, 100, PAGE, PAGE + 1, 3 * PAGE, 20_000, 70_000,
                                rng.randrange(1, capacity + PAGE)])
                predicted = alloc.could_fit(n)
                off = alloc.alloc(n)
                assert (off is not None) == predicted
                if off is not None:
                    size = alloc.slot_size(off)
                    assert size >= max(n, 1) and size % PAGE == 0
                    assert off + size <= alloc.size
                    for o, sz in live.items():
                        assert off + size <= o or o + sz <= off, "overlapping slots"
                    live[off] = size
            assert alloc.used_bytes == sum(live.values()) <= alloc.size
            assert alloc.allocated_slots == len(live)


def test_allocator_hard_capacity_and_reuse() -> None:
    a = SlabAllocator(4 * PAGE, slab_bytes=2 * PAGE)
    offs = [a.alloc(PAGE) for _ in range(4)]
    assert sorted(o for o in offs if o is not None) == [0, PAGE, 2 * PAGE, 3 * PAGE]
    assert a.alloc(1) is None and not a.could_fit(1)
    assert a.used_bytes == 4 * PAGE and a.allocated_slots == 4
    a.free(PAGE)
    assert a.alloc(PAGE) == PAGE
    assert a.slot_size(PAGE) == PAGE


def test_allocator_units_return_their_slabs() -> None:
    a = SlabAllocator(8 * PAGE, slab_bytes=2 * PAGE)     # four 8 KiB slabs
    assert a.alloc(PAGE) == 0                  # slab 0 becomes a unit of two 4 KiB slots
    assert a.alloc(3 * PAGE) == 2 * PAGE       # a 12 KiB slot spans slabs 1-2
    assert a.alloc(PAGE) == PAGE               # slab 0's second slot
    assert a.alloc(PAGE) == 6 * PAGE           # slab 3 becomes another 4 KiB unit
    assert a.alloc(PAGE) == 7 * PAGE
    assert a.alloc(PAGE) is None and a.alloc(3 * PAGE) is None
    a.free(2 * PAGE)                           # slabs 1-2 go back to the pool
    assert a.could_fit(4 * PAGE) and not a.could_fit(5 * PAGE)
    for off in (0, PAGE, 6 * PAGE, 7 * PAGE):
        a.free(off)
    assert a.used_bytes == 0 and a.allocated_slots == 0
    assert a.alloc(8 * PAGE) == 0              # every slab is free again: one 32 KiB slot


def test_allocator_rejects_bad_frees_and_sizes() -> None:
    a = SlabAllocator(8 * PAGE, slab_bytes=PAGE)
    off = a.alloc(10)
    assert off is not None
    for bad in (off + 1, -PAGE, 100 * PAGE, PAGE * 5):
        with pytest.raises(CapacityError):
            a.free(bad)
    a.free(off)
    with pytest.raises(CapacityError):
        a.free(off)                         # double free
    with pytest.raises(ValueError):
        a.alloc(-1)
    with pytest.raises(ConfigError):
        SlabAllocator(PAGE - 1)


# ---------------------------------------------------------------------- the tier
def host_tier(capacity: int = 8 * MiB, **kw: Any) -> HbmTier:
    t = HbmTier(capacity, slab_bytes=MiB, pool_factory=HostPool, **kw)
    t.open()
    return t


def test_tier_bookkeeping_and_stats() -> None:
    t = host_tier(device=0)
    assert isinstance(t, Tier) and t.name is TierName.HBM and t.up
    assert t.capacity_bytes == 8 * MiB and t.backend == "cuda-ipc"
    offs = [off for off in (t.alloc(MiB) for _ in range(8)) if off is not None]
    assert len(offs) == 8 and t.used_bytes == 8 * MiB and t.blocks == 8
    assert t.alloc(1) is None and t.counters.allocation_failures == 0  # store counts
    t.view(offs[0], MiB)[:] = 7
    assert int(t.view(offs[0], 16).sum()) == 7 * 16
    assert t.device_ptr(offs[3]) == HostPool.instances[-1].ptr + offs[3]
    with pytest.raises(BufferSizeError):
        t.device_ptr(9 * MiB)
    t.free(offs[0])
    stats = {**tier_stats(t), **t.stats_extra()}
    assert stats["name"] == "hbm" and stats["backend"] == "cuda-ipc"
    assert stats["used_bytes"] == 7 * MiB and stats["free_bytes"] == MiB
    assert stats["allocation_failures"] == 0 and stats["pci_bus_id"] == "0000:C1:00.0"
    assert stats["placement"].startswith("pool only")
    info = t.handshake_info()
    assert info == {"handle": bytes(range(64)), "size": 8 * MiB, "device": 0,
                    "pci_bus_id": "0000:C1:00.0"}
    pool = HostPool.instances[-1]
    t.close()
    assert pool.closed and not t.up
    with pytest.raises(KVTierError, match="not open"):
        t.alloc(1)
    with pytest.raises(KVTierError):
        t.open()


def test_tier_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"hbm\.bytes > 0"):
        HbmTier(0)
    with pytest.raises(ConfigError, match=r"hbm\.device"):
        HbmTier(MiB, device=-1)
    t = HbmTier(MiB, pool_factory=HostPool)
    assert not t.up and t.stats_extra()["device"] == 0
    with pytest.raises(KVTierError, match="not open"):
        t.export_handle()


# ---------------------------------------------------------------------- client side
def test_mapping_rejects_bad_handles_without_touching_cupy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)   # any import would raise ImportError
    with pytest.raises(ConfigError, match="64 bytes, got 10"):
        HbmMapping.open(b"0123456789", MiB)
    with pytest.raises(ConfigError, match="must be bytes"):
        HbmMapping.open("not bytes", MiB)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="size must be > 0"):
        HbmMapping.open(bytes(64), 0)


def test_mapping_ranges_and_close() -> None:
    closed: list[int] = []
    m = HbmMapping(0x7F00_0000_0000, 4 * MiB, 0, closer=lambda: closed.append(1))
    assert m.device_ptr(0) == 0x7F00_0000_0000
    assert m.device_ptr(MiB, MiB) == 0x7F00_0000_0000 + MiB
    for off, n in ((-1, 0), (4 * MiB, 1), (3 * MiB, 2 * MiB)):
        with pytest.raises(BufferSizeError):
            m.device_ptr(off, n)
    m.close()
    m.close()
    assert closed == [1]
    with pytest.raises(KVTierError, match="closed"):
        m.device_ptr(0)


def test_bus_ids_compare_across_spellings() -> None:
    norm = hbm_mod._normalize_bus_id
    assert norm("0000:C1:00.0") == norm("00000000:c1:00.0")
    assert norm("0000:C1:00.0") != norm("0000:C2:00.0")
    assert norm("weird") == "weird"


# ---------------------------------------------------------------------- daemon wiring
def _cfg(tmp_path: Path, **extra: Any) -> Any:
    return load_config(env={}, overrides={
        "daemon.data_dir": tmp_path / "data", "daemon.socket": tmp_path / "kvtier.sock",
        "http.port": 0, "cpu.bytes": "16MiB", "cpu.prefault": False, "nvme.bytes": "16MiB",
        **extra})


async def test_daemon_refuses_hbm_without_a_gpu(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.daemon.service import Daemon

    no_libcuda(monkeypatch)
    d = Daemon(_cfg(tmp_path, **{"hbm.enabled": True, "hbm.bytes": "1GiB"}))
    with pytest.raises(ConfigError) as err:
        await d.start()
    assert str(err.value).startswith("hbm.enabled needs a CUDA device: libcuda.so.1 cannot")
    assert "hbm.enabled = false" in str(err.value)
    arena = d.arena
    await d.stop()
    assert arena is not None and not arena.path.exists()


def test_daemon_refuses_hbm_without_bytes(tmp_path: Path) -> None:
    from kvtier.daemon.service import Daemon

    with pytest.raises(ConfigError, match=r"hbm\.bytes > 0"):
        Daemon(_cfg(tmp_path, **{"hbm.enabled": True}))._make_hbm()


async def test_daemon_reports_the_hbm_tier_in_stats(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.daemon.service import Daemon

    monkeypatch.setattr(hbm_mod, "hbm_available", lambda device: (True, "fake"))
    monkeypatch.setattr(hbm_mod, "CupyDevicePool", HostPool)
    d = Daemon(_cfg(tmp_path, **{"hbm.enabled": True, "hbm.bytes": "128MiB"}))
    await d.start()
    try:
        stats = d.stats()
        assert next(iter(stats["tiers"])) == "hbm"
        hbm = stats["tiers"]["hbm"]
        assert hbm["capacity_bytes"] == 128 * MiB and hbm["backend"] == "cuda-ipc"
        assert hbm["used_bytes"] == 0 and hbm["up"] is True
        assert "cpu" in stats["tiers"] and "nvme" in stats["tiers"]
        assert "hbm 0.12 GiB (cuda device 0)" in d.banner()
        from kvtier.cli import render_stats

        assert any(line.startswith("hbm ") for line in render_stats(stats).splitlines())
        pool = HostPool.instances[-1]
    finally:
        await d.stop()
    assert pool.closed


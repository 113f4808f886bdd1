"""The cupy side of the HBM tier (``CupyDevicePool``, ``HbmMapping.open``/``close``) over a
fake cupy whose copies land only when their stream is synchronised (mutation review
survivors: no CPU test ran these paths, and they have never run on a GPU).

The fake keeps "device memory" in host buffers, so the bytes a copy moved can be checked;
``memcpyAsync`` queues a copy on its stream, and only ``Stream.synchronize`` performs it,
as an asynchronous DMA may land any time before that.
"""

from __future__ import annotations

import ctypes
import sys
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvtier.errors import BufferSizeError
from kvtier.tiers import hbm_mapping
from kvtier.tiers.hbm_mapping import IPC_HANDLE_BYTES, HbmMapping
from kvtier.tiers.hbm_pool import CupyDevicePool, _check_range

H2D, D2H = 1, 2
BUS_IDS = ["0000:3B:00.0", "0000:C1:00.0"]   # device 0, device 1


class FakeRuntime:
    """cupy.cuda.runtime: allocations, queued async copies, IPC handles, devices."""

    memcpyHostToDevice = H2D
    memcpyDeviceToHost = D2H

    class CUDARuntimeError(RuntimeError):
        pass

    def __init__(self) -> None:
        self.current = 0
        self.allocs: dict[int, np.ndarray] = {}     # device pointer -> backing buffer
        self.queued: dict[int, list[tuple[int, int, int]]] = {}   # stream ptr -> copies
        self.opened: list[tuple[bytes, int]] = []   # (handle, current device)
        self.closed: list[tuple[int, int]] = []     # (pointer, current device)
        self.freed = 0

    def in_device(self, ptr: int, n: int) -> bool:
        return any(p <= ptr and ptr + n <= p + len(b) for p, b in self.allocs.items())

    def memset(self, ptr: int, value: int, n: int) -> None:
        ctypes.memset(ptr, value, n)

    def deviceSynchronize(self) -> None:
        pass

    def deviceGetPCIBusId(self, device: int) -> str:
        return BUS_IDS[device]

    def getDeviceCount(self) -> int:
        return len(BUS_IDS)

    def getDevice(self) -> int:
        return self.current

    def getDeviceProperties(self, device: int) -> dict[str, Any]:
        return {"name": b"Fake H100"}

    def memcpyAsync(self, dst: int, src: int, n: int, kind: int, stream: int) -> None:
        if kind == H2D and not (self.in_device(dst, n) and not self.in_device(src, n)):
            raise self.CUDARuntimeError("cudaErrorInvalidValue: not a host-to-device copy")
        if kind != H2D:
            raise self.CUDARuntimeError(f"unexpected copy kind {kind}")
        self.queued.setdefault(stream, []).append((dst, src, n))

    def ipcGetMemHandle(self, ptr: int) -> bytes:
        return ptr.to_bytes(8, "little").ljust(IPC_HANDLE_BYTES, b"\1")

    def ipcOpenMemHandle(self, handle: bytes) -> int:
        self.opened.append((bytes(handle), self.current))
        return 0x7000_0000_0000 + 0x1000_0000 * len(self.opened)

    def ipcCloseMemHandle(self, ptr: int) -> None:
        self.closed.append((ptr, self.current))


def fake_cupy() -> tuple[types.ModuleType, FakeRuntime]:
    rt = FakeRuntime()

    class Device:
        def __init__(self, index: int) -> None:
            self.index = index

        def __enter__(self) -> Device:
            self.prev, rt.current = rt.current, self.index
            return self

        def __exit__(self, *exc: object) -> None:
            rt.current = self.prev

    class Memory:
        def __init__(self, size: int) -> None:
            self.buf = np.full(size, 0xAB, dtype=np.uint8)   # stale device memory
            self.ptr = int(self.buf.ctypes.data)
            rt.allocs[self.ptr] = self.buf

        def __del__(self) -> None:
            rt.allocs.pop(self.ptr, None)
            rt.freed += 1

    class Stream:
        made: list[Stream] = []

        def __init__(self, non_blocking: bool = False) -> None:
            self.non_blocking = non_blocking
            self.ptr = 0x5000 + len(Stream.made)
            Stream.made.append(self)

        def synchronize(self) -> None:
            for dst, src, n in rt.queued.pop(self.ptr, []):
                ctypes.memmove(dst, src, n)

    class MemoryPointer:
        def __init__(self, mem: Memory, offset: int) -> None:
            self.mem, self.ptr = mem, mem.ptr + offset

    def ndarray(shape: tuple[int], dtype: Any, memptr: MemoryPointer) -> np.ndarray:
        return np.ctypeslib.as_array((ctypes.c_uint8 * shape[0]).from_address(memptr.ptr))

    mod = types.ModuleType("cupy")
    mod.uint8 = np.uint8  # type: ignore[attr-defined]
    mod.ndarray = ndarray  # type: ignore[attr-defined]
    mod.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        runtime=rt, Device=Device, Stream=Stream,
        memory=types.SimpleNamespace(Memory=Memory, MemoryPointer=MemoryPointer))
    return mod, rt


@pytest.fixture
def cupy(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeRuntime]:
    mod, rt = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", mod)
    monkeypatch.setattr(hbm_mapping, "_MAPPINGS", {})
    yield rt
    rt.queued.clear()


def host(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


# ---------------------------------------------------------------------- the device pool
def test_copy_in_returns_with_every_byte_on_the_device(cupy: FakeRuntime) -> None:
    """The daemon hands a slot to an engine as soon as ``copy_in`` returns: without the
    stream synchronise (or with the copies on another stream than the one synchronised)
    the engine would read the slot before the DMA landed, wrong KV. Each item goes to its
    own offset, host to device, on a non-blocking stream of the pool's own."""
    pool = CupyDevicePool(1 << 16, device=1)
    a, b = host(4096, 1), host(8192, 2)
    pool.copy_in([(0, a), (12288, b)])
    assert not any(cupy.queued.values())
    assert np.array_equal(pool.view(0, 4096), a)
    assert np.array_equal(pool.view(12288, 8192), b)
    stream = sys.modules["cupy"].cuda.Stream.made[-1]
    assert stream.non_blocking   # a blocking stream serialises with the engine's work


def test_copy_in_checks_every_range_before_any_copy(cupy: FakeRuntime) -> None:
    """A batch with one slot out of the pool is refused before any DMA is queued: the
    checks inside the copy loop would have written the earlier items (and a real
    ``cudaMemcpyAsync`` past the allocation corrupts device memory)."""
    pool = CupyDevicePool(1 << 16)
    with pytest.raises(BufferSizeError):
        pool.copy_in([(0, host(4096, 1)), ((1 << 16) - 4096, host(8192, 2))])
    assert not any(cupy.queued.values())
    assert np.all(pool.view(0, 4096) == 0)


def test_pool_is_zeroed_views_address_their_offset_and_close_frees(
        cupy: FakeRuntime) -> None:
    """A fresh pool is zeroed (cudaMalloc memory holds whatever ran before), ``view``
    addresses its own offset (offset 0 would hand out another block's bytes), and
    ``close`` drops the allocation (else the daemon keeps hbm.bytes of device memory)."""
    pool = CupyDevicePool(1 << 14)
    assert np.all(pool.view(0, 1 << 14) == 0)
    data = host(4096, 3)
    pool.copy_in([(8192, data)])
    assert np.array_equal(pool.view(8192, 4096), data)
    assert pool.describe() == {"device": 0, "device_name": "Fake H100",
                               "pci_bus_id": BUS_IDS[0]}
    pool.close()
    assert cupy.freed == 1 and pool.ptr == 0


def test_a_negative_length_is_outside_the_pool() -> None:
    """``_check_range`` guards every device range: a negative length must not pass as a
    range that ends inside the pool."""
    with pytest.raises(BufferSizeError):
        _check_range(4096, -1, 1 << 16)
    _check_range(0, 1 << 16, 1 << 16)


# ---------------------------------------------------------------------- the engine mapping
HANDLE = bytes(range(IPC_HANDLE_BYTES))


def test_open_maps_once_per_process_and_the_last_close_unmaps(cupy: FakeRuntime) -> None:
    """Clients of one process share one mapping: a second ``open`` of the same handle is
    a reference (CUDA refuses to open a handle twice in a context), the first ``close``
    keeps the mapping (the other client still copies from it), the last one unmaps once,
    and an extra ``close`` makes no CUDA call (a double ``cudaIpcCloseMemHandle``)."""
    a = HbmMapping.open(HANDLE, 1 << 20)
    b = HbmMapping.open(HANDLE, 1 << 20)
    assert a is b and len(cupy.opened) == 1
    a.close()
    assert cupy.closed == [] and b.device_ptr(4096) == b.ptr + 4096
    b.close()
    assert cupy.closed == [(a.ptr, 0)]
    b.close()
    assert cupy.closed == [(a.ptr, 0)]
    c = HbmMapping.open(HANDLE, 1 << 20)   # a daemon restart: a new mapping
    assert c is not a and len(cupy.opened) == 2
    c.close()


def test_open_and_close_run_on_the_pool_s_gpu_found_by_bus_id(cupy: FakeRuntime) -> None:
    """With ``CUDA_VISIBLE_DEVICES`` numbering GPUs differently, the daemon's device
    ordinal is wrong here: the bus id picks the local ordinal, and both the IPC open and
    the close must run with that device current (another device's context cannot map
    or unmap the pool)."""
    m = HbmMapping.open(HANDLE, 1 << 20, device=0, pci_bus_id="00000000:c1:00.0")
    assert m.device == 1 and cupy.opened == [(HANDLE, 1)]
    assert cupy.current == 0
    m.close()
    assert cupy.closed == [(m.ptr, 1)]


def test_on_current_device_compares_with_the_thread_s_device(cupy: FakeRuntime) -> None:
    """A caller on another GPU must not map the pool (a context on the pool's GPU and
    peer copies); the one on the pool's GPU maps it."""
    assert HbmMapping.on_current_device(0)
    assert not HbmMapping.on_current_device(1)
    assert not HbmMapping.on_current_device(0, pci_bus_id=BUS_IDS[1])
    cupy.current = 1
    assert HbmMapping.on_current_device(0, pci_bus_id=BUS_IDS[1])


def test_a_forked_child_forgets_the_parent_s_mappings(cupy: FakeRuntime) -> None:
    """In a forked child the parent's mapping is a pointer of a context the child does
    not have: it is marked closed (its clients' ``close`` makes no CUDA call) and
    forgotten (an ``open`` maps anew)."""
    parent = HbmMapping.open(HANDLE, 1 << 20)
    hbm_mapping._after_fork_in_child()
    assert parent._closed and not hbm_mapping._MAPPINGS
    parent.close()
    assert cupy.closed == []
    child = HbmMapping.open(HANDLE, 1 << 20)
    assert child is not parent and len(cupy.opened) == 2

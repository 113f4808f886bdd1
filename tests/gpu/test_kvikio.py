"""The nvme tier through real kvikio: selection, host-buffer frames, device-buffer frames.

Skipped (by tests/gpu/conftest.py) where no GPU is usable, and here when kvikio is missing.
These are the only checks of KvikioFileIO against the real library; it was written without
a GPU. ``KVTIER_GPU_TEST_DIR`` points the slot files at a disk-backed directory (GDS does not
work on tmpfs; kvikio then runs its compat mode).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.frame import make_header
from kvtier.tiers.aligned import aligned_buffer
from kvtier.tiers.nvme import PAGE, NvmeTier
from kvtier.tiers.nvme.backends import cuda_driver_status, make_frame_io, select_nvme_backend
from kvtier.tiers.nvme.kvikio_io import KvikioFileIO

pytestmark = pytest.mark.gpu
kvikio = pytest.importorskip("kvikio", reason="kvikio not installed (pip install 'kvtier[gpu]')")

NS = bytes(range(16))
LAYOUT = 77
MiB = 1 << 20
SIZES = [1, PAGE, 3 * PAGE + 5, MiB + 17, 5 * MiB]   # below and above kvikio's GDS threshold


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    base = os.environ.get("KVTIER_GPU_TEST_DIR")
    if not base:
        yield tmp_path / "nvme"
        return
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="kvtier-kvikio-", dir=base))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _kvikio_tier(root: Path) -> NvmeTier:
    io = make_frame_io(select_nvme_backend("kvikio"), threads=4)
    assert isinstance(io, KvikioFileIO)
    return NvmeTier(root, 256 * MiB, io=io)


def test_driver_probe_and_auto_selection() -> None:
    assert cuda_driver_status().ok
    choice = select_nvme_backend("auto")
    assert choice.name == "kvikio", choice.reason


async def test_host_frames_round_trip_and_stay_posix_readable(root: Path) -> None:
    rng = random.Random(3)
    t = _kvikio_tier(root)
    t.open()
    assert t.backend.startswith("kvikio") and t.stats_extra()["io_backend"] == "kvikio"
    blocks = {}
    for i, n in enumerate(SIZES):
        buf = aligned_buffer(NvmeTier.slot_bytes_for(n))
        buf[:n] = rng.randbytes(n)
        slot = t.alloc(n)
        assert slot is not None
        await t.write(slot, make_header(NS, _key(i), LAYOUT, buf[:n], seq=t.next_seq()), buf)
        blocks[i] = (slot, bytes(buf[:n]))
    for i, (slot, data) in blocks.items():
        out = aligned_buffer(slot.slot_bytes)
        h = await t.read_into(slot, out, namespace=NS, key=_key(i), layout_fp=LAYOUT)
        assert bytes(out[:h.payload_len]) == data
    t.close()
    posix = NvmeTier(root, 256 * MiB)
    found = {int.from_bytes(h.key, "little"): s for s, h in posix.open()}
    for i, (_, data) in blocks.items():
        out = aligned_buffer(found[i].slot_bytes)
        h = await posix.read_into(found[i], out, namespace=NS, key=_key(i), layout_fp=LAYOUT)
        assert bytes(out[:h.payload_len]) == data
    posix.close()


async def test_device_buffers_to_and_from_nvme(root: Path) -> None:
    import cupy

    t = _kvikio_tier(root)
    t.open()
    io: Any = t.io
    try:
        for i, n in enumerate(SIZES):
            host = cupy.random.randint(0, 256, n, dtype=cupy.int32).astype(cupy.uint8)
            host_bytes = cupy.asnumpy(host).tobytes()
            slot = t.alloc(n)
            assert slot is not None
            junk = bytes(n)   # a stored frame first, so the slot is STORED for read_into
            await t.write(slot, make_header(NS, _key(i), LAYOUT, junk, seq=t.next_seq()),
                          memoryview(junk))
            # the slot file's descriptor, pinned while it is used here (no public accessor)
            files = t._slots.files
            slot_file = t._slots.classes[slot.slot_bytes].file
            header = make_header(NS, _key(i), LAYOUT, host_bytes, seq=t.next_seq())
            # HBM -> NVMe: straight from device memory, over the junk frame
            with files.held(slot_file) as fd:
                io.write_frame_device(fd, slot.offset, header.pack(), host, n)
            # the POSIX path reads what the device path wrote
            out = aligned_buffer(slot.slot_bytes)
            h = await t.read_into(slot, out, namespace=NS, key=_key(i), layout_fp=LAYOUT)
            assert bytes(out[:h.payload_len]) == host_bytes
            # NVMe -> HBM: straight into device memory, verified
            dev = cupy.zeros(slot.slot_bytes, dtype=cupy.uint8)
            with files.held(slot_file) as fd:
                h2, nbytes = io.read_frame_device(fd, slot.offset, dev, slot.slot_bytes,
                                                  namespace=NS, key=_key(i),
                                                  layout_fp=LAYOUT)
            assert nbytes == PAGE + n and h2.payload_len == n
            assert cupy.asnumpy(dev[:n]).tobytes() == host_bytes
    finally:
        t.close()

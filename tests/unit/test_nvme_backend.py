"""nvme I/O backend selection and the kvikio FrameIO, on the CPU.

kvikio and the CUDA driver are faked here (``sys.modules`` and the ``libcuda`` loader); the
real kvikio path runs only in tests/gpu/test_kvikio.py on a GPU host.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import load_config
from kvtier.errors import ConfigError, FrameError
from kvtier.frame import make_header
from kvtier.tiers.aligned import aligned_buffer
from kvtier.tiers.base import tier_stats
from kvtier.tiers.nvme import PAGE, NvmeIOError, NvmeTier, PosixFrameIO
from kvtier.tiers.nvme import backends as nb
from kvtier.tiers.nvme.backends import (
    BackendChoice,
    cuda_driver_status,
    make_frame_io,
    select_nvme_backend,
)
from kvtier.tiers.nvme.kvikio_io import KvikioFileIO, kvikio_mode
from tests.support.fake_gpu_libs import (
    FakeCuFile,
    FakeDriver,
    fake_kvikio,
    no_kvikio,
    no_libcuda,
    with_driver,
    with_kvikio,
)

NS = bytes(range(16))
LAYOUT = 0xABCD
MiB = 1 << 20


# ---------------------------------------------------------------------- fakes
@pytest.fixture(autouse=True)
def _reset_fakes() -> Iterator[None]:
    FakeCuFile.fail = None
    FakeCuFile.opened = []
    yield
    FakeCuFile.fail = None


# ---------------------------------------------------------------------- driver probe
def test_driver_probe_without_libcuda(monkeypatch: pytest.MonkeyPatch) -> None:
    no_libcuda(monkeypatch)
    st = cuda_driver_status()
    assert not st.ok and st.devices == 0
    assert "libcuda.so.1 cannot be loaded" in st.reason and "no NVIDIA driver" in st.reason


def test_driver_probe_reports_cuinit_errors_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with_driver(monkeypatch, FakeDriver(init_rc=100))
    st = cuda_driver_status()
    assert not st.ok and "cuInit failed: CUDA_ERROR_NO_DEVICE (100)" in st.reason
    with_driver(monkeypatch, FakeDriver(init_rc=999))
    assert "CUDA error 999" in cuda_driver_status().reason


def test_driver_probe_no_visible_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with_driver(monkeypatch, FakeDriver(count=0))
    st = cuda_driver_status()
    assert not st.ok and "sees no device" in st.reason and "CUDA_VISIBLE_DEVICES=''" in st.reason
    with_driver(monkeypatch, FakeDriver(count_rc=35))
    assert "CUDA_ERROR_INSUFFICIENT_DRIVER" in cuda_driver_status().reason


def test_driver_probe_with_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    with_driver(monkeypatch, FakeDriver(count=2))
    st = cuda_driver_status()
    assert st.ok and st.devices == 2


def test_driver_probe_never_raises_on_a_bogus_library(monkeypatch: pytest.MonkeyPatch) -> None:
    with_driver(monkeypatch, object())   # no cuInit at all
    st = cuda_driver_status()
    assert not st.ok and "not a usable CUDA driver" in st.reason


# ---------------------------------------------------------------------- selection
def test_auto_without_kvikio_is_posix(monkeypatch: pytest.MonkeyPatch) -> None:
    no_kvikio(monkeypatch)
    choice = select_nvme_backend("auto")
    assert choice == BackendChoice("posix", "kvikio not installed (pip install 'kvtier[gpu]')")


def test_auto_with_kvikio_but_no_libcuda_is_posix(monkeypatch: pytest.MonkeyPatch) -> None:
    with_kvikio(monkeypatch)
    no_libcuda(monkeypatch)
    choice = select_nvme_backend("auto")
    assert choice.name == "posix"
    assert "libcuda.so.1 cannot be loaded" in choice.reason


def test_auto_with_kvikio_and_driver_but_no_device_is_posix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with_kvikio(monkeypatch)
    with_driver(monkeypatch, FakeDriver(count=0))
    choice = select_nvme_backend("auto")
    assert choice.name == "posix" and "no device" in choice.reason


def test_auto_with_everything_is_kvikio(monkeypatch: pytest.MonkeyPatch) -> None:
    with_kvikio(monkeypatch, version="26.10.0")
    with_driver(monkeypatch, FakeDriver(count=8))
    choice = select_nvme_backend("auto")
    assert choice.name == "kvikio"
    assert choice.reason == "auto: kvikio 26.10.0 and 8 CUDA device(s) visible"


def test_a_broken_kvikio_install_is_a_reason_not_a_crash(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(name: str, *a: Any, **k: Any) -> Any:
        raise OSError("libkvikio.so: undefined symbol cuFileDriverOpen")

    monkeypatch.delitem(sys.modules, "kvikio", raising=False)
    monkeypatch.setattr(nb.importlib, "import_module", boom)
    choice = select_nvme_backend("auto")
    assert choice.name == "posix"
    assert choice.reason.startswith("kvikio failed to import (OSError: libkvikio.so")


def test_forced_kvikio_without_driver_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with_kvikio(monkeypatch)
    no_libcuda(monkeypatch)
    with pytest.raises(ConfigError) as err:
        select_nvme_backend("kvikio")
    msg = str(err.value)
    assert msg.startswith("nvme.backend = kvikio but libcuda.so.1 cannot be loaded")
    assert "even in compat mode" in msg and "nvme.backend = auto" in msg


def test_forced_kvikio_without_kvikio_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    no_kvikio(monkeypatch)
    with pytest.raises(ConfigError, match="kvikio not installed"):
        select_nvme_backend("kvikio")


def test_forced_kvikio_with_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    with_kvikio(monkeypatch)
    with_driver(monkeypatch, FakeDriver())
    choice = select_nvme_backend("kvikio")
    assert choice.name == "kvikio" and choice.reason.startswith("nvme.backend = kvikio:")
    assert choice.forced and not select_nvme_backend("auto").forced


def test_posix_is_never_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*a: Any, **k: Any) -> Any:
        raise AssertionError("posix must not probe kvikio or the driver")

    monkeypatch.setattr(nb, "_import_kvikio", fail)
    monkeypatch.setattr(nb, "cuda_driver_status", fail)
    assert select_nvme_backend("posix") == BackendChoice("posix", "nvme.backend = posix", True)


def test_unknown_backend_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="auto, posix or kvikio"):
        select_nvme_backend("spdk")


# ---------------------------------------------------------------------- kvikio mode
def test_kvikio_mode_across_api_generations() -> None:
    assert kvikio_mode(fake_kvikio(compat=True)) == "compat"
    assert kvikio_mode(fake_kvikio(compat=False)) == "gds"

    class CompatMode:
        def __init__(self, name: str) -> None:
            self.name = name

    legacy = types.SimpleNamespace(defaults=types.SimpleNamespace(
        compat_mode=lambda: CompatMode("OFF")))
    assert kvikio_mode(legacy) == "gds"
    legacy.defaults.compat_mode = lambda: CompatMode("ON")
    assert kvikio_mode(legacy) == "compat"
    legacy.defaults.compat_mode = lambda: CompatMode("AUTO")
    assert kvikio_mode(legacy) == "unknown"
    legacy.defaults.compat_mode = lambda: True
    assert kvikio_mode(legacy) == "compat"

    def raises() -> bool:
        raise RuntimeError("no driver")

    assert kvikio_mode(types.SimpleNamespace(defaults=types.SimpleNamespace(
        is_compat_mode_preferred=raises))) == "unknown"
    assert kvikio_mode(types.SimpleNamespace()) == "unknown"


def test_kvikio_threads_follow_io_threads_unless_env_says(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    mod = fake_kvikio()
    KvikioFileIO("r", threads=6, kvikio_module=mod)
    assert mod.defaults.calls == [{"num_threads": 6}]
    monkeypatch.setenv("KVIKIO_NTHREADS", "2")
    mod = fake_kvikio()
    KvikioFileIO("r", threads=6, kvikio_module=mod)
    assert mod.defaults.calls == []


# ---------------------------------------------------------------------- make_frame_io
def test_make_frame_io_posix() -> None:
    io = make_frame_io(BackendChoice("posix", "kvikio not installed"))
    assert isinstance(io, PosixFrameIO) and io.reason == "kvikio not installed"


def test_make_frame_io_kvikio(monkeypatch: pytest.MonkeyPatch) -> None:
    with_kvikio(monkeypatch, compat=False)
    io = make_frame_io(BackendChoice("kvikio", "auto: ..."), threads=2)
    assert isinstance(io, KvikioFileIO)
    assert io.label(False) == "kvikio" and io.stats_extra()["kvikio_mode"] == "gds"


def test_make_frame_io_falls_back_when_kvikio_cannot_be_set_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kvikio", None)   # vanished between selection and set-up
    io = make_frame_io(BackendChoice("kvikio", "auto: kvikio 1 and 1 CUDA device(s) visible"))
    assert isinstance(io, PosixFrameIO) and io.reason.startswith("kvikio set-up failed")
    with pytest.raises(ConfigError, match=r"nvme\.backend = kvikio but kvikio set-up failed"):
        make_frame_io(BackendChoice("kvikio", "nvme.backend = kvikio: ...", forced=True))


# ---------------------------------------------------------------------- the tier with kvikio
def _block(rng: random.Random, n: int) -> memoryview:
    buf = aligned_buffer(NvmeTier.slot_bytes_for(n))
    buf[:n] = rng.randbytes(n)
    return buf


async def _put(t: NvmeTier, i: int, payload: memoryview, n: int) -> Any:
    slot = t.alloc(n)
    assert slot is not None
    header = make_header(NS, i.to_bytes(16, "little"), LAYOUT, payload[:n], seq=t.next_seq())
    await t.write(slot, header, payload)
    return slot


async def _get(t: NvmeTier, slot: Any, i: int, out_len: int | None = None) -> bytes:
    out = aligned_buffer(out_len if out_len is not None else slot.slot_bytes)
    h = await t.read_into(slot, out, namespace=NS, key=i.to_bytes(16, "little"),
                          layout_fp=LAYOUT)
    return bytes(out[:h.payload_len])


def kvikio_tier(root: Path, capacity: int = 64 * MiB, compat: bool = True) -> NvmeTier:
    io = KvikioFileIO("auto: test", kvikio_module=fake_kvikio(compat=compat))
    return NvmeTier(root, capacity, direct="auto", io=io)


@pytest.mark.parametrize("sizes", [[PAGE, 3 * PAGE + 17, 1, 0, 256 * 1024 + 5]])
async def test_kvikio_io_round_trip_and_same_format_as_posix(tmp_path: Path,
                                                             sizes: list[int]) -> None:
    rng = random.Random(7)
    t = kvikio_tier(tmp_path)
    assert t.open() == []
    assert t.backend == "kvikio-compat"
    assert t.stats_extra() == {"io_backend": "kvikio", "io_backend_reason": "auto: test",
                               "direct": t.direct, "disk_bytes": 0, "punched_slots": 0,
                               "open_files": 0, "file_reopens": 0, "file_closes": 0,
                               "kvikio_mode": "compat", "kvikio_version": "26.10.0"}
    blocks = {i: _block(rng, n) for i, n in enumerate(sizes)}
    slots = {i: await _put(t, i, blocks[i], n) for i, n in enumerate(sizes)}
    for i, n in enumerate(sizes):
        assert await _get(t, slots[i], i) == bytes(blocks[i][:n])
    # a payload view shorter than its slot (not the padded arena slot) also works
    short = memoryview(bytearray(rng.randbytes(5000)))
    slot = await _put(t, 99, short, 5000)
    assert await _get(t, slot, 99) == bytes(short)
    assert t.counters.bytes_written > 0 and t.counters.bytes_read > 0
    handles = list(FakeCuFile.opened)
    t.close()
    assert handles and all(h.closed for h in handles)

    posix = NvmeTier(tmp_path, 64 * MiB, direct="auto")   # restart on the POSIX backend
    found = {int.from_bytes(h.key, "little"): s for s, h in posix.open()}
    assert set(found) == {*range(len(sizes)), 99}
    for i, n in enumerate(sizes):
        assert await _get(posix, found[i], i) == bytes(blocks[i][:n])
    new = await _put(posix, 200, blocks[0], sizes[0])
    posix.close()

    back = kvikio_tier(tmp_path)   # and frames written by POSIX read through kvikio
    found = {int.from_bytes(h.key, "little"): s for s, h in back.open()}
    assert found[200] == new
    assert await _get(back, found[200], 200) == bytes(blocks[0][:sizes[0]])
    back.close()


async def test_kvikio_io_truncated_and_corrupt_frames_are_frame_errors(tmp_path: Path) -> None:
    rng = random.Random(1)
    t = kvikio_tier(tmp_path)
    t.open()
    payload = _block(rng, 3 * PAGE)
    slot = await _put(t, 1, payload, 3 * PAGE)
    path = tmp_path / f"slots-{slot.slot_bytes}.dat"
    os.truncate(path, slot.offset + PAGE + PAGE)          # payload cut short on disk
    with pytest.raises(FrameError, match="payload truncated"):
        await _get(t, slot, 1)
    os.truncate(path, slot.offset + 10)                   # header cut short
    with pytest.raises(FrameError, match="slot truncated"):
        await _get(t, slot, 1)
    assert t.counters.checksum_failures == 2
    slot2 = await _put(t, 2, payload, 3 * PAGE)
    with open(path, "r+b") as f:                          # flip one payload byte
        f.seek(slot2.offset + PAGE + 10)
        b = f.read(1)
        f.seek(slot2.offset + PAGE + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(FrameError):
        await _get(t, slot2, 2)
    with pytest.raises(FrameError):                       # wrong key
        await _get(t, slot2, 3)
    from kvtier.errors import BufferSizeError

    slot3 = await _put(t, 3, payload, 3 * PAGE)
    with pytest.raises(BufferSizeError):
        await _get(t, slot3, 3, out_len=PAGE)
    t.close()


async def test_kvikio_errors_are_counted_nvme_io_errors(tmp_path: Path) -> None:
    rng = random.Random(2)
    t = kvikio_tier(tmp_path)
    t.open()
    payload = _block(rng, PAGE)
    slot = await _put(t, 1, payload, PAGE)
    FakeCuFile.fail = "pread"
    with pytest.raises(NvmeIOError, match="kvikio pread failed: cuFile error"):
        await _get(t, slot, 1)
    FakeCuFile.fail = "pwrite"
    slot2 = t.alloc(PAGE)
    assert slot2 is not None
    header = make_header(NS, (5).to_bytes(16, "little"), LAYOUT, payload[:PAGE], seq=1)
    with pytest.raises(NvmeIOError, match="kvikio pwrite failed"):
        await t.write(slot2, header, payload)
    assert t.counters.errors == 2
    FakeCuFile.fail = None
    assert await _get(t, slot, 1) == bytes(payload[:PAGE])   # the tier keeps working
    t.close()


def test_kvikio_open_failure_is_an_os_error_and_leaks_no_descriptor(tmp_path: Path) -> None:
    class Refusing(FakeCuFile):
        def __init__(self, path: str, flags: str = "r") -> None:
            raise RuntimeError("cuFileHandleRegister failed")

    mod = fake_kvikio()
    mod.CuFile = Refusing  # type: ignore[attr-defined]
    t = NvmeTier(tmp_path, 8 * MiB, io=KvikioFileIO("x", kvikio_module=mod))
    t.open()
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="kvikio could not open"):
        t.alloc(PAGE)
    assert len(os.listdir("/proc/self/fd")) == before
    t.close()


# ---------------------------------------------------------------------- the posix default
async def test_default_tier_reports_posix_in_stats(tmp_path: Path) -> None:
    t = NvmeTier(tmp_path, 8 * MiB, direct="off")
    t.open()
    assert t.backend == "posix"
    assert isinstance(t.io, PosixFrameIO)
    stats = {**tier_stats(t), **t.stats_extra()}
    assert stats["io_backend"] == "posix" and stats["io_backend_reason"] == "default"
    assert stats["backend"] == "posix" and stats["direct"] is False
    t.close()


def test_daemon_builds_the_nvme_tier_with_the_selected_backend(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.daemon.service import Daemon

    no_kvikio(monkeypatch)
    cfg = load_config(env={}, overrides={"daemon.data_dir": tmp_path, "nvme.bytes": "8MiB"})
    tier = Daemon(cfg)._make_nvme()
    assert tier.stats_extra()["io_backend"] == "posix"
    assert tier.stats_extra()["io_backend_reason"].startswith("kvikio not installed")

    cfg = load_config(env={}, overrides={"daemon.data_dir": tmp_path, "nvme.backend": "kvikio"})
    with pytest.raises(ConfigError, match=r"nvme\.backend = kvikio but kvikio not installed"):
        Daemon(cfg)._make_nvme()


def test_selection_survives_an_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Selection is sync and cheap: callable from the daemon's start() on the loop."""
    no_kvikio(monkeypatch)

    async def pick() -> BackendChoice:
        return select_nvme_backend("auto")

    assert asyncio.run(pick()).name == "posix"

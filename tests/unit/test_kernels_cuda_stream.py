"""LayerStreams' synchronous CPU fallback and input checks (no GPU needed)."""

from __future__ import annotations

import sys

import pytest
from kvtier.kernels import cuda_stream
from kvtier.kernels.cuda import is_device_accessible
from kvtier.kernels.cuda_stream import LayerStreams, register_host_memory


def test_cpu_fallback_runs_transfers_synchronously_in_order():
    streams = LayerStreams(3, device="cpu") if _has_torch() else LayerStreams(3)
    assert not streams.is_async
    assert streams.load_stream is None and streams.save_stream is None
    calls: list[tuple[str, int, object]] = []
    streams.start_step()
    for layer in range(3):
        def load(s: object, i: int = layer) -> None:
            calls.append(("load", i, s))

        streams.load_layer(layer, load)
        assert streams.layer_loaded(layer)
    assert calls == [("load", 0, None), ("load", 1, None), ("load", 2, None)]
    for layer in range(3):
        streams.wait_for_layer(layer)
    streams.save_layer(1, lambda s: calls.append(("save", 1, s)))
    assert calls[-1] == ("save", 1, None)
    streams.wait_for_saves()


def test_new_step_forgets_previous_loads():
    streams = LayerStreams(2)
    streams.load_layer(0, lambda s: None)
    assert streams.layer_loaded(0) and not streams.layer_loaded(1)
    streams.start_step()
    assert not streams.layer_loaded(0)
    streams.wait_for_layer(1)  # nothing submitted: returns at once


def test_layer_bounds_and_size_checked():
    streams = LayerStreams(2)
    with pytest.raises(IndexError):
        streams.load_layer(2, lambda s: None)
    with pytest.raises(IndexError):
        streams.wait_for_layer(-1)
    with pytest.raises(ValueError):
        LayerStreams(0)


def test_transfer_errors_propagate_on_the_fallback():
    streams = LayerStreams(1)

    def boom(stream: object) -> None:
        raise OSError("arena read failed")

    with pytest.raises(OSError):
        streams.load_layer(0, boom)
    assert not streams.layer_loaded(0)


def test_host_registration_without_a_gpu_is_a_clean_no():
    buf = bytearray(4096)
    import ctypes

    address = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    if _gpu_present():
        pytest.skip("a GPU is present: registration would succeed")
    assert register_host_memory(address, len(buf)) is False


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _gpu_present() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.parametrize(("status", "registered"), [(None, True), (712, True), (2, False)])
def test_memory_another_registry_registered_counts_as_registered(
        monkeypatch: pytest.MonkeyPatch, status: int | None, registered: bool) -> None:
    """cudaHostRegister of memory this process registered already (a second registry)
    fails with cudaErrorHostMemoryAlreadyRegistered: the memory is registered all the same;
    any other failure (2: out of memory) is a clean no."""
    import types

    class CUDARuntimeError(Exception):
        def __init__(self, status: int) -> None:
            super().__init__(f"status {status}")
            self.status = status

    def host_register(address: int, nbytes: int, flags: int) -> None:
        assert flags == 0x01 | 0x02
        if status is not None:
            raise CUDARuntimeError(status)

    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1, hostRegister=host_register,
                                    CUDARuntimeError=CUDARuntimeError)
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=runtime)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(cuda_stream, "_REGISTERED", ())
    assert register_host_memory(4096, 4096) is registered
    # a row in registered memory needs no cudaPointerGetAttributes (this fake has none)
    # (712: registered, but not recorded: CUDA says so for any overlap)
    assert cuda_stream.in_registered_memory(4096 + 100, 3996) is (status is None)
    assert not cuda_stream.in_registered_memory(4096 + 100, 3997)
    if status is None:
        assert is_device_accessible(4096 + 2048)


def test_the_kernels_compile_once_per_device_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU worker's loader and saver threads both compile the transfer kernels at start
    (not on the first step's loads); one NVRTC compile per device, not one per thread."""
    import threading
    import types

    from kvtier.kernels import cuda

    compiles: list[int] = []
    gate = threading.Event()

    class RawModule:
        def __init__(self, code: str, options: tuple[str, ...]) -> None:
            assert "kvtier_gather" in code and options == ("-std=c++17",)

        def compile(self) -> None:
            gate.wait(5)              # both threads arrive while the first compiles
            compiles.append(1)

    class Device:
        def __init__(self, index: int) -> None:
            self.index = index

        def __enter__(self) -> Device:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1)
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(runtime=runtime, Device=Device)  # type: ignore[attr-defined]
    fake.RawModule = RawModule  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cuda, "_MODULES", {})
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(cuda.warm_kernels(0)))
               for _ in range(2)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(10)
    assert results == [True, True] and compiles == [1]
    runtime.getDeviceCount = lambda: 0          # no device: nothing to compile
    assert cuda.warm_kernels(1) is False and compiles == [1]

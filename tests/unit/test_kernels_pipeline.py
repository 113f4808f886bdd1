"""LayerPipeline on the CPU: layer-by-layer readiness on the loader thread, failures that
never deadlock the forward, and the saver's byte bound (no GPU, no daemon)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvtier.kernels.pipeline import LayerPipeline  # noqa: E402

LAYERS = 16
GATE_TIMEOUT_S = 30.0


class GatedLoad:
    """Copies one tensor row per layer; the copy of ``gated`` layers waits for ``gate``."""

    def __init__(self, gated: set[int], fail_at: int | None = None,
                 fail_open: bool = False) -> None:
        self.src = torch.randn(LAYERS, 4096)
        self.dst = torch.zeros_like(self.src)
        self.gate = threading.Event()
        self.gated = gated
        self.fail_at = fail_at
        self.fail_open = fail_open
        self.copied: list[int] = []
        self.closed = False

    def open(self) -> None:
        if self.fail_open:
            raise RuntimeError("daemon gone")

    def load_layer(self, layer: int, stream: Any) -> None:
        assert stream is None
        if layer in self.gated:
            assert self.gate.wait(GATE_TIMEOUT_S)
        if layer == self.fail_at:
            raise RuntimeError("copy failed")
        self.dst[layer].copy_(self.src[layer])
        self.copied.append(layer)

    def close(self) -> set[int]:
        self.closed = True
        return set()

    def all_pages(self) -> set[int]:
        return {7, 8, 9}


def test_first_layer_is_usable_before_the_last_layer_is_copied() -> None:
    pipe = LayerPipeline(LAYERS, max_inflight_bytes=1 << 20)
    job = GatedLoad(gated={LAYERS - 1})
    pipe.start_loads(job)
    pipe.wait_for_layer(0)             # returns while the last layer's copy is held back
    trace = pipe.last_trace
    assert trace is not None and trace.waited_at[0] is not None
    assert trace.ready_at[LAYERS - 1] is None
    assert torch.equal(job.dst[0], job.src[0])
    job.gate.set()
    for layer in range(LAYERS):
        pipe.wait_for_layer(layer)
    assert pipe.finish_loads() == set()
    assert trace.waited_at[0] < trace.ready_at[LAYERS - 1]  # type: ignore[operator]
    for layer in range(LAYERS):        # no layer was used before its copy was complete
        assert trace.ready_at[layer] <= trace.waited_at[layer]  # type: ignore[operator]
    assert torch.equal(job.dst, job.src) and job.closed
    assert not pipe.loading
    pipe.close()


def test_a_failed_layer_releases_every_wait_and_reports_all_pages() -> None:
    pipe = LayerPipeline(LAYERS, max_inflight_bytes=1 << 20)
    job = GatedLoad(gated=set(), fail_at=3)
    pipe.start_loads(job)
    for layer in range(LAYERS):        # must not hang on the layers after the failure
        pipe.wait_for_layer(layer)
    assert pipe.finish_loads() == {7, 8, 9}
    assert job.copied == [0, 1, 2]     # nothing is copied after the failure
    pipe.close()


def test_a_failed_open_reports_all_pages() -> None:
    pipe = LayerPipeline(2, max_inflight_bytes=1 << 20)
    pipe.start_loads(GatedLoad(gated=set(), fail_open=True))
    pipe.wait_for_layer(1)
    assert pipe.finish_loads() == {7, 8, 9}
    pipe.close()


def test_without_a_load_the_layer_waits_are_free() -> None:
    pipe = LayerPipeline(2, max_inflight_bytes=1 << 20)
    pipe.wait_for_layer(0)
    assert pipe.finish_loads() == set() and pipe.last_trace is None
    pipe.close()


class GatedSave:
    def __init__(self, gate: threading.Event | None = None, fail: bool = False) -> None:
        self.gate = gate
        self.fail = fail
        self.events: list[str] = []

    def prepare(self) -> bool:
        self.events.append("prepare")
        return True

    def copy(self, stream: Any) -> None:
        if self.gate is not None:
            assert self.gate.wait(GATE_TIMEOUT_S)
        if self.fail:
            raise RuntimeError("gather failed")
        self.events.append("copy")

    def commit(self) -> None:
        self.events.append("commit")

    def abandon(self) -> None:
        self.events.append("abandon")


def test_saves_beyond_the_byte_bound_are_dropped_and_counted() -> None:
    pipe = LayerPipeline(2, max_inflight_bytes=1000)
    gate = threading.Event()
    over: list[bool] = []
    first = GatedSave(gate)
    fut = pipe.submit_save(first, 600, over.append)
    assert fut is not None and pipe.inflight_bytes == 600
    assert pipe.submit_save(GatedSave(), 600) is None        # would exceed: dropped
    assert pipe.save_stats.dropped == 1 and pipe.save_stats.dropped_bytes == 600
    gate.set()
    assert fut.result(GATE_TIMEOUT_S) is True
    assert first.events == ["prepare", "copy", "commit"] and over == [True]
    assert pipe.inflight_bytes == 0
    later = pipe.submit_save(GatedSave(), 600)                # room again
    assert later is not None and later.result(GATE_TIMEOUT_S)
    assert pipe.save_stats.committed == 2 and pipe.save_stats.peak_inflight_bytes == 600
    pipe.close()


def test_a_failed_save_is_abandoned_not_committed() -> None:
    pipe = LayerPipeline(2, max_inflight_bytes=1000)
    job = GatedSave(fail=True)
    fut = pipe.submit_save(job, 100)
    assert fut is not None and fut.result(GATE_TIMEOUT_S) is False
    assert job.events == ["prepare", "abandon"]
    assert pipe.save_stats.failed == 1 and pipe.inflight_bytes == 0
    pipe.close()



def test_a_waited_warm_is_done_when_it_returns(caplog: pytest.LogCaptureFixture) -> None:
    """GPU engines wait for the set-up (the arena's cudaHostRegister) before vLLM captures
    its CUDA graphs: a registration still running on another thread would fail the
    capture. A failed set-up is logged, not raised (the threads set up at first use)."""
    pipe = LayerPipeline(LAYERS, None, max_inflight_bytes=1 << 20)
    done: list[str] = []
    slow = threading.Event()

    def loader() -> None:
        slow.wait(0.2)              # slower than the call that starts it
        done.append("load")

    def saver() -> None:
        raise OSError("daemon gone")

    pipe.warm(loader, saver, wait=True)
    assert done == ["load"]
    assert "setting up a transfer thread failed (OSError: daemon gone)" in caplog.text
    background = threading.Event()
    pipe.warm(background.wait, lambda: None)   # CPU engines: in the background
    background.set()
    pipe.close()

"""Stream ordering of an asynchronous load on a GPU (``AsyncLoads._load_whole``; mutation
review survivors): the CUDA calls go to a recording fake of ``torch.cuda`` and the batch
is stood in, so the order of fence, copies, synchronise and lease release is checked on a
host without a GPU."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.support.vllm_fakes import fake

pytest.importorskip("vllm", reason="the connector package imports vLLM")

import torch
from kvtier.connectors.vllm import asyncloads

LOG: list[str] = []
FENCE = object()


class Stream:
    made = 0

    def __init__(self, device: Any = None) -> None:
        Stream.made += 1
        LOG.append(f"stream on {device.index}")

    def wait_event(self, event: Any) -> None:
        LOG.append("wait fence" if event is FENCE else "wait other")

    def synchronize(self) -> None:
        LOG.append("synchronize")


class Batch:
    """A ``LoadBatch`` stood in that logs its calls; ``fail_at`` raises in that layer."""

    fail_at: int | None = None
    gate: threading.Event | None = None

    def __init__(self, specs: list[Any], caches: Any, link: Any, tp_rank: int,
                 device_loads: bool) -> None:
        self.loaded_blocks = 2

    def open(self) -> None:
        if Batch.gate is not None:
            Batch.gate.wait(5)
        LOG.append("open")

    def load_layer(self, layer: int, stream: Any) -> None:
        LOG.append(f"layer {layer} on {'stream' if isinstance(stream, Stream) else stream}")
        if layer == Batch.fail_at:
            raise RuntimeError("cudaErrorLaunchFailure")

    def close(self) -> set[int]:
        LOG.append("release leases")
        return set()

    def all_pages(self) -> set[int]:
        LOG.append("release leases (failed)")
        return {3, 4, 5, 6}


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    @contextmanager
    def on_stream(stream: Any) -> Iterator[None]:
        LOG.append("enter stream")
        try:
            yield
        finally:
            LOG.append("leave stream")

    LOG.clear()
    monkeypatch.setattr(Stream, "made", 0)
    monkeypatch.setattr(Batch, "fail_at", None)
    monkeypatch.setattr(Batch, "gate", None)
    monkeypatch.setattr(asyncloads, "LoadBatch", Batch)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: LOG.append(f"set_device {d.index}"))
    yield LOG


def load(loads: asyncloads.AsyncLoads, fence: Any = FENCE) -> set[int]:
    """One request (pages 3..6) loaded on a fake cuda:1 cache of two layers."""
    gpu = fake(type="cuda", index=1)
    spec = fake(req_id="r", pages=[[3, 4], [5, 6]])
    loads.submit(spec, fake(caches=[fake(device=gpu)], num_layers=2), True, fence)
    loads.running["r"].result(timeout=30)
    done, failed = loads.take_done()
    assert done == {"r"}
    return failed


def test_the_load_waits_for_the_fence_and_ends_before_its_leases_go(
        cuda: list[str]) -> None:
    """The copies run on the thread's own stream of the caches' GPU (made with that GPU
    current), after the fence (the pages were another request's, still read by queued
    kernels: without the wait the load overwrites them), and the stream is synchronised
    before the leases are released (the daemon reuses a slot the moment its lease goes:
    a copy still in flight would read another block's bytes)."""
    counted: list[tuple[str, int]] = []
    loads = asyncloads.AsyncLoads(lambda: None,  # type: ignore[arg-type, return-value]
                                  0, lambda name, n: counted.append((name, n)))
    try:
        assert load(loads) == set()
    finally:
        loads.shutdown()
    assert cuda == ["set_device 1", "stream on 1", "enter stream", "wait fence", "open",
                    "layer 0 on stream", "layer 1 on stream", "leave stream",
                    "synchronize", "release leases"]
    assert counted == [("loaded_blocks", 2)]


def test_a_load_that_fails_on_the_device_synchronises_then_recomputes_every_page(
        cuda: list[str]) -> None:
    """A copy that fails mid-way: the stream is drained before the leases go back (copies
    of earlier layers may still read the slots), and every page is reported failed so
    vLLM recomputes it rather than reading half-loaded KV."""
    Batch.fail_at = 1
    loads = asyncloads.AsyncLoads(lambda: None,  # type: ignore[arg-type, return-value]
                                  0, lambda name, n: None)
    try:
        assert load(loads) == {3, 4, 5, 6}
    finally:
        loads.shutdown()
    assert cuda[-3:] == ["leave stream", "synchronize", "release leases (failed)"]


def test_one_stream_serves_every_load_of_the_worker(cuda: list[str]) -> None:
    """The pool thread's stream is made once: a stream per load leaks streams, and the
    loads of one thread would no longer be ordered with each other."""
    loads = asyncloads.AsyncLoads(lambda: None,  # type: ignore[arg-type, return-value]
                                  0, lambda name, n: None)
    try:
        load(loads)
        load(loads, fence=None)
    finally:
        loads.shutdown()
    assert Stream.made == 1
    assert cuda.count("wait fence") == 1 and "wait other" not in cuda


def test_asking_which_loads_finished_never_waits_for_one(cuda: list[str]) -> None:
    """vLLM asks every step which asynchronous loads are over: a load still copying is
    left running, not waited for (waiting stalls the engine's step for the whole copy,
    which is what loading asynchronously avoids)."""
    Batch.gate = threading.Event()
    loads = asyncloads.AsyncLoads(lambda: None,  # type: ignore[arg-type, return-value]
                                  0, lambda name, n: None)
    try:
        gpu = fake(type="cuda", index=1)
        loads.submit(fake(req_id="r", pages=[[3, 4]]),
                     fake(caches=[fake(device=gpu)], num_layers=1), True)
        assert loads.take_done() == (set(), set())
        assert set(loads.running) == {"r"}
        Batch.gate.set()
        loads.running["r"].result(timeout=30)
        assert loads.take_done() == ({"r"}, set())
        assert loads.take_done() == (set(), set())
    finally:
        Batch.gate.set()
        loads.shutdown()

"""The connector's load and save bookkeeping, no daemon and no engine: which loads hold a
page shared by three requests, the context percentiles of an engine's report, an
asynchronous load that crashed outside its batch, and a producer's save committed with a
bounded synchronous write to Redis. Each was found unpinned by a mutation review of the
connector: a test fails on its mutant."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

import numpy as np
import torch
from kvtier.connectors.vllm import asyncloads
from kvtier.connectors.vllm.config import ConnectorConfig
from kvtier.connectors.vllm.link import DaemonLink
from kvtier.connectors.vllm.loadpages import LoadPages
from kvtier.connectors.vllm.metadata import TransferSpec
from kvtier.connectors.vllm.report import engine_report
from kvtier.connectors.vllm.transfers import LoadBatch, SaveRequest, SyncBudget

from kvtier.layout import KVLayout
from tests.support.vllm_fakes import fake

TPB = 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=TPB)


def test_a_page_in_three_loads_has_all_three_holders() -> None:
    """vLLM's prefix cache shares a loaded page with later requests: every load over it
    is found (a third one missed kept its errors off the request that owns it now)."""
    pages = LoadPages()
    for req in ("a", "b", "c"):
        pages.add(req, [5, 6])
    assert pages.holders([5]) == {"a", "b", "c"}
    pages.drop("b")
    assert pages.holders([6]) == {"a", "c"}


def test_the_report_s_p99_is_the_99th_percentile() -> None:
    """``kvtier doctor`` reads the context p99 for its KV-pressure patterns: one long
    context in a hundred is what it must see, not the 90th percentile's."""
    values = engine_report({}, range(1, 101), running=0, waiting=0, preemptions=0,
                           prefill_tokens_per_s=0.0)
    assert values["context_tokens_p50"] == pytest.approx(50.5)
    assert values["context_tokens_p99"] == pytest.approx(99.01)


def test_an_async_load_that_crashed_is_reported_done_with_all_its_pages_failed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A load whose thread raised outside its batch (no stream could be made) is over
    (left unreported, vLLM waited for the request forever), and it copied nothing
    trustworthy: every page it was to fill goes out as a load error, or vLLM decodes on
    pages nothing wrote (wrong tokens)."""
    def no_stream(self: asyncloads.AsyncLoads, caches: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(asyncloads.AsyncLoads, "stream", no_stream)
    loads = asyncloads.AsyncLoads(lambda: None, 0,   # type: ignore[arg-type, return-value]
                                  lambda name, n: None)
    try:
        spec = fake(req_id="r", pages=[[3, 4]], page_ids=[3, 4], skip_pages=0)
        loads.submit(spec, fake(caches=[torch.zeros(1)], num_layers=2), False)
        loads.running["r"].exception(timeout=30)
        assert loads.take_done() == ({"r"}, {3, 4})
        assert loads.running == {}
    finally:
        loads.shutdown()


def test_a_load_whose_thread_raised_fails_all_its_pages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Should the load itself raise (past its own guard), take_done still reports every
    page the load was to fill as failed, not the request as loaded."""
    def crash(self: asyncloads.AsyncLoads, *_: Any) -> set[int]:
        raise MemoryError

    monkeypatch.setattr(asyncloads.AsyncLoads, "_load_whole", crash)
    loads = asyncloads.AsyncLoads(lambda: None, 0,   # type: ignore[arg-type, return-value]
                                  lambda name, n: None)
    try:
        spec = fake(req_id="r", pages=[[3, 4, 5]], page_ids=[3, 4, 5], skip_pages=1)
        loads.submit(spec, fake(caches=[torch.zeros(1)], num_layers=2), False)
        assert isinstance(loads.running["r"].exception(timeout=30), MemoryError)
        assert loads.take_done() == ({"r"}, {4, 5})
        assert loads.take_done() == (set(), set())   # reported once, then forgotten
    finally:
        loads.shutdown()


class Batch:
    """A ``LoadBatch`` stood in: its request's pages ``FAILED`` holds fail; ``slow`` s
    per layer; ``LOG`` records each batch closed."""

    FAILED: dict[str, set[int]] = {}
    LOG: list[str] = []
    slow = 0.0
    started = threading.Event()

    def __init__(self, specs: list[Any], *_: Any) -> None:
        self.req = specs[0].req_id
        self.loaded_blocks = 1

    def open(self) -> None:
        Batch.started.set()

    def load_layer(self, layer: int, stream: Any) -> None:
        time.sleep(Batch.slow)

    def close(self) -> set[int]:
        Batch.LOG.append(self.req)
        return Batch.FAILED.get(self.req, set())


def test_loads_over_together_report_every_one_s_failed_pages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two loads found over in one step: the failed pages of both go to vLLM (the first's
    dropped, vLLM decoded on pages nothing wrote)."""
    monkeypatch.setattr(asyncloads, "LoadBatch", Batch)
    monkeypatch.setattr(Batch, "FAILED", {"a": {3}, "b": {8, 9}})
    loads = asyncloads.AsyncLoads(lambda: None, 0,   # type: ignore[arg-type, return-value]
                                  lambda name, n: None)
    try:
        for req in ("a", "b"):
            loads.submit(fake(req_id=req, page_ids=[], skip_pages=0),
                         fake(caches=[torch.zeros(1)], num_layers=1), False)
        for fut in list(loads.running.values()):
            fut.result(timeout=30)
        assert loads.take_done() == ({"a", "b"}, {3, 8, 9})
    finally:
        loads.shutdown()


def test_shutdown_waits_for_the_load_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load still copying at shutdown ends (its leases go back) before shutdown returns:
    the engine frees its KV caches right after, under the copy."""
    monkeypatch.setattr(asyncloads, "LoadBatch", Batch)
    monkeypatch.setattr(Batch, "LOG", [])
    monkeypatch.setattr(Batch, "slow", 0.1)
    monkeypatch.setattr(Batch, "started", threading.Event())
    loads = asyncloads.AsyncLoads(lambda: None, 0,   # type: ignore[arg-type, return-value]
                                  lambda name, n: None)
    loads.submit(fake(req_id="a", page_ids=[], skip_pages=0),
                 fake(caches=[torch.zeros(1)], num_layers=2), False)
    assert Batch.started.wait(30)
    loads.shutdown()
    assert Batch.LOG == ["a"]


class Put:
    """A put lease: ``views`` (None: a block the daemon holds already), what it was told."""

    def __init__(self, views: list[Any], synced: bool = True, reason: str = "") -> None:
        self.views = views
        self.redis_synced = synced
        self.redis_sync_reason = reason
        self.ended: list[Any] = []

    def commit(self, redis_sync_s: float | None = None) -> None:
        self.ended.append(("commit", redis_sync_s))

    def abort(self) -> None:
        self.ended.append("abort")


def save(monkeypatch: pytest.MonkeyPatch, put: Put, *, ok: bool = True,
         budget: SyncBudget | None = None) -> SaveRequest:
    """A save of two blocks whose daemon hands out ``put``; its lease ends ``ok``."""
    link = DaemonLink(ConnectorConfig(Path("/nonexistent.sock"), TPB, "m", timeout_s=1),
                      LAYOUT)
    client = fake(prepare_put=lambda ns, keys, **kw: put)
    monkeypatch.setattr(DaemonLink, "call", lambda self, op, default: op(client))
    monkeypatch.setattr(DaemonLink, "run", lambda self, op, c: (ok, op(c)) if ok
                        else (False, None))
    spec = TransferSpec("A", None, np.arange(1, 2 * TPB + 1, dtype=np.uint32), 0,
                        [[1], [2]], save_id=0)
    return SaveRequest(spec, fake(block_bytes=LAYOUT.block_bytes), lambda: link, 0,
                       redis_sync=budget)


def test_a_save_of_blocks_all_held_already_ends_its_lease(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing to copy: the put lease is committed at once (left open it pinned its
    chain in the daemon until the TTL) and no block counts as saved."""
    put = Put([None, None])
    job = save(monkeypatch, put)
    assert job.prepare() is False
    assert put.ended == [("commit", None)] and job.saved_blocks == 0


def test_a_save_counts_only_the_blocks_it_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    put = Put([None, np.zeros(8, dtype=np.uint8)])
    job = save(monkeypatch, put)
    assert job.prepare() is True
    job.commit()
    assert job.saved_blocks == 1


def test_a_withdrawn_save_is_never_published(monkeypatch: pytest.MonkeyPatch) -> None:
    """Withdrawn before it starts: the daemon is not asked; withdrawn during the copy:
    the commit refuses (its pages may hold another request's KV) and the lease is
    aborted."""
    put = Put([np.zeros(8, dtype=np.uint8)] * 2)
    job = save(monkeypatch, put)
    job.withdrawn.set()
    assert job.prepare() is False and put.ended == []
    job = save(monkeypatch, put)
    assert job.prepare() is True
    job.withdrawn.set()
    with pytest.raises(RuntimeError, match="withdrawn"):
        job.commit()
    assert put.ended == [] and job.saved_blocks == 0
    job._lease = put
    job.abandon()
    assert put.ended == ["abort"]


def test_a_refused_commit_saves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    job = save(monkeypatch, Put([np.zeros(8, dtype=np.uint8)] * 2), ok=False)
    assert job.prepare() is True
    with pytest.raises(RuntimeError, match="refused"):
        job.commit()
    assert job.saved_blocks == 0


def test_a_producer_commit_waits_what_is_left_of_the_step_s_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each synchronous commit waits at most what the step has left, and what it waited
    is taken from it; an overdrawn budget waits 0, never a negative time. A commit that
    failed is not synced, whatever its lease says."""
    from kvtier.connectors.vllm import transfers

    clock = iter([10.0, 10.3, 20.0, 21.0, 30.0, 30.0, 40.0, 40.0])
    monkeypatch.setattr(transfers, "time", fake(monotonic=lambda: next(clock),
                                                  perf_counter=time.perf_counter))
    budget = SyncBudget(1.0)
    first, second = Put([np.zeros(8, dtype=np.uint8)]), Put([np.zeros(8, dtype=np.uint8)])
    for put in (first, second):
        job = save(monkeypatch, put, budget=budget)
        assert job.prepare() is True
        job.commit()
        assert job.redis_synced is True and job.redis_off is False
    assert first.ended == [("commit", 1.0)]
    assert second.ended == [("commit", pytest.approx(0.7))]
    assert budget.left == pytest.approx(-0.3) and budget.take() == 0.0
    off = Put([np.zeros(8, dtype=np.uint8)], synced=False, reason="off")
    job = save(monkeypatch, off, budget=budget)
    job.prepare()
    job.commit()
    assert (job.redis_synced, job.redis_off) == (False, True)
    failed = save(monkeypatch, Put([np.zeros(8, dtype=np.uint8)], reason="off"), ok=False,
                  budget=SyncBudget(1.0))
    failed.prepare()
    with pytest.raises(RuntimeError):
        failed.commit()
    assert (failed.redis_synced, failed.redis_off) == (False, False)


def test_a_load_with_no_pages_asks_the_daemon_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A planned load left with no pages (vLLM allocated none) opens no get lease: one
    opened would pin blocks in the daemon for nothing, every step."""
    asked: list[Any] = []
    monkeypatch.setattr(DaemonLink, "call", lambda self, op, default: asked.append(op))
    link = DaemonLink(ConnectorConfig(Path("/nonexistent.sock"), TPB, "m", timeout_s=1),
                      LAYOUT)
    spec = TransferSpec("A", None, np.arange(1, TPB + 1, dtype=np.uint32), 0, [])
    batch = LoadBatch([spec], fake(pages_per_block=1), lambda: link, 0, False)
    batch.open()
    assert asked == [] and batch.close() == set()

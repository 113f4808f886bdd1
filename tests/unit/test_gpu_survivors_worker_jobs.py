"""The worker's load and save jobs around their copies (``connectors/vllm/transfers.py``;
mutation review survivors): the copy time each lease reports, the Redis wait budget of a
producer step, a save given up or refused, and the device a pool slot is read on. The
daemon answers by hand (the fakes of ``test_hbm_survivors_blocks``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

import torch
from kvtier.connectors.vllm import transfers
from kvtier.connectors.vllm.metadata import TransferSpec
from kvtier.connectors.vllm.transfers import LoadBatch, SaveRequest, SyncBudget

from tests.support.vllm_fakes import fake as NS
from tests.unit.test_hbm_survivors_blocks import BLOCK, blocks_in, caches, link, spec


def _leases(counts: list[int], log: list[tuple[int, Any]]) -> Any:
    """A client whose n-th get lease holds ``counts[n]`` blocks; releases are logged."""
    made = iter(range(len(counts)))

    def prepare_get(ns: Any, keys: Any, prefer_device: bool) -> Any:
        i = next(made)
        log.append((i, prefer_device))
        return NS(views=[np.zeros(BLOCK, dtype=np.uint8)] * counts[i],
                  release=lambda copy_s=None: log.append((i, copy_s)))

    return NS(prepare_get=prepare_get)


def test_each_lease_reports_its_share_of_the_copy_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step loading 1 block for one request and 3 for another tells the daemon a quarter
    and three quarters of the copy time (its reload bandwidth estimate, which prices every
    later lookup); the device placement asked for reaches the daemon (mutants: each lease
    given the whole copy time; ``prefer_device`` dropped, so pool slots never serve)."""
    log: list[tuple[int, Any]] = []
    lk = link(monkeypatch, _leases([1, 3], log))
    try:
        batch = LoadBatch([spec(1, [[1, 2]]), spec(3, [[3, 4], [5, 6], [7, 8]])], caches(),
                          lambda: lk, 0, True)
        batch.open()
        assert log == [(0, True), (1, True)]
        batch.copy_s = 4.0
        assert batch.close() == set() and batch.loaded_blocks == 4
    finally:
        lk.close()
    assert log[2:] == [(0, 1.0), (1, 3.0)]


def test_the_redis_budget_never_goes_negative_and_commits_spend_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer step's Redis budget: each synchronous commit is offered what is left and
    what it waited is taken off, and once spent a commit is offered 0 s, not a negative
    wait (mutants: the wait not taken off, so a step waits for Redis without bound; a
    negative timeout handed to the commit)."""
    budget = SyncBudget(0.05)
    offered: list[float] = []

    def commit(redis_sync_s: float) -> bool:
        offered.append(redis_sync_s)
        monotonic[0] += 0.04
        return True

    monotonic = [100.0]
    monkeypatch.setattr(transfers.time, "monotonic", lambda: monotonic[0])
    lease = NS(views=[np.zeros(BLOCK, dtype=np.uint8)], commit=commit, redis_synced=True,
               redis_sync_reason="")
    lk = link(monkeypatch, NS(prepare_put=lambda ns, keys, parent, start_depth: lease))
    try:
        for _ in range(3):
            save = SaveRequest(spec(1, [[1, 2]]), caches(), lambda: lk, 0, redis_sync=budget)
            assert save.prepare()
            save.commit()
            assert save.redis_synced and not save.redis_off
    finally:
        lk.close()
    assert offered == pytest.approx([0.05, 0.01, 0.0])
    assert budget.take() == 0.0


def test_a_refused_commit_is_not_reported_synced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit the daemon refused (the connection dropped) raises, and its save is neither
    synced to Redis nor told Redis is off, whatever the dead lease says (mutants: the
    outcome read from the lease alone; a producer then reports KV sent that is not)."""
    lease = NS(views=[np.zeros(BLOCK, dtype=np.uint8)], redis_synced=True,
               redis_sync_reason="off", commit=lambda redis_sync_s: None)
    lk = link(monkeypatch, NS(prepare_put=lambda ns, keys, parent, start_depth: lease),
              released=False)
    try:
        save = SaveRequest(spec(1, [[1, 2]]), caches(), lambda: lk, 0,
                           redis_sync=SyncBudget(1.0))
        assert save.prepare()
        with pytest.raises(RuntimeError, match="refused"):
            save.commit()
    finally:
        lk.close()
    assert save.redis_synced is False and save.redis_off is False
    assert save.saved_blocks == 0


def test_an_abandoned_save_aborts_its_put_lease_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A save given up after ``prepare`` aborts its put lease (else its slots stay
    reserved, and its keys locked, until the lease expires), only once, and a committed
    save aborts nothing (mutants: no abort; the lease kept after its commit)."""
    aborted: list[int] = []
    lease = NS(views=[np.zeros(BLOCK, dtype=np.uint8)], abort=lambda: aborted.append(1),
               commit=lambda: None)
    lk = link(monkeypatch, NS(prepare_put=lambda ns, keys, parent, start_depth: lease))
    try:
        save = SaveRequest(spec(1, [[1, 2]]), caches(), lambda: lk, 0)
        assert save.prepare()
        save.abandon()
        save.abandon()
        done = SaveRequest(spec(1, [[1, 2]]), caches(), lambda: lk, 0)
        assert done.prepare()
        done.commit()
        done.abandon()               # after a commit: nothing left to abort
    finally:
        lk.close()
    assert aborted == [1]


class _DeviceView:
    """A pool slot on GPU ``id`` as cupy exposes it (``__cuda_array_interface__``)."""

    def __init__(self, index: int) -> None:
        self.device = NS(id=index)
        self.__cuda_array_interface__ = {"shape": (4,), "typestr": "|u1", "version": 3,
                                         "data": (0, True)}


def test_a_pool_slot_is_read_on_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot of a pool on GPU 1 becomes a tensor on ``cuda:1``, not on the thread's
    current device (plain "cuda"), which would copy it across GPUs or fail (mutant: the
    device index dropped). A tensor is used as it is."""
    asked: list[str] = []

    def as_tensor(view: Any, device: str) -> torch.Tensor:
        asked.append(device)
        return torch.zeros(4, dtype=torch.uint8)

    monkeypatch.setattr(transfers.torch, "as_tensor", as_tensor)
    transfers.as_tensor(_DeviceView(1))
    assert asked == ["cuda:1"]
    t = torch.ones(3)
    assert transfers.as_tensor(t) is t


@pytest.mark.parametrize("held", [2, 0])
def test_a_load_keeps_the_locally_computed_leading_page(
        monkeypatch: pytest.MonkeyPatch, held: int) -> None:
    """A load whose first page vLLM computed itself (``skip_pages=1``) leaves that page's
    bytes alone in every layer, fills the first block's second page from that layer's
    slice of the block, and the other blocks whole; a lease that held nothing writes
    nothing and does not fail the step (mutants: the first block scattered whole over the
    shared page; the last block's pages overlaid; the layer slice taken at offset 0; the
    overlay run on a lease with no blocks)."""
    rng = np.random.default_rng(11)
    views = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(held)]
    client = NS(prepare_get=lambda ns, keys, prefer_device: NS(
        views=views, release=lambda copy_s=None: None))
    c = caches(fill=True)
    before = [layer.clone() for layer in c.caches]
    pages = [[1, 2], [3, 4]]
    lk = link(monkeypatch, client)
    try:
        batch = LoadBatch([spec(2, pages, skip_pages=1)], c, lambda: lk, 0, False)
        batch.open()
        for layer in range(2):
            batch.load_layer(layer, None)
        failed = batch.close()
    finally:
        lk.close()
    for layer in range(2):     # the local page: [kv, page, ...] untouched
        assert torch.equal(c.caches[layer][:, 1], before[layer][:, 1])
    if not held:
        assert failed == {2, 3, 4}
        assert all(torch.equal(a, b) for a, b in zip(c.caches, before, strict=True))
        return
    assert failed == set()
    first, second = blocks_in(c, pages)
    assert second == views[1].tobytes()
    got = np.frombuffer(first, np.uint8).reshape(2, 2, 2, -1)     # [layer][kv][page][..]
    want = views[0].reshape(2, 2, 2, -1)
    assert np.array_equal(got[:, :, 1], want[:, :, 1])


def test_a_withdrawn_save_never_publishes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A save the engine withdrew (its request preempted, its pages maybe reused by
    another request) opens no put lease if withdrawn before ``prepare``, and is not
    committed if withdrawn during the copy: what it copied may be another prompt's KV
    (mutants: either check dropped)."""
    calls: list[str] = []
    lease = NS(views=[np.zeros(BLOCK, dtype=np.uint8)], commit=lambda: calls.append("commit"))

    def prepare_put(ns: Any, keys: Any, parent: Any, start_depth: int) -> Any:
        calls.append("prepare")
        return lease

    lk = link(monkeypatch, NS(prepare_put=prepare_put))
    try:
        early = SaveRequest(spec(1, [[1, 2]]), caches(), lambda: lk, 0)
        early.withdrawn.set()
        assert not early.prepare() and calls == []
        late = SaveRequest(spec(1, [[1, 2]]), caches(), lambda: lk, 0)
        assert late.prepare()
        late.copy(None)
        late.withdrawn.set()
        with pytest.raises(transfers.SaveWithdrawn):
            late.commit()
    finally:
        lk.close()
    assert calls == ["prepare"] and late.saved_blocks == 0


def test_a_save_of_blocks_all_held_already_ends_its_lease(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block of a save is in the daemon already (no view to fill): the put lease is
    committed at once, empty, and nothing is copied (mutant: the lease left open, holding
    its keys until it expires)."""
    calls: list[str] = []
    lease = NS(views=[None, None], commit=lambda: calls.append("commit"))
    lk = link(monkeypatch, NS(prepare_put=lambda ns, keys, parent, start_depth: lease))
    try:
        save = SaveRequest(spec(2, [[1, 2], [3, 4]]), caches(), lambda: lk, 0)
        assert not save.prepare()
    finally:
        lk.close()
    assert calls == ["commit"] and save.saved_blocks == 0


def test_a_load_asks_only_for_the_blocks_it_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request of three blocks loading its first one asks the daemon for that block's
    key alone (mutant: every later key too: the lease read-locks blocks that are never
    copied, pinning them against eviction)."""
    asked: list[int] = []

    def prepare_get(ns: Any, keys: Any, prefer_device: bool) -> Any:
        asked.append(len(keys))
        return NS(views=[np.zeros(BLOCK, dtype=np.uint8)], release=lambda copy_s=None: None)

    tokens = np.arange(1, 3 * 16 + 1, dtype=np.uint32)
    lk = link(monkeypatch, NS(prepare_get=prepare_get))
    try:
        batch = LoadBatch([TransferSpec("A", None, tokens, 0, [[1, 2]])], caches(),
                          lambda: lk, 0, False)
        batch.open()
        assert batch.close() == set()
    finally:
        lk.close()
    assert asked == [1]

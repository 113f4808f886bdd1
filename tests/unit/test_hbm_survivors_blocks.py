"""The bytes a worker's load and save move (``LoadBatch``, ``SaveRequest``; mutation review
survivors): real engine caches on the CPU (NHD pages) and a daemon answering by hand, so
a copy of the wrong block, page or layer shows in the engine's pages or the put's slots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

import torch
from kvtier.connectors.vllm.config import ConnectorConfig
from kvtier.connectors.vllm.link import DaemonLink
from kvtier.connectors.vllm.metadata import TransferSpec
from kvtier.connectors.vllm.transfers import CacheSet, LoadBatch, SaveRequest
from kvtier.kernels.api import gather_blocks
from kvtier.kernels.layouts import PagedLayout

from kvtier.layout import KVLayout
from tests.support.vllm_fakes import fake as NS

TPB, R, PAGES = 16, 2, 12
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=TPB)
BLOCK = LAYOUT.block_bytes


def caches(fill: bool = False) -> CacheSet:
    """Two layers of NHD pages (``[2, pages, TPB / R, heads, dim]``), zeros or random."""
    gen = torch.Generator().manual_seed(3)
    shape = (2, PAGES, TPB // R, 2, 32)
    layers = [torch.randn(shape, generator=gen).half() if fill else torch.zeros(shape).half()
              for _ in range(2)]
    return CacheSet(layers, PagedLayout.NHD, TPB, R, BLOCK, 2)


def blocks_in(c: CacheSet, pages: list[list[int]]) -> list[bytes]:
    """The kvtier blocks the engine pages ``pages`` hold (every layer)."""
    out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in pages]
    gather_blocks(c.caches, c.paged, torch.tensor(pages, dtype=torch.int64), out,
                  tokens_per_block=TPB)
    return [bytes(b.numpy()) for b in out]


def link(monkeypatch: pytest.MonkeyPatch, client: Any, released: bool = True) -> DaemonLink:
    lk = DaemonLink(ConnectorConfig(Path("/nonexistent.sock"), TPB, "m", timeout_s=1), LAYOUT)
    monkeypatch.setattr(DaemonLink, "call", lambda self, op, default: op(client))
    monkeypatch.setattr(DaemonLink, "run", lambda self, op, c: (released, op(c)))
    return lk


def spec(n: int, pages: list[list[int]], skip_pages: int = 0) -> TransferSpec:
    tokens = np.arange(1, n * TPB + 1, dtype=np.uint32)
    return TransferSpec("A", None, tokens, 0, pages, skip_pages=skip_pages)


def test_a_load_writes_each_block_s_every_layer_into_its_own_pages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three blocks loaded into pages that are not in order: each block's every layer
    lands in its own pages (a layer slice of the wrong offset, or the wrong block of the
    lease, is another prompt's KV read as this one's)."""
    rng = np.random.default_rng(5)
    views = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(3)]
    released: list[Any] = []
    client = NS(prepare_get=lambda ns, keys, prefer_device: NS(
        views=views, release=lambda copy_s=None: released.append(copy_s)))
    c = caches()
    pages = [[7, 2], [4, 9], [10, 11]]
    lk = link(monkeypatch, client)
    try:
        batch = LoadBatch([spec(3, pages)], c, lambda: lk, 0, False)
        batch.open()
        for layer in range(2):
            batch.load_layer(layer, None)
        assert batch.close() == set() and batch.loaded_blocks == 3
    finally:
        lk.close()
    assert blocks_in(c, pages) == [v.tobytes() for v in views]
    assert len(released) == 1


def test_a_load_that_failed_or_was_not_released_is_all_errors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A load that could not open its lease, or whose lease was not released cleanly,
    reports every page it was to fill as an error (vLLM recomputes them), and only those:
    a leading page computed locally (``skip_pages``) is shared by other requests."""
    views = [np.zeros(BLOCK, dtype=np.uint8) for _ in range(2)]
    ok = NS(prepare_get=lambda ns, keys, prefer_device: NS(
        views=views, release=lambda copy_s=None: None))
    lk = link(monkeypatch, ok, released=False)
    try:
        batch = LoadBatch([spec(2, [[1, 2], [3, 4]], skip_pages=1)], caches(), lambda: lk,
                          0, False)
        batch.open()
        for layer in range(2):
            batch.load_layer(layer, None)
        assert batch.close() == {2, 3, 4} and batch.loaded_blocks == 0
    finally:
        lk.close()


def test_a_save_copies_each_missing_block_from_its_own_pages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon already holds block 0 of a save (its view is None): block 1 is copied
    from block 1's pages into the second slot, not from the first block's pages (stored
    under block 1's key, that is wrong KV for every later hit)."""
    slot = np.zeros(BLOCK, dtype=np.uint8)
    committed: list[int] = []
    lease = NS(views=[None, slot], commit=lambda: committed.append(1))
    client = NS(prepare_put=lambda ns, keys, parent, start_depth: lease)
    c = caches(fill=True)
    pages = [[3, 8], [5, 1]]
    lk = link(monkeypatch, client)
    try:
        save = SaveRequest(spec(2, pages), c, lambda: lk, 0)
        assert save.prepare()
        save.copy(None)
        save.commit()
    finally:
        lk.close()
    assert slot.tobytes() == blocks_in(c, [[5, 1]])[0]
    assert committed == [1] and save.saved_blocks == 1


def test_a_load_that_failed_on_the_device_gives_its_leases_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A load whose copy raised (``all_pages``, the error path) still releases its get
    lease at once, and once: kept, the daemon holds the blocks read-locked (pinned in cpu
    and hbm) until the lease expires. Every page it was to fill is an error for vLLM to
    recompute, but not a leading page computed locally (shared with other requests)."""
    released: list[Any] = []
    client = NS(prepare_get=lambda ns, keys, prefer_device: NS(
        views=[np.zeros(BLOCK, dtype=np.uint8)] * 2,
        release=lambda copy_s=None: released.append(copy_s)))
    lk = link(monkeypatch, client)
    try:
        batch = LoadBatch([spec(2, [[1, 2], [3, 4]], skip_pages=1)], caches(), lambda: lk,
                          0, False)
        batch.open()
        assert batch.all_pages() == {2, 3, 4}    # not the locally computed page 1
        assert released == [None]
        assert batch.all_pages() == {2, 3, 4} and released == [None]   # released once
    finally:
        lk.close()

"""A step's synchronous loads as the worker opens and closes them (transfers.LoadBatch),
with a daemon that answers by hand: a load asks for exactly its own blocks' keys, counts
loaded only the blocks the daemon's lease holds, and counts none when its lease could not
be released cleanly (expired during the copy). Each was found unpinned by a mutation
review of the connector: a test fails on its mutant."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.config import ConnectorConfig
from kvtier.connectors.vllm.link import DaemonLink
from kvtier.connectors.vllm.metadata import TransferSpec
from kvtier.connectors.vllm.transfers import LoadBatch

from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.vllm_fakes import fake as NS

TPB = 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=TPB)


class _Daemon:
    """A client whose get lease holds ``held`` blocks of those asked for."""

    def __init__(self, held: int) -> None:
        self.held = held
        self.asked: list[list[Any]] = []
        self.released: list[float | None] = []

    def prepare_get(self, ns: Any, keys: list[Any], *, prefer_device: bool) -> Any:
        self.asked.append(list(keys))
        views = [np.zeros(LAYOUT.block_bytes, dtype=np.uint8)
                 for _ in range(min(self.held, len(keys)))]
        return NS(views=views, release=lambda copy_s=None: self.released.append(copy_s))


def _batch(monkeypatch: pytest.MonkeyPatch, spec: TransferSpec, daemon: _Daemon,
           released: bool = True) -> tuple[LoadBatch, DaemonLink]:
    link = DaemonLink(ConnectorConfig(Path("/nonexistent.sock"), TPB, "m", timeout_s=1),
                      LAYOUT)
    monkeypatch.setattr(DaemonLink, "call", lambda self, op, default: op(daemon))
    monkeypatch.setattr(DaemonLink, "run", lambda self, op, client: (released, op(client)))
    return LoadBatch([spec], NS(pages_per_block=2), lambda: link, 0, False), link


def _spec(first: int, n: int) -> TransferSpec:
    tokens = np.arange(1, (first + n) * TPB + 1, dtype=np.uint32)
    return TransferSpec("A", None, tokens, first,
                        [[10 + 2 * b, 11 + 2 * b] for b in range(first, first + n)])


def test_a_load_asks_for_its_own_blocks_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load of blocks 1..2 asks the daemon for the keys of blocks 1..2 of its chain (the
    keys of blocks 0..1 filled the pages of blocks 1..2 with their predecessors' KV)."""
    spec = _spec(1, 2)
    daemon = _Daemon(held=2)
    batch, link = _batch(monkeypatch, spec, daemon)
    try:
        batch.open()
        ns = link.namespace(None, 0)
        assert daemon.asked == [block_keys(ns, spec.token_ids)[1:3]]
        assert batch.close() == set() and batch.loaded_blocks == 2
    finally:
        link.close()


def test_only_the_blocks_the_lease_holds_count_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's lease holds the first of 2 blocks (the second was evicted since the
    lookup): the second block's pages are the load's errors, so vLLM recomputes them
    (counted loaded, vLLM decoded on pages nothing wrote)."""
    daemon = _Daemon(held=1)
    batch, link = _batch(monkeypatch, _spec(0, 2), daemon)
    try:
        batch.open()
        assert batch.close() == {12, 13} and batch.loaded_blocks == 1
        assert len(daemon.released) == 1   # the lease is given back
    finally:
        link.close()


def test_a_lease_with_more_views_than_pages_loads_its_pages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease holding more blocks than the load has pages for (a reply longer than asked)
    loads the pages there are, and no more: taking every view, the load indexed past its
    pages and the step's loads failed."""
    daemon = _Daemon(held=3)
    monkeypatch.setattr(_Daemon, "prepare_get", lambda self, ns, keys, prefer_device: NS(
        views=[np.zeros(LAYOUT.block_bytes, dtype=np.uint8) for _ in range(3)],
        release=lambda copy_s=None: None))
    batch, link = _batch(monkeypatch, _spec(0, 2), daemon)
    try:
        batch.open()
        assert batch.close() == set() and batch.loaded_blocks == 2
    finally:
        link.close()


def test_a_lease_not_released_cleanly_loads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease expired (or its connection broke) during the copy: what was copied may
    have been overwritten meanwhile, so every page of the load is an error."""
    batch, link = _batch(monkeypatch, _spec(0, 2), _Daemon(held=2), released=False)
    try:
        batch.open()
        assert batch.close() == {10, 11, 12, 13} and batch.loaded_blocks == 0
    finally:
        link.close()

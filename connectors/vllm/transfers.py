"""The worker's load and save jobs: what ``LayerPipeline`` runs on its threads.

A load job holds one get lease per request for the whole step and scatters the blocks
layer by layer (a kvtier block is ``[layer][kv][token][head][dim]``, so one layer of a
block is one contiguous slice). A save job gathers one request's completed blocks into the
slots of a put lease and commits it. Both talk to the daemon through the ``DaemonLink`` of
the thread they run on; a lease the daemon could not release cleanly (it expired during
the copy, the connection dropped) makes its pages a load error, never good KV.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from kvtier.kernels.api import gather_blocks, scatter_blocks
from kvtier.kernels.layouts import PagedLayout

from kvtier.keys import BlockKey, Namespace, block_keys

from .link import DaemonLink
from .metadata import TransferSpec

logger = logging.getLogger("kvtier.connectors.vllm")


@dataclass(frozen=True, slots=True)
class CacheSet:
    """The engine's per-layer KV caches and how to address them."""

    caches: list[torch.Tensor]
    paged: PagedLayout
    tokens_per_block: int
    pages_per_block: int
    block_bytes: int
    kv_components: int

    @property
    def num_layers(self) -> int:
        return len(self.caches)

    @property
    def layer_bytes(self) -> int:
        return self.block_bytes // self.num_layers


@dataclass(slots=True)
class _OpenLoad:
    spec: TransferSpec
    lease: Any = None
    conn: Any = None          # the link's client the lease was opened on
    blocks: list[torch.Tensor] = field(default_factory=list)
    ok: bool = True


class LoadBatch:
    """One step's synchronous loads (all requests), scattered layer by layer."""

    def __init__(self, specs: list[TransferSpec], caches: CacheSet,
                 link_of: Callable[[], DaemonLink], tp_rank: int,
                 prefer_device: bool) -> None:
        self.specs = [s for s in specs if s.pages]
        self.caches = caches
        self.link_of = link_of
        self.tp_rank = tp_rank
        self.prefer_device = prefer_device
        self._open: list[_OpenLoad] = []
        self._link: DaemonLink | None = None
        self._plain_pages: torch.Tensor | None = None
        self._plain: list[tuple[int, int]] = []      # (open index, block index)
        self.copy_s = 0.0                            # time spent copying (all layers)
        self.loaded_blocks = 0

    def open(self) -> None:
        link = self._link = self.link_of()
        for spec in self.specs:
            item = _OpenLoad(spec)
            self._open.append(item)
            try:
                ns = link.namespace(spec.cache_salt, self.tp_rank)
                keys = block_keys(ns, spec.token_ids)[spec.first_block:spec.end_block]
                prefer = self.prefer_device
                got = link.call(functools.partial(_prepare_get, ns, keys, prefer), None)
            except Exception:
                logger.exception("kvtier: load of request %s failed; vLLM recomputes it",
                                 spec.req_id)
                got = None
            if got is None:
                item.ok = False
                continue
            item.conn, item.lease = got
            n = min(len(item.lease.views), len(spec.pages))
            item.blocks = [as_tensor(v, readonly=True) for v in list(item.lease.views)[:n]]
        for i, item in enumerate(self._open):
            first_overlaid = 1 if item.spec.skip_pages else 0
            self._plain.extend((i, j) for j in range(first_overlaid, len(item.blocks)))
        if self._plain:
            rows = [self._open[i].spec.pages[j] for i, j in self._plain]
            self._plain_pages = torch.tensor(rows, dtype=torch.int64)

    def load_layer(self, layer: int, stream: Any) -> None:
        t0 = time.perf_counter()
        try:
            self._load_layer(layer, stream)
        finally:
            self.copy_s += time.perf_counter() - t0

    def _load_layer(self, layer: int, stream: Any) -> None:
        c = self.caches
        lo, hi = layer * c.layer_bytes, (layer + 1) * c.layer_bytes
        cache = [c.caches[layer]]
        if self._plain_pages is not None:
            rows = [self._open[i].blocks[j][lo:hi] for i, j in self._plain]
            scatter_blocks(cache, c.paged, self._plain_pages, rows,
                           tokens_per_block=c.tokens_per_block, stream=stream)
        for item in self._open:
            if not (item.spec.skip_pages and item.blocks):
                continue
            # Keep the locally computed leading pages of the first block: overlay the
            # loaded pages on a copy of what the engine has for this layer, write it back.
            pages = torch.tensor(item.spec.pages[:1], dtype=torch.int64)
            here = torch.empty(c.layer_bytes, dtype=torch.uint8, device=c.caches[0].device)
            gather_blocks(cache, c.paged, pages, [here], tokens_per_block=c.tokens_per_block,
                          stream=stream)
            # (asynchronous on the load stream, the current one: a blocking copy made the
            # loader wait for the GPU at every layer; the lease keeps the source until
            # the step's loads are synchronised, and an unregistered source is staged)
            src = item.blocks[0][lo:hi].to(here.device, non_blocking=True)
            overlay_pages(here, src, item.spec.skip_pages, c.kv_components, c.pages_per_block)
            scatter_blocks(cache, c.paged, pages, [here], tokens_per_block=c.tokens_per_block,
                           stream=stream)

    def close(self) -> set[int]:
        failed: set[int] = set()
        r = self.caches.pages_per_block
        total = sum(len(item.blocks) for item in self._open) or 1
        for item in self._open:
            loaded = len(item.blocks) if item.ok else 0
            if item.lease is not None:
                assert self._link is not None
                share = self.copy_s * len(item.blocks) / total   # this lease's copy time
                released, _ = self._link.run(functools.partial(_release, item.lease, share),
                                             item.conn)
                if not released:   # expired or lost during the copy: not good KV
                    logger.warning("kvtier: the get lease of request %s was not released "
                                   "cleanly; its pages are recomputed", item.spec.req_id)
                    loaded = 0
            self.loaded_blocks += loaded
            failed |= set(item.spec.page_ids[max(loaded * r, item.spec.skip_pages):])
        return failed

    def all_pages(self) -> set[int]:
        for item in self._open:
            if item.lease is not None and self._link is not None:
                with contextlib.suppress(Exception):
                    self._link.run(functools.partial(_release, item.lease, None), item.conn)
                item.lease = None
        return {p for s in self.specs for p in s.page_ids[s.skip_pages:]}


class SyncBudget:
    """The time one producer step may wait for Redis, shared by its saves' synchronous
    commits: what each commit waits is taken from it, copies and waits for room are not
    (a deadline on the clock counted them, and large steps gave up on a healthy Redis).
    Used by the saver thread alone."""

    __slots__ = ("left",)

    def __init__(self, seconds: float) -> None:
        self.left = seconds

    def take(self) -> float:
        """The seconds the next commit may wait (0: do not wait for Redis)."""
        return max(0.0, self.left)

    def spent(self, seconds: float) -> None:
        self.left -= seconds


class SaveWithdrawn(RuntimeError):
    """The engine stopped waiting for this save (its request was preempted, its pages may
    hold another request's KV by now): it must not publish what it copied."""


class SaveRequest:
    """Offload one request's newly completed blocks into one put lease."""

    def __init__(self, spec: TransferSpec, caches: CacheSet,
                 link_of: Callable[[], DaemonLink], tp_rank: int,
                 redis_sync: SyncBudget | None = None) -> None:
        """``redis_sync`` (producers, shared by the step's saves): commit with a synchronous
        write-through to Redis bounded by what is left of it; ``redis_synced`` then says
        whether it got there."""
        self.spec = spec
        self.caches = caches
        self.link_of = link_of
        self.tp_rank = tp_rank
        self.redis_sync = redis_sync
        # set by the engine's thread when it stops waiting: checked once the copy is over,
        # before the commit (pages reused after it was set may have been copied)
        self.withdrawn = threading.Event()
        self._lease: Any = None
        self._conn: Any = None      # the link's client the lease was opened on
        self._link: DaemonLink | None = None
        self._todo: list[tuple[int, Any]] = []
        self.saved_blocks = 0
        self.redis_synced: bool | None = None
        self.redis_off = False     # the daemon has no Redis tier to sync to

    @property
    def nbytes(self) -> int:
        return len(self.spec.pages) * self.caches.block_bytes

    def prepare(self) -> bool:
        if self.withdrawn.is_set():
            return False
        link = self._link = self.link_of()
        ns = link.namespace(self.spec.cache_salt, self.tp_rank)
        chain = block_keys(ns, self.spec.token_ids)
        first = self.spec.first_block
        keys = chain[first:self.spec.end_block]
        # a piece of a longer chain: its parent and depth keep the chain whole for the
        # daemon's policy (a parent outlives its children) and its bounds
        parent = chain[first - 1] if first > 0 else None

        def prepare_put(client: Any) -> Any:
            self._conn = client      # the lease's connection: it alone can commit it
            return client.prepare_put(ns, keys, parent=parent, start_depth=first)

        self._lease = link.call(prepare_put, None)
        if self._lease is None:
            return False
        self._todo = [(i, v) for i, v in enumerate(self._lease.views) if v is not None]
        if not self._todo:       # every block is there already: publish nothing
            self.commit()
            return False
        return True

    def copy(self, stream: Any) -> None:
        c = self.caches
        page_ids = torch.tensor([self.spec.pages[i] for i, _ in self._todo], dtype=torch.int64)
        gather_blocks(c.caches, c.paged, page_ids, [as_tensor(v) for _, v in self._todo],
                      tokens_per_block=c.tokens_per_block, stream=stream)

    def commit(self) -> None:
        assert self._link is not None and self._lease is not None
        if self.withdrawn.is_set():
            raise SaveWithdrawn(f"request {self.spec.req_id}'s save was withdrawn (its "
                                "pages may have been reused): not published")
        lease, self._lease = self._lease, None
        budget = self.redis_sync
        if budget is None:
            ok, _ = self._link.run(lambda _c: lease.commit(), self._conn)
        else:
            sync_s, t0 = budget.take(), time.monotonic()
            ok, _ = self._link.run(lambda _c: lease.commit(redis_sync_s=sync_s), self._conn)
            budget.spent(time.monotonic() - t0)
            self.redis_synced = bool(ok and lease.redis_synced)
            self.redis_off = ok and lease.redis_sync_reason == "off"
        if not ok:
            raise RuntimeError(f"commit of request {self.spec.req_id}'s blocks refused")
        self.saved_blocks += len(self._todo)

    def abandon(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None and self._link is not None:
            self._link.run(lambda _c: lease.abort(), self._conn)


def _prepare_get(ns: Namespace, keys: Sequence[BlockKey], prefer_device: bool,
                 client: Any) -> tuple[Any, Any]:
    """``client`` and its get lease on the leading held blocks of ``keys`` (a
    ``DaemonLink`` op)."""
    return client, client.prepare_get(ns, keys, prefer_device=prefer_device)


def _release(lease: Any, copy_s: float | None, _client: Any) -> None:
    """Release a get lease, telling the daemon how long the copy took (a ``DaemonLink`` op:
    the lease carries its own connection, so the link's client is not used)."""
    lease.release(copy_s=copy_s)


def as_tensor(view: Any, readonly: bool = False) -> torch.Tensor:
    """A uint8 tensor aliasing a slot view without copying: an arena slot (numpy array)
    or an HBM pool slot (a device array exposing ``__cuda_array_interface__``).

    Get leases hand out read-only arrays; torch warns when aliasing those, and the
    connector only reads them, so that one warning is silenced here.
    """
    if isinstance(view, torch.Tensor):
        return view
    if hasattr(view, "__cuda_array_interface__"):
        # on the view's own GPU: "cuda" alone is the calling thread's current device,
        # and a view of a pool on another GPU would be copied there
        index = getattr(getattr(view, "device", None), "id", None)
        return torch.as_tensor(view, device="cuda" if index is None else f"cuda:{index}")
    if not readonly:
        return torch.from_numpy(view)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(view)


def overlay_pages(dst: torch.Tensor, src: torch.Tensor, skip_pages: int, kv_components: int,
                  pages_per_block: int, num_layers: int = 1) -> None:
    """Copy pages ``[skip_pages, r)`` of ``src`` over ``dst``: both canonical bytes of
    ``num_layers`` layers of one block (``[layer][kv][token][head][dim]``), tokens grouped
    ``r = pages_per_block`` pages at a time."""
    shape = (num_layers, kv_components, pages_per_block, -1)
    d = dst.view(torch.uint8).view(shape)
    s = src.view(torch.uint8).view(shape)
    if d.device.type == "cpu" and s.device.type == "cpu":   # no OpenMP team (kernels/host.py)
        np.copyto(d.numpy()[:, :, skip_pages:], s.numpy()[:, :, skip_pages:])
        return
    d[:, :, skip_pages:].copy_(s[:, :, skip_pages:])

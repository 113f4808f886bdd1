"""Worker-side half of the connector: moves KV between vLLM's pages and the daemon's arena.

Loads scatter kvtier blocks into the request's pages before the forward that needs them
(or in a background thread for asynchronous loads); saves gather completed blocks after
the step's forward, straight into arena slots handed out by ``prepare_put`` (one copy).
The byte layout conversion is ``kvtier.kernels`` (torch reference on CPU, CUDA kernel on
GPU); this module only decides which pages go where, batched per request.

Saves run in ``wait_for_save`` rather than per layer in ``save_kv_layer``: a kvtier block
holds every layer, so its arena slot is filled once all layers of the step are computed.
Failed loads (daemon gone, block evicted or rejected by checksum since the lookup) are
reported by page id through ``get_block_ids_with_load_errors`` so vLLM recomputes them.
"""

from __future__ import annotations

import logging
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from kvtier.kernels.api import gather_blocks, scatter_blocks
from kvtier.kernels.layouts import PagedLayout

from kvtier.errors import LayoutMismatch
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout

from .config import ConnectorConfig
from .link import DaemonLink
from .mapping import PageMap
from .metadata import KVTierConnectorMetadata, TransferSpec

logger = logging.getLogger("kvtier.connectors.vllm")


def paged_layout_of(kv_cache: torch.Tensor) -> PagedLayout:
    """Which page format a vLLM 0.32 layer cache uses.

    CPU backend: ``[pages, heads, page_size, 2*head]`` used as K rows then V rows per
    head. GPU backends: 5-D ``[2, pages, page_size, heads, head]`` (FlashAttention NHD) or
    the standardized 4-D ``[pages, heads, page_size, 2*head]`` with K|V halves.
    """
    if kv_cache.device.type == "cpu" and kv_cache.dim() == 4:
        return PagedLayout.CPU
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2:
        return PagedLayout.NHD
    if kv_cache.dim() == 4:
        return PagedLayout.PACKED_KV
    raise LayoutMismatch(f"unsupported vLLM KV cache shape {tuple(kv_cache.shape)} on "
                         f"{kv_cache.device}")


class WorkerSide:
    """The worker half of ``KVTierConnector`` (one per vLLM worker / TP rank)."""

    def __init__(self, config: ConnectorConfig, layout: KVLayout, block_size: int,
                 tp_rank: int, tp_size: int) -> None:
        self.config = config
        self.layout = layout
        self.pages = PageMap(block_size, config.tokens_per_block)
        self.tp_rank = tp_rank
        self.link = DaemonLink(config, layout, tp_size=tp_size, name=f"worker{tp_rank}")
        self._caches: list[torch.Tensor] = []
        self._paged: PagedLayout | None = None
        self._load_errors: set[int] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._thread_link = threading.local()
        self._async: dict[str, Future[set[int]]] = {}
        self.loaded_blocks = 0
        self.saved_blocks = 0

    # -- setup -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Remember the per-layer caches (in model order) and check they match the layout
        the scheduler side derived from ``KVCacheConfig``."""
        caches = list(kv_caches.values())
        if len(caches) != self.layout.num_layers:
            raise LayoutMismatch(f"vLLM registered {len(caches)} layer caches, the KV cache "
                                 f"config has {self.layout.num_layers} layers")
        paged = paged_layout_of(caches[0])
        from kvtier.kernels.api import block_bytes

        nbytes = block_bytes(caches, paged, self.config.tokens_per_block)
        if nbytes != self.layout.block_bytes:
            raise LayoutMismatch(f"vLLM caches give {nbytes} bytes per kvtier block, the "
                                 f"layout {self.layout} expects {self.layout.block_bytes}")
        self._caches, self._paged = caches, paged
        logger.info("kvtier: %d layers, %s pages, %d tokens (%d pages, %d bytes) per block",
                    len(caches), paged.name, self.config.tokens_per_block,
                    self.pages.pages_per_block, nbytes)

    # -- loads -------------------------------------------------------------------------

    def start_load_kv(self, meta: KVTierConnectorMetadata) -> None:
        """Run this step's synchronous loads now; hand asynchronous ones to the thread."""
        for spec in meta.loads:
            self._load_errors |= self._load(self.link, spec)
        for spec in meta.async_loads:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")
            self._async[spec.req_id] = self._pool.submit(self._load_in_thread, spec)

    def _load_in_thread(self, spec: TransferSpec) -> set[int]:
        link = getattr(self._thread_link, "link", None)
        if link is None:
            link = DaemonLink(self.config, self.layout, tp_size=self.link.tp_size,
                              name=f"worker{self.tp_rank}-async")
            self._thread_link.link = link
        return self._load(link, spec)

    def _load(self, link: DaemonLink, spec: TransferSpec) -> set[int]:
        """Scatter the spec's blocks into vLLM's pages; the page ids that did not load."""
        if not spec.pages:
            return set()
        wanted = spec.page_ids
        try:
            ns = self._namespace(link, spec)
            keys = block_keys(ns, spec.token_ids)[spec.first_block:spec.end_block]
            loaded = 0
            with link.lease(lambda c: c.prepare_get(ns, keys)) as lease:
                if lease is not None:
                    views = list(lease.views)[: len(keys)]
                    if views:
                        self._scatter(spec, [_as_tensor(v, readonly=True) for v in views])
                    loaded = len(views)
        except Exception:
            logger.exception("kvtier: load of request %s failed; vLLM recomputes it",
                             spec.req_id)
            loaded = 0
        self.loaded_blocks += loaded
        # Pages kept from vLLM's own cache (skip_pages) are valid whatever happened.
        return set(wanted[max(loaded * self.pages.pages_per_block, spec.skip_pages):])

    def _scatter(self, spec: TransferSpec, blocks: list[torch.Tensor]) -> None:
        assert self._paged is not None
        n = len(blocks)
        page_ids = torch.tensor(spec.pages[:n], dtype=torch.int64)
        if spec.skip_pages:
            # Keep the locally computed leading pages of the first block: overlay the
            # loaded pages on a copy of what the engine already has, then write it back.
            first = torch.empty(self.layout.block_bytes, dtype=torch.uint8)
            gather_blocks(self._caches, self._paged, page_ids[:1], [first],
                          tokens_per_block=self.config.tokens_per_block)
            _overlay_pages(first, blocks[0], spec.skip_pages, self.layout,
                           self.pages.pages_per_block)
            blocks = [first, *blocks[1:]]
        scatter_blocks(self._caches, self._paged, page_ids, blocks,
                       tokens_per_block=self.config.tokens_per_block)

    def get_finished(self) -> set[str]:
        """Request ids whose asynchronous load completed (successfully or not); their
        failed pages join the load errors reported in this same step."""
        done: set[str] = set()
        for req_id, fut in list(self._async.items()):
            if not fut.done():
                continue
            del self._async[req_id]
            try:
                self._load_errors |= fut.result()
            except Exception:  # _load never raises; defensive
                logger.exception("kvtier: async load of %s crashed", req_id)
            done.add(req_id)
        return done

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -------------------------------------------------------------------------

    def save(self, meta: KVTierConnectorMetadata) -> None:
        """Offload the blocks this step completed, one put lease per request."""
        for spec in meta.saves:
            try:
                self._save(spec)
            except Exception:
                logger.exception("kvtier: save of request %s failed; it is only a future "
                                 "cache miss", spec.req_id)

    def _save(self, spec: TransferSpec) -> None:
        assert self._paged is not None
        ns = self._namespace(self.link, spec)
        keys = block_keys(ns, spec.token_ids)[spec.first_block:spec.end_block]
        with self.link.lease(lambda c: c.prepare_put(ns, keys)) as lease:
            if lease is None:
                return
            todo = [(i, v) for i, v in enumerate(lease.views) if v is not None]
            if not todo:
                return
            page_ids = torch.tensor([spec.pages[i] for i, _ in todo], dtype=torch.int64)
            gather_blocks(self._caches, self._paged, page_ids,
                          [_as_tensor(v) for _, v in todo],
                          tokens_per_block=self.config.tokens_per_block)
            self.saved_blocks += len(todo)

    def _namespace(self, link: DaemonLink, spec: TransferSpec) -> Namespace:
        return link.namespace(spec.cache_salt, self.tp_rank)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self.link.close()


def _as_tensor(view: Any, readonly: bool = False) -> torch.Tensor:
    """A uint8 tensor aliasing an arena slot view (numpy array), without copying.

    Get leases hand out read-only arrays; torch warns when aliasing those, and the
    connector only reads them, so that one warning is silenced here.
    """
    if isinstance(view, torch.Tensor):
        return view
    if not readonly:
        return torch.from_numpy(view)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(view)


def _overlay_pages(dst: torch.Tensor, src: torch.Tensor, skip_pages: int, layout: KVLayout,
                   pages_per_block: int) -> None:
    """Copy pages ``[skip_pages, r)`` of block ``src`` over ``dst`` (both canonical
    ``[layer][kv][token][head][dim]`` bytes, tokens grouped ``r`` pages at a time)."""
    shape = (layout.num_layers, layout.kv_components, pages_per_block, -1)
    d = dst.view(torch.uint8).view(shape)
    s = src.view(torch.uint8).view(shape)
    d[:, :, skip_pages:].copy_(s[:, :, skip_pages:])

"""Worker-side half of the connector: moves KV between vLLM's pages and the daemon's arena.

Loads are layer-pipelined: ``start_load_kv`` hands the step's loads to the loader thread
of a :class:`~kvtier.kernels.pipeline.LayerPipeline` and returns; each attention layer's
``wait_for_layer_load`` waits for that layer only. Saves are off the critical path:
``wait_for_save`` queues each request's completed blocks on the saver thread (bounded
bytes in flight; beyond the bound a save is dropped and counted) and returns; a
``kv_producer`` instead waits for room and for its saves, each committed with a synchronous
write-through to Redis (docs/pd-disaggregation.md). A request with saves may finish while
they run: the scheduler side then asked vLLM to delay freeing
its pages, and this side reports it in ``finished_sending`` once its saves are over.
Preempted requests' saves are awaited before the step that may reuse their pages.

Failed loads (daemon gone, block evicted or rejected by checksum since the lookup, a lease
that expired during the copy) are reported by page id through
``get_block_ids_with_load_errors`` in the step that ran them, so vLLM recomputes them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Any

import torch
from kvtier.kernels.pipeline import LayerPipeline

from kvtier.layout import KVLayout
from kvtier.lograte import LogRate

from .asyncloads import AsyncLoads
from .config import ConnectorConfig
from .device import ArenaRegistry, Register, cuda_register
from .geometry import engine_caches
from .ledger import SaveLedger
from .link import DaemonLink
from .mapping import PageMap
from .metadata import KVTierConnectorMetadata, KVTierWorkerMetadata, TransferSpec
from .pieces import FAILED_STEPS_KEPT, first_failed_block, save_pieces, saved_before
from .ranks import Agree, tp_agree
from .transfers import CacheSet, LoadBatch, SaveRequest, SyncBudget

logger = logging.getLogger("kvtier.connectors.vllm")
_warn = LogRate(logger)

PREEMPTED_SAVES_WAIT_S = 0.5
"""How long a step waits, in all, for its preempted requests' saves before withdrawing
those still running (a healthy save of a step's blocks takes milliseconds)."""


class WorkerSide:
    """The worker half of ``KVTierConnector`` (one per vLLM worker / TP rank).

    ``register``: how to register the arena with the device (default: ``cudaHostRegister``
    when the caches are on a GPU, nothing otherwise); tests inject a recorder.
    """

    def __init__(self, config: ConnectorConfig, layout: KVLayout, block_size: int,
                 tp_rank: int, tp_size: int, *, replicas: int = 1,
                 register: Register | None = None, agree: Agree | None = None) -> None:
        """``replicas``: consecutive TP ranks holding the same KV (``geometry.
        tp_replicas``);
        ``agree``: how the TP ranks agree on their saves' cuts (default: an all-reduce
        over vLLM's TP group when ``tp_size`` > 1; tests inject one)."""
        self.config = config
        self._agree = agree if agree is not None else (tp_agree if tp_size > 1 else None)
        self.layout = layout
        self.pages = PageMap(block_size, config.tokens_per_block)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.replicas = replicas
        self.arenas = ArenaRegistry(register)
        self._register_override = register is not None
        self.device_loads = bool(config.device_loads)
        self._links: list[DaemonLink] = []   # every link made (``adopt`` renames them)
        self.link = self._new_link("")
        # ranks holding the same KV (an MLA latent): the first of them alone saves it (the
        # others still agree on the cuts, which depend on every rank's loads through the
        # all-reduce)
        self.saves_kv = tp_rank % replicas == 0
        self._thread_links = threading.local()
        self.caches: CacheSet | None = None
        self.layer_index: dict[str, int] = {}
        self.pipeline: LayerPipeline | None = None
        self._batch: LoadBatch | None = None
        self._load_errors: set[int] = set()
        # step -> pages whose load failed in it (the last FAILED_STEPS_KEPT steps): a save
        # stops before its first block holding one (``TransferSpec.loaded_pages``): what
        # was computed on those pages is not the prompt's KV, whichever request computed it
        self._failed_at: dict[int, set[int]] = {}
        self._step = -1          # the step of the metadata bound last (start_load_kv)
        self._batch_step = -1    # the step of the loads in ``_batch``
        self.async_loads = AsyncLoads(lambda: self._thread_link("-async"), tp_rank,
                                      self._count)
        self.ledger = SaveLedger()   # saves in flight, delayed frees, per-step reports
        self.loaded_blocks = 0
        self.saved_blocks = 0
        self.put_room = 0   # the daemon's per-process put share (its hello; 0: unknown)

    # -- setup -------------------------------------------------------------------------

    def _new_link(self, suffix: str) -> DaemonLink:
        link = DaemonLink(self.config, self.layout, tp_size=self.tp_size,
                          replicas=self.replicas,
                          name=f"worker{self.tp_rank}{suffix}",
                          device=self.device_loads,
                          on_connect=self._on_connect)
        self._links.append(link)
        return link

    def adopt(self, meta: KVTierConnectorMetadata) -> None:
        """Name namespaces as the scheduler side does: a model id or ``kv_format`` derived
        here from a config vLLM's model loading changed would key saves where no lookup
        looks (an EAGLE engine's did; found by review). Logged once, before any save."""
        model_id, kv_format = meta.model_id or self.config.model_id, \
            meta.kv_format or self.layout.kv_format
        if (model_id, kv_format) == (self.config.model_id, self.layout.kv_format):
            return
        logger.warning("kvtier: worker %d names its namespaces as the scheduler does "
                       "(model_id %r, kv_format %r), not %r, %r", self.tp_rank, model_id,
                       kv_format, self.config.model_id, self.layout.kv_format)
        self.config = replace(self.config, model_id=model_id)
        self.layout = replace(self.layout, kv_format=kv_format)
        for link in self._links:
            link.config, link.layout = self.config, self.layout

    def _on_connect(self, client: Any) -> None:
        self.put_room = int(getattr(client, "put_bytes", 0) or 0)
        try:
            self.arenas.adopt(client)
        except Exception:
            logger.exception("kvtier: could not share the arena mapping; continuing")

    def _on_device(self, device: Any, suffix: str) -> None:
        """A pipeline thread's first work: its CUDA device set to the caches' (a thread
        starts on GPU 0), the kernels compiled for it, then its connection to the daemon."""
        if device is not None:
            torch.cuda.set_device(device)
            from kvtier.kernels.cuda import warm_kernels
            warm_kernels(torch.cuda.current_device())   # (NVRTC: not on the first step)
        self._thread_link(suffix).preconnect()

    def _thread_link(self, suffix: str) -> DaemonLink:
        """The calling thread's own link (a client is not thread-safe)."""
        link = getattr(self._thread_links, "link", None)
        if link is None:
            link = self._thread_links.link = self._new_link(suffix)
        return link

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Remember the per-layer caches (in model order), check they match the layout the
        scheduler side derived from ``KVCacheConfig``, and start the transfer pipeline."""
        caches, paged, nbytes = engine_caches(kv_caches, self.layout,
                                              self.config.tokens_per_block)
        on_gpu = caches[0].device.type == "cuda"
        if on_gpu and not self._register_override:
            self.arenas.register = cuda_register
        if self.config.device_loads is None:
            self.device_loads = on_gpu
            self.link.device = on_gpu
        self.caches = CacheSet(caches, paged, self.config.tokens_per_block,
                               self.pages.pages_per_block, nbytes, self.layout.kv_components)
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.pipeline = LayerPipeline(len(caches), caches[0].device if on_gpu else None,
                                      max_inflight_bytes=self.config.max_inflight_save_bytes)
        # Connect (map and register the arena) off the first step's critical path, each
        # thread's CUDA calls (cudaHostRegister among them) on the caches' device, not 0;
        # on a GPU before vLLM's CUDA graph capture (LayerPipeline.warm)
        device = caches[0].device if on_gpu else None
        self.pipeline.warm(lambda: self._on_device(device, "-load"),
                           lambda: self._on_device(device, "-save"), wait=on_gpu)
        logger.info("kvtier: %d layers, %s pages, %d tokens (%d pages, %d bytes) per block, "
                    "%s, saves in flight <= %d bytes", len(caches), paged.name,
                    self.config.tokens_per_block, self.pages.pages_per_block, nbytes,
                    "GPU streams" if on_gpu else "loader/saver threads",
                    self.config.max_inflight_save_bytes)

    # -- loads -------------------------------------------------------------------------

    def start_load_kv(self, meta: KVTierConnectorMetadata) -> None:
        """Start this step's loads layer by layer; hand asynchronous ones to the pool."""
        self.adopt(meta)
        self._step = meta.step
        self._load_errors.update(meta.stale_pages)   # (see KVTierConnectorMetadata)
        for req_id in meta.undelayed:   # (before this step's get_finished)
            self.ledger.undelayed(req_id)
        if meta.loads and self.pipeline is not None and self.caches is not None:
            batch = LoadBatch(meta.loads, self.caches, lambda: self._thread_link("-load"),
                              self.tp_rank, self.device_loads)
            self._batch, self._batch_step = batch, meta.step
            self.pipeline.start_loads(batch)
        if meta.async_loads and self.pipeline is not None and self.caches is not None:
            fence = self.pipeline.streams.compute_fence()   # (GPU: see AsyncLoads.submit)
            for spec in meta.async_loads:
                self.async_loads.submit(spec, self.caches, self.device_loads, fence)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for this layer of the step's loads only."""
        if self.pipeline is not None and self.pipeline.loading:
            layer = self.layer_index.get(layer_name)
            if layer is not None:
                self.pipeline.wait_for_layer(layer)

    def _finish_loads(self) -> None:
        if self.pipeline is not None and self.pipeline.loading:
            failed = self.pipeline.finish_loads()
            self._load_errors |= failed
            if failed:
                self._failed_at.setdefault(self._batch_step, set()).update(failed)
                for old in [s for s in self._failed_at
                            if s <= self._batch_step - FAILED_STEPS_KEPT]:
                    del self._failed_at[old]
            batch = self._batch
            if batch is not None:
                self.loaded_blocks += batch.loaded_blocks
                self._count("loaded_blocks", batch.loaded_blocks)
                self._batch = None

    def take_load_errors(self) -> set[int]:
        """Pages that failed to load in this step (the step's load is joined first)."""
        self._finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -------------------------------------------------------------------------

    def save(self, meta: KVTierConnectorMetadata) -> None:
        """End of the step: join its loads, queue its saves (never wait for them; a
        producer waits for room and for its saves, see ``_wait_saves``)."""
        self._finish_loads()
        if self.pipeline is None or self.caches is None:
            return
        producer = self.config.producer
        # a producer's step waits for Redis at most redis_sync_timeout_s in all: its saves'
        # synchronous commits share one budget (a hung Redis cost each its own bound)
        sync = (SyncBudget(min(self.config.redis_sync_timeout_s, 0.9 * self.config.timeout_s))
                if producer else None)
        step: list[Future[bool]] = []
        cuts = [first_failed_block(planned, self._failed_at) for planned in meta.saves]
        if self._agree is not None and any(s.loaded_pages for s in meta.saves):
            cuts = self._agree(cuts)   # (the same saves on every rank: one collective)
        for planned, cut in zip(meta.saves, cuts, strict=True):
            self.ledger.planned(planned.req_id)
            if not self.saves_kv:     # another rank saves this KV: over for this one
                self.ledger.dropped(planned.save_id)
                continue
            spec = saved_before(planned, cut, self.config.tokens_per_block)
            if spec is None:   # built on pages whose load failed in this step: not its KV
                self._count("dropped_saves", 1)
                self.ledger.dropped(planned.save_id)
                continue
            most = self._piece_blocks() if producer else len(spec.pages)
            for piece in save_pieces(spec, most, self.config.tokens_per_block):
                self._submit_save(piece, producer, sync, step)
        if producer and step:
            self._wait_saves(step)

    def _piece_blocks(self) -> int:
        """Blocks per piece of a producer's save: every block of its prompt must reach
        Redis, so a save larger than the bound on saves in flight, or than half the put
        share the daemon gives this process, goes in pieces that fit (each committed, and
        its slots readable and evictable, before the next is prepared on the saver
        thread). A prompt larger than the share was capped to its leading blocks and one
        larger than the arena refused (found by review)."""
        assert self.pipeline is not None and self.caches is not None
        room = self.pipeline.max_inflight_bytes
        if self.put_room > 0:
            room = min(room, self.put_room // 2)
        return max(1, room // self.caches.block_bytes)

    def _submit_save(self, spec: TransferSpec, producer: bool, sync: SyncBudget | None,
                     step: list[Future[bool]]) -> None:
        """Queue one save (appended to ``step``); dropped and counted when the bound on
        saves in flight has no room for it (a producer first waits for room)."""
        assert self.pipeline is not None and self.caches is not None
        job = SaveRequest(spec, self.caches, lambda: self._thread_link("-save"),
                          self.tp_rank, redis_sync=sync)
        fut = self.pipeline.submit_save(
            job, job.nbytes, functools.partial(self._save_over, job))
        if fut is None and producer:   # a producer never drops a save for room
            self._wait_saves(self.ledger.running())
            fut = self.pipeline.submit_save(
                job, job.nbytes, functools.partial(self._save_over, job))
        if fut is None:
            logger.debug("kvtier: save of %s dropped (%d bytes in flight)",
                         spec.req_id, self.pipeline.inflight_bytes)
            self._count("dropped_saves", 1)
            self._count("dropped_save_bytes", job.nbytes)
            self.ledger.dropped(spec.save_id)
            return
        step.append(fut)
        self.ledger.submitted(spec.req_id, fut, job.withdrawn.set)

    def _wait_saves(self, futs: list[Future[bool]]) -> None:
        """A producer's step ends only once its saves are committed (and in Redis, or given
        up on): the request it finishes is then reported with its KV visible to every
        consumer. Each save is bounded by the daemon calls' own timeouts; this wait is
        bounded too, in case a copy hangs."""
        until = (time.monotonic() + 3 * self.config.timeout_s
                 + self.config.redis_sync_timeout_s)
        for fut in futs:
            try:
                fut.result(timeout=max(0.0, until - time.monotonic()))
            except Exception:   # a timeout: the save continues, the step does not wait
                self._count("producer_save_waits_timed_out", 1)

    def _save_over(self, job: SaveRequest, committed: bool) -> None:
        """Saver thread: a save was committed or abandoned."""
        self.saved_blocks += job.saved_blocks
        self._count("saved_blocks", job.saved_blocks)
        if job.redis_sync is not None and not job.redis_synced:
            if job.redis_off:    # not a give-up: nothing to wait for (a producer alone)
                _warn.warning("redis-off", "kvtier: kv_producer on a daemon without a Redis "
                              "tier: its saves stay on this node (set redis.url for P/D)")
            else:
                self._count("redis_sync_gave_up", 1)
        self.ledger.over(job.spec.req_id, job.spec.save_id)

    def handle_preemptions(self, req_ids: Iterable[str]) -> None:
        """Wait for the saves of preempted requests, vLLM may hand their pages to another
        request in this very step: at most ``PREEMPTED_SAVES_WAIT_S`` for all of them (a
        stalled daemon would hold the step for its timeouts); saves not over by then are
        withdrawn: they publish nothing, as what they copy may be another request's KV."""
        until = time.monotonic() + min(PREEMPTED_SAVES_WAIT_S, self.config.timeout_s)
        for req_id in req_ids:
            for fut in self.ledger.of(req_id):
                with contextlib.suppress(FutureTimeout):
                    fut.result(timeout=max(0.0, until - time.monotonic()))
            withdrawn = self.ledger.withdraw(req_id)
            if withdrawn:
                logger.info("kvtier: withdrew %d save(s) of preempted request %s still "
                            "running", withdrawn, req_id)
                self._count("withdrawn_saves", withdrawn)
            self.ledger.forget(req_id)   # (as the scheduler side does: saved_any)

    def get_finished(self, finished_req_ids: Iterable[str] = ()) -> tuple[set[str], set[str]]:
        """(requests whose delayed free may happen now, requests whose asynchronous load
        completed). A finished request that had saves is reported once they are over; the
        scheduler side delayed freeing exactly those (it planned the saves)."""
        sending = self.ledger.finished_sending(finished_req_ids)
        recving, failed = self.async_loads.take_done()
        self._load_errors |= failed
        return sending, recving

    def worker_meta(self) -> KVTierWorkerMetadata:
        """Saves over and counter increments since the last step, and the step whose
        loads are finished (their failures go out in the same output), for the scheduler."""
        self._finish_loads()
        meta = self.ledger.take_meta() or KVTierWorkerMetadata()
        meta.step = self._step
        return meta

    def _count(self, name: str, n: int) -> None:
        self.ledger.count(name, n)

    def shutdown(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
        self.async_loads.shutdown()
        self.link.close()

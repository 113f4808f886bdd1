"""Asynchronous loads (``async_load``): a request's whole prefix copied between engine
steps on a thread of its own, every layer at once, while vLLM schedules other requests;
vLLM asks each step which of them finished (``get_finished``), and the pages that failed
go out with the step's load errors so that vLLM recomputes them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .link import DaemonLink
from .metadata import TransferSpec
from .transfers import CacheSet, LoadBatch

logger = logging.getLogger("kvtier.connectors.vllm")


class AsyncLoads:
    """The asynchronous loads of one worker: one pool thread, with its own link to the
    daemon (``link``) and, on a GPU, its own CUDA stream."""

    def __init__(self, link: Callable[[], DaemonLink], tp_rank: int,
                 count: Callable[[str, int], None]) -> None:
        self._link = link
        self._tp_rank = tp_rank
        self._count = count
        self._pool: ThreadPoolExecutor | None = None
        self._stream: Any = None
        self.running: dict[str, Future[set[int]]] = {}   # request id -> its failed pages
        self._specs: dict[str, TransferSpec] = {}   # request id -> what its load fills

    def submit(self, spec: TransferSpec, caches: CacheSet, device_loads: bool,
               fence: Any = None) -> None:
        """Start ``spec``'s load; on a GPU it waits first for ``fence`` (an event on the
        compute stream: its fresh pages may have been another request's until this step,
        still read by queued kernels)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-async-load")
        self._specs[spec.req_id] = spec
        self.running[spec.req_id] = self._pool.submit(self._load_whole, spec, caches,
                                                      device_loads, fence)

    def take_done(self) -> tuple[set[str], set[int]]:
        """(requests whose load is over, the pages that failed in them)."""
        done: set[str] = set()
        failed: set[int] = set()
        for req_id, fut in list(self.running.items()):
            if not fut.done():
                continue
            del self.running[req_id]
            spec = self._specs.pop(req_id, None)
            try:
                failed |= fut.result()
            except BaseException:  # _load_whole does not raise; a crash copied nothing sure
                logger.exception("kvtier: async load of %s crashed", req_id)
                failed |= _pages_of(spec) if spec is not None else set()
            done.add(req_id)
        return done, failed

    def _load_whole(self, spec: TransferSpec, caches: CacheSet, device_loads: bool,
                    fence: Any) -> set[int]:
        """Every layer at once, on the pool thread. On a GPU the copies run on this
        thread's own stream, after ``fence``, and are finished before the leases are
        released: the daemon may reuse a slot the moment its lease is given back."""
        try:   # a load that cannot even start (a CUDA fault) fails every page it fills
            stream = self.stream(caches)
            batch = LoadBatch([spec], caches, self._link, self._tp_rank, device_loads)
        except Exception:
            logger.exception("kvtier: load of request %s could not start; vLLM recomputes "
                             "it", spec.req_id)
            return _pages_of(spec)
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if fence is not None and stream is not None:
                    stream.wait_event(fence)
                batch.open()
                for layer in range(caches.num_layers):
                    batch.load_layer(layer, stream)
            if stream is not None:
                stream.synchronize()
            failed = batch.close()
        except Exception:
            logger.exception("kvtier: load of request %s failed; vLLM recomputes it",
                             spec.req_id)
            if stream is not None:   # nothing may still read the slots being given back
                with contextlib.suppress(Exception):
                    stream.synchronize()
            failed = batch.all_pages()
        self._count("loaded_blocks", batch.loaded_blocks)
        return failed

    def stream(self, caches: CacheSet) -> Any:
        """The pool thread's CUDA stream on the caches' device (None on the CPU); made on
        first use, with that thread's current device set to the caches' (its other CUDA
        calls would go to GPU 0)."""
        device = caches.caches[0].device
        if device.type != "cuda":
            return None
        if self._stream is None:
            torch.cuda.set_device(device)
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _pages_of(spec: TransferSpec) -> set[int]:
    """The pages a load of ``spec`` fills (those before ``skip_pages`` vLLM computes)."""
    return set(spec.page_ids[spec.skip_pages:])

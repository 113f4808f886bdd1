"""LayerPipeline: layer-pipelined loads and off-path saves, one mechanism for CPU and GPU.

Loads. ``start_loads(job)`` returns at once; a loader thread opens the job (daemon leases)
and copies it layer by layer, marking each layer ready as soon as its copy is done (CPU)
or enqueued on the load stream with its event recorded (GPU, through ``LayerStreams``).
``wait_for_layer(i)`` waits for layer ``i`` only: on the CPU the host blocks until that
layer's bytes are in place; on the GPU the host waits for the (fast) enqueue and the
compute stream waits on the layer's event. ``finish_loads()`` joins the job at the end of
the step and returns the pages that failed, so they are reported in that same step.

A layer is never marked ready before its copy has completed (CPU) or been ordered before
the compute that reads it (GPU): no layer reads a half-written page. A job that fails
marks its remaining layers ready without copying them and reports every page it owns.

Saves. ``submit_save(job, nbytes)`` hands a save to the saver thread and returns; the job
prepares (opens a put lease), copies on the save stream ordered after the compute issued so
far, and commits once the copy has finished. Bytes in flight are bounded: a save that
would exceed ``max_inflight_bytes`` is refused (the caller counts it as dropped) instead of
stalling the engine; a dropped save is only a future cache miss. (The saver thread keeps
the engine's CPU priority: a lowered one was measured to stall the engine, since the
saver holds the GIL between copies and, starved, hands it back late.)
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier.kernels.cuda_stream import LayerStreams

logger = logging.getLogger("kvtier.kernels.pipeline")


class LoadJob(Protocol):
    """One step's loads, driven by the loader thread."""

    def open(self) -> None:
        """Acquire what the copies read (get leases); runs on the loader thread."""

    def load_layer(self, layer: int, stream: Any) -> None:
        """Copy (or enqueue the copy of) one layer of every block of the job."""

    def close(self) -> set[int]:
        """After every layer has finished: release leases; the page ids that failed."""

    def all_pages(self) -> set[int]:
        """Every page the job writes (all of them fail when the job itself fails)."""


class SaveJob(Protocol):
    """One save, driven by the saver thread."""

    def prepare(self) -> bool:
        """Acquire arena slots (a put lease); False when there is nothing to copy."""

    def copy(self, stream: Any) -> None:
        """Copy (or enqueue the copy of) the blocks into the slots."""

    def commit(self) -> None:
        """The copy has finished: publish the blocks."""

    def abandon(self) -> None:
        """Something failed: release the slots without publishing."""


@dataclass(slots=True)
class LoadTrace:
    """Timestamps (``clock`` seconds) of the last step's load, for tests and logs:
    when each layer became ready, and when ``wait_for_layer`` returned for it."""

    started: float
    ready_at: list[float | None]
    waited_at: list[float | None]
    finished_at: float | None = None


@dataclass(slots=True)
class _StepLoad:
    ready: list[threading.Event]
    trace: LoadTrace
    future: Future[set[int]] | None = None


@dataclass(slots=True)
class SaveStats:
    """Counters of the saver (monotonic)."""

    submitted: int = 0
    committed: int = 0
    failed: int = 0
    dropped: int = 0
    dropped_bytes: int = 0
    peak_inflight_bytes: int = 0
    errors: list[str] = field(default_factory=list)


class LayerPipeline:
    """A loader thread with per-layer readiness and a saver thread with a byte bound."""

    def __init__(self, num_layers: int, device: Any = None, *, max_inflight_bytes: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if max_inflight_bytes <= 0:
            raise ValueError(f"max_inflight_bytes must be positive, got {max_inflight_bytes}")
        self.num_layers = num_layers
        self.streams = LayerStreams(num_layers, device)
        self.max_inflight_bytes = max_inflight_bytes
        self.clock = clock
        self.save_stats = SaveStats()
        self.last_trace: LoadTrace | None = None
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvtier-save")
        self._step: _StepLoad | None = None
        self._lock = threading.Lock()
        self._inflight_bytes = 0

    # -- loads -------------------------------------------------------------------------

    def start_loads(self, job: LoadJob) -> None:
        """Start this step's loads on the loader thread; returns at once."""
        if self._step is not None:
            self.finish_loads()
        self.streams.start_step()  # GPU: loads ordered after compute already queued
        trace = LoadTrace(self.clock(), [None] * self.num_layers, [None] * self.num_layers)
        step = _StepLoad([threading.Event() for _ in range(self.num_layers)], trace)
        self._step = step
        self.last_trace = trace
        step.future = self._loader.submit(self._run_load, job, step)

    def _run_load(self, job: LoadJob, step: _StepLoad) -> set[int]:
        failed: set[int] = set()
        ok = True
        try:
            job.open()
        except Exception:
            logger.exception("kvtier: opening a load failed; its pages are recomputed")
            ok = False
        for layer in range(self.num_layers):
            if ok:
                try:
                    self.streams.load_layer(layer, functools.partial(job.load_layer, layer))
                except Exception:
                    logger.exception("kvtier: load of layer %d failed; its pages are "
                                     "recomputed", layer)
                    ok = False
            step.trace.ready_at[layer] = self.clock()
            step.ready[layer].set()
        try:
            self.streams.sync_loads()
            failed = job.close()
        except Exception:
            logger.exception("kvtier: finishing a load failed; its pages are recomputed")
            ok = False
        if not ok:
            failed = job.all_pages()
        step.trace.finished_at = self.clock()
        return failed

    def wait_for_layer(self, layer: int) -> None:
        """Block until layer ``layer`` of this step's load is usable (no-op without one)."""
        step = self._step
        if step is None:
            return
        step.ready[layer].wait()
        self.streams.wait_for_layer(layer)
        if step.trace.waited_at[layer] is None:
            step.trace.waited_at[layer] = self.clock()

    def finish_loads(self) -> set[int]:
        """Join this step's load (if any); the page ids that did not load."""
        step, self._step = self._step, None
        if step is None or step.future is None:
            return set()
        return step.future.result()

    @property
    def loading(self) -> bool:
        """Whether a step's load is started and not yet joined."""
        return self._step is not None

    # -- saves -------------------------------------------------------------------------

    @property
    def inflight_bytes(self) -> int:
        """Bytes of saves submitted and not yet committed or abandoned."""
        return self._inflight_bytes

    def submit_save(self, job: SaveJob, nbytes: int,
                    done: Callable[[bool], None] | None = None) -> Future[bool] | None:
        """Queue a save; None (dropped, counted) when it would exceed the byte bound.

        ``done(committed)`` runs on the saver thread once the save is over.
        """
        with self._lock:
            if self._inflight_bytes + nbytes > self.max_inflight_bytes:
                self.save_stats.dropped += 1
                self.save_stats.dropped_bytes += nbytes
                return None
            self._inflight_bytes += nbytes
            self.save_stats.submitted += 1
            self.save_stats.peak_inflight_bytes = max(self.save_stats.peak_inflight_bytes,
                                                      self._inflight_bytes)
        fence = self.streams.compute_fence()
        return self._saver.submit(self._run_save, job, nbytes, fence, done)

    def _run_save(self, job: SaveJob, nbytes: int, fence: Any,
                  done: Callable[[bool], None] | None) -> bool:
        committed = False
        try:
            if job.prepare():
                self.streams.run_save(fence, job.copy)
                job.commit()
                committed = True
        except Exception as exc:
            logger.warning("kvtier: save failed (%s: %s); it is only a future cache miss",
                           type(exc).__name__, exc)
            self.save_stats.failed += 1
            try:
                # a copy enqueued before the failure may still write the put slots:
                # they go back to the daemon only once it is over (GPU; no-op on the CPU)
                self.streams.wait_for_saves()
                job.abandon()
            except Exception:
                logger.debug("kvtier: abandoning a failed save failed too", exc_info=True)
        finally:
            with self._lock:
                self._inflight_bytes -= nbytes
                if committed:
                    self.save_stats.committed += 1
            if done is not None:
                done(committed)
        return committed

    def warm(self, on_loader: Callable[[], object], on_saver: Callable[[], object], *,
             wait: bool = False) -> None:
        """Run set-up work (a daemon connection, an arena mapping) on the loader and saver
        threads now, so the first step does not pay for it.

        ``wait`` (GPU engines): return only once it is done. vLLM captures its CUDA graphs
        right after the connector's ``register_kv_caches``, and a ``cudaHostRegister`` of
        the arena from another thread during a capture in the default "global" mode fails
        the capture (cudaErrorStreamCaptureUnsupported: vLLM's own CPU offloading hung at
        capture that way and went back to pinning at start, vllm-project/vllm#46933).
        A failure is logged; the threads then set up at first use."""
        futures = [self._loader.submit(on_loader), self._saver.submit(on_saver)]
        if not wait:
            return
        for future in futures:
            exc = future.exception()
            if exc is not None:
                logger.warning("kvtier: setting up a transfer thread failed (%s: %s); it "
                               "sets up at first use", type(exc).__name__, exc)

    def close(self) -> None:
        """Join the loader and let queued saves finish."""
        self.finish_loads()
        self._loader.shutdown(wait=True)
        self._saver.shutdown(wait=True)


"""The worker's save ledger: which requests have saves in flight, which finished requests
may be freed (vLLM's delayed free, reported in ``finished_sending``), and what to tell
the scheduler at the end of each step (saves over, counter increments).

Shared by the engine's thread (``WorkerSide``) and the saver thread (``over``), so every
method takes the one lock; futures are only inspected, never waited on, under it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from .metadata import KVTierWorkerMetadata


class SaveLedger:
    """Saves in flight per request, delayed frees, and per-step reports."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight: dict[str, list[Future[bool]]] = {}
        self._withdraw: dict[Future[bool], Callable[[], None]] = {}   # per save in flight
        self._saved_reqs: set[str] = set()     # requests with saves planned (delay_free)
        self._finishing: set[str] = set()      # finished by vLLM, saves maybe still running
        self._saves_done: dict[int, int] = {}
        self._counters: dict[str, int] = {}

    def planned(self, req_id: str) -> None:
        """A save of ``req_id`` is about to be submitted (its free will be delayed)."""
        with self._lock:
            self._saved_reqs.add(req_id)

    def submitted(self, req_id: str, fut: Future[bool],
                  withdraw: Callable[[], None] | None = None) -> None:
        """A save of ``req_id`` runs; ``withdraw()`` tells it not to publish its blocks."""
        with self._lock:
            self._inflight.setdefault(req_id, []).append(fut)
            if withdraw is not None:
                self._withdraw[fut] = withdraw

    def dropped(self, save_id: int) -> None:
        """A save that never ran (no room): over for the scheduler at once."""
        with self._lock:
            self._saves_done[save_id] = 1

    def over(self, req_id: str, save_id: int) -> None:
        """Saver thread: a save was committed or abandoned."""
        with self._lock:
            self._saves_done[save_id] = 1
            futs = self._inflight.get(req_id)
            if futs is not None:
                self._drop(f for f in futs if f.done())
                futs[:] = [f for f in futs if not f.done()]

    def _drop(self, futs: Iterable[Future[bool]]) -> None:
        for f in futs:
            self._withdraw.pop(f, None)

    def running(self) -> list[Future[bool]]:
        """Every save not yet over."""
        with self._lock:
            return [f for futs in self._inflight.values() for f in futs if not f.done()]

    def of(self, req_id: str) -> list[Future[bool]]:
        """``req_id``'s saves in flight."""
        with self._lock:
            return list(self._inflight.get(req_id, ()))

    def withdraw(self, req_id: str) -> int:
        """Tell ``req_id``'s saves still running not to publish; how many there were."""
        with self._lock:
            running = [self._withdraw.get(f) for f in self._inflight.get(req_id, ())
                       if not f.done()]
        for withdraw in running:
            if withdraw is not None:
                withdraw()
        return len(running)

    def forget(self, req_id: str) -> None:
        """``req_id`` was preempted and its saves are over or withdrawn: its free is no
        longer delayed for them (the scheduler side clears ``saved_any`` in the same step)."""
        with self._lock:
            self._saved_reqs.discard(req_id)
            self._drop(self._inflight.pop(req_id, ()))

    def undelayed(self, req_id: str) -> None:
        """vLLM freed ``req_id`` without waiting (the scheduler saw every save of it over):
        never report it. A save still running (none should) is withdrawn: its pages may
        be another request's by now."""
        self.withdraw(req_id)
        with self._lock:
            self._saved_reqs.discard(req_id)
            self._finishing.discard(req_id)
            self._drop(self._inflight.pop(req_id, ()))

    def finished_sending(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Requests vLLM finished (now or earlier) whose saves are all over: their pages
        may be freed. A finished request without saves was never delayed: not reported."""
        with self._lock:
            for req_id in finished_req_ids:
                if req_id in self._saved_reqs:
                    self._saved_reqs.discard(req_id)
                    self._finishing.add(req_id)
            sending = set()
            for req_id in list(self._finishing):
                if not any(not f.done() for f in self._inflight.get(req_id, ())):
                    self._finishing.discard(req_id)
                    self._drop(self._inflight.pop(req_id, ()))
                    sending.add(req_id)
            return sending

    def count(self, name: str, n: int) -> None:
        if n:
            with self._lock:
                self._counters[name] = self._counters.get(name, 0) + n

    def take_meta(self) -> KVTierWorkerMetadata | None:
        """Saves over and counter increments since the last call, for the scheduler."""
        with self._lock:
            if not self._saves_done and not self._counters:
                return None
            meta = KVTierWorkerMetadata(self._saves_done, self._counters)
            self._saves_done, self._counters = {}, {}
        return meta

"""Giving nvme disk back: punching free slots out of the files, and erasing deleted frames.

A new size class grows its own file at the tail, so the room other classes freed in their
files' middles is useless to it until those free slots are punched out
(``fallocate(PUNCH_HOLE)``, ``kvtier.tiers.nvme.holes``); an explicit delete zeroes its
frame's header page so the block does not come back after a restart. Both run in the
tier's I/O pool, never on the event loop (513 punches once held every client 1.5 s on
ext4), ordered with the slot's other disk operations (``pending``: the last one queued
per slot, shared with the tier's writes), each file's descriptor pinned until they end
(``kvtier.tiers.nvme.files``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from kvtier.tiers.aligned import PAGE
from kvtier.tiers.nvme.buffers import ZERO_PAGE
from kvtier.tiers.nvme.files import SlotFile
from kvtier.tiers.nvme.holes import punch_run
from kvtier.tiers.nvme.slots import NvmeSlot, SizeClass, SlotTable, slot_bytes_for

log = logging.getLogger("kvtier.tiers.nvme.tier")
ERASING_PRUNE_MIN = 64   # erases queued before the first pass that drops finished ones


class Reclaimer:
    """Punches and erases of one tier: ``pool()`` is its I/O pool (None once closed)."""

    def __init__(self, slots: SlotTable, pending: dict[NvmeSlot, Future[Any]],
                 pool: Callable[[], ThreadPoolExecutor | None],
                 settled: Callable[[NvmeSlot], bool]) -> None:
        self._slots = slots
        self._pending = pending
        self._pool = pool
        self._settled = settled
        self._erasing: list[Future[Any]] = []   # erases queued and not known done
        # pruned of finished erases only when it doubles: per erase, a drop of n orphans
        # cost O(n^2) done() checks, a 0.4-4 s stall of the event loop at 2047 orphans
        self._erasing_prune_at = ERASING_PRUNE_MIN
        self._punches: set[asyncio.Future[None]] = set()   # make_room's punches in flight
        self._wanted = 0   # bytes of disk the allocations waiting in make_room need

    async def make_room(self, payload_len: int) -> bool:
        """Punch free slots out of the files until ``payload_len`` fits their disk, and
        wait for the punches in flight (another allocation's included); False when none
        runs (none free, no holes here), so the store evicts."""
        slot_bytes = slot_bytes_for(payload_len)
        footprint = PAGE + slot_bytes
        # what the allocations waiting here with this one still need counts too: room
        # made for one at a time, the 8th of a batch of evictions ran out of rounds
        self._wanted += footprint
        try:
            need = (self._slots.disk_short(slot_bytes) + self._wanted - footprint
                    - self._slots.punching_bytes)
            plan = self._slots.take_for_punch(need, self._settled)
            if plan:   # a task of its own: a caller cancelled does not strand the slots
                task = asyncio.ensure_future(self._punch(plan))
                self._punches.add(task)
                task.add_done_callback(self._punches.discard)
            if not self._punches:
                return False
            await asyncio.wait(list(self._punches))
            return True
        finally:
            self._wanted -= footprint

    async def _punch(self, plan: list[tuple[SizeClass, list[int]]]) -> None:
        outcomes: list[OSError | None] = [OSError("punch not run")] * len(plan)
        pool = self._pool()
        if pool is None:   # closed before this task's first step: nothing to undo
            return
        files = self._slots.files
        try:
            jobs: list[tuple[int, int, int, list[int]]] = []
            pinned: list[SlotFile] = []
            for i, (cls, run) in enumerate(plan):
                try:
                    jobs.append((i, files.pin(cls.file), cls.stride, run))
                except OSError as exc:   # (it could not be reopened)
                    outcomes[i] = exc
                    continue
                pinned.append(cls.file)
            fut = asyncio.wrap_future(
                files.unpin_when_done(pinned, lambda: pool.submit(_punch_all, jobs)))
            try:
                ended = await asyncio.shield(fut)
            except asyncio.CancelledError:
                # the slots go back only once the punch is over: a write into one before it
                # ended could be punched away
                with contextlib.suppress(Exception):
                    for i, err in await fut:
                        outcomes[i] = err
                raise
            for i, err in ended:
                outcomes[i] = err
        finally:
            for cls, slot in self._slots.punched(plan, outcomes):
                if self._pool() is not None:   # (not closed meanwhile)
                    self.queue_erase(cls, slot)

    def erase_free(self, slot: NvmeSlot) -> bool:
        """Zero the header page of a free slot whose frame is still on disk (an evicted
        frame whose key was deleted since: it must not come back at a restart), ordered
        like an erase at free. False, with nothing done, when the slot was handed out
        again (its frame is or will be overwritten) or cut off its file."""
        cls = self._slots.classes.get(slot.slot_bytes)
        if cls is None or not 0 <= slot.index < cls.high_water or slot.index in cls.busy:
            return False
        if slot.index in cls.punching:     # its punch removes the frame (or, failing, the
            cls.erase_after.add(slot.index)    # erase is queued then: ``_punch``)
        elif slot.index not in cls.holes:  # a punched slot's frame is gone already
            self.queue_erase(cls, slot)
        return True

    def queue_erase(self, cls: SizeClass, slot: NvmeSlot) -> None:
        """Zero ``slot``'s header page in the pool, after the slot's last queued op."""
        pool = self._pool()
        assert pool is not None
        prev = self._pending.get(slot)
        try:
            op = self._slots.files.start(
                cls.file, lambda fd: pool.submit(_erase_sync, fd, slot.offset, prev))
        except OSError as exc:   # its file could not be reopened (removed, replaced)
            self._slots.counters.errors += 1
            log.warning("nvme tier: cannot erase %s slot %d (%s): its frame may come back "
                        "after a restart", cls.path, slot.index, exc.strerror or exc)
            return
        self._pending[slot] = op
        self._erasing.append(op)
        if len(self._erasing) > self._erasing_prune_at:   # amortized: not per erase
            self._erasing = [f for f in self._erasing if not f.done()]
            self._erasing_prune_at = max(ERASING_PRUNE_MIN, 2 * len(self._erasing))

    async def erased(self) -> None:
        """Wait until every erase queued so far is on disk (or failed, logged): a delete
        answers after it, so a crash right after cannot bring the block back. A frame in a
        slot being punched is gone with the punch (or erased when it fails): the punches
        in flight are waited for first."""
        if self._punches:
            await asyncio.wait(list(self._punches))
        # every erase not yet done, another delete's too: taking them away (as before)
        # let a second delete that had waited answer before its own erase was on disk
        todo = self._erasing = [f for f in self._erasing if not f.done()]
        if todo:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in todo),
                                 return_exceptions=True)


def _punch_all(jobs: list[tuple[int, int, int, list[int]]]) -> list[tuple[int, OSError | None]]:
    return [(i, punch_run(fd, stride, run)) for i, fd, stride, run in jobs]


def _erase_sync(fd: int, offset: int, prev: Future[Any] | None) -> int:
    if prev is not None:
        wait([prev])   # order after the slot's previous op; its caller saw any error
    try:
        return os.pwritev(fd, [ZERO_PAGE], offset)
    except OSError as exc:
        log.warning("nvme tier: erasing the frame at offset %d failed (%s); it may come back "
                    "after a restart until the slot is reused", offset, exc.strerror)
        raise

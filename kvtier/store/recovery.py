"""Warm restart: rebuild the store's index from nvme frames and the adopted cpu arena.

After a crash the daemon finds two kinds of survivors: frames in the nvme slot files and,
when it could adopt its predecessor's arena, the blocks the arena journal says were committed
there (``kvtier.tiers.arena_journal``). ``recover`` merges them:

1. nvme frames, oldest first (the tier's own scan: torn headers are already gone);
2. journal commits whose payload still has the recorded xxh3-64 in the arena (verified in a
   thread pool), re-reserved in the slab allocator; a block on nvme and in the arena is in both;
3. chain reachability: a block whose parent (full key from the journal, or the frame's parent
   tag) is in no tier is unreachable by any lookup, and so is everything below it: dropped as
   an orphan (frames of the old format, without a recorded parent, count as chain heads);
4. slots that were being written at the crash are quarantined for one lease TTL (a stalled
   client of the dead daemon may still write into them), then freed;
5. a fresh journal describing the adopted state is written, and the arena journals from then on.

Anything in flight or failing its checksum is dropped and counted (``RecoveryCounters``).
``CommitLog`` is the store's side of the journal while it serves: it writes the COMMIT record
of each block that becomes ready in the arena, with the checksum computed off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from kvtier.checksum import checksums_in_background
from kvtier.frame import FLAG_CHAIN, parent_tag
from kvtier.index import BlockMeta, SlotState
from kvtier.store.slices import slices
from kvtier.tiers.aligned import byte_view
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_journal import ArenaJournal
from kvtier.tiers.base import EvictionReason
from kvtier.tiers.journal_format import CommitInfo, CommittedSlot
from kvtier.tiers.journal_replay import JournalState
from kvtier.tiers.nvme import NvmeSlot
from kvtier.tiers.nvme.recovery import Recovered

if TYPE_CHECKING:
    from kvtier.store.coordinator import TieredStore

log = logging.getLogger("kvtier.store")

# blocks hashed and journaled per executor round trip: the event loop's own work for a
# batch (views, journal records) stays well under a ms (kvtier.store.slices)
DRAIN_BATCH = 256


@dataclass(slots=True)
class RecoveryCounters:
    """What the last start recovered and dropped (``recovery`` in /v1/stats)."""

    mode: str = "cold"             # warm: the arena was adopted; cold: it was not
    cold_reason: str = ""
    nvme_blocks: int = 0           # frames indexed from nvme (before orphan collection)
    adopted_blocks: int = 0        # arena blocks verified and indexed in the cpu tier
    adopted_bytes: int = 0
    dropped_checksum: int = 0      # journal commits whose arena bytes no longer match
    dropped_inflight: int = 0      # slots being written (or checksummed) at the crash
    dropped_conflict: int = 0      # commits that could not be re-reserved or disagree
    orphans_dropped: int = 0       # blocks no chain head leads to (cpu and nvme)
    quarantined_slots: int = 0     # slots held back for one lease TTL
    seconds: float = 0.0


@dataclass(slots=True)
class _Found:
    """One surviving block before it enters the index."""

    key: bytes
    namespace: bytes
    layout_fp: int
    nbytes: int
    seq: int
    nvme: NvmeSlot | None = None
    cpu: int | None = None
    cpu_order: int = 0
    checksum: int = 0
    parent: bytes | None = None    # full key (journal)
    tag: int | None = None         # parent tag (frame) when the full key is not known
    depth: int = 0


class CommitLog:
    """Writes the journal's COMMIT record of each block that becomes ready in the arena.

    A checksum the caller knows (a promotion from nvme or Redis of an uncompressed frame:
    the frame's payload checksum, the same xxh3-64 over the same bytes, already verified) is
    recorded at once; others (a put's payload, written by the client) are hashed in the
    default executor in batches (large blocks without holding the GIL), and recorded only
    if the slot was not freed meanwhile (the journal's slot generation): a crash before the
    record leaves the block uncommitted, dropped at adoption.
    """

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.hashed = 0        # blocks this log had to hash (no checksum came with them)
        self.borrowed = 0      # blocks whose checksum came from their Redis frame instead
        self._queue: dict[int, tuple[int, CommitInfo]] = {}   # offset -> (generation, info)
        self._task: asyncio.Task[None] | None = None

    def ready(self, meta: BlockMeta, checksum: int | None = None) -> None:
        self.ready_many((meta,), (checksum,))

    def ready_many(self, metas: Sequence[BlockMeta], checksums: Sequence[int | None]) -> None:
        """``metas`` became ready: the known checksums recorded in one journal write, the
        other blocks queued for hashing."""
        journal = self.arena.journal
        if journal is None:
            return
        known: list[tuple[int, int, CommitInfo, int]] = []
        for meta, checksum in zip(metas, checksums, strict=True):
            off = meta.cpu
            gen = None if off is None else journal.generation(off)
            if off is None or gen is None:
                continue
            info = CommitInfo(meta.key, meta.namespace, meta.layout_fp, meta.nbytes,
                              meta.parent, meta.depth, meta.seq)
            if checksum is not None:
                known.append((off, gen, info, checksum))
            else:
                self._queue[off] = (gen, info)
        if known:
            journal.commit_many(known)
        if self._queue and self._task is None:
            self._task = asyncio.ensure_future(self._drain())

    def defer(self, meta: BlockMeta) -> Callable[[int | None], None] | None:
        """``meta`` (queued for hashing, not hashed yet) is about to be framed for Redis
        from its slot, which hashes the same bytes with the same function: take it out of
        the queue and return the callback that records that checksum (None: hash it here
        after all). None when there is nothing to defer. The record then waits for the
        Redis write; a crash before it leaves the block to Redis, not to the adopted arena."""
        if meta.cpu is None or meta.cpu not in self._queue:
            return None
        off = meta.cpu
        gen, info = self._queue.pop(off)

        def record(checksum: int | None) -> None:
            journal = self.arena.journal
            if journal is None or journal.generation(off) != gen:
                return   # journal gone, or the slot was freed meanwhile
            if checksum is None:
                self._queue[off] = (gen, info)
                if self._task is None:
                    self._task = asyncio.ensure_future(self._drain())
                return
            self.borrowed += 1
            journal.commit(off, gen, info, checksum)

        return record

    async def flush(self) -> None:
        """Wait until every queued checksum is recorded (or found stale)."""
        while self._task is not None:
            await asyncio.shield(self._task)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._queue:
                queued, self._queue = self._queue, {}
                # a batch at a time: the loop's share of each (views, records) stays short
                for part in slices(list(queued.items()), DRAIN_BATCH):
                    journal = self.arena.journal
                    if journal is None:
                        return
                    # slots freed since they became ready need no checksum
                    batch = [(off, gen, info) for off, (gen, info) in part
                             if journal.generation(off) == gen]
                    views = [self.arena.view(off, info.nbytes) for off, _, info in batch]
                    sums = await loop.run_in_executor(None, checksums_in_background, views)
                    self.hashed += len(views)
                    if self.arena.journal is not journal:
                        return
                    journal.commit_many([(off, gen, info, csum) for (off, gen, info), csum
                                         in zip(batch, sums, strict=True)])  # freed: skipped
        finally:
            self._task = None


def _verify(arena: Arena, slots: list[CommittedSlot]) -> list[bool]:
    """Whether each committed slot's arena bytes still have its checksum (thread pool)."""
    def check(chunk: list[CommittedSlot]) -> list[bool]:
        out = []
        for c in chunk:
            end = c.offset + c.info.nbytes
            out.append(c.offset >= 0 and end <= arena.size and xxhash.xxh3_64_intdigest(
                byte_view(arena.view(c.offset, c.info.nbytes))) == c.checksum)
        return out

    workers = max(1, min(4, os.cpu_count() or 1))
    step = max(1, -(-len(slots) // workers))
    chunks = [slots[i: i + step] for i in range(0, len(slots), step)]
    with ThreadPoolExecutor(workers, thread_name_prefix="kvtier-adopt") as pool:
        return [ok for part in pool.map(check, chunks) for ok in part]


async def recover(store: TieredStore, state: JournalState | None, *,
                  journal: Path | None, quarantine_s: float, last_run: bytes | None,
                  begin_run: Callable[[], bytes]) -> RecoveryCounters:
    """Index what survived (nvme frames, adopted arena blocks), drop orphans, quarantine
    the slots in flight at the crash, then start journaling to ``journal`` (None: never).
    A journal of another run than ``last_run`` is not adopted (``journal_run``);
    ``begin_run`` records this run once the nvme tier is open (the last step that may
    refuse the start, which then leaves the last run's arena for the next)."""
    t0 = time.monotonic()
    loop = asyncio.get_running_loop()
    c = RecoveryCounters()
    arena = store.arena
    entries: Recovered = []
    if store.nvme is not None:
        entries = await loop.run_in_executor(None, store.nvme.open)
    run = await loop.run_in_executor(None, begin_run)
    committed: list[CommittedSlot] = []
    writing: list[tuple[int, int]] = []
    if state is None:
        c.cold_reason = "no arena journal from a previous run"
    elif state.run != last_run:
        c.cold_reason = ("the arena journal is not from this data directory's last run (a "
                         "start in between did not adopt it, so its blocks may be stale)")
    elif (state.arena_size, state.slab_bytes) != (arena.size, arena.slab_bytes):
        c.cold_reason = (f"arena geometry changed (size {state.arena_size} -> {arena.size}, "
                         f"slab {state.slab_bytes} -> {arena.slab_bytes})")
    elif not arena.adopted:
        c.cold_reason = "the previous arena file is gone or not usable"
    else:
        c.mode = "warm"
        ok = await loop.run_in_executor(None, _verify, arena, state.committed)
        committed = [s for s, good in zip(state.committed, ok, strict=True) if good]
        c.dropped_checksum = len(state.committed) - len(committed)
        writing = state.writing
        c.dropped_inflight = len(writing)
    if c.mode == "cold":
        log.info("cpu tier starts cold: %s", c.cold_reason)
    adopted, quarantine = _merge(store, entries, committed, writing, c)
    if journal is not None:
        live: list[tuple[int, int, CommittedSlot | None]] = [
            (s.offset, s.info.nbytes, s) for s in adopted]
        live += [(off, nbytes, None) for off, nbytes in quarantine]
        try:
            arena.journal = ArenaJournal(journal, arena.size, arena.slab_bytes,
                                         run=run, live=live)
        except OSError as exc:
            log.warning("cannot write the arena journal %s (%s): warm restart is off",
                        journal, exc)
    if quarantine:
        c.quarantined_slots = len(quarantine)
        loop.call_later(quarantine_s, _release, store, [off for off, _ in quarantine])
    c.seconds = round(time.monotonic() - t0, 6)
    store.recovery = c
    if c.mode == "warm" or c.orphans_dropped:
        log.info("recovered %d cpu blocks (%d bytes) and %d nvme frames in %.3f s; dropped "
                 "%d failing checksum, %d in flight, %d conflicting, %d orphans",
                 c.adopted_blocks, c.adopted_bytes, c.nvme_blocks, c.seconds,
                 c.dropped_checksum, c.dropped_inflight, c.dropped_conflict, c.orphans_dropped)
    return c


def rebuild_nvme_only(store: TieredStore) -> int:
    """Index nvme frames without an arena to adopt (sync: runs ``nvme.open()`` here)."""
    if store.nvme is None:
        return 0
    entries = store.nvme.open()
    c = RecoveryCounters()
    _merge(store, entries, [], [], c)
    store.recovery = c
    return c.nvme_blocks


def _merge(store: TieredStore, entries: Recovered,
           committed: list[CommittedSlot], writing: list[tuple[int, int]],
           c: RecoveryCounters) -> tuple[list[CommittedSlot], list[tuple[int, int]]]:
    """Build the index from the survivors; return the adopted cpu slots and the quarantined
    ones. Runs before the daemon serves (nothing else touches the store)."""
    found: dict[bytes, _Found] = {}
    nvme = store.nvme
    assert nvme is not None or not entries
    for slot, h in entries:   # oldest first
        old = found.pop(h.key, None)
        if old is not None and old.nvme is not None and nvme is not None:
            nvme.free(old.nvme, erase=True)   # the same key under two namespaces: the newest
        f = _Found(h.key, h.namespace, h.layout_fp, h.raw_len, h.seq, nvme=slot)
        if h.flags & FLAG_CHAIN:
            f.tag = h.chain_parent
        found[h.key] = f
    c.nvme_blocks = len(found)
    reserved = store.arena.reserve_many([(s.offset, s.info.nbytes) for s in committed]
                                        + writing)
    by_offset: dict[int, CommittedSlot] = {}
    for s, ok in zip(committed, reserved, strict=False):
        info = s.info
        on_nvme = found.get(info.key)
        if not ok or (on_nvme is not None and (on_nvme.cpu is not None or (
                on_nvme.namespace, on_nvme.layout_fp, on_nvme.nbytes) != (
                    info.namespace, info.layout_fp, info.nbytes))):
            if ok:
                store.arena.free(s.offset)
            c.dropped_conflict += 1
            continue
        f = on_nvme if on_nvme is not None else _Found(info.key, info.namespace,
                                                        info.layout_fp, info.nbytes, info.seq)
        found[info.key] = f
        f.cpu, f.cpu_order, f.checksum = s.offset, s.order, s.checksum
        f.parent, f.tag, f.depth = info.parent, None, info.depth
        by_offset[s.offset] = s
    quarantine = [w for w, ok in zip(writing, reserved[len(committed):], strict=True) if ok]
    order = _reachable(found)
    for f in found.values():
        if f.key not in order:
            _drop_orphan(store, f)
            c.orphans_dropped += 1
    now = store.clock()
    metas = []
    for f in order.values():   # parents before children
        meta = BlockMeta(f.key, f.namespace, f.layout_fp, f.nbytes, f.parent, f.depth,
                         nvme=f.nvme, nvme_ready=f.nvme is not None, seq=f.seq)
        store.index[f.key] = meta
        if store.forest is not None:
            store.forest.add(f.key, f.parent)
        metas.append((meta, f))
    for meta, _f in sorted((m for m in metas if m[1].nvme is not None),
                           key=lambda m: m[1].seq):
        store.nvme_policy.insert(meta.key, nbytes=meta.nbytes, parent=meta.parent,
                                 depth=meta.depth, now=now)
    adopted = []
    for meta, f in sorted((m for m in metas if m[1].cpu is not None),
                          key=lambda m: m[1].cpu_order):
        meta.cpu = f.cpu
        meta.set_cpu_state(SlotState.LOADING)
        store.cpu.ready(meta, now)
        adopted.append(by_offset[f.cpu])  # type: ignore[index]
        c.adopted_blocks += 1
        c.adopted_bytes += meta.nbytes
    return adopted, quarantine


def _reachable(found: dict[bytes, _Found]) -> dict[bytes, _Found]:
    """The blocks a prefix walk can reach, parents first, with parent keys and depths
    resolved; a parent known only by its tag is looked up among the survivors."""
    by_tag = {parent_tag(k): k for k in found}
    children: dict[bytes, list[_Found]] = {}
    roots = []
    for f in found.values():
        if f.parent is None and f.tag is not None:
            f.parent = by_tag.get(f.tag, b"")   # b"": the parent is in no tier
            if f.parent == b"":
                continue
        if f.parent is None:
            roots.append(f)
        elif f.parent in found:
            children.setdefault(f.parent, []).append(f)
    order: dict[bytes, _Found] = {}
    stack = roots
    while stack:
        f = stack.pop()
        if f.key in order:
            continue
        order[f.key] = f
        for kid in children.get(f.key, ()):
            if kid.parent is not None and kid.depth == 0:
                kid.depth = f.depth + 1
            stack.append(kid)
    return order


def _drop_orphan(store: TieredStore, f: _Found) -> None:
    if f.nvme is not None and store.nvme is not None:
        store.nvme.free(f.nvme, erase=True)   # else it is back once its parent is stored again
        store.nvme.counters.evicted(EvictionReason.ORPHAN)
    if f.cpu is not None:
        store.arena.free(f.cpu)
        store.cpu.counters.evicted(EvictionReason.ORPHAN)


def _release(store: TieredStore, offsets: list[int]) -> None:
    for off in offsets:
        store.arena.free(off)

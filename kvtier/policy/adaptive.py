"""``adaptive``: the live tier follows whichever mode its shadow caches say hits the most.

Nothing here is fitted to a trace. The shadows (:mod:`kvtier.policy.shadow`) replay the
tier's own recent references through miniature ``lru``, ``lfu`` and ``cost`` caches; the
live policy runs one of them (the *mode*) and, when the shadows' choice changes, rebuilds
the new mode's ordering over the resident blocks, most recently used last (a child may come
before its parent, as in the store), so a block just used is the last to go under any
mode. Switches are rare (hysteresis and a minimum of evidence in
:class:`~kvtier.policy.shadow.TierShadows`); a rebuild is O(resident blocks).

The wrapper mirrors residency in one insertion-ordered dict (the recency order the rebuild
needs) and forwards every call to the live mode: an O(1) overhead per call.

Wiring: :class:`ShadowObserver` feeds every request's chain to the shadows of each tier
(the store's observer seam); the simulator calls :meth:`TierShadows.on_request` itself.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.policy.base import EvictionPolicy, Key, register_eviction_policy
from kvtier.policy.shadow import TierShadows
from kvtier.policy.stats import WorkloadStats

DRAIN_SLICE_S = 0.0003
"""The deferred lookup replay's time per event-loop turn (see :class:`ShadowObserver`)."""
DRAIN_PIECE = 8
"""Keys of one chain counted between two looks at the clock."""
DRAIN_GAP_S = 0.001
"""The least time between two slices while the queue is short."""
BUSY_QUEUED_KEYS = 1 << 13
"""Queued keys beyond which the slices run back to back."""
MAX_QUEUED_KEYS = 1 << 15
"""Queued keys beyond which the oldest queued chains are dropped."""


class AdaptivePolicy:
    """An eviction policy that delegates to the mode its :class:`TierShadows` chose.

    ``make(mode)`` builds a policy of a mode (the same factory the shadows use).
    ``shadows`` may be shared with an observer that feeds it; when its capacity is not
    known yet, ``capacity_bytes`` over the first block's size sizes it (a daemon knows its
    tier in bytes, not blocks), else the population at the first eviction (the tier is
    full then). ``on_capacity`` is then told that size in blocks (the daemon sizes the
    ``hindsight`` mode's OPTgen with it).
    """

    name = "adaptive"

    __slots__ = (
        "_cap_bytes", "_live", "_make", "_meta", "_on_capacity", "_pinned", "mode", "shadows",
    )

    def __init__(self, make: Callable[[str], EvictionPolicy],
                 shadows: TierShadows | None = None, *, capacity_bytes: int = 0,
                 on_capacity: Callable[[int], None] | None = None) -> None:
        self._make = make
        self._cap_bytes = capacity_bytes
        self._on_capacity = on_capacity  # told the tier's size in blocks once it is known
        self.shadows = shadows if shadows is not None else TierShadows(make)
        self.mode = self.shadows.mode
        self._live = make(self.mode)
        # nbytes, parent, depth, block_tokens of every resident block, in recency order
        self._meta: dict[Key, tuple[int, Key | None, int, int]] = {}
        self._pinned: set[Key] = set()

    def _follow(self) -> None:
        mode = self.shadows.mode
        if mode == self.mode:
            return
        live = self._make(mode)
        # in recency order, least recent first, as the blocks were last used: the store
        # inserts and touches a chain tail first, so a child often comes before its parent,
        # which every mode accepts (a prefix-aware one counts the children resident before
        # their parent). Inserting parents first instead would make a chain's root its
        # least recent block again, and a recency mode would evict it first.
        for key, (nbytes, par, depth, bt) in self._meta.items():
            if bt:
                live.insert(key, nbytes=nbytes, parent=par, depth=depth, now=0.0,
                            block_tokens=bt)
            else:
                live.insert(key, nbytes=nbytes, parent=par, depth=depth, now=0.0)
        for key in self._pinned:
            live.set_pinned(key, True)
        self._live = live
        self.mode = mode

    def insert(self, key: Key, *, nbytes: int, parent: Key | None = None, depth: int = 0,
               now: float = 0.0, block_tokens: int = 0) -> None:
        meta = self._meta
        if key in meta:
            del meta[key]
        elif self._cap_bytes and nbytes > 0 and not self.shadows.capacity_blocks:
            self._size_shadows(self._cap_bytes // nbytes)
        meta[key] = (nbytes, parent, depth, block_tokens)
        if block_tokens:  # only then: a mode that predates the keyword keeps working
            self._live.insert(key, nbytes=nbytes, parent=parent, depth=depth, now=now,
                              block_tokens=block_tokens)
        else:
            self._live.insert(key, nbytes=nbytes, parent=parent, depth=depth, now=now)

    def touch(self, key: Key, *, now: float = 0.0) -> None:
        meta = self._meta
        m = meta.pop(key, None)
        if m is not None:
            meta[key] = m
            self._live.touch(key, now=now)

    def remove(self, key: Key) -> None:
        if self._meta.pop(key, None) is not None:
            pinned = self._pinned
            if pinned:
                pinned.discard(key)
            self._live.remove(key)

    def _size_shadows(self, blocks: int) -> None:
        shadows = self.shadows
        if shadows.above is not None and not shadows.above.capacity_blocks:
            # the tier above has not learned its size yet (a restart indexes the nvme
            # frames before any cpu block): size later, as the cache of both tiers
            return
        above = (shadows.above.capacity_blocks if shadows.above is not None
                 else shadows.above_blocks)
        if blocks > 0:
            shadows.set_capacity(blocks, above)
            if self._on_capacity is not None:
                self._on_capacity(blocks)

    def victim(self) -> Key | None:
        shadows = self.shadows
        if not shadows.capacity_blocks and self._meta:  # not sized yet (``active``)
            self._size_shadows(len(self._meta))
        if shadows.mode != self.mode:
            self._follow()
        return self._live.victim()

    def set_pinned(self, key: Key, pinned: bool) -> None:
        if key not in self._meta:
            return
        if pinned:
            self._pinned.add(key)
        else:
            self._pinned.discard(key)
        self._live.set_pinned(key, pinned)

    def __contains__(self, key: object) -> bool:
        return key in self._meta

    def __len__(self) -> int:
        return len(self._meta)


@register_eviction_policy("adaptive")
def _make_adaptive(*, make: Callable[[str], EvictionPolicy] | None = None,
                   shadows: TierShadows | None = None,
                   capacity_bytes: int = 0,
                   on_capacity: Callable[[int], None] | None = None) -> AdaptivePolicy:
    if make is None:
        from kvtier.policy.base import make_eviction_policy

        def make(mode: str) -> EvictionPolicy:
            return make_eviction_policy(mode)

    return AdaptivePolicy(make, shadows, capacity_bytes=capacity_bytes, on_capacity=on_capacity)


class ShadowObserver:
    """The store's observer seam: feeds each lookup's chain to every tier's shadows and to
    ``inner`` (the cost-like modes' :class:`~kvtier.policy.stats.WorkloadStats`).

    ``block_tokens`` weighs each block (the daemon looks up full blocks only). ``defer``
    (the daemon passes the event loop's ``call_soon``) takes both off the request path: a
    lookup only queues its chain, and the queue is replayed into ``inner`` and the shadows
    after the reply has gone out (a store report drains it first, so ``inner`` sees every
    lookup before the store that follows it). Without it both run inline (tests, tools).

    The deferred replay is the daemon's lowest priority: it runs in slices of about
    :data:`DRAIN_SLICE_S` (a :class:`WorkloadStats` counts a long chain in pieces of
    :data:`DRAIN_PIECE` keys), each at least :data:`DRAIN_GAP_S` after the previous one
    (``defer_after``, the loop's ``call_later``), so a request that arrives meanwhile runs
    its every step before the next slice; the learning of a 32K-token chain costs
    milliseconds in a woken daemon, and a router's probe or an engine's next call should
    not wait for it. Past :data:`BUSY_QUEUED_KEYS` queued keys the slices run back to back
    (a share of every loop turn); past :data:`MAX_QUEUED_KEYS` the oldest queued chains are
    dropped (``dropped_lookups``): learning that falls behind costs accuracy, never the
    requests' time or unbounded memory.
    """

    def __init__(self, shadows: dict[str, TierShadows], inner: Any = None,
                 block_tokens: int = 1,
                 defer: Callable[[Callable[[], None]], Any] | None = None,
                 defer_after: Callable[[float, Callable[[], None]], Any] | None = None,
                 ) -> None:
        self.shadows = shadows
        self.inner = inner
        self.block_tokens = block_tokens
        self.defer = defer
        self.defer_after = defer_after
        self.dropped_lookups = 0
        self._ranged = isinstance(inner, WorkloadStats)
        # [keys, hit_blocks, now, keys of it counted into inner so far]
        self._queue: deque[list[Any]] = deque()
        self._queued_keys = 0
        self._scheduled = False
        self._queued_chains = 0   # chains ever queued, and of them counted (or dropped):
        self._done_chains = 0     # the queue holds the ones in between, oldest first

    def on_lookup(self, keys: Sequence[Key], hit_blocks: int, *, now: float) -> None:
        if self.defer is None:
            if self.inner is not None:
                self.inner.on_lookup(keys, hit_blocks, now=now)
            self._feed(keys, now)
            return
        self._queue.append([tuple(keys), hit_blocks, now, 0])
        self._queued_keys += len(keys)
        self._queued_chains += 1
        while self._queued_keys > MAX_QUEUED_KEYS and len(self._queue) > 1:
            dropped = self._queue.popleft()   # a chain partly counted stays partly counted
            self._queued_keys -= len(dropped[0])
            self._done_chains += 1
            self.dropped_lookups += 1
        if not self._scheduled:
            self._schedule()

    def drain(self) -> None:
        """Replay every queued lookup into ``inner`` and the shadows (in arrival order)."""
        while self._queue:
            self._step(None)

    def _schedule(self) -> None:
        self._scheduled = True
        if self.defer_after is not None and self._queued_keys <= BUSY_QUEUED_KEYS:
            self.defer_after(DRAIN_GAP_S, self._drain_slice)
        elif self.defer is not None:
            self.defer(self._drain_slice)

    def _drain_slice(self) -> None:
        """One slice of the replay; schedules the next while any is left."""
        self._scheduled = False
        deadline = time.perf_counter() + DRAIN_SLICE_S
        while self._queue:
            self._step(DRAIN_PIECE)
            if time.perf_counter() >= deadline:
                break
        if self._queue:
            self._schedule()

    def _step(self, piece: int | None) -> None:
        """Count the next ``piece`` keys of the oldest queued chain (None: all of it);
        the shadows take a chain whole once ``inner`` has counted all of it."""
        head = self._queue[0]
        keys, hit_blocks, now, done = head
        n = len(keys)
        stop = n if piece is None or not self._ranged else min(n, done + piece)
        inner = self.inner
        if inner is not None:
            if self._ranged:
                inner.on_lookup(keys, hit_blocks, now=now, start=done, stop=stop)
            else:
                inner.on_lookup(keys, hit_blocks, now=now)
        if stop < n:
            head[3] = stop
            return
        self._queue.popleft()
        self._queued_keys -= n
        self._done_chains += 1
        self._feed(keys, now)

    def _feed(self, keys: Sequence[Key], now: float) -> None:
        bt = self.block_tokens
        for shadows in self.shadows.values():
            shadows.on_request(keys, lambda _d: bt, now)

    def on_stored(self, keys: Sequence[Key], *, output_tokens: int | None,
                  now: float) -> None:
        if self._queue:  # the lookups before this store count first
            self.drain()
        self.on_stored_range(keys, output_tokens=output_tokens, now=now, start=0,
                             stop=len(keys))

    # A store report a piece at a time (kvtier.store.writes: the event loop serves other
    # clients between pieces): the lookups queued before it, then its chain in slices.
    def queued_through(self) -> int:
        """A mark of the lookups queued so far (for :meth:`replay_until`)."""
        return self._queued_chains

    def replay_until(self, mark: int) -> bool:
        """Replay the lookups queued before ``mark`` for about :data:`DRAIN_SLICE_S`; True
        once all of them are counted (lookups queued after ``mark`` wait their turn)."""
        deadline = time.perf_counter() + DRAIN_SLICE_S
        while self._queue and self._done_chains < mark:
            self._step(DRAIN_PIECE)
            if time.perf_counter() >= deadline:
                break
        return not self._queue or self._done_chains >= mark

    def on_stored_range(self, keys: Sequence[Key], *, output_tokens: int | None,
                        now: float, start: int, stop: int) -> None:
        """:meth:`on_stored` of ``keys[start:stop]`` (its depths unchanged), once the
        lookups before the store are replayed (:meth:`replay_until`). An ``inner`` that
        counts whole chains only gets the chain at ``start == 0``."""
        on_stored = getattr(self.inner, "on_stored", None)
        if on_stored is None:
            return
        if self._ranged:
            on_stored(keys, output_tokens=output_tokens, now=now, start=start, stop=stop)
        elif start == 0:
            on_stored(keys, output_tokens=output_tokens, now=now)

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Per tier: mode, switches, sample rate and the miss-ratio curve."""
        self.drain()
        return {tier: s.snapshot() for tier, s in self.shadows.items() if s.active}

"""Miniature shadow caches over a spatially hashed sample of keys (SHARDS-style).

Waldspurger et al., "Cache Modeling and Optimization using Miniature Simulations"
(ATC'17): a cache of ``R x C`` slots fed only the keys whose hash falls under ``R`` behaves
like the full cache of ``C`` slots, at ``R`` of the cost. One :class:`TierShadows` per tier
runs, for every candidate mode (``hindsight``, ``lru``, ``lfu``), a miniature cache of the tier's
size, and for the live mode also one at each other :data:`MRC_SCALES` size. The 1x shadows
say which mode would have hit the most tokens lately (the live tier follows it,
:mod:`kvtier.policy.adaptive`); the live mode's shadows form the tier's miss-ratio curve.

**Prefix semantics.** Keys are sampled one by one (a chain is not sampled whole: most
workloads share a handful of roots, so sampling by root would sample almost nothing or
almost everything). A request's sampled blocks, in chain order, form a sampled sub-chain,
and a shadow applies the simulator's rules to it in the store's order (``kvtier replay``'s
default, ``SimConfig.order == "store"``): the request hits the longest prefix of its
sampled sub-chain resident in the shadow, which is touched tail first (the head the most
recent of it, as the lookup's ``touch_chain`` does); room is made for the rest, which is
then inserted tail first (a put allocates before its blocks reach the policy; its commit's
``ready_many`` inserts them tail first); each sampled block's parent is the previous
sampled block of the chain; a block whose parent was not kept is not inserted; a block
evicted takes its resident sampled descendants with it (orphans). The shadows exist to
predict what each mode would do in the daemon, so they follow the store's order whatever
order a replay runs in. The shadow's hit rate is token-weighted (hit tokens / tokens of
the sampled blocks), the ratio estimator of SHARDS.

**Tiers.** A lower tier is modelled as the part of one cache of the hierarchy's cumulative
size: tier ``j`` at scale ``s`` is a cache of ``(tiers above j) + s x (tier j)`` blocks.

**Cost.** ``modes + 4`` (7) shadows each see a fraction ``rate`` of the block references,
so the extra work is ``7 x rate`` policy operations per reference; ``rate`` is chosen so
that the 1x shadow holds about :data:`SHADOW_SLOTS` blocks, clamped to ``[MIN_RATE,
MAX_RATE]``. Memory: ``(3 + 6.75) x rate x C`` resident keys (``C``: the modelled size).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from kvtier.policy.base import EvictionPolicy, Key
from kvtier.policy.prefix import PrefixForest

MRC_SCALES: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)
"""Sizes of the miss-ratio curve, in multiples of the tier's size."""
MODES: tuple[str, ...] = ("hindsight", "lru", "lfu")
"""Candidate modes; the first is the mode a tier starts in. ``hindsight`` is ``cost``'s
estimator trained on OPTgen's labels (:mod:`kvtier.policy.hindsight`); it replaced ``cost``
here (docs/replay-analysis.md, "a fourth attempt")."""
SHADOW_SLOTS = 512
"""Target size, in blocks, of a 1x shadow: enough slots that a miniature cache behaves like
the full one (SHARDS reports errors of ~0.01 from a few thousand sampled keys)."""
MIN_RATE = 1.0 / 128
MAX_RATE = 1.0 / 16
"""Bounds of the sampling rate: at most ``7 / 16`` extra policy operations per reference."""
HYSTERESIS = 0.01
"""A challenger must hit this much more (relative) than the live mode to take over (the
same 1% a default is allowed to lose to the best simple policy)..."""
Z_SWITCH = 3.0
"""...and its lead must be this many standard errors of the per-epoch differences."""
WINDOW_EPOCHS = 16.0
"""The comparison forgets with a window of this many epochs (an epoch: one turnover of the
1x shadow, at least 256 sampled references)."""

_MASK = (1 << 64) - 1
DIGEST_BYTES = 16        # a daemon block key (kvtier.keys)
DIGESTS_AT_ONCE = 64     # chains shorter than this are hashed key by key
_GOLDEN = 0x9E3779B97F4A7C15
_OFFSET = 0x632BE59BD9B4E019   # any odd constant: no key is special (see key_hash)
_SPACE = 1 << 24


def key_hash(key: Key) -> int:
    """A uniform 24-bit hash of a block key (ints in replay, digest bytes in the daemon),
    the same on every run and every process (no salted ``hash()``).

    The key's 64 bits are offset by the odd constant :data:`_OFFSET` before the mix: the
    mix alone maps 0 to 0, below every sampling threshold, so block id 0 (in a replayed
    trace usually the root of the most popular prompt) was always sampled and made up to
    71% of a shadow's references (found by review: shadow hit rates above Belady's)."""
    if isinstance(key, bytes):
        x = int.from_bytes(key[:8], "little")
    elif isinstance(key, int):
        x = key
    else:
        x = int.from_bytes(repr(key).encode()[:8], "little")
    x = (x + _OFFSET) & _MASK
    x = ((x ^ (x >> 31)) * _GOLDEN) & _MASK
    return (x ^ (x >> 29)) >> 40


def digest_hashes(keys: Sequence[Key]) -> np.ndarray | None:
    """``key_hash`` of every key at once (numpy, uint64 arithmetic wrapping as ``_MASK``
    does) when every key is a :data:`DIGEST_BYTES`-byte digest, as the daemon's are; else
    None (the caller hashes key by key). 10,000 keys: 0.4 ms instead of 3.9 ms."""
    if len(keys) < DIGESTS_AT_ONCE or type(keys[0]) is not bytes:
        return None
    digests = cast("Sequence[bytes]", keys)   # each one checked below
    try:
        blob = b"".join(digests)   # (a key that is not bytes: TypeError)
    except TypeError:
        return None
    if len(blob) != DIGEST_BYTES * len(digests) or set(map(len, digests)) != {DIGEST_BYTES}:
        return None
    x = np.frombuffer(blob, dtype="<u8")[::DIGEST_BYTES // 8].copy()
    x += np.uint64(_OFFSET)   # (array arithmetic wraps modulo 2^64)
    x ^= x >> np.uint64(31)
    x *= np.uint64(_GOLDEN)
    x ^= x >> np.uint64(29)
    return x >> np.uint64(40)


def sampling_rate(capacity_blocks: int) -> float:
    """The rate that gives a 1x shadow of about :data:`SHADOW_SLOTS` blocks (clamped)."""
    if capacity_blocks <= 0:
        return MAX_RATE
    return min(MAX_RATE, max(MIN_RATE, SHADOW_SLOTS / capacity_blocks))


class ShadowCache:
    """One miniature cache: a policy instance, its capacity and its (decayed) hit tokens."""

    __slots__ = (
        "capacity", "d1", "d2", "forest", "hits", "policy", "recent", "resident", "tokens",
    )

    def __init__(self, policy: EvictionPolicy, capacity: int) -> None:
        self.policy = policy
        self.capacity = max(1, capacity)
        self.forest = PrefixForest()
        # the policy's keys, mirrored (only this cache inserts and removes them): membership
        # and size without a call into the policy
        self.resident: set[Key] = set()
        self.hits = 0.0    # hit tokens since the start
        self.tokens = 0.0  # tokens of the sampled blocks seen since the start
        self.recent = 0.0  # hit tokens in the current epoch
        self.d1 = 0.0  # decayed sum of per-epoch (hit rate - live mode's hit rate)
        self.d2 = 0.0  # decayed sum of its squares

    @property
    def hit_rate(self) -> float:
        """Hit tokens over the tokens seen, since the start."""
        return self.hits / self.tokens if self.tokens else 0.0

    def access(self, chain: Sequence[tuple[Key, int, int]], now: float,
               n_tokens: float) -> None:
        """One request's sampled sub-chain ``(key, depth, tokens)`` (``n_tokens`` in all),
        in the store's order: count the hit prefix and touch it tail first (the lookup's
        ``touch_chain``); make room for the rest (the put allocates before its blocks reach
        the policy, so none of them is a victim); insert the rest tail first (the commit's
        ``ready_many``). The resident blocks of a sub-chain are always a prefix of it (an
        evicted block takes its descendants), so the rest is exactly the blocks to write;
        if making room took the hit prefix's last block, they are not written (orphans at
        birth); what a sub-chain larger than the shadow cannot keep is evicted after."""
        self.tokens += n_tokens
        pol = self.policy
        resident = self.resident
        hit = 0
        n_hit = 0
        for key, _, tokens in chain:
            if key not in resident:
                break
            hit += tokens
            n_hit += 1
        for i in range(n_hit - 1, -1, -1):
            pol.touch(chain[i][0], now=now)
        self.hits += hit
        self.recent += hit
        new = len(chain) - n_hit
        if not new:
            return
        capacity = self.capacity
        if len(resident) + min(new, capacity) > capacity:
            self._evict(min(new, capacity))
        if n_hit and chain[n_hit - 1][0] not in resident:
            return
        forest = self.forest
        for i in range(len(chain) - 1, n_hit - 1, -1):
            key, depth, _ = chain[i]
            parent = chain[i - 1][0] if i else None
            pol.insert(key, nbytes=1, parent=parent, depth=depth, now=now)
            resident.add(key)
            forest.add(key, parent)
        if len(resident) > capacity:  # more than the shadow holds: its tail goes first
            self._evict(0)

    def _evict(self, room: int) -> None:
        """Evict down to ``room`` blocks under capacity; an evicted block takes its resident
        sampled descendants with it."""
        pol = self.policy
        resident = self.resident
        forest = self.forest
        limit = self.capacity - room
        while len(resident) > limit:
            victim = pol.victim()
            if victim is None:
                break
            pol.remove(victim)
            resident.discard(victim)
            for orphan in forest.discard(victim):
                pol.remove(orphan)
                resident.discard(orphan)


@dataclass(slots=True)
class ModeSwitch:
    """A change of the live mode, for the record (stats, replay output)."""

    at_reference: int
    old: str
    new: str


class TierShadows:
    """The shadows of one tier: every mode at 1x, the live mode at every curve size.

    ``make(mode)`` builds a fresh eviction policy of that mode. ``capacity_blocks`` is the
    tier's size and ``above_blocks`` the size of the tiers above it (0 for the top tier);
    both can be given later with :meth:`set_capacity` (a daemon learns its tier's size in
    blocks at its first eviction; ``above``, the shadows of the tier above, then gives
    ``above_blocks``). Until then the shadows are idle.
    """

    def __init__(self, make: Callable[[str], EvictionPolicy], *, capacity_blocks: int = 0,
                 above_blocks: int = 0, modes: Sequence[str] = MODES,
                 rate: float | None = None, above: TierShadows | None = None) -> None:
        self.make = make
        self.above = above  # the tier above, whose size is learned later (daemon)
        self.modes = tuple(modes)
        self.mode = self.modes[0]
        self.switches: list[ModeSwitch] = []
        self.references = 0   # block references seen (sampled or not)
        self.sampled = 0      # sampled block references
        self.tokens = 0.0     # tokens of the sampled references since the start
        self._fixed_rate = rate
        self.rate = 0.0
        self.capacity_blocks = 0
        self.above_blocks = above_blocks
        self.ones: dict[str, ShadowCache] = {}  # every mode at the tier's size
        self.sizes: dict[float, ShadowCache] = {}  # the live mode at the other curve sizes
        self._threshold = 0
        self._epoch = 0       # sampled references per comparison
        self._since = 0       # sampled references since the last comparison
        self._epochs = 0      # comparisons since the start or the last switch
        self._weight = 0.0    # decayed number of epochs in d1/d2
        self._base = 0.0      # decayed sum of the live mode's per-epoch hit rates
        self._epoch_tokens = 0.0
        if capacity_blocks > 0:
            self.set_capacity(capacity_blocks, above_blocks)

    @property
    def active(self) -> bool:
        return self.capacity_blocks > 0

    def set_capacity(self, capacity_blocks: int, above_blocks: int = 0) -> None:
        """Size (or re-size) the shadows; re-sizing starts them afresh."""
        if capacity_blocks == self.capacity_blocks and above_blocks == self.above_blocks:
            return
        self.capacity_blocks = capacity_blocks
        self.above_blocks = above_blocks
        rate = self._fixed_rate or sampling_rate(above_blocks + capacity_blocks)
        self.rate = rate
        self._threshold = int(rate * _SPACE)
        self.ones = {m: self._cache(m, 1.0) for m in self.modes}
        self._curve_for(self.mode)
        self._epoch = max(256, self.ones[self.mode].capacity)
        self.sampled = 0
        self.tokens = 0.0
        self._since = 0
        self._epochs = 0
        self._weight = self._base = self._epoch_tokens = 0.0   # no evidence of the old size

    def _cache(self, mode: str, scale: float) -> ShadowCache:
        blocks = self.above_blocks + scale * self.capacity_blocks
        return ShadowCache(self.make(mode), round(self.rate * blocks))

    def _curve_for(self, mode: str) -> None:
        # a new live mode's curve starts empty: its other sizes fill over the next turnovers
        self.sizes = {s: self._cache(mode, s) for s in MRC_SCALES if s != 1.0}

    def sample(self, keys: Sequence[Key], tokens: Callable[[int], int],
               ) -> list[tuple[Key, int, int]]:
        """The sampled sub-chain of one request: ``(key, depth, tokens)``."""
        th = self._threshold
        hashes = digest_hashes(keys)
        if hashes is not None:   # the daemon's digests: hashed at once, the sample picked
            return [(keys[d], d, tokens(d)) for d in np.flatnonzero(hashes < th).tolist()]
        out = []
        for d, k in enumerate(keys):
            if type(k) is int:  # key_hash inlined for replay's int keys (the hot path)
                x = (k + _OFFSET) & _MASK
                x = ((x ^ (x >> 31)) * _GOLDEN) & _MASK
                h = (x ^ (x >> 29)) >> 40
            else:
                h = key_hash(k)
            if h < th:
                out.append((k, d, tokens(d)))
        return out

    def on_request(self, keys: Sequence[Key], tokens: Callable[[int], int], now: float) -> None:
        """Feed one request (its whole chain; ``tokens(depth)`` is the block's token count)
        to every shadow, after the request ran (where the live tier stores it)."""
        self.references += len(keys)
        if not self.ones:
            return
        chain = self.sample(keys, tokens)
        if not chain:
            return
        self.sampled += len(chain)
        n_tokens = sum(t for _, _, t in chain)
        self.tokens += n_tokens
        self._epoch_tokens += n_tokens
        for cache in self.ones.values():
            cache.access(chain, now, n_tokens)
        for cache in self.sizes.values():
            cache.access(chain, now, n_tokens)
        self._since += len(chain)
        if self._since >= self._epoch:
            self._compare()

    def _compare(self) -> None:
        """End of an epoch: update each mode's lead over the live mode (a paired
        comparison: every shadow saw the same references) and switch to a challenger whose
        lead is both large (:data:`HYSTERESIS`) and significant (:data:`Z_SWITCH`)."""
        self._since = 0
        self._epochs += 1
        tokens = self._epoch_tokens or 1.0
        self._epoch_tokens = 0.0
        live = self.ones[self.mode]
        base = live.recent / tokens
        keep = 1.0 - 1.0 / WINDOW_EPOCHS
        self._weight = self._weight * keep + 1.0
        self._base = self._base * keep + base
        best, best_z = self.mode, 0.0
        n = self._weight
        for m, c in self.ones.items():
            d = c.recent / tokens - base
            c.d1 = c.d1 * keep + d
            c.d2 = c.d2 * keep + d * d
            if m == self.mode or n < 4.0:
                continue
            mean = c.d1 / n
            var = max(c.d2 / n - mean * mean, 1e-12)
            z = mean / (var / n) ** 0.5
            if mean > HYSTERESIS * (self._base / n) and z > Z_SWITCH and z > best_z:
                best, best_z = m, z
        for c in self.ones.values():
            c.recent = 0.0
        if best != self.mode and self._epochs >= WINDOW_EPOCHS / 2:
            self.switches.append(ModeSwitch(self.references, self.mode, best))
            self.mode = best
            self._epochs = 0
            self._weight = 0.0
            self._base = 0.0
            for c in self.ones.values():
                c.d1 = c.d2 = 0.0
            self._curve_for(best)

    def curve(self) -> list[tuple[float, float]]:
        """The miss-ratio curve under the live mode as ``(scale, token hit rate)`` pairs:
        each size's hit rate since its shadow started (at 1x: since the shadows started;
        elsewhere: since the mode became live)."""
        if not self.ones or self.tokens <= 0:
            return []
        caches = {**self.sizes, 1.0: self.ones[self.mode]}
        return [(s, caches[s].hit_rate) for s in MRC_SCALES if caches[s].tokens > 0]

    def hit_rates(self) -> dict[str, float]:
        """Each mode's token hit rate at the tier's own size (since the start)."""
        if self.tokens <= 0:
            return {}
        return {m: c.hit_rate for m, c in self.ones.items()}

    def snapshot(self) -> dict[str, object]:
        """Stats for /v1/stats, ``kvtier stats`` and replay output."""
        return {
            "mode": self.mode,
            "switches": len(self.switches),
            "capacity_blocks": self.capacity_blocks,
            "sample_rate": round(self.rate, 6),
            "sampled_references": self.sampled,
            "mrc": [{"scale": s, "hit_rate": round(h, 6)} for s, h in self.curve()],
            "modes": {m: round(h, 6) for m, h in self.hit_rates().items()},
        }

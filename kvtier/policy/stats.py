"""Workload statistics learned online: how likely is a block to be asked for again?

The store (or the replay simulator) reports two events to one :class:`WorkloadStats`
shared by the tiers' ``cost`` policies:

- :meth:`WorkloadStats.on_lookup` when a request arrives: its whole prefix chain and how
  many leading blocks were cached somewhere;
- :meth:`WorkloadStats.on_stored` when the request has run and its KV is about to be
  stored: the same chain, plus the number of tokens the request generated when the engine
  knows it (``None`` otherwise).

Each reference of a block puts it into a *reuse class* built from signals any prefix
caching workload has, known at the moment the block is stored:

- ``uses``: how many requests referenced the block so far (1, 2, 3-4, 5+);
- ``hit``: the block was part of the cached prefix / new behind a cached prefix / new in a
  request that hit nothing / unknown (a store without a lookup);
- ``tail``: distance from the end of the chain (0, 1, 2, 3-5, 6+): a follow-up request
  extends its predecessor's prompt, so the last chunks of a prompt are the least shared;
- ``length``: the prompt length in blocks, log2 buckets;
- ``output``: the generated tokens, log2 buckets, or unknown. A request that answered at
  length is more often the end of its conversation than one that answered briefly; how
  much that holds is for the workload to show, not for this code to assume.

**Outcome.** A reference of class ``c`` is *reused* if the block is referenced again
within ``horizon`` block references, *not reused* if it is not (noticed when the horizon
passes or the key falls out of the bounded history). Outcomes are counted when they are
resolved, both numerator and denominator, so the open references of the last horizon do
not bias the rate down.

**Estimate.** Counts decay exponentially (``half_life`` references), so the estimate
follows a workload that shifts. The classes are nested (``uses`` > ``hit`` > ``tail`` >
``length`` > ``output``) and each level's rate is shrunk toward its parent's with
``strength`` pseudo-references (hierarchical empirical Bayes): a class with little evidence
takes its coarser parent's rate, a class with plenty speaks for itself, and a feature that
carries no signal yields children equal to their parent. The root starts at ``prior``.
The same counts, weighted by the gap of each reuse, give a class's mean reuse gap.

**Per-key evidence.** The class is only the prior of a key. Every key also keeps its own
record, decayed like the class counts: how many of its resolved references (all but the
last) were followed by a reuse within the horizon, and the gaps of those reuses. The key's
estimate is the Beta posterior of that record with ``key_strength`` pseudo-references at
its class's rate. This matters most while the class counts are young: until a horizon has
passed, the open references of one-off blocks weigh on every class as not (yet) reused,
so a prefix that six requests came back to, judged by its class alone, looked no more
reusable than a block seen once (0.14-0.19 vs 0.18 in a daemon 150 references old). Its
own record (five reuses out of five, five references apart) says otherwise.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from functools import cache

from kvtier.policy.base import Key

# ``uses`` buckets: 1, 2, 3-4, 5+ (computed inline in ``_reference``)
# class layout, coarse to fine: ((((uses * OUT + output) * TAIL + tail) * HIT + hit) * LEN + length)
_USE_B = 4
_OUT_B = 16
_TAIL_B = 5
_HIT_B = 4
_LEN_B = 8
HIT, FRESH_BEHIND_HIT, FRESH_NO_HIT, HIT_UNKNOWN = 0, 1, 2, 3
OUT_UNKNOWN = _OUT_B - 1
N_CLASSES = _USE_B * _OUT_B * _TAIL_B * _HIT_B * _LEN_B
_OUT_DIV = _TAIL_B * _HIT_B * _LEN_B
# divisor that maps a full class to its ancestor at each level (root first)
_LEVEL_DIV = (N_CLASSES, _OUT_B * _OUT_DIV, _OUT_DIV, _HIT_B * _LEN_B, _LEN_B, 1)
# the counts of every level live in one flat list: level l's cells start at _OFFSET[l]
_OFFSET = tuple(sum(N_CLASSES // d for d in _LEVEL_DIV[:i]) for i in range(len(_LEVEL_DIV)))
_N_CELLS = sum(N_CLASSES // d for d in _LEVEL_DIV)


@cache
def _cells(cls: int) -> tuple[int, ...]:
    """The flat-list cells of one full class and of its ancestors, root first (memoised:
    a reference then costs one tuple lookup, not a division per level)."""
    return tuple(off + cls // div for off, div in zip(_OFFSET, _LEVEL_DIV, strict=True))
_TAIL_OF = (0, 1, 2, 3, 3, 3)


def _log_bucket(n: int, top: int) -> int:
    b = (n + 1).bit_length() - 1  # int(log2(n + 1))
    return b if b < top else top


def output_bucket(output_tokens: int | None) -> int:
    """The ``output`` feature of a request: log2 bucket of its tokens, or unknown."""
    if output_tokens is None or output_tokens < 0:
        return OUT_UNKNOWN
    return _log_bucket(output_tokens, OUT_UNKNOWN - 1)


class _Rec:
    """What the stats remember of one key (slotted: one per key in the history)."""

    __slots__ = ("cls", "gaps", "last", "reused", "stored", "tried", "uses", "w")

    def __init__(self, uses: int, cls: int, last: int, w: float, stored: bool) -> None:
        self.uses = uses
        self.cls = cls      # class of the last reference
        self.last = last    # tick of the last reference
        self.w = w          # weight the last reference was counted with
        self.stored = stored  # the last reference was (also) reported by on_stored
        # the key's own resolved outcomes (every reference before the last one), decayed
        # with the class counts' half-life: how many were followed by a reuse in time
        self.reused = 0.0
        self.tried = 0.0
        self.gaps = 0.0  # decayed sum of the gaps (in references) of those reuses


class WorkloadStats:
    """Per-class reuse probabilities, learned from the lookups and stores reported.

    ``horizon``: a reference counts as reused only if the next one comes within this many
    block references (how long a block could usefully stay cached). ``history``: most keys
    remembered (an LRU of records; a reuse after a key fell out counts as a new block).
    ``half_life``: references after which old evidence weighs half. ``strength``:
    pseudo-references of the parent level's rate in every class estimate. ``prior``: the
    root's rate before any evidence. ``key_strength``: pseudo-references of the class's
    rate against a key's own record. O(len(keys)) per event, O(1) per query.
    """

    __slots__ = (
        "_access", "_cache", "_cache_at", "_decay", "_gap", "_hist", "_history",
        "_key_strength", "_reuse", "_scale", "_strength", "horizon", "prior", "tick",
    )

    def __init__(
        self, *, horizon: int = 65536, history: int = 1 << 20, half_life: float = 200_000.0,
        strength: float = 8.0, prior: float = 0.5, key_strength: float = 2.0,
    ) -> None:
        if history <= 0 or half_life <= 0 or horizon <= 0 or strength <= 0 or key_strength <= 0:
            raise ValueError("horizon, history, half_life and strength must be positive")
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior must be a probability, got {prior}")
        self._history = history
        self._hist: OrderedDict[Key, _Rec] = OrderedDict()  # by last reference
        # decayed counts per level, stored scaled by _scale (grows per reference: no O(n)
        # decay); a reference is counted in its class's accesses when it happens and in its
        # reuses when the next reference of the key comes within the horizon
        self._access = [0.0] * _N_CELLS
        self._reuse = [0.0] * _N_CELLS
        self._gap = [0.0] * _N_CELLS  # reuse-weighted gaps
        self._decay = 0.5 ** (1.0 / half_life)
        self._scale = 1.0
        self._strength = strength
        self._key_strength = key_strength
        # class -> (reuse probability, mean reuse gap), cleared every 256 references
        self._cache: dict[int, tuple[float, float]] = {}
        self._cache_at = 0
        self.prior = prior
        self.tick = 0  # block references seen so far
        self.horizon = horizon

    # ---------------------------------------------------------------- observer API
    def on_lookup(self, keys: Sequence[Key], hit_blocks: int, *, now: float = 0.0,
                  start: int = 0, stop: int | None = None) -> None:
        """A request asked for the chain ``keys``; its first ``hit_blocks`` were cached.

        ``start``/``stop``: count only that slice of the chain (its depths unchanged), so a
        long chain can be counted in pieces, in order, between other work."""
        n = len(keys)
        fresh = FRESH_BEHIND_HIT if hit_blocks > 0 else FRESH_NO_HIT
        length = _log_bucket(n, _LEN_B - 1)
        reference = self._reference
        stop = n if stop is None else min(stop, n)
        labels = self._labels(keys, start, stop) or [None] * (stop - start)
        for depth in range(start, stop):
            reference(keys[depth], HIT if depth < hit_blocks else fresh, n - 1 - depth,
                      length, OUT_UNKNOWN, False, labels[depth - start])

    def on_request(self, keys: Sequence[Key], hit_blocks: int, *, output_tokens: int | None,
                   now: float = 0.0) -> None:
        """:meth:`on_lookup` then :meth:`on_stored` of one request, in one pass: for a caller
        that knows the request's output when it looks it up (the replay). Each reference
        is counted once, in its refined class, where the two calls count it in the coarse
        class and then move it. (A chain that repeats a key, or is longer than the
        history, takes the two calls: only they give its second references' semantics.)"""
        n = len(keys)
        if n > self._history or len(set(keys)) != n:
            self.on_lookup(keys, hit_blocks, now=now)
            self.on_stored(keys, output_tokens=output_tokens, now=now)
            return
        out = output_bucket(output_tokens)
        fresh = FRESH_BEHIND_HIT if hit_blocks > 0 else FRESH_NO_HIT
        length = _log_bucket(n, _LEN_B - 1)
        reference = self._reference
        labels = self._labels(keys, 0, n) or [None] * n
        for depth, key in enumerate(keys):
            reference(key, HIT if depth < hit_blocks else fresh, n - 1 - depth, length,
                      out, True, labels[depth])

    def on_stored(
        self, keys: Sequence[Key], *, output_tokens: int | None, now: float = 0.0,
        start: int = 0, stop: int | None = None,
    ) -> None:
        """The request whose chain is ``keys`` ran and its KV is about to be stored.

        Called once per request, before the store inserts or touches the blocks, with the
        whole chain (every full block of the prompt, in order, cached or not).
        ``output_tokens`` is how many tokens the request generated (``None``: unknown).
        A key whose lookup was reported and not yet followed by a store only gains the
        ``output`` feature (its reference is moved to the refined class, not counted
        again); any other key counts as a new reference of unknown hit state.
        ``start``/``stop``: only that slice of the chain (its depths unchanged), as in
        :meth:`on_lookup`.
        """
        out = output_bucket(output_tokens)
        n = len(keys)
        length = _log_bucket(n, _LEN_B - 1)
        hist = self._hist
        access = self._access
        for depth in range(start, n if stop is None else min(stop, n)):
            key = keys[depth]
            rec = hist.get(key)
            if rec is not None and not rec.stored:
                old = rec.cls
                new = old + (out - old // _OUT_DIV % _OUT_B) * _OUT_DIV
                rec.stored = True
                if new != old:
                    rec.cls = new
                    w = rec.w
                    for i in _cells(old):
                        access[i] -= w
                    for i in _cells(new):
                        access[i] += w
            else:
                self._reference(key, HIT_UNKNOWN, n - 1 - depth, length, out, True)

    # ---------------------------------------------------------------- bookkeeping
    def _reused_in_time(self, last: int, tick: int) -> bool:
        """The label a reuse teaches: the block referenced at ``last`` came back at
        ``tick`` soon enough to count (here: within the horizon; ``HindsightStats``: the
        optimal cache of the tier's size would have hit it)."""
        return tick - last <= self.horizon

    def _labels(self, keys: Sequence[Key], start: int, stop: int) -> list[bool | None] | None:
        """The reuse labels of ``keys[start:stop]`` referenced in order from now, computed
        at once (None at a key without a record), or None: label each as it comes. Here
        always None (the horizon test is one comparison); ``HindsightStats`` batches."""
        return None

    def _reference(
        self, key: Key, hit: int, tail: int, length: int, out: int, stored: bool,
        reused: bool | None = None,
    ) -> None:
        """Count one reference; ``reused``: its reuse label when computed ahead (_labels)."""
        hist = self._hist
        rec = hist.get(key)
        tick = self.tick
        decay = self._decay
        if rec is not None:
            gap = tick - rec.last
            fade = decay ** gap
            rec.tried = rec.tried * fade + 1.0
            rec.reused *= fade
            rec.gaps *= fade
            if self._reused_in_time(rec.last, tick) if reused is None else reused:
                # the previous reference counts
                rec.reused += 1.0
                rec.gaps += gap
                w = rec.w
                wg = w * gap
                reuse = self._reuse
                gaps = self._gap
                # the six levels unrolled (the hottest loop of a replay)
                c0, c1, c2, c3, c4, c5 = _cells(rec.cls)
                reuse[c0] += w
                reuse[c1] += w
                reuse[c2] += w
                reuse[c3] += w
                reuse[c4] += w
                reuse[c5] += w
                gaps[c0] += wg
                gaps[c1] += wg
                gaps[c2] += wg
                gaps[c3] += wg
                gaps[c4] += wg
                gaps[c5] += wg
            hist.move_to_end(key)
            uses = rec.uses + 1
            ub = 1 if uses == 2 else (2 if uses <= 4 else 3)
        else:
            uses = 1
            ub = 0
        cls = (
            ((ub * _OUT_B + out) * _TAIL_B + (_TAIL_OF[tail] if tail < 6 else 4))
            * _HIT_B + hit
        ) * _LEN_B + length
        self._scale = w = self._scale / decay
        access = self._access
        c0, c1, c2, c3, c4, c5 = _cells(cls)
        access[c0] += w
        access[c1] += w
        access[c2] += w
        access[c3] += w
        access[c4] += w
        access[c5] += w
        if rec is None:
            hist[key] = _Rec(uses, cls, tick, w, stored)
            if len(hist) > self._history:
                hist.popitem(last=False)
        else:
            rec.uses = uses
            rec.cls = cls
            rec.last = tick
            rec.w = w
            rec.stored = stored
        self.tick = tick + 1
        cache_at = self._cache_at = self._cache_at + 1
        if cache_at >= 256:  # estimates move slowly: recompute at most every 256
            self._cache_at = 0
            self._cache.clear()
            if self._scale > 1e200:
                self._renormalise()

    # ---------------------------------------------------------------- queries
    def reuse_probability(self, key: Key) -> float:
        """Estimated probability that ``key`` is referenced again within the horizon."""
        return self.reuse_estimate(key)[0]

    def reuse_estimate(self, key: Key) -> tuple[float, float]:
        """``(p, gap)``: probability that ``key`` is referenced again within the horizon,
        and the expected number of block references until then if it is.

        The key's class gives the prior; the key's own resolved references (how many were
        followed by a reuse in time, and after how long, decayed like the class counts)
        are the evidence, weighed against ``key_strength`` pseudo-references of the class.
        A block that requests keep coming back to is known by its own record however
        young the class statistics are; a block seen once is its class.
        """
        rec = self._hist.get(key)
        if rec is None:
            return self.prior, self.horizon / 2.0
        est = self._cache.get(rec.cls)
        p, gap = est if est is not None else self.class_estimate(rec.cls)
        if rec.tried:
            k = self._key_strength
            kp = k * p
            gap = (rec.gaps + kp * gap) / (rec.reused + kp) if rec.reused + kp > 0 else gap
            p = (rec.reused + kp) / (rec.tried + k)
        return p, gap

    def class_probability(self, cls: int) -> float:
        """Hierarchically smoothed reuse rate of one full class (see the module doc)."""
        return self.class_estimate(cls)[0]

    def class_estimate(self, cls: int) -> tuple[float, float]:
        """Smoothed ``(reuse rate, mean reuse gap)`` of one full class: each level of the
        hierarchy is shrunk toward its parent with ``strength`` pseudo-references (the
        gap with as many pseudo-reuses as the parent's rate gives them)."""
        est = self._cache.get(cls)
        if est is not None:
            return est
        pseudo = self._strength * self._scale
        p = self.prior
        g = self.horizon / 2.0
        access = self._access
        reuse = self._reuse
        gaps = self._gap
        for level, i in enumerate(_cells(cls)):
            r = reuse[i]
            pr = pseudo * p
            if level == 0:  # the root's gap is what it has seen (the prior only if nothing)
                if r > 0:
                    g = gaps[i] / r
            elif r + pr > 0:
                g = (gaps[i] + pr * g) / (r + pr)
            p = (r + pr) / (access[i] + pseudo)
        est = (p, g)
        self._cache[cls] = est
        return est

    def uses(self, key: Key) -> int:
        """Requests that referenced ``key`` while it stayed in the history."""
        rec = self._hist.get(key)
        return 0 if rec is None else rec.uses

    def _renormalise(self) -> None:
        s = self._scale
        self._access = [a / s for a in self._access]
        self._reuse = [r / s for r in self._reuse]
        self._gap = [g / s for g in self._gap]
        for rec in self._hist.values():
            rec.w /= s
        self._scale = 1.0

    def __len__(self) -> int:
        return len(self._hist)

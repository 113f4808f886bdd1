"""Issue 13, fourth attempt at 1.2x LRU on the shared trace: the variants, reproducible.

Each variant is a one-off policy or statistics class composed from kvtier/policy and
replayed through ``kvtier.replay.simulator.simulate`` (the code of ``kvtier replay``); its
token hits over LRU's are printed at nine capacities 0.84-1.16x of each fraction (the
0.92x, 1x and 1.08x points, the mean of the nine and of the middle five). Results and
reading: docs/replay-analysis.md, "Issue 13: a fourth attempt". Nothing here is used by
kvtier itself.

- ``lecar``: LeCaR / CACHEUS-style per-eviction expert mixing (Vietri et al., HotStorage'18;
  Rodriguez et al., FAST'21): each eviction takes the victim of ``cost`` or of ``lfu`` /
  ``lru`` drawn by weight; a miss on a key in an expert's ghost (the keys evicted by its
  choice, one cache size of them) multiplies its weight by ``exp(-lr * d^t)``, discount
  ``d = 0.005^(1/N)`` (N the cache size) and ``lr = 0.45``, as in LeCaR. ``--leaf`` makes
  the other experts prefix-aware (they name leaves of ``cost``'s tree only).
- ``mix``: the same with fixed weights (no learning): how much a few foreign evictions cost.
- ``perturb``: ``cost`` with 0.1% of its evictions taking its second-lowest leaf instead,
  eight seeds at the 1x point: the chaos at the acceptance point itself.
- ``optgen``: Hawkeye-style hindsight labels (Jain & Lin, ISCA'16): OPTgen's occupancy
  vector over a window of 8 (4, 16) capacities says whether OPT at this capacity would have
  hit a reuse; ``cost``'s class and key estimates learn "OPT hit it" instead of "reused
  within the horizon" (both / class only / key only; ``--plain``: value ``p`` alone, no
  hit density; ``--windows 2 3 4``: those windows). ``optgen --plain --windows 2 3 4 5 6``
  is the one variant that beats ``cost`` (docs/replay-analysis.md).
- ``arc``: an ARC-style split between once-seen and reused blocks, ``cost`` ordering inside
  each part, the once-seen part's target size moved by ghost hits (ARC's rule or +-1).
- ``deep``: the use count of the request's deepest hit block as a class feature (with the
  length feature, or in its place).

Usage: python scripts/issue13_variants.py {lecar,mix,perturb,optgen,arc,deep} [-f 0.05 0.1]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from statistics import mean
from typing import Any

import numpy as np

import kvtier.policy.stats as S
import kvtier.replay.simulator as sim
from kvtier.policy.cost import CostPolicy
from kvtier.policy.lfu import LFUPolicy
from kvtier.policy.lru import LRUPolicy
from kvtier.replay.trace import Trace, load_trace

TRACE = "/work/shared/traces/mooncake_synthetic_trace.jsonl"
SPREAD9 = tuple(0.84 + 0.04 * i for i in range(9))
Factory = Callable[[int, Any, Any], Any]  # (tier index, SimConfig, stats) -> policy
StatsFactory = Callable[[int, int], Any]  # (horizon, history) -> WorkloadStats

_make_policy = sim.make_policy
_stats_cls = sim.WorkloadStats
_lru_hits: dict[int, int] = {}


def replay(trace: Trace, policy: Factory | str, cap: int,
           stats: StatsFactory | None = None) -> int:
    """Token hits of one replay with ``policy`` (a name or a factory) and ``stats``."""
    def make(name: str, i: int, config: Any, st: Any) -> Any:
        return policy(i, config, st) if callable(policy) else _make_policy(name, i, config, st)

    sim.make_policy = make  # type: ignore[assignment]
    if stats is not None:
        sim.WorkloadStats = lambda *, horizon, history: stats(horizon, history)  # type: ignore
    try:
        cfg = sim.SimConfig(tiers=(sim.TierSpec("cpu", max(1, cap), 25e9),))
        return sim.simulate(trace, policy if isinstance(policy, str) else "x", cfg).hit_tokens
    finally:
        sim.make_policy = _make_policy
        sim.WorkloadStats = _stats_cls  # type: ignore[misc]


def evaluate(trace: Trace, name: str, policy: Factory | str, fractions: Sequence[float],
             stats: StatsFactory | None = None) -> None:
    """Print ``policy``/LRU at the nine capacities around each fraction."""
    for f in fractions:
        rs = []
        for s in SPREAD9:
            cap = int(trace.n_unique_blocks * f * s)
            if cap not in _lru_hits:
                _lru_hits[cap] = replay(trace, "lru", cap)
            rs.append(replay(trace, policy, cap, stats) / _lru_hits[cap])
        print(f"{name:>28} {f:>4.0%}  0.92x {rs[2]:.3f}  1x {rs[4]:.3f}  1.08x {rs[6]:.3f}  "
              f"mean9 {mean(rs):.3f}  mean5 {mean(rs[2:7]):.3f}", flush=True)


def cost_policy(config: Any, stats: Any) -> CostPolicy:
    return CostPolicy(stats=stats, costs=config.costs)


# ----------------------------------------------------------------------------- LeCaR
class LeafLRU(LRUPolicy):
    """LRU that names only leaves of ``tree`` (a CostPolicy over the same blocks)."""

    __slots__ = ("tree",)

    def victim(self) -> Any:
        ents = self.tree._entries
        for k in self._order:
            e = ents.get(k)
            if e is None or e.children == 0:
                return k
        return None


class LeafLFU(LFUPolicy):
    """Aged LFU that names only leaves of ``tree``."""

    __slots__ = ("tree",)

    def victim(self) -> Any:
        if not self._half_life:
            super().victim()  # sizes the half-life and history
        heap, ents, held, found = self._heap, self.tree._entries, [], None
        while heap:
            score, _, _, key = heap[0]
            if self._score.get(key) == score and key not in self._pinned:
                e = ents.get(key)
                if e is None or e.children == 0:
                    found = key
                    break
                held.append(heapq.heappop(heap))
                continue
            heapq.heappop(heap)
        for item in held:
            heapq.heappush(heap, item)
        return found


class LeCaR:
    """Per-eviction choice among experts that all mirror the same resident blocks."""

    name = "lecar"

    def __init__(self, experts: list[Any], *, lr: float = 0.45, weights: list[float] | None
                 = None, seed: int = 1) -> None:
        self.experts = experts
        self.w = weights or [1.0 / len(experts)] * len(experts)
        self.ghost: list[OrderedDict[Any, int]] = [OrderedDict() for _ in experts]
        self.lr = lr
        self.rng = random.Random(seed)
        self.d = 0.0  # discount, from the cache size at the first eviction
        self.cap = 0
        self.t = 0  # misses so far
        self.pending: Any = None
        self.pending_e: int | None = None

    def __len__(self) -> int:
        return len(self.experts[0])

    def __contains__(self, key: object) -> bool:
        return key in self.experts[0]

    def insert(self, key: Any, **kw: Any) -> None:
        if key not in self.experts[0] and self.lr > 0:
            self.t += 1
            for e, ghost in enumerate(self.ghost):
                at = ghost.pop(key, None)
                if at is not None and self.d:
                    self.w[e] *= math.exp(-self.lr * self.d ** (self.t - at))
            total = sum(self.w)
            self.w = [max(x / total, 1e-3) for x in self.w]
        for p in self.experts:
            p.insert(key, **kw)

    def touch(self, key: Any, **kw: Any) -> None:
        for p in self.experts:
            p.touch(key, **kw)

    def remove(self, key: Any) -> None:
        if key == self.pending:
            if self.pending_e is not None:
                ghost = self.ghost[self.pending_e]
                ghost[key] = self.t
                while len(ghost) > self.cap:
                    ghost.popitem(last=False)
            self.pending = None
        for p in self.experts:
            p.remove(key)

    def victim(self) -> Any:
        if not self.d:
            self.cap = max(1, len(self))
            self.d = 0.005 ** (1.0 / self.cap)
        if self.pending is not None and self.pending in self:
            return self.pending
        names = [p.victim() for p in self.experts]
        x, e, acc = self.rng.random(), 0, self.w[0]
        while x > acc and e < len(names) - 1:
            e += 1
            acc += self.w[e]
        v = names[e]
        self.pending = v
        # no regret to assign when every expert named the same block
        self.pending_e = None if all(u == v for u in names) else e
        return v

    def set_pinned(self, key: Any, pinned: bool) -> None:
        for p in self.experts:
            p.set_pinned(key, pinned)


def lecar(others: Sequence[str], *, leaf: bool, **kw: Any) -> Factory:
    def make(i: int, config: Any, stats: Any) -> LeCaR:
        cost = cost_policy(config, stats)
        experts: list[Any] = [cost]
        for n in others:
            if leaf:
                p: Any = LeafLFU() if n == "lfu" else LeafLRU()
                p.tree = cost
            else:
                p = LFUPolicy() if n == "lfu" else LRUPolicy()
            experts.append(p)
        return LeCaR(experts, **kw)
    return make


class Perturbed(CostPolicy):
    """``cost`` whose victim is, at ``rate``, its second-lowest leaf instead."""

    __slots__ = ("rate", "rng")

    def victim(self) -> Any:
        v = super().victim()
        if v is None or self.rng.random() >= self.rate:
            return v
        top = heapq.heappop(self._heap)
        second = super().victim()
        heapq.heappush(self._heap, top)
        if second is None:
            return super().victim()
        self._victim = self._entries[second]
        return second


# ----------------------------------------------------------------------------- OPTgen
class OptStats(S.WorkloadStats):
    """WorkloadStats whose reuse label is OPTgen's "OPT at ``cap`` would have hit it"."""

    __slots__ = ("cap", "label", "occ", "window")

    def __init__(self, *, cap: int, window: int, label: str, n: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.occ = np.zeros(n + 1, dtype=np.int32)  # the occupancy vector, per reference
        self.cap, self.window, self.label = cap, window, label

    def _opt(self, s: int, t: int) -> bool:
        if t - s > self.window:
            return False
        seg = self.occ[s:t]
        if seg.size and seg.max() >= self.cap:
            return False
        seg += 1
        return True

    def _reference(self, key: Any, hit: int, tail: int, length: int, out: int,
                   stored: bool) -> None:
        # WorkloadStats._reference with the label swapped (the class and/or the key's own)
        hist, rec, tick, decay = self._hist, self._hist.get(key), self.tick, self._decay
        if rec is not None:
            gap = tick - rec.last
            fade = decay ** gap
            rec.tried = rec.tried * fade + 1.0
            rec.reused *= fade
            rec.gaps *= fade
            in_h, opt = gap <= self.horizon, self._opt(rec.last, tick)
            if opt if self.label in ("both", "key") else in_h:
                rec.reused += 1.0
                rec.gaps += gap
            if opt if self.label in ("both", "class") else in_h:
                for c in S._cells(rec.cls):
                    self._reuse[c] += rec.w
                    self._gap[c] += rec.w * gap
            hist.move_to_end(key)
            uses = rec.uses + 1
            ub = 1 if uses == 2 else (2 if uses <= 4 else 3)
        else:
            uses, ub = 1, 0
        cls = (((ub * S._OUT_B + out) * S._TAIL_B + (S._TAIL_OF[tail] if tail < 6 else 4))
               * S._HIT_B + hit) * S._LEN_B + length
        self._scale = w = self._scale / decay
        for c in S._cells(cls):
            self._access[c] += w
        if rec is None:
            hist[key] = S._Rec(uses, cls, tick, w, stored)
            if len(hist) > self._history:
                hist.popitem(last=False)
        else:
            rec.uses, rec.cls, rec.last, rec.w, rec.stored = uses, cls, tick, w, stored
        self.tick = tick + 1
        self._cache_at += 1
        if self._cache_at >= 256:
            self._cache_at = 0
            self._cache.clear()


class PlainCost(CostPolicy):
    """``cost`` with value ``p x saved`` (no hit density)."""

    __slots__ = ()

    def _schedule(self, entry: Any) -> None:
        p, _ = self._stats.reuse_estimate(entry.key)  # type: ignore[union-attr]
        entry.prio = self._level + entry.saved * p / self._unit
        self._uses += 1
        entry.order = self._uses
        entry.at = self._stats.tick  # type: ignore[union-attr]
        if entry.children == 0 and not entry.pinned:
            self._push(entry)


# ----------------------------------------------------------------------------- ARC split
class ArcCost:
    """Once-seen and reused blocks in two ``cost`` orderings; ARC moves the split."""

    name = "arccost"

    def __init__(self, stats: Any, costs: Any, *, arc_step: bool) -> None:
        self.stats = stats
        self.parts = (CostPolicy(stats=stats, costs=costs), CostPolicy(stats=stats, costs=costs))
        self.where: dict[Any, int] = {}
        self.meta: dict[Any, dict[str, Any]] = {}
        self.ghost: tuple[OrderedDict[Any, None], ...] = (OrderedDict(), OrderedDict())
        self.p = -1.0  # target size of the once-seen part (set at the first eviction)
        self.cap = 0
        self.arc_step = arc_step
        self.pending: Any = None

    def __len__(self) -> int:
        return len(self.where)

    def __contains__(self, key: object) -> bool:
        return key in self.where

    def insert(self, key: Any, **kw: Any) -> None:
        if key in self.where:
            return self.touch(key)
        g0, g1 = self.ghost
        if key in g0:  # the once-seen part was too small
            del g0[key]
            self.p = min(self.cap, self.p + (max(1.0, len(g1) / max(len(g0), 1))
                                             if self.arc_step else 1.0))
        elif key in g1:
            del g1[key]
            self.p = max(0.0, self.p - (max(1.0, len(g0) / max(len(g1), 1))
                                        if self.arc_step else 1.0))
        part = 1 if self.stats.uses(key) >= 2 else 0
        self.where[key] = part
        self.meta[key] = kw
        self.parts[part].insert(key, **kw)

    def touch(self, key: Any, **kw: Any) -> None:
        part = self.where.get(key)
        if part == 0:  # reused now: moves to the reused part
            self.parts[0].remove(key)
            self.where[key] = 1
            self.parts[1].insert(key, **self.meta[key])
        elif part == 1:
            self.parts[1].touch(key)

    def remove(self, key: Any) -> None:
        part = self.where.pop(key, None)
        if part is None:
            return
        del self.meta[key]
        if key == self.pending:
            ghost = self.ghost[part]
            ghost[key] = None
            while len(ghost) > self.cap:
                ghost.popitem(last=False)
            self.pending = None
        self.parts[part].remove(key)

    def victim(self) -> Any:
        if self.p < 0:
            self.cap = len(self.where)
            self.p = self.cap / 2
        first = 0 if len(self.parts[0]) > self.p or not len(self.parts[1]) else 1
        v = self.parts[first].victim()
        self.pending = v if v is not None else self.parts[1 - first].victim()
        return self.pending

    def set_pinned(self, key: Any, pinned: bool) -> None:
        part = self.where.get(key)
        if part is not None:
            self.parts[part].set_pinned(key, pinned)


# ----------------------------------------------------------------------------- deep uses
def _relayout(len_b: int) -> None:
    """Resize the stats' last class level (module constants; ``8`` restores it)."""
    S._LEN_B = len_b
    S.N_CLASSES = S._USE_B * S._OUT_B * S._TAIL_B * S._HIT_B * len_b
    S._OUT_DIV = S._TAIL_B * S._HIT_B * len_b
    S._LEVEL_DIV = (S.N_CLASSES, S._OUT_B * S._OUT_DIV, S._OUT_DIV, S._HIT_B * len_b, len_b, 1)
    S._OFFSET = tuple(sum(S.N_CLASSES // d for d in S._LEVEL_DIV[:i])
                      for i in range(len(S._LEVEL_DIV)))
    S._N_CELLS = sum(S.N_CLASSES // d for d in S._LEVEL_DIV)
    S._cells.cache_clear()


class DeepStats(S.WorkloadStats):
    """The uses of the request's deepest hit block (1, 2, 3-4, 5-8, 9+) as a feature."""

    __slots__ = ("combine",)

    def __init__(self, *, combine: bool, **kw: Any) -> None:
        _relayout(64 if combine else 8)
        super().__init__(**kw)
        self.combine = combine

    def on_request(self, keys: Sequence[Any], hit_blocks: int, *, output_tokens: int | None,
                   now: float = 0.0) -> None:
        n, out = len(keys), S.output_bucket(output_tokens)
        fresh = S.FRESH_BEHIND_HIT if hit_blocks else S.FRESH_NO_HIT
        u = self.uses(keys[hit_blocks - 1]) if hit_blocks else 0
        deep = 0 if u <= 0 else min(5, (u - 1).bit_length() + 1)
        feat = S._log_bucket(n, 7) * 8 + deep if self.combine else deep
        for d, key in enumerate(keys):
            self._reference(key, S.HIT if d < hit_blocks else fresh, n - 1 - d, feat, out, True)


# ----------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variant", choices=["lecar", "mix", "perturb", "optgen", "arc", "deep"])
    ap.add_argument("-f", "--fraction", nargs="+", type=float, default=[0.05])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--leaf", action="store_true", help="prefix-aware lru/lfu experts")
    ap.add_argument("--plain", action="store_true", help="optgen: value p (no density)")
    ap.add_argument("--windows", nargs="+", type=int, default=[],
                    help="optgen: OPTgen windows (capacities) to try, labels of class and key")
    args = ap.parse_args()
    trace = load_trace(args.trace)
    fr = args.fraction
    evaluate(trace, "cost", "cost", fr)
    if args.variant == "lecar":
        for others in (["lfu"], ["lru"], ["lru", "lfu"]):
            evaluate(trace, f"lecar cost+{'+'.join(others)}", lecar(others, leaf=args.leaf), fr)
    elif args.variant == "mix":
        for f in fr:
            cap = int(trace.n_unique_blocks * f)
            lru = replay(trace, "lru", cap)
            for wc in (0.999, 0.99, 0.9):
                for other in ("lfu", "lru"):
                    mix = lecar([other], leaf=args.leaf, lr=0.0, weights=[wc, 1 - wc])
                    print(f"{f:.0%} fixed weights cost {wc} / {other} {1 - wc:.3f}: "
                          f"{replay(trace, mix, cap) / lru:.3f}", flush=True)
    elif args.variant == "perturb":
        for f in fr:
            cap = int(trace.n_unique_blocks * f)
            lru = replay(trace, "lru", cap)
            rs = []
            for seed in range(1, 9):
                def make(i: int, config: Any, stats: Any, seed: int = seed) -> Perturbed:
                    p = Perturbed(stats=stats, costs=config.costs)
                    p.rng, p.rate = random.Random(seed), 0.001
                    return p
                rs.append(replay(trace, make, cap) / lru)
            print(f"{f:.0%} 1x, 0.1% second-lowest leaf, 8 seeds: "
                  + " ".join(f"{r:.3f}" for r in rs) + f"  mean {mean(rs):.3f}")
    elif args.variant == "optgen":
        pol: Factory = ((lambda i, c, s: PlainCost(stats=s, costs=c.costs)) if args.plain
                        else (lambda i, c, s: cost_policy(c, s)))
        specs = ([("both", w) for w in args.windows] if args.windows else
                 [("both", 8), ("class", 8), ("key", 8), ("both", 4), ("both", 16)])
        for label, wm in specs:
            def st(h: int, hi: int, label: str = label, wm: int = wm) -> OptStats:
                cap = h // 16  # the simulator's window is 16 capacities
                return OptStats(cap=cap, window=wm * cap, label=label,
                                n=trace.n_references, horizon=h, history=hi)
            evaluate(trace, f"optgen {label} window {wm}x", pol, fr, st)
    elif args.variant == "arc":
        for arc_step in (True, False):
            def mk(i: int, c: Any, s: Any, a: bool = arc_step) -> ArcCost:
                return ArcCost(s, c.costs, arc_step=a)
            evaluate(trace, f"arc split ({'arc' if arc_step else 'unit'} step)", mk, fr)
    else:
        try:
            for combine in (True, False):
                def ds(h: int, hi: int, combine: bool = combine) -> DeepStats:
                    return DeepStats(combine=combine, horizon=h, history=hi)
                evaluate(trace, f"deep uses ({'with' if combine else 'for'} length)", "cost",
                         fr, ds)
        finally:
            _relayout(8)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

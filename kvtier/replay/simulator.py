"""Replay a trace through a simulated tier hierarchy driven by kvtier's own policies.

Semantics (the same as the reference figures in shared/traces/README.md):

- a request hits the longest prefix of its block chain that is resident in some tier at
  its arrival; blocks in a lower tier are promoted (prefetched) toward the top tier;
- after the request runs, every block of its chain is touched (if in the top tier) or
  inserted into the top tier, in chain order;
- a tier over capacity asks its eviction policy for a victim; the victim is demoted to the
  next tier if that tier's admission policy agrees (and it is not already there), else
  dropped; a block gone from every tier takes its resident descendants with it (orphans);
- capacity is counted in blocks (slots); bytes moved count real tokens x bytes per token.

With ``reuse_breakdown`` the result also counts, per reuse distance (block references since
the block's previous use, in multiples of the total capacity), how many references were
reuses and how many of them hit: where a policy loses to another one. LRU hits every reuse
within one capacity (and some beyond, when blocks repeat in between); Belady's optimum hits
nearly every reuse within two.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvtier.policy.adaptive import AdaptivePolicy
from kvtier.policy.admission import AdmissionPolicy, AlwaysAdmit
from kvtier.policy.base import EvictionPolicy, Key, make_eviction_policy
from kvtier.policy.costmodel import BlockCosts
from kvtier.policy.hindsight import HindsightStats
from kvtier.policy.prefetch import TIMEOUT_BASE_S, PrefetchWait, wait_for_prefix
from kvtier.policy.prefix import PrefixForest
from kvtier.policy.shadow import TierShadows
from kvtier.policy.stats import WorkloadStats
from kvtier.replay.belady import BeladyPolicy
from kvtier.replay.reuse import REUSE_EDGES, next_use_index, reuse_buckets
from kvtier.replay.trace import Trace


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One simulated tier: capacity in blocks and bandwidth toward the engine (B/s)."""

    name: str
    capacity_blocks: int
    read_bw: float

    def __post_init__(self) -> None:
        if self.capacity_blocks < 0:
            raise ValueError(f"tier {self.name}: capacity_blocks must not be negative, got "
                             f"{self.capacity_blocks}")
        if not self.read_bw > 0:  # NaN too: a reload would take NaN seconds
            raise ValueError(f"tier {self.name}: read_bw must be positive, got {self.read_bw}")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything a replay needs besides the trace and the policy name."""

    tiers: tuple[TierSpec, ...]
    costs: BlockCosts | None = None  # None: default model at the trace's block size
    bytes_per_token: int = 131072
    prefetch: PrefetchWait = PrefetchWait.WAIT
    drop_orphans: bool = True
    admission: Callable[[str], AdmissionPolicy] | None = None  # tier name -> policy


@dataclass(slots=True)
class TierResult:
    """Per-tier outcome of one replay."""

    name: str
    capacity_blocks: int
    hit_tokens: int = 0
    hit_blocks: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    rejected: int = 0


@dataclass(slots=True)
class ReplayResult:
    """Outcome of replaying one trace with one policy and one set of capacities."""

    policy: str
    capacity_fraction: float | None
    requests: int = 0
    references: int = 0
    total_tokens: int = 0
    hit_tokens: int = 0
    hit_blocks: int = 0
    orphans_dropped: int = 0
    late_blocks: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tiers: list[TierResult] = field(default_factory=list)
    elapsed_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time for the replay (a loaded machine's wall
    # clock counts the time other processes had the cores too)
    # per REUSE_EDGES bucket (+1 open bucket): reuses seen and reuses hit; empty unless asked
    reuses_by_distance: list[int] = field(default_factory=list)
    hits_by_distance: list[int] = field(default_factory=list)
    # per tier (adaptive only): the shadows' snapshot at the end (mode, switches, MRC)
    shadows: list[dict[str, object]] = field(default_factory=list)

    @property
    def modes(self) -> list[str]:
        """The live mode of each tier at the end of the replay (adaptive only)."""
        return [str(s["mode"]) for s in self.shadows]

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.references if self.references else 0.0


def make_policy(
    name: str, tier_index: int, config: SimConfig, stats: WorkloadStats | None
) -> EvictionPolicy:
    """Build the eviction policy of one simulated tier (``belady`` is replay-only)."""
    if name == "belady":
        return BeladyPolicy()
    if name == "adaptive":
        def make(mode: str) -> EvictionPolicy:
            return make_policy(mode, tier_index, config, stats)

        above = sum(t.capacity_blocks for t in config.tiers[:tier_index])
        shadows = TierShadows(make, capacity_blocks=config.tiers[tier_index].capacity_blocks,
                              above_blocks=above)
        return AdaptivePolicy(make, shadows)
    if name in ("cost", "hindsight"):
        below = config.tiers[tier_index + 1].read_bw if tier_index + 1 < len(config.tiers) else None
        return make_eviction_policy(name, stats=stats, costs=config.costs,
                                    reload_bandwidth=below)
    return make_eviction_policy(name)


def _block_tokens(tokens_per_block: int, input_tokens: int, depth: int) -> int:
    """Tokens of a request's block at ``depth`` (the last block may be partial)."""
    return max(0, min(tokens_per_block, input_tokens - depth * tokens_per_block))


def simulate(
    trace: Trace,
    policy: str,
    config: SimConfig,
    *,
    capacity_fraction: float | None = None,
    progress: Callable[[int], None] | None = None,
    reuse_breakdown: bool = False,
) -> ReplayResult:
    """Replay ``trace`` with eviction policy ``policy`` on every tier of ``config``
    (``reuse_breakdown``: also count reuses and hits by reuse distance, see module doc).

    The cyclic garbage collector is paused for the replay: it builds hundreds of thousands
    of small acyclic objects (policy entries, heap items), and the collector's passes over
    them cost up to a fifth of the replay's time without ever freeing one."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _simulate(trace, policy, config, capacity_fraction=capacity_fraction,
                         progress=progress, reuse_breakdown=reuse_breakdown)
    finally:
        if enabled:
            gc.enable()


def _simulate(
    trace: Trace,
    policy: str,
    config: SimConfig,
    *,
    capacity_fraction: float | None,
    progress: Callable[[int], None] | None,
    reuse_breakdown: bool,
) -> ReplayResult:
    t0 = time.perf_counter()
    c0 = time.process_time()
    costs = config.costs or BlockCosts(
        block_tokens=trace.block_tokens, block_bytes=trace.block_tokens * config.bytes_per_token
    )
    config = replace(config, costs=costs)
    n_tiers = len(config.tiers)
    total = sum(t.capacity_blocks for t in config.tiers)
    # keys remembered, and a reuse counted, within 16x the capacity: measured on the shared
    # Mooncake trace, a horizon of one top-tier lifetime has too few reuses of fresh blocks to
    # tell classes apart (online AUC 0.65 vs 0.84 at 16x)
    window = max(1024, 16 * total)
    # only these policies read the workload statistics (make_policy hands them over): for
    # the others, keeping them up to date is a third of the replay's time, for nothing
    stats: WorkloadStats | None = None
    if policy in ("hindsight", "adaptive"):
        stats = HindsightStats(capacity_blocks=total, horizon=window, history=window)
    elif policy == "cost":
        stats = WorkloadStats(horizon=window, history=window)
    on_request = stats.on_request if stats is not None else None
    pols = [make_policy(policy, i, config, stats) for i in range(n_tiers)]
    caps = [t.capacity_blocks for t in config.tiers]
    bws = [t.read_bw for t in config.tiers]
    admits = [
        (config.admission(t.name) if config.admission else AlwaysAdmit()) for t in config.tiers
    ]
    belady = policy == "belady"
    nxt = next_use_index(trace) if belady else []
    loc: dict[Key, int] = {}  # key -> bitmask of tiers holding it
    forest = PrefixForest() if config.drop_orphans else None
    res = ReplayResult(policy=policy, capacity_fraction=capacity_fraction)
    tres = [TierResult(t.name, t.capacity_blocks) for t in config.tiers]
    res.tiers = tres
    bt = trace.block_tokens
    bpt = config.bytes_per_token
    slot = costs.block_bytes
    prefill = costs.prefill
    top = pols[0]
    shadow_sets = [p.shadows for p in pols if isinstance(p, AdaptivePolicy)]
    ref = 0
    depth_of: dict[Key, int] = {}  # only kept with several tiers (demotion needs the depth)
    buckets = reuse_buckets(trace, total) if reuse_breakdown else []
    by_hits = [0] * (len(REUSE_EDGES) + 1)

    def drop_everywhere(key: Key) -> None:
        # key left every tier: its descendants are unreachable
        if forest is None:
            return
        for orphan in forest.discard(key):
            mask = loc.pop(orphan, 0)
            j = 0
            while mask:
                if mask & 1:
                    pols[j].remove(orphan)
                mask >>= 1
                j += 1
            res.orphans_dropped += 1

    cap0 = caps[0]
    top_res = tres[0]

    def evict_single() -> None:
        # make_room(0) with one tier: a victim leaves the hierarchy, its orphans with it
        while len(loc) > cap0:
            v = top.victim()
            if v is None:
                return
            top_res.evictions += 1
            top.remove(v)
            del loc[v]
            if forest is not None:
                for orphan in forest.discard(v):
                    if loc.pop(orphan, 0):
                        top.remove(orphan)
                    res.orphans_dropped += 1

    def make_room(j: int, now: float) -> None:
        pol = pols[j]
        cap = caps[j]
        while len(pol) > cap:
            v = pol.victim()
            if v is None:
                return
            tres[j].evictions += 1
            mask = loc[v] & ~(1 << j)
            if j + 1 < n_tiers and not mask & (1 << (j + 1)):
                if admits[j + 1].admit(v, tier=config.tiers[j + 1].name, nbytes=slot, now=now):
                    if belady:
                        below = pols[j + 1]
                        # belady: every tier's policy is a BeladyPolicy
                        below.next_use = pol.next_use_of(v)  # type: ignore[attr-defined]
                    nb = forest.parent(v) if forest is not None else None
                    pols[j + 1].insert(v, nbytes=slot, parent=nb, depth=depth_of.get(v, 0),
                                       now=now)
                    mask |= 1 << (j + 1)
                    tres[j + 1].bytes_written += slot
                    pol.remove(v)
                    loc[v] = mask
                    make_room(j + 1, now)
                    continue
                tres[j + 1].rejected += 1
            pol.remove(v)
            if mask:
                loc[v] = mask
            else:
                del loc[v]
                depth_of.pop(v, None)
                drop_everywhere(v)

    top_touch, top_insert = top.touch, top.insert
    # AlwaysAdmit (the default) says yes without being asked
    admit0 = None if type(admits[0]) is AlwaysAdmit else admits[0].admit
    top_name = config.tiers[0].name
    for r in trace.requests:
        keys = r.blocks
        n = len(keys)
        now = r.arrival_s
        inp = r.input_tokens if r.input_tokens > 0 else n * bt
        # ---- lookup: longest resident prefix, served by the highest tier holding each block
        hit = 0
        served: list[int] = []
        for k in keys:
            mask = loc.get(k, 0)
            if not mask:
                break
            served.append((mask & -mask).bit_length() - 1)
            hit += 1
        # lookup and store in one pass (nothing reads the stats in between)
        if on_request is not None:
            on_request(keys, hit, output_tokens=r.output_tokens, now=now)
        # ---- prefetch: lower-tier blocks land one after another at their tier's bandwidth
        ready_at: list[float] = []
        t_ready = now
        for d in range(hit):
            j = served[d]
            if j:
                t_ready += min(bt, inp - d * bt) * bpt / bws[j]
                ready_at.append(t_ready)
            else:
                ready_at.append(now)
        usable = hit
        wait_s = 0.0
        if n_tiers > 1 and hit:
            out = wait_for_prefix(config.prefetch, ready_at, now,
                                  per_block_s=slot / bws[-1], base_s=TIMEOUT_BASE_S)
            usable = out.ready_blocks
            res.late_blocks += out.late_blocks
            wait_s = out.return_at - now
        hit_tokens = 0
        load_s = wait_s
        for d in range(usable):
            tok = min(bt, inp - d * bt)
            if tok <= 0:
                break
            j = served[d]
            hit_tokens += tok
            tres[j].hit_tokens += tok
            tres[j].hit_blocks += 1
            tres[j].bytes_read += tok * bpt
            if j == 0:
                load_s += tok * bpt / bws[0]
            else:
                tres[0].bytes_written += slot  # promotion into the top tier
        res.hit_blocks += usable
        if buckets:
            for b in buckets[ref:ref + usable]:
                by_hits[b] += 1
        res.hit_tokens += hit_tokens
        res.total_tokens += inp
        res.references += n
        res.requests += 1
        res.ttft_s.append(load_s + prefill.seconds(hit_tokens, inp))
        # ---- after the run: every block touched or inserted into the top tier, in order
        for sh in shadow_sets:
            sh.on_request(keys, functools.partial(_block_tokens, bt, inp), now)
        parent: Key | None = None
        for d, k in enumerate(keys):
            mask = loc.get(k, 0)
            if belady:
                top.next_use = nxt[ref]  # type: ignore[attr-defined]  # a BeladyPolicy
            ref += 1
            if mask & 1:
                top_touch(k, now=now)
            else:
                if forest is not None and parent is not None and parent not in loc:
                    # the parent was not kept (bypassed just now): this block would be an
                    # orphan at birth, unreachable by any lookup until its parent returns
                    parent = k
                    continue
                if admit0 is not None and not admit0(k, tier=top_name, nbytes=slot, now=now):
                    top_res.rejected += 1
                    parent = k
                    continue
                top_insert(k, nbytes=slot, parent=parent, depth=d, now=now)
                loc[k] = mask | 1
                if not mask:
                    top_res.bytes_written += slot
                    if forest is not None:
                        forest.add(k, parent)
                    if n_tiers > 1:
                        depth_of[k] = d
                if n_tiers == 1:
                    if len(loc) > cap0:  # one tier: ``loc`` holds exactly its keys
                        evict_single()
                elif len(top) > cap0:
                    make_room(0, now)
            parent = k
        if progress is not None:
            progress(n)
    res.elapsed_s = time.perf_counter() - t0
    res.cpu_s = time.process_time() - c0
    res.shadows = [sh.snapshot() for sh in shadow_sets]
    if buckets:
        res.hits_by_distance = by_hits
        res.reuses_by_distance = [0] * (len(REUSE_EDGES) + 1)
        for b in buckets:
            if b >= 0:
                res.reuses_by_distance[b] += 1
    return res

"""Replay a trace through a simulated tier hierarchy driven by kvtier's own policies.

Semantics:

- a request hits the longest prefix of its block chain that is resident in some tier at
  its arrival; blocks in a lower tier are promoted (prefetched) toward the top tier;
- after the request runs, every block of its chain is touched (if in the top tier) or
  inserted into the top tier, except a block whose parent was not kept (bypassed or
  refused just now: it would be an orphan at birth) or that the top tier's admission
  refuses, in the order ``SimConfig.order`` says (:class:`~kvtier.replay.config.Order`):
  ``store``, the default, as kvtier's store does it (hits touched tail first, room made
  for the new blocks, which then are inserted tail first), or ``reference``, head first
  with an eviction after each insert (the reference figures of shared/traces/README.md);
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
from dataclasses import replace

from kvtier.policy.adaptive import AdaptivePolicy
from kvtier.policy.admission import AlwaysAdmit
from kvtier.policy.base import EvictionPolicy, Key
from kvtier.policy.costmodel import BlockCosts
from kvtier.policy.hindsight import HindsightStats
from kvtier.policy.prefetch import TIMEOUT_BASE_S, wait_for_prefix
from kvtier.policy.prefix import PrefixForest
from kvtier.policy.stats import WorkloadStats
from kvtier.replay.config import PUT_EVICT_BATCH, Order, SimConfig, TierSpec, make_policy
from kvtier.replay.results import ReplayResult, TierResult
from kvtier.replay.reuse import REUSE_EDGES, next_use_index, reuse_buckets
from kvtier.replay.trace import Trace

__all__ = ["PUT_EVICT_BATCH", "REUSE_EDGES", "Order", "ReplayResult", "SimConfig",
           "TierResult", "TierSpec", "make_policy", "next_use_index", "reuse_buckets",
           "simulate"]


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
    res = ReplayResult(policy=policy, capacity_fraction=capacity_fraction,
                       order=config.order.value)
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

    next_use_of: dict[Key, float] = {}  # belady: of the victims a batch took out

    def batch(pol: EvictionPolicy, n: int) -> list[Key]:
        # the policy's next ``n`` victims, each removed as it is chosen (kvtier.store.alloc)
        out: list[Key] = []
        while len(out) < n:
            v = pol.victim()
            if v is None:
                break
            out.append(v)
            if n > 1:
                if belady:
                    next_use_of[v] = pol.next_use_of(v)  # type: ignore[attr-defined]
                pol.remove(v)
        return out

    def evict_single(room: int = 0) -> None:
        # make_room(0) with one tier: a victim leaves the hierarchy, its orphans with it.
        # ``room``: a put's blocks to make room for, its victims chosen PUT_EVICT_BATCH at
        # a time, before their orphans go (as the store does)
        while len(loc) > cap0 - room:
            vs = batch(top, min(PUT_EVICT_BATCH, len(loc) - cap0 + room) if room else 1)
            if not vs:
                return
            for v in vs:
                if loc.pop(v, 0):  # (not an orphan of an earlier victim of the batch)
                    top_res.evictions += 1
                    top.remove(v)
                    if forest is not None:
                        for orphan in forest.discard(v):
                            if loc.pop(orphan, 0):
                                top.remove(orphan)
                            res.orphans_dropped += 1

    def make_room(j: int, now: float, room: int = 0) -> None:
        # down to the capacity less ``room`` (a put's blocks about to be written)
        pol = pols[j]
        cap = caps[j] - room
        while len(pol) > cap:
            vs = batch(pol, min(PUT_EVICT_BATCH, len(pol) - cap) if room else 1)
            if not vs:
                return
            for v in vs:
                nu = next_use_of.pop(v, None) if belady else None
                if v not in loc:
                    continue
                tres[j].evictions += 1
                mask = loc[v] & ~(1 << j)
                if j + 1 < n_tiers and not mask & (1 << (j + 1)):
                    if admits[j + 1].admit(v, tier=config.tiers[j + 1].name, nbytes=slot,
                                           now=now):
                        if belady:
                            below = pols[j + 1]
                            # belady: every tier's policy is a BeladyPolicy
                            below.next_use = (  # type: ignore[attr-defined]
                                pol.next_use_of(v)  # type: ignore[attr-defined]
                                if nu is None else nu)
                        nb = forest.parent(v) if forest is not None else None
                        pols[j + 1].insert(v, nbytes=slot, parent=nb,
                                           depth=depth_of.get(v, 0), now=now)
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
    store_order = config.order is Order.STORE

    def apply_reference(keys: tuple[Key, ...], now: float, base: int) -> None:
        # head first, each insert followed by the evictions it calls for
        parent: Key | None = None
        for d, k in enumerate(keys):
            mask = loc.get(k, 0)
            if belady:
                top.next_use = nxt[base + d]  # type: ignore[attr-defined]  # a BeladyPolicy
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
                insert(k, parent, d, mask, now)
                settle(now)
            parent = k

    def apply_store(keys: tuple[Key, ...], now: float, base: int) -> None:
        # which blocks are touched (in the top tier) and which are to be written, in chain
        # order (a block whose parent is not kept or that admission refuses is not)
        touched: list[int] = []
        plan: list[int] = []
        parent_kept = True
        for d, k in enumerate(keys):
            mask = loc.get(k, 0)
            if mask & 1:
                touched.append(d)
            elif forest is not None and d and not parent_kept:
                parent_kept = mask != 0  # (still in a lower tier: its child may come)
                continue
            elif admit0 is not None and not admit0(k, tier=top_name, nbytes=slot, now=now):
                top_res.rejected += 1
                parent_kept = mask != 0
                continue
            else:
                plan.append(d)
            parent_kept = True
        # the lookup touches its blocks tail first (the head the most recent of them) ...
        for d in reversed(touched):
            if belady:
                top.next_use = nxt[base + d]  # type: ignore[attr-defined]  # a BeladyPolicy
            top_touch(keys[d], now=now)
        if not plan:
            return
        # ... the put makes room for its new blocks (none of them a victim) ...
        settle(now, min(len(plan), cap0))
        # ... and its commit inserts them tail first; those whose parent went to make room
        # are not written (orphans at birth). More than the tier holds: the policy's
        # victims among them go after (the tail first), to the tier below if there is one.
        write: list[int] = []
        for d in plan:
            if forest is not None and d and keys[d - 1] not in loc and (
                    not write or write[-1] != d - 1):
                continue
            write.append(d)
        for d in reversed(write):
            if belady:
                top.next_use = nxt[base + d]  # type: ignore[attr-defined]
            insert(keys[d], keys[d - 1] if d else None, d, loc.get(keys[d], 0), now)
        settle(now)

    def settle(now: float, room: int = 0) -> None:
        # evict down to the top tier's capacity less ``room``
        if n_tiers == 1:
            if len(loc) > cap0 - room:  # one tier: ``loc`` holds exactly its keys
                evict_single(room)
        elif len(top) > cap0 - room:
            make_room(0, now, room)

    def insert(k: Key, parent: Key | None, d: int, mask: int, now: float) -> None:
        top_insert(k, nbytes=slot, parent=parent, depth=d, now=now)
        loc[k] = mask | 1
        if not mask:
            top_res.bytes_written += slot
            if forest is not None:
                forest.add(k, parent)
            if n_tiers > 1:
                depth_of[k] = d

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
        # ---- after the run: every block touched or inserted into the top tier
        for sh in shadow_sets:
            sh.on_request(keys, functools.partial(_block_tokens, bt, inp), now)
        if store_order:
            apply_store(keys, now, ref)
        else:
            apply_reference(keys, now, ref)
        ref += n
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

"""The KV failure patterns: when each one shows, and what to change.

Eight are the engine's (1-8); two are kvtier's own tiers (9: a full tier pinned by
leases, 10: a tier down), which an operator otherwise learns of from an alert only.

Each rule reads Signals and returns a Finding or None. A rule fires only on its own
signature, so one cause gives one finding: long prompts arriving (1) shows as a shift in
prompt length with a jumping queue; a steady workload outgrowing the pool (8) as KV
filling up with no such shift; preemption (6) by the preemption counter itself.
Thresholds are named in one frozen dataclass so operators can see and tune them.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.doctor.patterns import Finding, Pattern, Thresholds
from kvtier.doctor.signals import Signals, TierSignal


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def _ratio(recent: float | None, base: float | None) -> float | None:
    if recent is None or base is None or base <= 0:
        return None
    return recent / base


def _prompt_shift(s: Signals, t: Thresholds) -> bool:
    r = _ratio(s.prompt_mean, s.prompt_mean_base)
    return r is not None and r >= t.shift


def _context_growth(s: Signals, t: Thresholds) -> float | None:
    r = _ratio(s.prompt_mean, s.prompt_mean_base)
    c = _ratio(s.context_p50_last, s.context_p50_first)
    return max((x for x in (r, c) if x is not None), default=None)


def _queue_jump(s: Signals, t: Thresholds) -> bool:
    if s.waiting_last is None or s.waiting_last < t.queue_min:
        return False
    first = s.waiting_first or 0.0
    return s.waiting_last >= t.jump * max(first, 1.0)


def _tier_full(x: TierSignal, t: Thresholds) -> bool:
    """Whether a tier counts as full: ``tier_full`` used or more, or usage not reported (a
    failed allocation is one eviction could not make room for, and nothing shows free
    space). Below it, free space that allocations cannot use is pattern 5's; at or above,
    pattern 1's or 9's: every tier with failures is one or the other."""
    return x.used_share is None or x.used_share >= t.tier_full


def _full_tier_failures(s: Signals, t: Thresholds) -> list[str]:
    return [f"kvtier {x.name} tier: {x.allocation_failures:,.0f} allocation failures at "
            + (f"{_pct(x.used_share)} used" if x.used_share is not None else "unreported usage")
            for x in s.tiers if x.allocation_failures > 0 and _tier_full(x, t)]


def long_prompts_kv_full(s: Signals, t: Thresholds) -> Finding | None:
    """1: long prompts arrive, the queue and TTFT jump, KV blocks near the limit."""
    if not s.trend or s.kv_usage_last is None or s.kv_usage_last < t.kv_near_full:
        return None
    ttft_jump = _ratio(s.ttft_mean, s.ttft_mean_base)
    failures = _full_tier_failures(s, t)
    if not (_queue_jump(s, t) and (ttft_jump or 0.0) >= t.jump
            and (_prompt_shift(s, t) or failures)):
        return None
    evidence = [
        f"KV cache usage {_pct(s.kv_usage_last)}",
        f"waiting requests {s.waiting_first or 0:.0f} -> {s.waiting_last:.0f}",
        f"TTFT mean {s.ttft_mean_base:.2f} s -> {s.ttft_mean:.2f} s ({ttft_jump:.1f}x)",
    ]
    if _prompt_shift(s, t):
        evidence.append(f"prompt length mean {s.prompt_mean_base:,.0f} -> "
                        f"{s.prompt_mean:,.0f} tokens")
    evidence += failures
    return Finding(
        Pattern.LONG_PROMPTS_KV_FULL, "Long prompts filled the KV cache",
        "long prompts arrive, the waiting queue and TTFT jump",
        tuple(evidence),
        "KV blocks are near the limit: a long prompt needs many free blocks at once, so it "
        "waits until running sequences finish, and new allocations fail",
        ("turn on chunked prefill and cap --max-num-batched-tokens so one long prompt does "
         "not take every free block at once",
         "give kvtier a CPU tier large enough to hold the long prompts' KV (kvtier plan "
         "--context at your P99) so prefixes reload instead of waiting",
         "route long-context requests to a pool sized for them, or raise "
         "--gpu-memory-utilization / use fp8 KV (--kv-cache-dtype fp8) to add blocks"))


def decode_slows_with_context(s: Signals, t: Thresholds) -> Finding | None:
    """2: inter-token latency worsens as contexts grow, with a steady batch."""
    if s.itl_mean is None or s.itl_mean_base is None:
        return None
    itl = _ratio(s.itl_mean, s.itl_mean_base)
    growth = _context_growth(s, t)
    if not s.trend or itl is None or itl < t.shift or growth is None or growth < t.shift:
        return None
    batch = _ratio(s.running_last, s.running_first)
    if batch is not None and batch >= t.batch_growth:
        return None  # a growing batch explains it: pattern 3's signature
    if _queue_jump(s, t):
        return None  # admission is stalling: pattern 1's signature
    evidence = [f"inter-token latency mean {s.itl_mean_base * 1e3:.0f} ms -> "
                f"{s.itl_mean * 1e3:.0f} ms ({itl:.1f}x)"]
    if s.prompt_mean is not None and s.prompt_mean_base is not None:
        evidence.append(f"prompt length mean {s.prompt_mean_base:,.0f} -> "
                        f"{s.prompt_mean:,.0f} tokens")
    if s.context_p50_first is not None and s.context_p50_last is not None:
        evidence.append(f"kvtier connector context P50 {s.context_p50_first:,.0f} -> "
                        f"{s.context_p50_last:,.0f} tokens")
    evidence.append(f"running sequences {s.running_first or 0:.0f} -> {s.running_last or 0:.0f}")
    return Finding(
        Pattern.DECODE_SLOWS_WITH_CONTEXT, "Streaming slows as contexts grow",
        "inter-token latency worsens while the batch stays the same",
        tuple(evidence),
        "decode reads every running sequence's whole KV each step, so it is bound by HBM "
        "bandwidth and each step takes longer as contexts grow",
        ("use fp8 KV (--kv-cache-dtype fp8) to halve the bytes each step reads",
         "cap the context (--max-model-len) or summarise long histories",
         "split long-context traffic onto its own replicas, or raise TP so each GPU reads "
         "a smaller share of the KV"))


def decode_memory_bound(s: Signals, t: Thresholds) -> Finding | None:
    """3: the GPU is busy but tokens/s stay flat as the batch grows."""
    evidence: list[str] = []
    if s.gpu_util is not None and s.dram_active is not None and s.tensor_active is not None \
            and s.gpu_util >= t.gpu_busy_pct and s.dram_active >= t.dram_busy \
            and s.tensor_active < t.tensor_idle:
        evidence.append(f"GPU utilization {s.gpu_util:.0f}%, memory interface busy "
                        f"{_pct(s.dram_active)}, tensor cores busy {_pct(s.tensor_active)}")
    if len(s.generation_tps) >= 2:
        batch = _ratio(s.running_avg[-1], s.running_avg[0])
        tps = _ratio(s.generation_tps[-1], s.generation_tps[0])
        if batch is not None and tps is not None and batch >= t.batch_growth \
                and tps < t.throughput_flat:
            evidence.append(f"running sequences {s.running_avg[0]:.0f} -> "
                            f"{s.running_avg[-1]:.0f} ({batch:.1f}x)")
            evidence.append(f"generation {s.generation_tps[0]:,.0f} -> "
                            f"{s.generation_tps[-1]:,.0f} tokens/s ({tps:.2f}x)")
    if not evidence:
        return None
    if s.itl_mean is not None:
        evidence.append(f"inter-token latency mean {s.itl_mean * 1e3:.0f} ms")
    return Finding(
        Pattern.DECODE_MEMORY_BOUND, "GPU busy, tokens/s flat: decode is memory-bound",
        "the GPU is busy but generated tokens per second do not grow with the batch",
        tuple(evidence),
        "decode is bound by memory bandwidth (weights and KV read every step), not by "
        "compute: more sequences make every step longer instead of producing more tokens",
        ("stop raising --max-num-seqs: past this point it adds latency, not throughput",
         "use fp8 KV and, if quality allows, fp8/int4 weights to cut bytes per step",
         "add replicas (or speculative decoding) to gain tokens/s; more batch will not"))


def _served_from_kvtier(s: Signals, t: Thresholds) -> bool:
    """Whether prompts do share prefixes once kvtier's hits count: vLLM's prefix cache
    rate is the GPU's alone, and a small GPU cache whose evictions kvtier serves is what
    the tiers are for (their hits are vLLM's ``external_prefix_cache_hits``)."""
    if s.combined_hit_rate is not None and s.combined_hit_rate >= t.hit_rate_low:
        return True
    return s.kvtier_hit_rate is not None and s.kvtier_hit_rate >= t.hit_rate_low \
        and (s.kvtier_queries is None or s.kvtier_queries >= t.hit_rate_min_queries)


def low_prefix_hit_rate(s: Signals, t: Thresholds) -> Finding | None:
    """4: the prefix cache hit rate stays low, the GPU's and kvtier's alike."""
    if s.prefix_hit_rate is None or s.prefix_queries is None \
            or s.prefix_queries < t.hit_rate_min_queries or s.prefix_hit_rate >= t.hit_rate_low \
            or _served_from_kvtier(s, t):
        return None
    evidence = [f"prefix cache hit rate {_pct(s.prefix_hit_rate)} of "
                f"{s.prefix_queries:,.0f} queried tokens"]
    if s.combined_hit_rate is not None:
        evidence.append(f"with the KV connector's hits {_pct(s.combined_hit_rate)}")
    if s.kvtier_hit_rate is not None:
        evidence.append(f"kvtier lookups hit {_pct(s.kvtier_hit_rate)} of tokens")
    return Finding(
        Pattern.LOW_PREFIX_HIT_RATE, "Prefix cache hit rate stays low",
        "almost no prompt tokens are served from cached KV",
        tuple(evidence),
        "prompts do not share exact token prefixes: a template that varies early (a "
        "timestamp, a request id, reordered tools or documents) breaks every hash after it, "
        "or the prompts are truly unique",
        ("put the stable part first (system prompt, tool schemas, documents), the variable "
         "part last; no timestamps or ids at the top",
         "check that every client uses the same template, tokenizer and cache_salt",
         "if prompts are truly unique, prefix caching cannot help: size kvtier's tiers "
         "down and do not expect TTFT savings"))


def fragmentation(s: Signals, t: Thresholds) -> Finding | None:
    """5: allocations fail although the tier is not full."""
    hits = [x for x in s.tiers if x.allocation_failures > 0 and not _tier_full(x, t)]
    if not hits:
        return None
    evidence = tuple(f"kvtier {x.name} tier: {x.allocation_failures:,.0f} allocation "
                     f"failures with only {_pct(x.used_share)} used" for x in hits)
    return Finding(
        Pattern.FRAGMENTATION, "Out of memory although memory did not look full",
        "allocations fail while usage shows free space",
        evidence,
        "the free space is fragmented or reserved: there is no contiguous run (slot, "
        "extent) of the size asked for, or leases hold slots that look free",
        ("make the tier's slot size equal to the block size (one layout per tier, "
         "tokens_per_block the same for all models on it)",
         "shorten lease TTLs so slots of crashed or slow clients come back",
         "leave headroom: keep the tier under ~80% by capacity, or restart it to compact"))


def preemption(s: Signals, t: Thresholds) -> Finding | None:
    """6: preemptions and the waiting queue climb."""
    if s.preemptions is None or s.preemptions < t.preemptions_min:
        return None
    evidence = [f"{s.preemptions:,.0f} preemptions"
                + (f" in {s.interval_s:g} s" if s.interval_s else "")]
    if s.waiting_last is not None:
        evidence.append(f"waiting requests {s.waiting_first or 0:.0f} -> {s.waiting_last:.0f}")
    if s.running_last is not None:
        evidence.append(f"running sequences {s.running_last:.0f}")
    if s.kv_usage_last is not None:
        evidence.append(f"KV cache usage {_pct(s.kv_usage_last)}")
    if s.output_mean is not None:
        evidence.append(f"mean output {s.output_mean:,.0f} tokens per request")
    return Finding(
        Pattern.PREEMPTION, "Preemptions and a growing waiting queue",
        "running sequences are preempted and the waiting queue climbs",
        tuple(evidence),
        "too many sequences run at once for the KV pool: as their outputs grow each needs "
        "more blocks, so the scheduler evicts some and recomputes them later",
        ("lower --max-num-seqs so the running set fits at its final length",
         "cap max_tokens per request: long outputs hold their KV for the whole decode",
         "enable kvtier offload so preempted KV is saved to CPU and reloaded, not "
         "recomputed"))


def agent_chain_ttft(s: Signals, t: Thresholds) -> Finding | None:
    """7: short calls whose time is mostly TTFT: chains of them wait seconds end to end."""
    if s.ttft_mean is None or s.e2e_mean is None or s.output_mean is None or s.e2e_mean <= 0:
        return None
    share = s.ttft_mean / s.e2e_mean
    queued = s.waiting_last is not None and s.waiting_last >= t.queue_min
    kv_full = s.kv_usage_last is not None and s.kv_usage_last >= t.kv_near_full
    if s.ttft_mean < t.agent_ttft_s or share < t.agent_ttft_share \
            or s.output_mean > t.agent_output_max or queued or kv_full:
        return None
    evidence = [f"TTFT mean {s.ttft_mean:.2f} s = {share:.0%} of the end-to-end "
                f"{s.e2e_mean:.2f} s", f"mean output {s.output_mean:,.0f} tokens per request"]
    if s.prompt_mean is not None:
        evidence.append(f"mean prompt {s.prompt_mean:,.0f} tokens")
    if s.prefix_hit_rate is not None:
        evidence.append(f"prefix cache hit rate {_pct(s.prefix_hit_rate)}")
    evidence.append(f"a 10-call chain spends ~{10 * s.ttft_mean:.0f} s in prefill alone")
    return Finding(
        Pattern.AGENT_CHAIN_TTFT, "Agent chains wait seconds end to end",
        "short calls spend most of their time before the first token; chained calls add up",
        tuple(evidence),
        "each call re-prefills the whole growing history; with no queue and free KV the "
        "time is prefill itself, so TTFT accumulates over the calls of a chain",
        ("keep each session's history cached between calls: a kvtier CPU/NVMe tier holds "
         "it after the GPU evicts it; route a session to the same replica",
         "keep the history append-only and the prefix byte-identical between calls so it "
         "hits",
         "issue independent calls in parallel and shorten what each call re-sends"))


def sized_below_p99(s: Signals, t: Thresholds) -> Finding | None:
    """8: KV fills up under a steady workload: the pool is sized below the P99 demand.
    Not beside pattern 1, which a full kvtier tier's failures fire without a prompt shift
    (one cause, one finding)."""
    if s.kv_usage_last is None or s.kv_usage_last < t.kv_full or _prompt_shift(s, t) \
            or long_prompts_kv_full(s, t) is not None:
        return None
    evidence = [f"KV cache usage {_pct(s.kv_usage_first)} -> {_pct(s.kv_usage_last)}"]
    climbed = s.trend and s.kv_usage_first is not None \
        and s.kv_usage_last - s.kv_usage_first >= t.kv_climb
    p99 = s.prompt_p99 if s.prompt_p99 is not None else s.context_p99
    demand = None
    if p99 is not None and s.running_last and s.kv_capacity_tokens:
        demand = s.running_last * p99
    undersized = demand is not None and s.kv_capacity_tokens is not None \
        and demand > t.p99_over_pool * s.kv_capacity_tokens
    if not (climbed or undersized):
        return None
    if demand is not None and s.kv_capacity_tokens:
        evidence.append(f"{s.running_last:.0f} running x P99 context {p99:,.0f} tokens = "
                        f"{demand:,.0f} tokens vs a KV pool of {s.kv_capacity_tokens:,} tokens")
    if s.prompt_p50 is not None and s.prompt_p99 is not None:
        evidence.append(f"prompt length P50 {s.prompt_p50:,.0f}, P99 {s.prompt_p99:,.0f} "
                        "tokens (no shift in the mix)")
    return Finding(
        Pattern.SIZED_BELOW_P99, "Memory runs out under a steady workload",
        "the service started fine, then KV filled up without the traffic mix changing",
        tuple(evidence),
        "KV is a product of the workload (concurrency x context length): the pool was "
        "sized for typical requests, and the long tail fills it as requests accumulate",
        ("size for P99, not the mean: kvtier plan --context P50,P95,P99 --concurrency N "
         "shows what fits",
         "cap concurrency (--max-num-seqs) at what fits at P99, or cap --max-model-len",
         "give kvtier CPU/NVMe tiers for the spill plan reports, and use fp8 KV"))


def tier_pinned(s: Signals, t: Thresholds) -> Finding | None:
    """9: a full kvtier tier fails allocations: eviction found nothing it could free, so
    leases pin the tier (a full tier that evicts is normal and counts no failure)."""
    failures = _full_tier_failures(s, t)
    if not failures or long_prompts_kv_full(s, t) is not None:
        return None    # with the engine's long-prompt signature, pattern 1 tells the cause
    return Finding(
        Pattern.TIER_PINNED, "A full kvtier tier cannot take new blocks",
        "kvtier stores fewer blocks than engines save: allocations fail on a full tier",
        tuple(failures),
        "eviction found no block it could free: engines hold leases on (nearly) every "
        "block, reading them or writing them, so new saves are refused and recomputed later",
        ("look for hung or slow engines: /v1/stats shows the open and quarantined leases "
         "(`leases`) and the expired ones (`requests.lease_expired`); an engine must copy, "
         "then release",
         "lower daemon.client_get_share / client_put_share so one client cannot pin the "
         "whole tier, or daemon.lease_ttl_s so a stuck client's leases come back sooner",
         "enlarge the tier (kvtier plan) if the working set of in-flight requests needs it"))


def tier_down(s: Signals, t: Thresholds) -> Finding | None:
    """10: a kvtier tier is down: its blocks are misses and nothing is written to it."""
    down = [x for x in s.tiers if x.up is False]
    if not down:
        return None
    evidence = tuple(f"kvtier {x.name} tier is down"
                     + (f" ({x.errors:,.0f} errors counted)" if x.errors else "")
                     for x in down)
    return Finding(
        Pattern.TIER_DOWN, "A kvtier tier is down",
        "lookups miss what the tier holds; engines recompute it",
        evidence,
        "the tier's backend stopped answering or refused writes: Redis unreachable, "
        "failing over or refusing the credentials, or the nvme disk full or failing (it "
        "comes back by itself when its probe succeeds)",
        ("`kvtier doctor --env --config <the daemon's config>` connects to the Redis server "
         "from this host as the tier does (credentials, TLS, PING) and checks the nvme "
         "path's space and file system",
         "read the daemon's log for the tier's last error; `kvtier stats` shows its error "
         "counters",
         "for Redis: check redis.url, the credentials and the cluster's state; for nvme: "
         "free space on the file system of nvme.path"))


RULES: tuple[Callable[[Signals, Thresholds], Finding | None], ...] = (
    long_prompts_kv_full, decode_slows_with_context, decode_memory_bound,
    low_prefix_hit_rate, fragmentation, preemption, agent_chain_ttft, sized_below_p99,
    tier_pinned, tier_down,
)


def diagnose(signals: Signals, thresholds: Thresholds | None = None) -> list[Finding]:
    """Run every rule; the findings come in pattern order."""
    t = thresholds or Thresholds()
    return [f for f in (rule(signals, t) for rule in RULES) if f is not None]

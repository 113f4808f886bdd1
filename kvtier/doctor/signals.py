"""Signals: the numbers the patterns compare, derived from one or more scrapes.

With two or more samples, "recent" is what happened between the last two scrapes and
"baseline" is everything the engine saw before the first one (its cumulative
histograms), so a jump shows up even from two scrapes. Rates are per interval between
consecutive samples. With one sample, recent is the cumulative view and the trend and
rate checks are skipped.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from kvtier.doctor import engine as m
from kvtier.doctor.engine import EngineSample
from kvtier.doctor.histogram import Histogram
from kvtier.doctor.stats import KVTierStats
from kvtier.statsdoc import clean


@dataclass(frozen=True, slots=True)
class TierSignal:
    """Allocation failures of one kvtier tier in the window, how full it is, and whether
    it was up at the last sample (None: not reported)."""

    name: str
    allocation_failures: float
    used_share: float | None
    up: bool | None = None
    errors: float | None = None


@dataclass(frozen=True, slots=True)
class Signals:
    """Everything the rules read; ``None`` means the metric was not available."""

    samples: int
    interval_s: float | None
    kv_usage_first: float | None = None
    kv_usage_last: float | None = None
    running_first: float | None = None
    running_last: float | None = None
    waiting_first: float | None = None
    waiting_last: float | None = None
    preemptions: float | None = None  # in the recent window
    prefix_hit_rate: float | None = None  # the GPU's own prefix cache
    prefix_queries: float | None = None  # tokens queried in the window
    combined_hit_rate: float | None = None  # GPU cache and KV connector (kvtier) together
    kvtier_hit_rate: float | None = None  # kvtier's own lookups, tokens
    kvtier_queries: float | None = None  # tokens kvtier was asked for in the window
    ttft_mean: float | None = None
    ttft_mean_base: float | None = None
    ttft_p90: float | None = None
    itl_mean: float | None = None
    itl_mean_base: float | None = None
    prompt_mean: float | None = None
    prompt_mean_base: float | None = None
    prompt_p50: float | None = None  # whole distribution at the last scrape
    prompt_p99: float | None = None
    output_mean: float | None = None
    e2e_mean: float | None = None
    generation_tps: tuple[float, ...] = ()  # per interval
    running_avg: tuple[float, ...] = ()  # per interval
    gpu_util: float | None = None  # percent
    dram_active: float | None = None
    tensor_active: float | None = None
    kv_capacity_tokens: int | None = None
    context_p50_first: float | None = None  # kvtier connector's view
    context_p50_last: float | None = None
    context_p99: float | None = None
    tiers: tuple[TierSignal, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def trend(self) -> bool:
        """Whether there are two samples or more to compare."""
        return self.samples >= 2


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def _window(samples: list[EngineSample], names: tuple[str, ...]
            ) -> tuple[Histogram | None, Histogram | None]:
    """(recent, baseline) observations of a histogram family."""
    last = samples[-1].histogram(names)
    if last is None:
        return None, None
    if len(samples) == 1:
        return last, None
    prev = samples[-2].histogram(names)
    first = samples[0].histogram(names)
    recent = last.minus(prev) if prev is not None else last
    return recent, first


def _mean(h: Histogram | None) -> float | None:
    return None if h is None else h.mean()


def _delta(samples: list[EngineSample], names: tuple[str, ...]) -> float | None:
    if len(samples) < 2:
        return None
    a, b = samples[-2].get(names), samples[-1].get(names)
    if a is None or b is None:
        return None
    return b - a if b >= a else b  # a counter reset restarts from zero


def _lookups(samples: list[EngineSample], queries: tuple[str, ...], hits: tuple[str, ...]
             ) -> tuple[float, float] | None:
    """(queried, hit) tokens of a pair of counters in the last interval; cumulative with
    one sample or after a counter reset; None when the scrape lacks them."""
    q_last, h_last = samples[-1].get(queries), samples[-1].get(hits)
    if q_last is None or h_last is None:
        return None
    if len(samples) >= 2:
        q_prev, h_prev = samples[-2].get(queries), samples[-2].get(hits)
        if q_prev is not None and h_prev is not None and q_last >= q_prev:
            return q_last - q_prev, h_last - h_prev
    return q_last, h_last


def _prefix(samples: list[EngineSample]) -> tuple[float | None, float | None, float | None]:
    """(GPU hit rate, tokens queried, GPU and connector hit rate). vLLM counts a prompt's
    tokens once in its prefix cache queries, and the ones the GPU missed but a KV
    connector loaded (kvtier's hits) in ``external_prefix_cache_hits``: both hits over
    the queried tokens is the share of prompt tokens served from cached KV."""
    local = _lookups(samples, m.PREFIX_QUERIES, m.PREFIX_HITS)
    if local is None:
        return None, None, None
    q, h = local
    if q <= 0:
        return None, q, None
    external = _lookups(samples, m.EXTERNAL_QUERIES, m.EXTERNAL_HITS)
    combined = None if external is None else min(1.0, (h + external[1]) / q)
    return h / q, q, combined


def _kvtier_hit_rate(stats: list[KVTierStats]) -> tuple[float | None, float | None]:
    last = stats[-1]
    if last.lookup_tokens is None or last.hit_tokens is None:
        return last.prefix_hit_rate, None
    q, h = last.lookup_tokens, last.hit_tokens
    if len(stats) >= 2:
        prev = stats[-2]
        if prev.lookup_tokens is not None and prev.hit_tokens is not None \
                and q >= prev.lookup_tokens:
            q, h = q - prev.lookup_tokens, h - prev.hit_tokens
    return (h / q if q > 0 else None), q


def _tiers(stats: list[KVTierStats]) -> tuple[TierSignal, ...]:
    out = []
    for name, tier in stats[-1].tiers.items():
        failures = tier.allocation_failures
        if failures is None:
            failures = 0.0
        elif len(stats) >= 2:
            before = stats[-2].tiers.get(name)
            if before is not None and before.allocation_failures is not None \
                    and failures >= before.allocation_failures:
                failures -= before.allocation_failures
        # the name is the daemon's text: clean (an ESC reached the terminal; found by review)
        out.append(TierSignal(clean(name), failures, tier.used_share, tier.up, tier.errors))
    return tuple(out)


def derive(engine: list[EngineSample], stats: list[KVTierStats],
           interval_s: float | None) -> Signals:
    """Reduce the scrapes (oldest first) to Signals; either list may be empty."""
    notes: list[str] = []
    n = max(len(engine), len(stats))
    if n < 2:
        notes.append("one sample only: trend and rate checks (patterns 2, 3, 6, 8) need two "
                     "scrapes some seconds apart (--samples 2 --interval S, or two files)")
    fields: dict[str, Any] = {}
    if engine:
        e0, e1 = engine[0], engine[-1]
        ttft, ttft_base = _window(engine, m.TTFT)
        itl, itl_base = _window(engine, m.ITL)
        prompt, prompt_base = _window(engine, m.PROMPT_LEN)
        output, _ = _window(engine, m.OUTPUT_LEN)
        e2e, _ = _window(engine, m.E2E)
        prompt_all = e1.histogram(m.PROMPT_LEN)
        hit_rate, queries, combined = _prefix(engine)
        tps: list[float] = []
        running_avg: list[float] = []
        if interval_s:
            for before, after in itertools.pairwise(engine):
                ga, gb = before.get(m.GENERATION_TOKENS), after.get(m.GENERATION_TOKENS)
                ra, rb = before.get(m.RUNNING), after.get(m.RUNNING)
                if ga is not None and gb is not None and ra is not None and rb is not None:
                    tps.append(max(0.0, gb - ga) / interval_s)
                    running_avg.append((ra + rb) / 2)
        fields.update(
            kv_usage_first=e0.get(m.KV_USAGE), kv_usage_last=e1.get(m.KV_USAGE),
            running_first=e0.get(m.RUNNING), running_last=e1.get(m.RUNNING),
            waiting_first=e0.get(m.WAITING), waiting_last=e1.get(m.WAITING),
            preemptions=_delta(engine, m.PREEMPTIONS),
            prefix_hit_rate=hit_rate, prefix_queries=queries, combined_hit_rate=combined,
            ttft_mean=_mean(ttft), ttft_mean_base=_mean(ttft_base),
            ttft_p90=None if ttft is None else ttft.quantile(0.9),
            itl_mean=_mean(itl), itl_mean_base=_mean(itl_base),
            prompt_mean=_mean(prompt), prompt_mean_base=_mean(prompt_base),
            prompt_p50=None if prompt_all is None else prompt_all.quantile(0.5),
            prompt_p99=None if prompt_all is None else prompt_all.quantile(0.99),
            output_mean=_mean(output), e2e_mean=_mean(e2e),
            generation_tps=tuple(tps), running_avg=tuple(running_avg),
            gpu_util=e1.get(m.GPU_UTIL), dram_active=e1.get(m.DRAM_ACTIVE),
            tensor_active=e1.get(m.TENSOR_ACTIVE), kv_capacity_tokens=e1.kv_capacity_tokens,
        )
    if stats:
        s0, s1 = stats[0], stats[-1]
        if s1.missing:
            lacking = ", ".join(f"'{x}'" for x in s1.missing)
            notes.append(f"kvtier stats lack {lacking}: checks that need them use the "
                         "engine's metrics or are skipped")
        if s1.version not in (None, 1):
            notes.append(f"kvtier stats version {s1.version} is newer than this doctor "
                         "knows (1); reading the fields it recognises")
        kv_rate, kv_queries = _kvtier_hit_rate(stats)
        preempt = None
        if len(stats) >= 2:
            a, b = stats[-2].preemptions, s1.preemptions
            if a is not None and b is not None:
                preempt = b - a if b >= a else b
        fields.update(
            running_first=_first(fields.get("running_first"), s0.running),
            running_last=_first(fields.get("running_last"), s1.running),
            waiting_first=_first(fields.get("waiting_first"), s0.waiting),
            waiting_last=_first(fields.get("waiting_last"), s1.waiting),
            preemptions=_first(fields.get("preemptions"), preempt),
            context_p50_first=s0.context_p50, context_p50_last=s1.context_p50,
            context_p99=s1.context_p99, tiers=_tiers(stats), kvtier_hit_rate=kv_rate,
            kvtier_queries=kv_queries,
        )
        if fields.get("prefix_hit_rate") is None and kv_rate is not None:
            fields.update(prefix_hit_rate=kv_rate, prefix_queries=kv_queries)
    return Signals(samples=n, interval_s=interval_s if n >= 2 else None, notes=tuple(notes),
                   **fields)

"""A serving engine's Prometheus scrape, reduced to what the patterns read.

vLLM's v1 names come first, with the older names as fallbacks
(``vllm:gpu_cache_usage_perc``, ``vllm:time_per_output_token_seconds``, the
``gpu_``-prefixed prefix-cache counters). DCGM exporter gauges, when present in the
same scrape or given with ``--gpu-metrics``, tell whether the GPU is busy and on what.
Series of several engines (data parallel) are summed; usage gauges take the maximum.
``vllm:cache_config_info`` is kept per engine, so the KV pool is every engine's blocks.
A value doctor reads that is NaN, infinite or negative makes the scrape unreadable
(DoctorError, exit 2), as text that is not exposition format does: it is never diagnosed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvtier.doctor.errors import DoctorError
from kvtier.doctor.histogram import Histogram
from kvtier.errors import brief
from kvtier.statsdoc import clean

KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
PREEMPTIONS = ("vllm:num_preemptions_total",)
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
# tokens the GPU prefix cache missed that a KV connector (kvtier) was asked for / loaded
EXTERNAL_QUERIES = ("vllm:external_prefix_cache_queries_total",)
EXTERNAL_HITS = ("vllm:external_prefix_cache_hits_total",)
PROMPT_TOKENS = ("vllm:prompt_tokens_total",)
GENERATION_TOKENS = ("vllm:generation_tokens_total",)
TTFT = ("vllm:time_to_first_token_seconds",)
ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
PROMPT_LEN = ("vllm:request_prompt_tokens",)
OUTPUT_LEN = ("vllm:request_generation_tokens",)
E2E = ("vllm:e2e_request_latency_seconds",)
QUEUE_TIME = ("vllm:request_queue_time_seconds",)
CACHE_INFO = "vllm:cache_config_info"
VLLM_PREFIX = "vllm:"  # every vLLM metric's name starts so; other exporters' do not
GPU_UTIL = ("DCGM_FI_DEV_GPU_UTIL",)  # percent
DRAM_ACTIVE = ("DCGM_FI_PROF_DRAM_ACTIVE",)  # ratio of cycles the memory interface is busy
TENSOR_ACTIVE = ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",)  # ratio
_MAX_GAUGES = frozenset(KV_USAGE)
_MEAN_GAUGES = frozenset(GPU_UTIL + DRAM_ACTIVE + TENSOR_ACTIVE)
_KNOWN = frozenset(KV_USAGE + RUNNING + WAITING + PREEMPTIONS + PREFIX_QUERIES + PREFIX_HITS
                   + EXTERNAL_QUERIES + EXTERNAL_HITS + PROMPT_TOKENS + GENERATION_TOKENS)
_READ = _KNOWN | _MEAN_GAUGES  # the gauges and counters the patterns read
_READ_HISTOGRAMS = frozenset(TTFT + ITL + PROMPT_LEN + OUTPUT_LEN + E2E + QUEUE_TIME)


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One scrape: scalar samples by name, histograms by family, and the cache info
    labels of each engine (by its ``engine`` label; one entry without data parallel)."""

    source: str
    values: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    cache_info: dict[str, dict[str, str]] = field(default_factory=dict)

    def get(self, names: tuple[str, ...]) -> float | None:
        """The first of ``names`` present in the scrape (new name before old)."""
        for name in names:
            if name in self.values:
                return self.values[name]
        return None

    def histogram(self, names: tuple[str, ...]) -> Histogram | None:
        """The first histogram family of ``names`` present in the scrape."""
        for name in names:
            if name in self.histograms:
                return self.histograms[name]
        return None

    @property
    def kv_capacity_tokens(self) -> int | None:
        """Tokens the GPU KV pools of all engines hold (``num_gpu_blocks`` x ``block_size``
        per engine, summed like the running and waiting gauges); None unless every engine
        exports both, since a partial sum would understate the pool."""
        pools = [_pool_tokens(info) for info in self.cache_info.values()]
        if not pools or any(p is None for p in pools):
            return None
        return sum(p for p in pools if p is not None)

    @property
    def has_engine_metrics(self) -> bool:
        """Whether any of vLLM's metrics (a ``vllm:`` name) was found. Another exporter's
        histograms (kvtier's own /metrics, ``foo_seconds``) are not the engine's: counting
        them read any such page as a healthy engine (found by review)."""
        return bool(self.cache_info) or any(
            name.startswith(VLLM_PREFIX) for name in (*self.values, *self.histograms))


def _pool_tokens(info: dict[str, str]) -> int | None:
    """One engine's KV pool in tokens, from its cache_config_info labels."""
    try:
        return int(info["num_gpu_blocks"]) * int(info["block_size"])
    except (KeyError, ValueError):
        return None


def _why_unparsable(exc: Exception, text: str) -> str:
    """The parser's reason; prometheus_client raises some errors with no message."""
    if str(exc):
        return str(exc)
    if text and not text.endswith("\n"):
        return (f"a line is cut off or malformed ({type(exc).__name__}); the text ends "
                "mid-line: was the scrape or the file truncated?")
    return f"a line is cut off or malformed ({type(exc).__name__})"


def _check_value(name: str, value: float, source: str) -> None:
    """Gauges, counters and histogram samples are finite and not negative; NaN, an
    infinity or a negative count means a broken exporter, not a state to diagnose."""
    if not math.isfinite(value) or value < 0:
        raise DoctorError(f"{source}: {name} is {value:g}, not a finite number >= 0: the "
                          "exporter's value cannot be read")


def _bound(family: str, le: str, source: str) -> float | None:
    """A histogram bucket's ``le`` as a number (``+Inf`` included). Not a number (or NaN):
    DoctorError for a histogram doctor reads, None (the sample skipped) for another; it
    was a ValueError traceback (found by review)."""
    try:
        bound = float(le)
    except ValueError:
        bound = math.nan
    if not math.isnan(bound):
        return bound
    if family in _READ_HISTOGRAMS:
        raise DoctorError(f"{source}: {family} has a bucket le={clean(le)[:40]!r}, not a "
                          "number: the exporter's histogram cannot be read")
    return None


MAX_POOL_FIELD = 10**12
"""Largest ``num_gpu_blocks`` or ``block_size`` read from vllm:cache_config_info: more is
no GPU (4000 digits overflowed a float in the sizing rule; found by review)."""


def _check_pool(labels: dict[str, str], source: str) -> None:
    """DoctorError when a cache_config_info size is an integer outside 0 .. MAX_POOL_FIELD
    (one that is not an integer, such as ``None`` before vLLM knows it, stays unknown)."""
    for key in ("num_gpu_blocks", "block_size"):
        try:
            value = int(labels.get(key, ""))
        except ValueError:
            continue
        if not 0 <= value <= MAX_POOL_FIELD:
            raise DoctorError(f"{source}: {CACHE_INFO} {key} is {brief(value)}, not from 0 "
                              f"to {MAX_POOL_FIELD:,}: not a KV pool size")


def parse_engine(text: str, source: str) -> EngineSample:
    """Parse Prometheus exposition text; DoctorError when it is not exposition format."""
    values: dict[str, float] = {}
    counts: dict[str, int] = {}
    buckets: dict[str, dict[tuple[tuple[str, str], ...], dict[float, float]]] = {}
    sums: dict[str, float] = {}
    totals: dict[str, float] = {}
    info: dict[str, dict[str, str]] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as exc:
        raise DoctorError(f"{source} is not Prometheus exposition text: "
                          f"{_why_unparsable(exc, text)}") from exc
    for family in families:
        if family.type == "histogram":
            for s in family.samples:
                if family.name in _READ_HISTOGRAMS:
                    _check_value(s.name, s.value, source)
                if s.name.endswith("_bucket") and "le" in s.labels:
                    le = _bound(family.name, s.labels["le"], source)
                    if le is None:
                        continue
                    series = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                    per = buckets.setdefault(family.name, {}).setdefault(series, {})
                    per[le] = s.value
                elif s.name.endswith("_sum"):
                    sums[family.name] = sums.get(family.name, 0.0) + s.value
                elif s.name.endswith("_count"):
                    totals[family.name] = totals.get(family.name, 0.0) + s.value
            continue
        for s in family.samples:
            if s.name == CACHE_INFO or family.name == CACHE_INFO:
                info.setdefault(s.labels.get("engine", ""), {}).update(s.labels)
                continue
            if s.name in _READ:
                _check_value(s.name, s.value, source)
            if s.name in _MAX_GAUGES:
                values[s.name] = max(values.get(s.name, s.value), s.value)
            else:
                values[s.name] = values.get(s.name, 0.0) + s.value
            counts[s.name] = counts.get(s.name, 0) + 1
    for labels in info.values():
        _check_pool(labels, source)
    for name in _MEAN_GAUGES & values.keys():
        values[name] /= counts[name]
    histograms: dict[str, Histogram] = {}
    for name, per_series in buckets.items():
        merged: Histogram | None = None
        for per in per_series.values():
            bounds = tuple(sorted(per))
            h = Histogram(bounds, tuple(per[b] for b in bounds), 0.0, per[bounds[-1]])
            merged = h if merged is None else merged.plus(h)
        if merged is not None:
            histograms[name] = Histogram(merged.bounds, merged.counts, sums.get(name, 0.0),
                                         totals.get(name, merged.count))
    return EngineSample(source=source, values=values, histograms=histograms, cache_info=info)


def merge(engine: EngineSample, gpu: EngineSample) -> EngineSample:
    """Add a DCGM scrape's gauges to an engine scrape taken at the same time."""
    values = dict(engine.values)
    for name in _MEAN_GAUGES:
        if name in gpu.values:
            values[name] = gpu.values[name]
    return EngineSample(engine.source, values, engine.histograms, engine.cache_info)
